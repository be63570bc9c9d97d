"""A user's own Pyro program as a client's model: a ``PyroModule`` whose ``PyroSample`` statements are its prior and
whose observed site is its likelihood, or a model function.

The program is called as a Pyro user calls it: ``model(x)`` to predict, ``model(x, y)`` to condition on the targets
``y``. Its latent sites are global (one value for the whole dataset, as a network's weights are); its observed site
sits in a plate over the batch. A mini-batch of B of the client's ``n`` examples stands for all of them: every
observed site's log density is scaled by ``n / B`` (the scaling ``pyro.plate("data", n, subsample=...)`` would
give), so an ELBO of a batch is an unbiased estimate of the ELBO of the local dataset.

A ``PyroModule`` keeps its parameters on itself, never in Pyro's global parameter store: every run is in Pyro's
``module_local_params`` mode (as :class:`~bnpfed.models.BayesianNetwork`'s), so any number of copies of one program
coexist, each the parameters of its own client.

Usage::

    >>> import pyro, torch
    >>> import pyro.distributions as dist
    >>> from pyro import poutine
    >>> def model(x, y=None):
    ...     w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    ...     with pyro.plate("data", x.shape[0]):
    ...         return pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=y)
    >>> program = PyroProgram(model)
    >>> x, y = torch.randn(4, 3), torch.randn(4)
    >>> program.inspect(x, y)
    >>> program.latent_sites, program.observed_site
    (('w',), 'obs')
    >>> trace = poutine.trace(program.model).get_trace(x, y, dataset_size=100)
    >>> trace.nodes["obs"]["scale"]                          # the batch of 4 stands for 100 examples
    25.0
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import pyro
import torch
from pyro import poutine
from pyro.nn.module import PyroModule
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import Tensor, nn

from bnpfed.models.bayesian import BayesianNetwork, Undrawn
from bnpfed.seeding import seeded
from bnpfed.validation import check_int

__all__ = ["PyroProgram", "module_local_params"]


def module_local_params():
    """Pyro's ``module_local_params`` mode, in which a ``PyroModule``'s parameters are its own ``nn.Parameter`` s
    (not entries of the global parameter store, which two copies of one architecture would share by name)."""
    return pyro.settings.context(module_local_params=True)


def localize_(module: Any) -> Any:
    """Let ``PyroModule`` s created outside :func:`module_local_params` run inside it (Pyro sets up a module's
    bookkeeping for one mode when the module is created: running it in the other fails with ``'_Context' object has
    no attribute 'param_state'``). In place; returns ``module``. Anything that is no ``nn.Module`` is returned as
    it is."""
    if isinstance(module, nn.Module):
        for sub in module.modules():
            context = sub.__dict__.get("_pyro_context")
            if isinstance(sub, PyroModule) and context is not None and not hasattr(context, "param_state"):
                context.param_state = {"params": {}, "constraints": {}}
    return module


class _ScaleObserved(Messenger):
    """Multiplies the ``scale`` of every observed sample site by ``factor`` (``n / B``: the batch stands for the
    dataset)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def _process_message(self, msg):
        if msg["type"] == "sample" and msg["is_observed"]:
            msg["scale"] = self.factor * msg["scale"]


class PyroProgram(nn.Module):
    """A Pyro program, a ``PyroModule`` or a model function ``model(x, y=None)``, as the model of a
    :class:`~bnpfed.clients.BayesianClient`: its latent sites are the client's posterior, its observed site the
    likelihood.

    :param model: a ``PyroModule`` (held, not copied: :class:`~bnpfed.clients.BayesianClient` copies the user's) or a
        function; called as ``model(x)`` or ``model(x, y)``.

    Attributes (after :meth:`inspect`): ``latent_sites`` (the names of the latent sample sites, in the order the
    program samples them), ``observed_site`` (the name of its observed site), ``supports`` (``{site: constraint}``,
    each latent site's support).
    """

    def __init__(self, model: Callable):
        super().__init__()
        if isinstance(model, type) or not callable(model):
            raise ValueError(f"model: expected a Pyro program, a PyroModule or a function model(x, y=None), got "
                             f"{model!r}")
        if isinstance(model, nn.Module):
            self.program = localize_(model)   # a submodule: its deterministic parameters are this module's
        else:
            object.__setattr__(self, "program", model)
        self.latent_sites: tuple[str, ...] = ()
        self.observed_site: Optional[str] = None
        self.supports: dict[str, Any] = {}

    @property
    def inspected(self) -> bool:
        """Whether :meth:`inspect` has read the program's sites."""
        return self.observed_site is not None

    def context(self):
        """Context manager for each run of the program with a guide (parameters module-local)."""
        return module_local_params()

    def call(self, x: Tensor, y: Optional[Tensor] = None) -> Any:
        """``model(x)`` or ``model(x, y)``, as the user's program takes them."""
        with module_local_params():
            return self.program(x) if y is None else self.program(x, y)

    def model(self, x: Tensor, y: Optional[Tensor] = None, dataset_size: Optional[int] = None) -> Any:
        """The program on a batch standing for ``dataset_size`` examples (default: the batch): its observed sites'
        log densities scaled by ``dataset_size / B``. Returns what the program returns."""
        batch, n = self.check_batch(x, y, dataset_size)
        with _ScaleObserved(n / batch) if n != batch else contextlib.nullcontext():
            return self.call(x, y)

    forward = model

    @staticmethod
    def check_batch(x: Tensor, y: Optional[Tensor] = None, dataset_size: Optional[int] = None) -> tuple[int, int]:
        """``(B, n)`` for a batch of the program's arguments, or a ``ValueError`` naming the bad one (as
        :meth:`BayesianNetwork.check_batch <bnpfed.models.BayesianNetwork.check_batch>`)."""
        return BayesianNetwork.check_batch(x, y, dataset_size)

    def guide_runner(self, guide: Callable) -> Callable:
        """``guide`` as the ELBO calls it, with the model's arguments ``(x, y, dataset_size)``: the user's guide
        gets the program's own, ``(x)`` or ``(x, y)`` (an autoguide runs the program with them to find its
        sites)."""
        def run(x, y=None, dataset_size=None):
            return guide(x) if y is None else guide(x, y)
        return run

    @torch.no_grad()
    def inspect(self, x: Tensor, y: Tensor) -> None:
        """Read the program's sites from one run on the batch ``(x, y)`` (and one on its first example, to tell
        global latent sites from per-example ones): ``latent_sites``, ``observed_site``, ``supports``.

        :raises ValueError: ``"x: ..."`` for a program that cannot run on the batch (its error's first line); for a
            program with no observed site or more than one, whose observed site is not
            observed with ``y``, that scales its observed site itself (a subsampled plate: the client does the
            scaling), or with latent sites whose shape follows the batch (per-example latent variables: a client's
            posterior is global).
        """
        batch = self.check_batch(x, y)[0]
        try:
            with seeded(0):
                trace = poutine.trace(self.call).get_trace(x, y)
                first = poutine.trace(self.call).get_trace(x[:1], y[:1]) if batch > 1 else trace
        except (RuntimeError, ValueError, IndexError, TypeError) as error:
            raise ValueError(f"x: the program cannot run on inputs of shape {tuple(x.shape[1:])} and targets of "
                             f"dtype {y.dtype}: {type(error).__name__}: {str(error).splitlines()[0]}") from error
        samples = [(name, site) for name, site in trace.nodes.items()
                   if site["type"] == "sample" and not site_is_subsample(site)]
        observed = [name for name, site in samples if site["is_observed"]]
        latent = [name for name, site in samples if not site["is_observed"]]
        if len(observed) != 1:
            raise ValueError(f"model: expected a program with one observed site (pyro.sample(..., obs=y)), got "
                             f"{len(observed)}: {observed}")
        name = observed[0]
        site = trace.nodes[name]
        if not torch.is_tensor(site["value"]) or site["value"] is not y and not torch.equal(site["value"], y):
            raise ValueError(f"model: expected its observed site {name!r} to be observed with the targets y "
                             f"(model(x, y) passing y as obs=)")
        if float(site["scale"]) != 1.0:
            raise ValueError(f"model: its observed site {name!r} is scaled by {float(site['scale']):g} (a subsampled "
                             f"plate); give it a plate of the batch's size, pyro.plate('data', x.shape[0]): the "
                             f"client scales a batch to the dataset itself")
        local = [s for s in latent
                 if s not in first.nodes or first.nodes[s]["value"].shape != trace.nodes[s]["value"].shape]
        if local:
            raise ValueError(f"model: expected global latent sites (one value for the whole dataset, as a network's "
                             f"weights), got {local}, whose shapes follow the batch (per-example latent variables)")
        self.latent_sites = tuple(latent)
        self.observed_site = name
        self.supports = {s: trace.nodes[s]["fn"].support for s in latent}

    def sample_traces(self, x: Tensor, num_samples: int, guide: Callable, seed: Optional[int] = None,
                      undrawn: bool = False) -> list:
        """``num_samples`` traces of the program on ``x`` (targets not given) under draws from ``guide``, with every
        module in eval mode (restored after); the global random state is left as it was when ``seed`` is given.
        ``undrawn``: the observed site is not drawn (:class:`~bnpfed.models.bayesian.Undrawn`)."""
        num_samples = check_int(num_samples, "num_samples", low=1)
        self.check_batch(x)
        modules = [m for m in (self.program, guide) if isinstance(m, nn.Module)]
        modes = [(module, module.training) for m in modules for module in m.modules()]
        for m in modules:
            m.eval()
        traces = []
        try:
            with seeded(seed, x.device), module_local_params():
                for _ in range(num_samples):
                    guide_trace = poutine.trace(self.guide_runner(guide)).get_trace(x)
                    program = poutine.replay(self.call, trace=guide_trace)
                    if undrawn:
                        program = Undrawn(self.observed_site)(program)
                    traces.append(poutine.trace(program).get_trace(x))
        finally:
            for module, training in modes:
                module.training = training
        return traces

    @torch.no_grad()
    def sample_outputs(self, x: Tensor, num_samples: int = 10, guide: Optional[Callable] = None,
                       seed: Optional[int] = None) -> Tensor:
        """``(S, B, ...)`` what the program returns (e.g. logits) under ``num_samples`` draws from ``guide``."""
        traces = self.sample_traces(x, num_samples, guide, seed)
        outputs = [t.nodes["_RETURN"]["value"] for t in traces]
        if not all(torch.is_tensor(o) for o in outputs):
            raise ValueError(f"model: sample_outputs stacks what the program returns; it returned a "
                             f"{type(outputs[0]).__name__}, not a tensor")
        return torch.stack(outputs)

    @torch.no_grad()
    def sample_observations(self, x: Tensor, num_samples: int = 10, guide: Optional[Callable] = None,
                            seed: Optional[int] = None) -> list:
        """The observed site's distribution ``p(y | x, w_s)`` under each of ``num_samples`` draws ``w_s`` from
        ``guide``: a list of S distributions of batch shape ``(B,)``."""
        if not self.inspected:
            raise ValueError("model: the program's sites are read on its first batch (fit, or inspect(x, y)); "
                             "it has seen none yet")
        return [t.nodes[self.observed_site]["fn"] for t in self.sample_traces(x, num_samples, guide, seed, True)]

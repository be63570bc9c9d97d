"""Federated clients: a variational Bayesian client trained by SVI, and a deterministic (FedAvg) client.

A Bayesian client k fits a posterior ``q_k(w)`` (by default mean-field Gaussian, ``N(mu_k, sigma_k^2)``) to its
``n_k`` examples by maximising the ELBO divided by ``n_k`` (Ozer et al. 2022):

    L_k(q) = 1/n_k sum_i E_q[log p(y_i | x_i, w)] - 1/n_k KL(q(w) || p(w))

estimated on mini-batches (the model's data plate scales a batch's log-likelihood by ``n_k / B``), with the KL in
closed form and Adam, for E local epochs. A server fuses the clients' :meth:`BayesianClient.posterior` s with
:mod:`bnpfed.combine` and sends the result back through :meth:`BayesianClient.load_posterior`; where a client's
prior is the last round's global posterior, :meth:`BayesianClient.update_prior_` makes it so.

A client is composed, as in TyXe: a network, a prior object, a likelihood object, a guide factory, an ELBO. The
default ELBO, :class:`~bnpfed.clients.elbo.MeanFieldELBO`, computes ``TraceMeanField_ELBO`` 's loss straight from
the guide's parameters for the mean-field Gaussian guide and Normal priors (as fast as a hand-written
Bayes-by-backprop step) and runs the Pyro program otherwise; any Pyro ELBO can be passed instead.

Isolation: a client's parameters are its own tensors: the guide's are ``nn.Parameter`` s of its guide module, the
deterministic ones belong to its :class:`~bnpfed.models.BayesianNetwork` 's private copy of the network, which
always runs in Pyro's ``module_local_params`` mode (otherwise ``PyroModule`` parameters are registered in Pyro's
global parameter store by name, and two copies of one architecture would share them). A ``torch.optim.Adam`` over
exactly those tensors minimises the ELBO's ``differentiable_loss`` — the PyTorch form of ``pyro.infer.SVI``, whose
``PyroOptim`` looks parameters up in the global store. The global store's contents are never changed, so any
number of clients of one architecture coexist, with each other and with a user's own Pyro code.

Randomness: ``fit(seed=s)`` shuffles with a ``torch.Generator`` seeded with ``s`` and draws all samples under
``torch.random.fork_rng`` seeded with ``s``: the same seed gives the same numbers, and the global random state is
left untouched. Each ``fit`` starts a fresh Adam state.

Divergence: a loss that becomes NaN or infinite, or parameters that do, stop ``fit`` with a
:class:`TrainingDiverged` that says where and why, instead of a traceback from deep inside Pyro.
"""

from __future__ import annotations

import copy
import functools
import math
import types
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np
import pyro.infer
import torch
from pyro.infer.autoguide import AutoGuide, AutoNormal
from pyro.nn import PyroModule
import torch.nn.functional as F
from torch import Tensor, nn

from bnpfed.clients.augment import augmenter, check_augment
from bnpfed.clients.elbo import MeanFieldELBO
from bnpfed.clients.guide_io import GuideIO, check_guide_kind, guide_io
from bnpfed.clients.guides import MeanFieldGuide
from bnpfed.models import BayesianNetwork, Categorical, Likelihood, Prior, PyroProgram, localize_, predictive_of
from bnpfed.posterior import GaussianPosterior
from bnpfed.seeding import Stream, seeded, torch_generator
from bnpfed.validation import (check_bool, check_choice, check_float, check_int, check_names, check_positive,
                               check_tensor)

__all__ = ["BayesianClient", "DeterministicClient", "TrainingDiverged", "SCALE_LR_FACTOR"]

#: The initial posterior standard deviation of the default guide.
DEFAULT_INIT_SCALE = 1e-2
#: The initial posterior standard deviation of a Pyro program's default guide, ``AutoNormal`` 's own.
PROGRAM_INIT_SCALE = 0.1
#: The guide's scales learn at this multiple of the means' learning rate unless ``fit(scale_lr=)`` says otherwise:
#: at one rate for all they barely leave their initial value in a few hundred steps, at 10 times it a client reaches
#: its variational optimum (the docs' benchmark page on calibration, "Which default reaches the optimum").
SCALE_LR_FACTOR = 10.0
#: A fit has converged when its last epochs improved the mean -ELBO per example by less than this fraction (or by
#: less than their Monte Carlo spread: :func:`_convergence`).
CONVERGENCE_TOLERANCE = 1e-3
#: The most epochs in each of the two windows :func:`_convergence` compares.
CONVERGENCE_WINDOW = 20


class TrainingDiverged(RuntimeError):
    """``fit`` stopped because the loss or a parameter became NaN or infinite.

    Attributes: ``epoch`` (1-based), ``step`` (1-based, within the epoch; 0 when found at the end of an epoch),
    ``loss`` (the last loss seen, ``nan`` if none), ``lr``.
    """

    def __init__(self, trainer: str, epoch: int, step: int, steps: int, loss: float, lr: float, what: str):
        self.epoch, self.step, self.loss, self.lr = epoch, step, loss, lr
        self._args = (trainer, epoch, step, steps, loss, lr, what)
        where = f"epoch {epoch}, step {step} of {steps}" if step else f"the end of epoch {epoch}"
        if epoch == 1 and step == 1:
            cause = ("This is before any parameter update, so the network or the data produce it, not the learning "
                     "rate.")
        else:
            cause = (f"The likely cause is a learning rate too large for this model and data (lr={lr!r}): try one 10 "
                     f"to 100 times smaller. The parameters are left as that step made them: load a posterior or a "
                     f"state before fitting again.")
        super().__init__(f"{trainer} diverged at {where}: {what}. {cause}")

    def __reduce__(self):  # so that it crosses process boundaries (Flower client apps) intact
        return type(self), self._args


class BayesianClient:
    """A client holding a variational posterior over the Bayesian parameters of its copy of a network.

    Usage::

        >>> import torch
        >>> from bnpfed.models import LeNet, only_linear_weights
        >>> x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
        >>> client = BayesianClient(LeNet(image_size=8), only_linear_weights(), local_reparameterization=True)
        >>> client = client.fit(x, y, epochs=2, batch_size=16, lr=1e-3, seed=0)
        >>> len(client.losses_)                                    # mean -ELBO per example, one per epoch
        2
        >>> posterior = client.posterior()                          # {site: GaussianPosterior(loc, variance)}
        >>> list(posterior), tuple(posterior["fc3.weight"].loc.shape)
        (['fc1.weight', 'fc2.weight', 'fc3.weight'], (10, 84))
        >>> client.load_posterior(posterior)                        # e.g. a server's fused posterior
        >>> client = client.update_prior_(posterior)                # ... and the next round's prior
        >>> client.predict_proba(x, num_samples=4, seed=0).shape
        torch.Size([32, 10])

    Regression is a likelihood away::

        >>> from bnpfed.models import Gaussian, mlp
        >>> reg = BayesianClient(mlp(1, [8], 1), only_linear_weights(), likelihood=Gaussian(scale=0.1))
        >>> reg = reg.fit(torch.randn(16, 1), torch.randn(16), epochs=1, batch_size=8, lr=1e-2, seed=0)
        >>> reg.predict(torch.zeros(3, 1), num_samples=4, seed=0).variance.shape
        torch.Size([3])

    A Pyro user's own program is a client as it is, with no prior or likelihood object: a ``PyroModule`` whose
    ``PyroSample`` statements are its prior and whose observed site is its likelihood, or a model function, with
    its guide (Pyro's ``AutoNormal`` by default)::

        >>> import pyro, pyro.distributions as dist
        >>> from pyro.infer.autoguide import AutoNormal
        >>> from pyro.nn import PyroModule, PyroSample
        >>> class Regression(PyroModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.tau = PyroSample(dist.HalfNormal(torch.tensor(1.0)))     # a hyper-prior, learned
        ...         self.linear = PyroModule[torch.nn.Linear](3, 1)
        ...         self.linear.weight = PyroSample(lambda m: dist.Normal(0.0, self.tau).expand([1, 3]).to_event(2))
        ...     def forward(self, x, y=None):
        ...         mean = self.linear(x)[:, 0]
        ...         with pyro.plate("data", x.shape[0]):
        ...             pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)
        ...         return mean
        >>> program = Regression()
        >>> own = BayesianClient(program, guide=AutoNormal(program))
        >>> own = own.fit(torch.randn(16, 3), torch.randn(16), epochs=2, batch_size=8, seed=0)
        >>> sorted(own.posterior())                                 # every latent site, in the unconstrained space
        ['linear.weight', 'tau']

    :param net: the model: a network (an ``nn.Module``, with ``prior``), or a Pyro program (with ``prior=None``): a
        ``PyroModule`` or a function ``model(x, y=None)`` whose latent sites are global and whose one observed site is
        observed with ``y``, in a plate of the batch's size (the client scales a mini-batch to the dataset). It is
        deep-copied (with ``guide``, if that is a module: the user's objects are not changed). Clients built from the
        same ``net`` start from the same weights, as federated clients should.
    :param Prior prior: which parameters of a network are Bayesian and their priors, e.g. ``only_linear_weights()``;
        None for a Pyro program (its own sample statements are its prior).
    :param Likelihood likelihood: a network's observation model: ``Categorical()`` (default, classification) or
        ``Gaussian(scale)`` (regression); None for a Pyro program (its observed site is its likelihood).
    :param guide: with a network: a factory ``init_values -> guide`` called with ``{site: initial value}`` (the
        network's own initialisation), or an autoguide class such as ``AutoNormal`` (built on the network's model).
        With a Pyro program: the guide module, e.g. ``AutoNormal(model)``; default ``AutoNormal(model,
        init_scale=init_scale or 0.1)``. Either way a guide whose latent sites are mean-field Normals in the
        unconstrained space: :class:`MeanFieldGuide`, Pyro's ``AutoNormal`` and ``AutoDiagonalNormal``, or any guide
        that draws each site so (other autoguides, such as ``AutoMultivariateNormal`` or a flow, are refused by
        name). Default with a network ``functools.partial(MeanFieldGuide, init_scale=init_scale)``.
    :param elbo: the objective: an object with ``differentiable_loss(model, guide, x, y, dataset_size=n)``
        returning -ELBO. Default with a network :class:`~bnpfed.clients.elbo.MeanFieldELBO` (closed-form fast path,
        else Pyro's ``TraceMeanField_ELBO``), with a Pyro program ``pyro.infer.Trace_ELBO()``; a Pyro ELBO runs under
        the model's ``context()``.
    :param bool local_reparameterization: train and predict with the local reparameterisation trick (a network
        only). Default False.
    :param float init_scale: initial posterior standard deviation of every Bayesian weight in the default guide;
        with a network the means start at the network's own initial values. Default ``1e-2`` with a network, 0.1
        (Pyro's) with a program. Not allowed together with ``guide`` (give it to your guide).

    Attributes: ``bnn`` (the model: a :class:`BayesianNetwork`, or a :class:`~bnpfed.models.PyroProgram`),
    ``guide`` (the guide module), ``elbo``, ``losses_`` (mean negative ELBO per example, one per epoch of the last
    ``fit``), ``converged_`` and ``notes_`` (whether that fit converged; see :meth:`fit`).
    """

    def __init__(self, net: Any, prior: Optional[Prior] = None, *, likelihood: Optional[Likelihood] = None,
                 guide: Any = None, elbo: Any = None, local_reparameterization: bool = False,
                 init_scale: Optional[float] = None):
        self._io: Optional[GuideIO] = None
        if prior is None:
            self._init_program(net, likelihood, guide, elbo, local_reparameterization, init_scale)
        else:
            self._init_network(net, prior, likelihood, guide, elbo, local_reparameterization, init_scale)
        if not callable(getattr(self.elbo, "differentiable_loss", None)):
            raise ValueError(f"elbo: expected an object with differentiable_loss(model, guide, ...) such as "
                             f"MeanFieldELBO() or pyro.infer.TraceMeanField_ELBO(), got {elbo!r}")
        self.losses_: list[float] = []
        self.converged_: Optional[bool] = None
        self.notes_: list[str] = []

    def _init_network(self, net, prior, likelihood, guide, elbo, local_reparameterization, init_scale) -> None:
        self.bnn = BayesianNetwork(net, prior, likelihood=likelihood, local_reparameterization=local_reparameterization)
        if guide is None:
            scale = DEFAULT_INIT_SCALE if init_scale is None else init_scale
            supports = {name: self.bnn.supports[name] for name in self.bnn.hyper_sites}
            guide = functools.partial(MeanFieldGuide, init_scale=scale, **({"supports": supports} if supports else {}))
        elif init_scale is not None:
            raise ValueError(f"init_scale: sets the default guide's scale; with guide= given, pass it to the guide "
                             f"factory instead, got init_scale={init_scale!r}")
        if _is_autoguide_factory(guide):
            self.guide = localize_(guide(self.bnn.model))   # built outside Pyro's module-local mode
        elif isinstance(guide, nn.Module) or not callable(guide):
            raise ValueError("guide: expected a factory init_values -> guide, such as "
                             "functools.partial(MeanFieldGuide, init_scale=0.1), or an autoguide class such as "
                             f"AutoNormal, got {guide!r}")
        else:
            self.guide = guide(self.bnn.init_values)
        if not isinstance(self.guide, nn.Module):
            raise ValueError(f"guide: expected the factory to return a torch.nn.Module guide, got "
                             f"{type(self.guide).__name__}")
        check_guide_kind(self.guide)
        self._run_guide = self.guide
        if _has_protocol(self.guide):
            self._io = guide_io(self.guide, self.guide, {})
            missing = [name for name in self.bnn.latent_sites if name not in self._io.sites]
            if missing:
                raise ValueError(f"guide: expected a guide of every latent site of the model "
                                 f"{list(self.bnn.latent_sites)}, got {type(self.guide).__name__}, which has no "
                                 f"{missing}")
        self.elbo = MeanFieldELBO() if elbo is None else elbo

    def _init_program(self, net, likelihood, guide, elbo, local_reparameterization, init_scale) -> None:
        if isinstance(net, nn.Module) and not isinstance(net, PyroModule):
            raise ValueError(f"prior: expected a Prior object for the network {type(net).__name__} (a plain torch "
                             f"module has no random parameters), or a Pyro program (a PyroModule whose PyroSample "
                             f"statements are its prior, or a model function) with prior=None")
        if likelihood is not None:
            raise ValueError(f"likelihood: a Pyro program's observed site is its likelihood; expected None with "
                             f"prior=None, got {likelihood!r}")
        if check_bool(local_reparameterization, "local_reparameterization"):
            raise ValueError("local_reparameterization: applies to a network with a prior object; expected False "
                             "with a Pyro program (prior=None)")
        if guide is None:
            scale = PROGRAM_INIT_SCALE if init_scale is None else check_positive(init_scale, "init_scale")
            model = _copy_model(net)
            guide = AutoNormal(localize_(model), init_scale=float(scale))
        else:
            if init_scale is not None:
                raise ValueError(f"init_scale: sets the default guide's scale; with guide= given, set it on your "
                                 f"guide instead, got init_scale={init_scale!r}")
            if not isinstance(guide, nn.Module):
                raise ValueError(f"guide: expected a guide module for the program (AutoNormal(model), "
                                 f"AutoDiagonalNormal(model), a MeanFieldGuide or a PyroModule guide: a guide "
                                 f"function's pyro.param's live in Pyro's global store, which every client would "
                                 f"share), got {guide!r}")
            check_guide_kind(guide)
            model, guide = _copy_program(net, guide)
        self.bnn = PyroProgram(model)
        self.guide = localize_(guide)
        self._run_guide = self.bnn.guide_runner(self.guide)
        if _has_protocol(self.guide):
            self._io = guide_io(self.guide, self._run_guide, {})
        self.elbo = pyro.infer.Trace_ELBO() if elbo is None else elbo

    @property
    def is_program(self) -> bool:
        """Whether the client's model is a user's Pyro program (:class:`~bnpfed.models.PyroProgram`), not a network
        with a prior object."""
        return isinstance(self.bnn, PyroProgram)

    def _ensure_guide(self, x: Tensor, y: Tensor) -> GuideIO:
        """Read the program's sites and set the guide up (an autoguide builds its parameters on its first run) on the
        first examples of ``(x, y)``, once; the reader of the guide's posterior."""
        if self._io is not None and (not self.is_program or self.bnn.inspected):
            return self._io
        xs, ys = x[:2], y[:2]
        if self.is_program:
            self.bnn.inspect(xs, ys)
            supports = self.bnn.supports
        else:
            supports = self.bnn.supports
        context = self.bnn.context

        def run():
            with context():
                return self._run_guide(xs, ys)

        if self._io is None:
            with torch.no_grad(), seeded(0):
                run()
            self._io = guide_io(self.guide, run, supports)
        return self._io

    def prepare(self, x: Tensor, y: Tensor) -> "BayesianClient":
        """Set the guide up on the first examples of ``(x, y)`` without training: a Pyro program's sites are read and
        an autoguide builds its parameters (its initial values drawn from seed 0, the same for every client of one
        program, as :meth:`fit` does on its first batch), so that :meth:`posterior` and :meth:`load_posterior` work
        before any fit (a federation's server, or a client that starts from a fused posterior). Nothing changes for a
        guide set up already. Returns ``self``."""
        n = _check_x(x)
        if not torch.is_tensor(y) or y.dim() < 1 or y.shape[0] != n:
            raise ValueError(f"y: expected a tensor of shape ({n}, ...) matching x, got {_describe(y)}")
        if not self.is_program:
            self.bnn.likelihood.check_targets(y, n, self._probe(x))
            y = self.bnn.likelihood.targets(y)
        self._ensure_guide(x, y)
        return self

    def _require_guide(self, what: str) -> GuideIO:
        if self._io is None:
            raise ValueError(f"{what}: the guide {type(self.guide).__name__} is set up on the client's first batch "
                             "(an autoguide builds its parameters when it first runs with data); fit or prepare "
                             "first")
        return self._io

    def fit(self, x: Tensor, y: Tensor, *, epochs: int = 1, batch_size: int = 64, lr: float = 1e-3, seed: int = 0,
            amsgrad: bool = False, scale_lr: Optional[float] = None, augment: str = "none") -> "BayesianClient":
        """Run SVI on the local data ``x`` ``(n, ...)``, ``y`` (targets the likelihood accepts, e.g. ``(n,)`` labels
        in ``0 .. num_classes - 1``) for ``epochs`` passes of mini-batches of ``batch_size`` with Adam (AMSGrad if
        ``amsgrad``) at learning rate ``lr``; every random step uses ``seed``. Returns ``self``.

        The guide's scale parameters (``rho``, ``sigma = softplus(rho)``, about ``log sigma`` for small sigma;
        an autoguide's scales) have their own learning rate ``scale_lr``: Adam moves a parameter by about its learning
        rate per step, so at one rate for all, a weight's mean (of size ~0.03) moves by a few percent a step while its
        scale moves by 0.1 %, and after a few hundred steps the scales are still near ``init_scale``. Default None:
        :data:`SCALE_LR_FACTOR` (10) times ``lr``, which reaches the variational optimum of the ELBO, where weights
        no datum touches sit at their prior (the docs' benchmark page on calibration, "Which default reaches the
        optimum"); ``scale_lr=lr`` is one rate for all (the behaviour before 0.2). A Pyro program's guide (the
        user's own, e.g. ``AutoNormal`` at its initial scale 0.1) takes one rate by default, as Pyro's SVI trains it.
        A guide without scale parameters takes one rate, and an explicit ``scale_lr`` other than ``lr`` is refused
        for it.

        ``augment``: each mini-batch's images drawn through a random transform before the step, ``"none"``
        (default), ``"crop"`` or ``"crop-flip"`` (:mod:`bnpfed.clients.augment`; images ``(n, C, H, W)`` only).

        With an estimable prior (``prior.estimable``, e.g. :class:`~bnpfed.models.EmpiricalBayesPrior`), the prior
        is estimated from the guide before the first step and after every step (``prior.estimate_(...)`` on the
        sites whose prior is not a posterior), so it is a function of the fit alone, not of earlier fits (a client
        rebuilt each round, as on Flower, gets the same numbers as one kept).

        After the fit, ``losses_`` holds each epoch's mean ``-ELBO / n``, ``converged_`` whether the last epochs
        improved it by less than :data:`CONVERGENCE_TOLERANCE` (relative, 1e-3) or than their Monte Carlo spread
        (:func:`_convergence`; a fit of one epoch is not judged: None), and ``notes_`` says so in words when it has
        not.

        :raises ValueError: naming the argument, for bad data or settings (checked before any training).
        :raises TrainingDiverged: when the loss or a parameter becomes NaN or infinite.
        """
        n = _check_x(x)
        if self.is_program:
            if not torch.is_tensor(y) or y.dim() < 1 or y.shape[0] != n:
                raise ValueError(f"y: expected a tensor of shape ({n}, ...) matching x, got {_describe(y)}")
        else:
            self.bnn.likelihood.check_targets(y, n, self._probe(x))
            y = self.bnn.likelihood.targets(y)
        lr = check_positive(lr, "lr")
        io = self._ensure_guide(x, y)
        scale_ids = {id(p) for p in io.scale_parameters()}
        default = scale_lr is None
        if default:   # a Pyro program's guide is the user's: one rate for all, as Pyro's SVI trains it
            scale_lr = lr if self.is_program else SCALE_LR_FACTOR * lr
        if scale_lr == lr or (default and not scale_ids):
            scale_lr = None  # one parameter group: exactly the steps of one rate for all
        elif not scale_ids:
            raise ValueError(f"scale_lr: sets the learning rate of the guide's scales; the guide "
                             f"{type(self.guide).__name__} has no parameter holding them, got scale_lr={scale_lr!r}")
        else:
            scale_lr = check_positive(scale_lr, "scale_lr")
        if scale_lr is None:
            scale_ids = set()
        named = [*(("bnn." + k, p) for k, p in self.bnn.named_parameters()),
                 *(("guide." + k, p) for k, p in self.guide.named_parameters() if id(p) not in scale_ids)]
        scales = [("guide." + k, p) for k, p in self.guide.named_parameters() if id(p) in scale_ids]
        after_step = None
        prior = None if self.is_program else self.bnn.prior
        estimated = [] if prior is None else [name for name in self.bnn.bayesian_sites
                                              if name not in prior.posterior_sites]
        if prior is not None and prior.estimable and estimated:
            def after_step():
                posterior = io.posterior()
                prior.estimate_({name: posterior[name] for name in estimated})

            after_step()  # from the guide the fit starts at: the estimate never depends on earlier fits

        def loss(xb, yb):
            return self._loss(xb, yb, n)

        self.losses_ = _train(named, loss, x, y, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
                              amsgrad=amsgrad, trainer="BayesianClient.fit", scale_params=scales, scale_lr=scale_lr,
                              after_step=after_step, augment=augment)
        self.converged_, self.notes_ = _convergence(self.losses_)
        return self

    def loss(self, x: Tensor, y: Tensor, dataset_size: Optional[int] = None) -> Tensor:
        """The training objective on a batch: a one-sample estimate of ``-ELBO / n_k``,

            ( KL(q || p) - n_k / B sum_{i in batch} E_q[log p(y_i | x_i, w)] ) / n_k

        with the KL in closed form where the ELBO has one. Differentiable in the guide's and the deterministic
        parameters.

        :param int dataset_size: ``n_k``, the size of the local dataset the batch comes from. Default ``len(x)``.
        """
        _, n = self.bnn.check_batch(x, y, dataset_size)
        if self.is_program:
            self._ensure_guide(x, y)
            return self._loss(x, y, n)
        return self._loss(x, self.bnn.likelihood.targets(y), n)

    def _loss(self, x: Tensor, y: Tensor, n: int) -> Tensor:
        if isinstance(self.elbo, pyro.infer.ELBO):
            with self.bnn.context():
                return self.elbo.differentiable_loss(self.bnn, self._run_guide, x, y, dataset_size=n) / n
        return self.elbo.differentiable_loss(self.bnn, self._run_guide, x, y, dataset_size=n) / n

    @torch.no_grad()
    def _probe(self, x: Tensor) -> Tensor:
        """The network's output for ``x[0]`` (in eval mode, so no random draw and no running statistic changes), for
        checks of the targets; a ``ValueError`` naming ``x`` if the network cannot run on it."""
        values = {name: value.to(device=x.device, dtype=x.dtype) for name, value in self.bnn.init_values.items()}
        return _probe(lambda: self.bnn.output_at(x[:1], values), self.bnn, x)

    def posterior(self) -> dict[str, GaussianPosterior]:
        """``{site: GaussianPosterior(loc, variance)}`` for every latent site of the model (the Bayesian weights and
        any hyper-parameter, such as a per-layer prior scale), copies of the guide's current values, in the guide's
        unconstrained space: a site of support S is reported as the Normal of ``biject_to(S)^{-1}`` of its value (a
        positive scale ``tau`` as ``log tau``), the space in which the guide is a mean-field Normal and in which the
        fusion rules of :mod:`bnpfed.combine` combine it. For a Pyro program's autoguide, after the first batch the
        client has seen (:meth:`fit`)."""
        return self._require_guide("posterior").posterior()

    def load_posterior(self, posterior: Mapping[str, Any]) -> None:
        """Set the guide to ``{site: GaussianPosterior or (loc, variance)}`` (exactly the latent sites, in the form
        :meth:`posterior` gives), in place, e.g. a server's fused posterior; see
        :meth:`MeanFieldGuide.load_posterior`. Raises ``ValueError`` naming the site on a bad entry."""
        self._require_guide("load_posterior").load_posterior(posterior)

    def update_prior_(self, posterior: Mapping[str, Any]) -> "BayesianClient":
        """Make ``posterior`` (``{site: GaussianPosterior or (loc, variance)}``, some or all Bayesian sites) the
        prior of those sites: ``self.bnn.prior.update_(posterior)`` (see :meth:`Prior.update_`; the prior object is
        shared by every network built with it). A network with a prior object only. Returns ``self``."""
        if self.is_program:
            raise ValueError("update_prior_: replaces a prior object's sites by a posterior; a Pyro program's priors "
                             "are its own sample statements (condition them in the program instead)")
        self.bnn.prior.update_(posterior)
        return self

    def deterministic_state(self) -> dict[str, Tensor]:
        """``{name: tensor}`` copies of the parameters the prior keeps deterministic (a program's own parameters;
        empty if there are none)."""
        return _state(self._deterministic_module())

    def load_deterministic(self, state: Mapping[str, Tensor]) -> None:
        """Overwrite the deterministic parameters in place with ``state`` (exactly their names and shapes)."""
        _load_state(self._deterministic_module(), state, "state")

    def _deterministic_module(self) -> nn.Module:
        if self.is_program:
            return self.bnn.program if isinstance(self.bnn.program, nn.Module) else nn.Module()
        return self.bnn.net

    @torch.no_grad()
    def mean_network(self) -> nn.Module:
        """The posterior-mean network: a plain torch copy of the network (no Pyro) with every Bayesian weight at its
        posterior mean and the deterministic parameters and buffers as they are now, in eval mode. A client built
        from it (same prior) has the same deterministic parameters and its guide's means start there. A network
        with a prior object only."""
        if self.is_program:
            raise ValueError("mean_network: rebuilds the plain network of a network with a prior object; a Pyro "
                             "program has no plain network to rebuild")
        net = self.bnn.template()
        state = net.state_dict()
        state.update({name: b.detach().clone() for name, b in self.bnn.net.named_buffers()})
        state.update(self.deterministic_state())
        posterior = self.posterior()
        state.update({site: posterior[site].loc.detach().clone() for site in self.bnn.bayesian_sites})
        net.load_state_dict(state)
        return net.eval()

    def predict(self, x: Tensor, num_samples: int = 10, seed: Optional[int] = None) -> Any:
        """The posterior predictive from ``num_samples`` draws from the guide, as the likelihood aggregates them
        (see :meth:`BayesianNetwork.predict`): class probabilities ``(B, num_classes)`` for ``Categorical``, a
        ``GaussianPredictive(mean, variance)`` for ``Gaussian``; for a Pyro program, as its observed site's
        distributions aggregate (:func:`~bnpfed.models.predictive_of`)."""
        self._require_guide("predict")
        if self.is_program:
            return predictive_of(self.bnn.sample_observations(x, num_samples, self.guide, seed))
        return self.bnn.predict(x, num_samples=num_samples, guide=self.guide, seed=seed)

    def sample_observations(self, x: Tensor, num_samples: int = 10, seed: Optional[int] = None) -> list:
        """The observation distributions ``p(y | x, w_s)`` (batch shape ``(B,)``) under ``num_samples`` draws ``w_s``
        from the guide, every latent site included (a learned noise scale): what a regression's predictive
        intervals and their coverage are computed from (:func:`~bnpfed.metrics.regression_report`)."""
        self._require_guide("sample_observations")
        return self.bnn.sample_observations(x, num_samples, self.guide, seed)

    def sample_outputs(self, x: Tensor, num_samples: int = 10, seed: Optional[int] = None) -> Tensor:
        """``(S, B, ...)`` the network's outputs (logits; what a Pyro program returns) under the ``num_samples``
        draws from the guide that :meth:`predict` aggregates."""
        self._require_guide("sample_outputs")
        return self.bnn.sample_outputs(x, num_samples=num_samples, guide=self.guide, seed=seed)

    def predict_proba(self, x: Tensor, num_samples: int = 10, seed: Optional[int] = None) -> Tensor:
        """Posterior predictive class probabilities ``(B, num_classes)``: the softmax averaged over ``num_samples``
        draws from the guide (:meth:`predict` for a ``Categorical`` likelihood, or a program's ``Categorical``
        observed site; at its temperature)."""
        if self.is_program:
            prediction = self.predict(x, num_samples=num_samples, seed=seed)
            if not torch.is_tensor(prediction):
                raise ValueError(f"predict_proba: the program's observed site {self.bnn.observed_site!r} is no "
                                 "Categorical and has no class probabilities; use predict")
            return prediction
        if not isinstance(self.bnn.likelihood, Categorical):
            raise ValueError(f"predict_proba: the likelihood {self.bnn.likelihood!r} has no class probabilities; "
                             "use predict")
        return self.predict(x, num_samples=num_samples, seed=seed)


class DeterministicClient:
    """A FedAvg client: the same network trained by maximum likelihood (cross-entropy, Adam), the baseline of the
    federated loop.

    Usage::

        >>> import torch
        >>> from bnpfed.models import mlp
        >>> x, y = torch.randn(20, 4), torch.randint(0, 2, (20,))
        >>> client = DeterministicClient(mlp(4, [3], 2)).fit(x, y, epochs=2, batch_size=8, lr=1e-2, seed=0)
        >>> sorted(client.state())                                  # what FedAvg averages
        ['1.bias', '1.weight', '3.bias', '3.weight']
        >>> client.load_state(client.state())
        >>> client.predict_proba(x).shape
        torch.Size([20, 2])

    :param nn.Module net: the network (deep-copied; the user's module is not changed); ``net(x)`` returns logits.

    Attributes: ``net`` (the copy), ``losses_`` (mean cross-entropy per example, one per epoch of the last ``fit``).
    """

    def __init__(self, net: nn.Module):
        if not isinstance(net, nn.Module):
            raise ValueError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        self.net = copy.deepcopy(net)
        self.losses_: list[float] = []

    def fit(self, x: Tensor, y: Tensor, *, epochs: int = 1, batch_size: int = 64, lr: float = 1e-3, seed: int = 0,
            amsgrad: bool = False, weight_decay: float = 0.0, optimizer: str = "adam",
            momentum: Optional[float] = None, augment: str = "none") -> "DeterministicClient":
        """Minimise the mean cross-entropy on ``x`` ``(n, ...)``, ``y`` ``(n,)`` labels; same schedule, seeding,
        ``augment`` and checks as :meth:`BayesianClient.fit`; ``weight_decay`` adds ``weight_decay * ||theta||^2 /
        2`` to the loss (the L2 term of the PFNM reference, 1e-6 there). ``optimizer``: ``"adam"`` (default) or
        ``"sgd"`` (with ``momentum``, None for none: FedAvg's usual local step). Returns ``self``."""
        n = _check_x(x)
        Categorical().check_targets(y, n, _probe(lambda: self.net(x[:1]), self.net, x))
        y = Categorical().targets(y)

        def loss(xb, yb):
            return F.cross_entropy(self.net(xb), yb)

        self.losses_ = _train(list(self.net.named_parameters()), loss, x, y, epochs=epochs, batch_size=batch_size,
                              lr=lr, seed=seed, amsgrad=amsgrad, weight_decay=weight_decay, optimizer=optimizer,
                              momentum=momentum, trainer="DeterministicClient.fit", augment=augment)
        return self

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        """Class probabilities ``(B, num_classes)``, the softmax of the network's logits."""
        return self.net(x).softmax(-1)

    def state(self) -> dict[str, Tensor]:
        """``{name: tensor}`` copies of all the network's parameters."""
        return _state(self.net)

    def load_state(self, state: Mapping[str, Tensor]) -> None:
        """Overwrite the network's parameters in place with ``state`` (exactly their names and shapes)."""
        _load_state(self.net, state, "state")


#: The local optimisers: Adam (optionally AMSGrad) or SGD (optionally with momentum).
OPTIMIZERS = ("adam", "sgd")


def check_optimizer(optimizer: str, momentum: Optional[float], amsgrad: bool) -> None:
    """``optimizer`` one of :data:`OPTIMIZERS`; ``momentum`` (in [0, 1)) with SGD only, ``amsgrad`` with Adam only."""
    check_choice(optimizer, OPTIMIZERS, "optimizer")
    if momentum is not None:
        if optimizer != "sgd":
            raise ValueError(f"momentum: SGD's momentum; expected None with optimizer={optimizer!r}, got {momentum!r}")
        check_float(momentum, "momentum", low=0.0, high=1.0, high_open=True)
    if amsgrad and optimizer != "adam":
        raise ValueError(f"amsgrad: the AMSGrad variant of Adam; expected False with optimizer={optimizer!r}")


def _train(
    named_params: Iterable[tuple[str, Tensor]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    amsgrad: bool = False,
    weight_decay: float = 0.0,
    optimizer: str = "adam",
    momentum: Optional[float] = None,
    trainer: str = "fit",
    scale_params: Iterable[tuple[str, Tensor]] = (),
    scale_lr: Optional[float] = None,
    after_step: Optional[Callable[[], None]] = None,
    augment: str = "none",
) -> list[float]:
    """Adam (``optimizer="adam"``, optionally AMSGrad) or SGD (``"sgd"``, with ``momentum``, None for none), with
    coupled L2 ``weight_decay``, on ``loss_fn(x_batch, y_batch)`` over shuffled mini-batches; returns the mean loss of
    each epoch. ``scale_params`` learn at ``scale_lr`` (the others at ``lr``); ``after_step()`` runs after every
    optimiser step. ``augment`` (:data:`~bnpfed.clients.augment.AUGMENTATIONS`) draws each mini-batch's images
    through its transform, from a generator of its own (``(seed, AUGMENT)``), so the mini-batches are the same as
    without it. Raises :class:`TrainingDiverged` on a non-finite loss or parameter."""
    epochs = check_int(epochs, "epochs", low=1)
    batch_size = check_int(batch_size, "batch_size", low=1)
    lr = check_positive(lr, "lr")
    seed = check_int(seed, "seed", low=-(2**63), high=2**64 - 1)
    amsgrad = check_bool(amsgrad, "amsgrad")
    weight_decay = check_float(weight_decay, "weight_decay", low=0.0)
    check_optimizer(optimizer, momentum, amsgrad)
    check_augment(augment, tuple(x.shape[1:]))
    transform = augmenter(augment)
    named_params, scale_params = list(named_params), list(scale_params)
    groups = [{"params": [p for _, p in named_params]}]
    if scale_params:
        groups.append({"params": [p for _, p in scale_params], "lr": scale_lr})
    named_params += scale_params
    # foreach: one kernel per operation for all parameters instead of one per parameter, the same numbers (small
    # networks' steps are dominated by per-call overhead; the default on CPU is the per-parameter loop)
    if optimizer == "sgd":
        optim = torch.optim.SGD(groups, lr=lr, momentum=momentum or 0.0, weight_decay=weight_decay, foreach=True)
    else:
        optim = torch.optim.Adam(groups, lr=lr, amsgrad=amsgrad, weight_decay=weight_decay, foreach=True)
    shuffle = torch.Generator().manual_seed(seed)
    draws = None if transform is None else torch_generator(seed % 2**64, Stream.AUGMENT)
    n = x.shape[0]
    steps = math.ceil(n / batch_size)
    losses = []
    with seeded(seed, x.device):
        for epoch in range(1, epochs + 1):
            order = torch.randperm(n, generator=shuffle).to(x.device)
            total = 0.0
            for step, start in enumerate(range(0, n, batch_size), 1):
                batch = order[start : start + batch_size]
                xb = x[batch] if transform is None else transform(x[batch], draws)
                try:
                    loss = loss_fn(xb, y[batch])
                except ValueError as error:
                    # after a step of training, a NaN parameter, or a distribution refusing its parameters (Pyro's
                    # Normal with a scale that underflowed to 0), is divergence; before any step it is a real error
                    bad = _first_not_finite(named_params)
                    first = epoch == 1 and step == 1
                    if first or (bad is None and "Expected parameter" not in str(error)):
                        raise
                    what = (f"parameter {bad} is not finite" if bad is not None
                            else f"a distribution refused its parameters ({str(error).splitlines()[0]})")
                    raise TrainingDiverged(trainer, epoch, step, steps, math.nan, lr, what) from error
                value = loss.item()
                if not math.isfinite(value):
                    raise TrainingDiverged(trainer, epoch, step, steps, value, lr, f"the loss is {value}")
                optim.zero_grad()
                loss.backward()
                optim.step()
                if after_step is not None:
                    after_step()
                total += value * batch.numel()
            bad = _first_not_finite(named_params)
            if bad is not None:
                raise TrainingDiverged(trainer, epoch, 0, steps, value, lr, f"parameter {bad} is not finite")
            losses.append(total / n)
    return losses


def _convergence(losses: list[float]) -> tuple[Optional[bool], list[str]]:
    """``(converged, notes)`` of a fit's epoch losses; None (not judged) after one epoch.

    An epoch's loss is a Monte Carlo estimate (weights drawn at every step), so one epoch against the one before
    mostly compares noise when an epoch has few steps. The mean of the last ``W`` epochs is compared with the mean of
    the ``W`` before them (``W = min(CONVERGENCE_WINDOW, len // 4)``): converged when it improved by less than
    :data:`CONVERGENCE_TOLERANCE` of its size or by less than twice the standard error of the difference (no
    improvement the noise does not explain). Fewer than 8 epochs: the last against the one before."""
    if len(losses) < 2:
        return None, []
    W = min(CONVERGENCE_WINDOW, len(losses) // 4)
    if W < 2:
        previous, last, spread = losses[-2], losses[-1], 0.0
    else:
        before, after = np.asarray(losses[-2 * W:-W]), np.asarray(losses[-W:])
        previous, last = float(before.mean()), float(after.mean())
        spread = 2.0 * math.sqrt((before.var(ddof=1) + after.var(ddof=1)) / W)
    change = (previous - last) / max(abs(last), 1e-12)
    if change < CONVERGENCE_TOLERANCE or previous - last < spread:
        return True, []
    what = "the last epoch" if W < 2 else f"the last {W} epochs (against the {W} before)"
    noise = "" if W < 2 else f", more than their Monte Carlo spread {spread:.3g}"
    return False, [f"not converged: {what} still lowered -ELBO/n by {100 * change:.2g} % "
                   f"({previous:.6g} -> {last:.6g}{noise}; converged is under {100 * CONVERGENCE_TOLERANCE:.2g} %); "
                   "train more epochs or raise lr / scale_lr"]


def _copy_program(model, guide) -> tuple[Any, nn.Module]:
    """Deep copies of a program and its guide, the guide's own reference to the model (an autoguide's) pointing to
    the copy. (An autoguide drops its model when copied, and from the original too, which is put back.)"""
    autoguides = [m for m in guide.modules() if isinstance(m, AutoGuide)]
    models = [m._model for m in autoguides]
    memo: dict = {}
    model_copy = _copy_model(model, memo)
    models_copy = copy.deepcopy(models, memo)
    try:
        guide_copy = copy.deepcopy(guide, memo)
    finally:
        for module, held in zip(autoguides, models):
            module._model = held
    for module, held in zip((m for m in guide_copy.modules() if isinstance(m, AutoGuide)), models_copy):
        module._model = held
    return model_copy, guide_copy


def _copy_model(model, memo: Optional[dict] = None):
    """A deep copy of a program module whose ``PyroSample`` functions point at the copy (:func:`_rebind_closures_`);
    a model function is returned as it is."""
    if not isinstance(model, nn.Module):
        return model
    memo = {} if memo is None else memo
    model_copy = copy.deepcopy(model, memo)
    _rebind_closures_(model_copy, memo)
    return model_copy


def _rebind_closures_(module: nn.Module, memo: dict) -> None:
    """Point the ``PyroSample`` functions of a copied program at the copy: ``lambda m: dist.Normal(0, self.tau)``
    closes over the original module (``self``), which a deep copy keeps (functions are copied by reference), so the
    copy would draw ``tau`` from the original, outside the copy's trace. Each such function is remade with its
    closure's contents copied through ``memo`` (the original module's copy is the copy)."""
    for sub in module.modules():
        samples = sub.__dict__.get("_pyro_samples", {})
        for name, prior in list(samples.items()):
            if isinstance(prior, types.FunctionType) and prior.__closure__:
                cells = tuple(_copied_cell(cell, memo) for cell in prior.__closure__)
                remade = types.FunctionType(prior.__code__, prior.__globals__, prior.__name__, prior.__defaults__,
                                            cells)
                remade.__kwdefaults__ = prior.__kwdefaults__
                samples[name] = remade


def _copied_cell(cell, memo: dict):
    try:
        contents = cell.cell_contents
    except ValueError:   # a name the function closes over that is not bound yet
        return types.CellType()
    return types.CellType(copy.deepcopy(contents, memo))


def _is_autoguide_factory(guide) -> bool:
    """An autoguide class (``AutoNormal``), or a ``functools.partial`` of one: built on the model."""
    func = guide.func if isinstance(guide, functools.partial) else guide
    return isinstance(func, type) and issubclass(func, AutoGuide)


def _has_protocol(guide) -> bool:
    """A guide that reads and writes its own posterior (:class:`MeanFieldGuide`)."""
    return (callable(getattr(guide, "posterior", None)) and callable(getattr(guide, "load_posterior", None))
            and not isinstance(guide, AutoGuide))


def _first_not_finite(named_params) -> Optional[str]:
    with torch.no_grad():
        return next((name for name, p in named_params if not bool(torch.isfinite(p).all())), None)


def _check_x(x) -> int:
    if not torch.is_tensor(x) or x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(f"x: expected a tensor of shape (n, ...) with n >= 1, got {_describe(x)}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got dtype {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x: contains NaN or infinite values")
    return x.shape[0]


@torch.no_grad()
def _probe(run: Callable[[], Tensor], net: nn.Module, x: Tensor) -> Tensor:
    """``run()`` (the network on ``x[:1]``) with every module of ``net`` in eval mode, restored afterwards."""
    modes = [(module, module.training) for module in net.modules()]
    net.eval()
    try:
        return run()
    except (RuntimeError, ValueError, IndexError) as error:
        raise ValueError(f"x: the network cannot run on inputs of shape {tuple(x.shape[1:])}: {error}") from error
    finally:
        for module, mode in modes:
            module.training = mode


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)


def _state(net: nn.Module) -> dict[str, Tensor]:
    return {name: param.detach().clone() for name, param in net.named_parameters()}


@torch.no_grad()
def _load_state(net: nn.Module, state, argument: str) -> None:
    params = dict(net.named_parameters())
    check_names(state, {name: p.shape for name, p in params.items()}, argument, "parameter")
    for name, param in params.items():
        check_tensor(state[name], param.shape, f"{argument}[{name!r}]")
    for name, param in params.items():
        param.copy_(state[name])

"""A Bayesian neural network as a Pyro program: any ``nn.Module`` plus a prior object plus a likelihood.

The generative story for client k with ``n_k`` examples ``(x_i, y_i)``:

    w_s ~ p_s                                      for every Bayesian parameter site s (the prior object decides)
    y_i | x_i, w ~ Categorical(softmax(f(x_i; w, theta)))     i = 1 .. n_k

where ``theta`` are the parameters the prior keeps deterministic. A mini-batch of B examples stands for all
``n_k``: the likelihood sits in ``pyro.plate("data", size=n_k, subsample=...)``, which scales it by ``n_k / B``,
so an ELBO on a batch is an unbiased estimate of the ELBO on the whole local dataset.

Parameters live on the modules, never in Pyro's global parameter store: every run of the network is in Pyro's
``module_local_params`` mode (``PyroModule`` parameters are otherwise mirrored into, and shared through, the global
store by name, so two clients' copies of one architecture would be the same parameters).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Optional

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.nn.module import to_pyro_module_
from torch import Tensor, nn

from bnpfed.models.local_reparameterization import local_reparameterization
from bnpfed.models.priors import Prior

__all__ = ["LIKELIHOODS", "BayesianNetwork"]

#: Likelihoods :class:`BayesianNetwork` implements.
LIKELIHOODS = ("categorical",)


def _module_local_params():
    return pyro.settings.context(module_local_params=True)


class BayesianNetwork(nn.Module):
    """A Bayesian copy of a plain network: the chosen parameters become Pyro sample sites named like the
    parameters (``"fc1.weight"``), the others stay deterministic ``nn.Parameter`` s of this module.

    The user's network is deep-copied, never modified.

    Usage::

        bnn = BayesianNetwork(LeNet(image_size=8), only_linear_weights())
        bnn.bayesian_sites                     # ("fc1.weight", "fc2.weight", "fc3.weight")
        trace = poutine.trace(bnn.model).get_trace(x, y, dataset_size=1000)
        probs = bnn.predict(x, num_samples=10, guide=guide)       # posterior predictive

    :param nn.Module net: the network; ``net(x)`` returns logits ``(B, num_classes)``.
    :param Prior prior: which parameters are random, and their priors.
    :param str likelihood: observation model; only ``"categorical"`` (softmax classification). Default
        ``"categorical"``.
    :param bool local_reparameterization: sample the pre-activations of linear layers with Gaussian weights instead
        of the weights (see :mod:`bnpfed.models.local_reparameterization`) in every run under :meth:`context`.
        Default ``False``.
    """

    def __init__(
        self, net: nn.Module, prior: Prior, *, likelihood: str = "categorical", local_reparameterization: bool = False
    ):
        super().__init__()
        if not isinstance(net, nn.Module):
            raise ValueError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        if not isinstance(prior, Prior):
            raise ValueError(f"prior: expected a bnpfed.models.Prior, got {type(prior).__name__}")
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"likelihood: expected one of {LIKELIHOODS}, got {likelihood!r}")
        if not isinstance(local_reparameterization, bool):
            raise ValueError(f"local_reparameterization: expected a bool, got {local_reparameterization!r}")
        self.likelihood = likelihood
        self.local_reparameterization = local_reparameterization
        pyro_net = copy.deepcopy(net)
        with _module_local_params():  # a PyroModule's parameter bookkeeping is set up when it is created
            to_pyro_module_(pyro_net)
            #: Values of the Bayesian parameters in the user's network, ``{site: tensor}``.
            self.init_values: dict[str, Tensor] = prior.apply_(pyro_net)
        self.net = pyro_net
        #: Names of the Pyro sample sites of the weights, in ``net.named_parameters()`` order.
        self.bayesian_sites: tuple[str, ...] = tuple(self.init_values)
        #: Names of the parameters kept deterministic (``nn.Parameter`` s of ``self.net``).
        self.deterministic_params: tuple[str, ...] = tuple(name for name, _ in pyro_net.named_parameters())

    def logits(self, x: Tensor) -> Tensor:
        """Run the network once: ``(B, ...)`` inputs to ``(B, num_classes)`` logits. Bayesian parameters are sampled
        at their sites (from the prior, or from a guide's trace under ``poutine.replay``)."""
        with _module_local_params():
            return self.net(x)

    def model(self, x: Tensor, y: Optional[Tensor] = None, dataset_size: Optional[int] = None) -> Tensor:
        """The Pyro model: weights from the prior, then labels ``y`` from the likelihood.

        :param Tensor x: inputs, ``(B, ...)``.
        :param Tensor y: labels ``(B,)`` (integers in ``0 .. num_classes - 1``) to condition on, or ``None`` to sample.
        :param int dataset_size: number of examples ``n`` the batch stands for; the likelihood is scaled by
            ``n / B``. Default ``B`` (no scaling).
        :returns: the logits, ``(B, num_classes)``.
        """
        batch = _batch_size(x)
        if y is not None and (not torch.is_tensor(y) or y.shape != (batch,)):
            raise ValueError(f"y: expected a tensor of shape ({batch},) matching x, got {_describe(y)}")
        if dataset_size is None:
            dataset_size = batch
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < batch:
            raise ValueError(f"dataset_size: expected an int >= the batch size {batch}, got {dataset_size!r}")
        logits = self.logits(x)
        with pyro.plate("data", size=dataset_size, subsample=torch.arange(batch, device=x.device)):
            pyro.sample("y", dist.Categorical(logits=logits), obs=y)
        return logits

    # nn.Module entry point, so that ELBO modules (``TraceMeanField_ELBO()(bnn, guide)``) and optimisers find the
    # deterministic parameters.
    forward = model

    @contextlib.contextmanager
    def context(self):
        """Context manager for each joint run of a guide and this model (an ELBO evaluation, a predictive sample):
        keeps parameters module-local and, if enabled, applies local reparameterisation to both."""
        with _module_local_params():
            if self.local_reparameterization:
                with local_reparameterization():
                    yield
            else:
                yield

    def sample_logits(self, x: Tensor, guide: Optional[Callable] = None) -> Tensor:
        """Logits under one draw of the weights: from ``guide`` (called with ``x``) if given, else from the prior.

        :returns: ``(B, num_classes)`` logits.
        """
        with self.context():
            if guide is None:
                return self.logits(x)
            guide_trace = poutine.trace(guide).get_trace(x)
            return poutine.replay(self.logits, trace=guide_trace)(x)

    @torch.no_grad()
    def predict(
        self, x: Tensor, num_samples: int = 10, guide: Optional[Callable] = None, seed: Optional[int] = None
    ) -> Tensor:
        """Predictive class probabilities, the softmax averaged over ``num_samples`` draws of the weights:

            p(y | x) ~= 1/S sum_s softmax(f(x; w_s)),   w_s ~ guide (posterior) or the prior when ``guide`` is None

        :param Tensor x: inputs, ``(B, ...)``.
        :param int num_samples: S, the number of weight draws. Default 10.
        :param guide: a guide of this model, e.g. :class:`bnpfed.inference.MeanFieldGuide`; ``None`` samples the prior.
        :param int seed: if given, draws use this seed (Torch's global random state is left as it was).
        :returns: ``(B, num_classes)`` probabilities; rows sum to 1.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples: expected a positive int, got {num_samples!r}")
        _batch_size(x)
        with seeded(seed, x.device):
            probs = self.sample_logits(x, guide).softmax(-1)
            for _ in range(num_samples - 1):
                probs += self.sample_logits(x, guide).softmax(-1)
        return probs / num_samples


@contextlib.contextmanager
def seeded(seed: Optional[int], device: torch.device | str = "cpu"):
    """Context in which Torch's random numbers come from ``seed`` and after which the global random state is as
    before; a no-op when ``seed`` is None."""
    if seed is None:
        yield
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int or None, got {seed!r}")
    device = torch.device(device)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        # only the forked generators are seeded (torch.manual_seed would also reseed every CUDA device)
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def _batch_size(x) -> int:
    if not torch.is_tensor(x) or x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(f"x: expected a tensor of shape (B, ...) with B >= 1, got {_describe(x)}")
    return x.shape[0]


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)

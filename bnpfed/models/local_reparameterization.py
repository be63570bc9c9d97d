"""The local reparameterisation trick (Kingma, Salimans & Welling 2015): a Pyro effect handler, and a layer.

For a linear layer ``b = x W^T + c`` whose weights are mean-field Gaussian, ``W_ij ~ N(mu_ij, sigma2_ij)``, each
pre-activation is Gaussian too:

    b ~ N(x mu^T + E[c],  x^2 (sigma2)^T + Var[c])

(squares elementwise), independently for every example. Sampling ``b`` instead of ``W`` gives every example of a
mini-batch its own weight noise, which lowers the variance of ELBO gradients at the same cost. Ozer et al. (2022)
train their clients this way.

Two implementations of the same draw:

- :func:`local_reparameterization`, an effect handler for Pyro programs (the reference semantics). Inside it, every
  non-observed Pyro sample site records which distribution its value came from; every ``torch.nn.functional.linear``
  call (what ``nn.Linear`` runs) whose weight is such a value with a (possibly ``Independent``) ``Normal``
  distribution returns a sample of ``b`` instead. The bias may be a Gaussian sample too, or any tensor (variance 0),
  or ``None``. Other calls run unchanged. The handler must wrap the guide *and* the model of one ELBO evaluation, so
  that the model's linear layers see the guide's distributions (the idea of TyXe's
  ``LocalReparameterizationMessenger``); calls are intercepted with a ``TorchFunctionMode``, which sees every torch
  call of the forward pass.
- :class:`LocalReparameterizedLinear`, a module-level layer: an ``nn.Linear`` told the moments of its weight (and
  bias) before a forward pass draws its pre-activations directly, at no cost to the other layers. The fast ELBO of
  :class:`~bnpfed.clients.MeanFieldELBO` uses it.

Both draw ``b`` with :func:`sample_linear`.

Usage::

    >>> import pyro, pyro.distributions as dist, torch
    >>> from torch import nn
    >>> from bnpfed.models import BayesianNetwork, IIDPrior
    >>> bnn = BayesianNetwork(nn.Linear(3, 2), IIDPrior(hide=["bias"]))
    >>> def guide(x):                                       # a mean-field Gaussian weight, sigma = 0.1
    ...     return pyro.sample("weight", dist.Normal(torch.zeros(2, 3), 0.1).to_event(2))
    >>> x = torch.ones(4, 3)
    >>> with local_reparameterization():                    # guide and model run inside the handler
    ...     out = pyro.poutine.replay(bnn.output, pyro.poutine.trace(guide).get_trace(x))(x)
    >>> out.shape, bool((out[0] != out[1]).all())           # identical inputs, independent pre-activations
    (torch.Size([4, 2]), True)
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from pyro.poutine.messenger import Messenger
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "LocalReparameterizationMessenger",
    "LocalReparameterizedLinear",
    "local_reparameterization",
    "sample_linear",
]

#: Added to pre-activation variances before the square root (a row of zero inputs with a deterministic bias has
#: variance 0, whose square root has an infinite gradient).
MIN_VARIANCE = 1e-16


def sample_linear(input: Tensor, weight_loc: Tensor, weight_var: Tensor, bias_loc: Optional[Tensor] = None,
                  bias_var: Optional[Tensor] = None) -> Tensor:
    """One draw of the pre-activations ``b = x W^T + c`` of a linear layer with Gaussian weights, independently
    for every row of ``input``:

        b ~ N(x mu^T + E[c],  x^2 (sigma2)^T + Var[c])

    :param Tensor input: ``x``, ``(..., in_features)``.
    :param Tensor weight_loc: ``mu``, ``(out_features, in_features)``; ``weight_var``: ``sigma2``, the same shape.
    :param Tensor bias_loc: ``E[c]`` ``(out_features,)``, or ``None`` (no bias).
    :param Tensor bias_var: ``Var[c]``, or ``None`` for a deterministic bias.
    :returns: ``(..., out_features)``; draws ``torch.randn_like`` of that shape.
    """
    loc = F.linear(input, weight_loc, bias_loc)
    # x * x rather than x.pow(2), and a floor added rather than clamped: the same values, fewer and cheaper
    # autograd nodes (a small layer's step is dominated by per-operation overhead)
    var = F.linear(input * input, weight_var, bias_var) + MIN_VARIANCE
    return torch.addcmul(loc, var.sqrt(), torch.randn_like(loc))


class LocalReparameterizedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward draws its pre-activations with :func:`sample_linear` from the moments it is
    given, ``weight_moments = (mu, sigma2)`` and optionally ``bias_moments``; with ``weight_moments = None`` it is a
    plain ``nn.Linear``. Whoever sets the moments (a fast ELBO, before each forward pass) owns them; the layer keeps
    no state of its own beyond ``nn.Linear``'s.

    An existing ``nn.Linear`` becomes one in place with :meth:`convert_`.
    """

    weight_moments: Optional[tuple[Tensor, Tensor]] = None
    bias_moments: Optional[tuple[Tensor, Tensor]] = None

    @classmethod
    def convert_(cls, module: nn.Linear) -> "LocalReparameterizedLinear":
        """Turn an ``nn.Linear`` (exactly that class) into this class in place; returns it."""
        if type(module) is not nn.Linear:
            raise ValueError(f"module: expected a torch.nn.Linear, got {type(module).__name__}")
        module.__class__ = cls
        return module

    def forward(self, input: Tensor) -> Tensor:
        if self.weight_moments is None:
            return super().forward(input)
        bias_loc, bias_var = self.bias_moments if self.bias_moments is not None else (self.bias, None)
        return sample_linear(input, *self.weight_moments, bias_loc, bias_var)


def _gaussian_base(fn):
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return fn if isinstance(fn, torch.distributions.Normal) else None


class LocalReparameterizationMessenger(Messenger):
    """Samples the pre-activations of linear layers with Gaussian weights instead of the weights.

    See the module docstring for the math. Use it through :func:`local_reparameterization`.
    """

    def __enter__(self):
        # id(value) -> (weak reference to value, distribution); the weak reference guards against a reused id
        self._sources: dict[int, tuple[weakref.ref, object]] = {}
        self._mode = _LinearInterceptor(self)
        self._mode.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._mode.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            self._mode.__exit__(exc_type, exc_value, traceback)
            self._sources = {}

    def _pyro_post_sample(self, msg):
        if msg["is_observed"] or not torch.is_tensor(msg["value"]):
            return
        # keep the first source: under replay the model re-reports the guide's value with the prior's distribution
        self._sources.setdefault(id(msg["value"]), (weakref.ref(msg["value"]), msg["fn"]))

    def _moments(self, tensor: Tensor) -> Optional[tuple[Tensor, Tensor]]:
        """``(mean, variance)`` of a Gaussian sample, or ``None`` if ``tensor`` is not one."""
        source = self._sources.get(id(tensor))
        if source is None or source[0]() is not tensor:
            return None
        base = _gaussian_base(source[1])
        return None if base is None else (base.mean, base.variance)

    def linear(self, input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Optional[Tensor]:
        """A sample of ``F.linear(input, weight, bias)`` drawn through the pre-activations, or ``None`` when ``weight``
        (or a random ``bias``) is not a Gaussian sample from this context."""
        w = self._moments(weight)
        if w is None:
            return None
        b_loc, b_var = bias, None
        if bias is not None and id(bias) in self._sources:
            b = self._moments(bias)
            if b is None:
                return None
            b_loc, b_var = b
        return sample_linear(input, w[0], w[1], b_loc, b_var)


class _LinearInterceptor(TorchFunctionMode):
    def __init__(self, messenger: LocalReparameterizationMessenger):
        super().__init__()
        self.messenger = messenger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            # the mode is switched off while this method runs, so the F.linear calls below are plain ones
            result = self.messenger.linear(*args, **kwargs)
            if result is not None:
                return result
        return func(*args, **kwargs)


def local_reparameterization(fn=None):
    """Effect handler applying :class:`LocalReparameterizationMessenger`: a context manager, or a wrapper of
    ``fn`` when given."""
    messenger = LocalReparameterizationMessenger()
    return messenger(fn) if fn is not None else messenger

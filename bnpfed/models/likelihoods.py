"""Likelihood objects: how a Bayesian network's output ``f(x; w)`` generates the observations ``y``.

A likelihood says four things, and :class:`~bnpfed.models.bayesian.BayesianNetwork` asks it each of them:

- the observation distribution given the network's output, ``p(y | f(x; w))`` (:meth:`Likelihood.distribution`),
  with a batch dimension of one entry per example;
- the sum of ``log p(y_i | f(x_i; w))`` over a batch (:meth:`Likelihood.log_likelihood`), the data term of the ELBO;
- how S predictive draws ``f(x; w_s)``, ``w_s ~ q``, make the posterior predictive, which is what ``predict``
  returns (:meth:`Likelihood.predictive`);
- which targets are valid (:meth:`Likelihood.check_targets`), so that ``fit`` fails at the boundary with a message.

:class:`Categorical` is classification (logits in, probabilities out); :class:`Gaussian` and :class:`StudentT` are
regression, with a known noise scale or one learned as a latent site of the model (:data:`NOISE_SITE`, drawn from its
prior in every run, :meth:`Likelihood.latent_sites`: a client's guide learns it, its posterior reports it, the fusion
rules fuse it in log space). A new observation model is a new subclass; nothing else changes.

Usage::

    >>> import torch
    >>> Categorical().predictive(torch.zeros(4, 3, 2))           # S = 4 draws, B = 3 examples, 2 classes
    tensor([[0.5000, 0.5000],
            [0.5000, 0.5000],
            [0.5000, 0.5000]])
    >>> draws = torch.tensor([[[1.0]], [[3.0]]])                   # S = 2 draws of one example's output
    >>> Gaussian(scale=0.5).predictive(draws)                     # mean 2, variance 0.5^2 + 1
    GaussianPredictive(mean=tensor([2.]), variance=tensor([1.2500]))
    >>> Categorical().check_targets(torch.tensor([0, 4]), 2, output=torch.zeros(1, 3))
    Traceback (most recent call last):
    ...
    ValueError: y: expected integer class labels in 0 .. 2 (the network has 3 outputs), got labels from 0 to 4
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Optional

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch import Tensor

from bnpfed.validation import check_int, check_positive

__all__ = ["NOISE_SITE", "Categorical", "Gaussian", "GaussianPredictive", "Likelihood", "StudentT", "predictive_of"]

#: The latent site of a regression likelihood's learned noise scale.
NOISE_SITE = "noise_scale"


class Likelihood(ABC):
    """Base class: the observation model ``p(y | f(x; w))`` of a Bayesian network.

    Subclasses implement :meth:`distribution`, :meth:`predictive` and :meth:`check_targets`; they may override
    :meth:`log_likelihood` with a faster formula of the same value.
    """

    @abstractmethod
    def distribution(self, output: Tensor) -> dist.TorchDistribution:
        """``p(y | f(x; w))`` for a batch: a distribution with ``batch_shape (B,)`` (one entry per example) given the
        network's output ``(B, ...)``."""

    def log_likelihood(self, output: Tensor, y: Tensor) -> Tensor:
        """``sum_i log p(y_i | f(x_i; w))`` over the batch, a scalar (the same value as
        ``distribution(output).log_prob(y).sum()``)."""
        observations = self.distribution(output)
        if y.shape != observations.shape():
            raise ValueError(f"y: expected a tensor of shape {tuple(observations.shape())} for {self!r}, "
                             f"got {_describe(y)}")
        return observations.log_prob(y).sum()

    @abstractmethod
    def predictive(self, outputs: Tensor) -> Any:
        """The posterior predictive from S draws of the network's output, ``outputs: (S, B, ...)``; what
        ``BayesianNetwork.predict`` returns."""

    @abstractmethod
    def check_targets(self, y: Any, n: int, output: Tensor, label: str = "y") -> None:
        """Raise a ``ValueError`` naming ``label`` unless ``y`` holds ``n`` valid targets for a network whose output
        for one example looks like ``output`` ``(1, ...)``."""

    def targets(self, y: Tensor) -> Tensor:
        """Valid targets (:meth:`check_targets`) in the dtype the likelihood computes with (default: as given)."""
        return y

    def latent_sites(self) -> dict[str, Any]:
        """``{site: prior}``: the latent sites :meth:`distribution` draws with ``pyro.sample`` (a learned noise
        scale), which a model reads as hyper-parameters; none by default."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Categorical(Likelihood):
    """Classification: ``y_i ~ Categorical(softmax(f(x_i; w) / T))``, the network's output being logits ``(B, C)``
    and ``T > 0`` a temperature (1, the default, is the plain softmax of the papers).

    The predictive is the mean of the S draws' softmax probabilities,
    ``p(y | x) ~= 1/S sum_s softmax(f(x; w_s) / T)``, a ``(B, C)`` tensor whose rows sum to 1. A temperature other
    than 1 is temperature scaling (Guo et al., ICML 2017) inside every draw: what a fused global posterior's
    predictive is given when its clients fit one on their own data (``FusionConfig(temperature="fit")``); training
    under it tempers the likelihood itself.

    :param int num_classes: C, if known; labels must then lie in ``0 .. C - 1`` and the network must output C
        values per example. Default ``None``: C is the width of the network's output.
    :param float temperature: ``T > 0``. Default 1.
    """

    def __init__(self, num_classes: Optional[int] = None, temperature: float = 1.0):
        self.num_classes = None if num_classes is None else check_int(num_classes, "num_classes", low=1)
        self.temperature = float(check_positive(temperature, "temperature"))

    def _tempered(self, output):
        return output if self.temperature == 1.0 else output / self.temperature

    def distribution(self, output):
        return dist.Categorical(logits=self._tempered(output))

    def log_likelihood(self, output, y):
        if output.dim() == 2:   # the same value, one fused kernel
            return -F.cross_entropy(self._tempered(output), y, reduction="sum")
        return super().log_likelihood(output, y)

    def predictive(self, outputs):
        return self._tempered(outputs).softmax(-1).mean(0)

    def check_targets(self, y, n, output, label="y"):
        if not torch.is_tensor(y) or y.shape != (n,):
            raise ValueError(f"{label}: expected a tensor of shape ({n},) matching x, got {_describe(y)}")
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise ValueError(f"{label}: expected integer class labels, got dtype {y.dtype}")
        width = output.shape[-1]
        if self.num_classes is not None and width != self.num_classes:
            raise ValueError(f"likelihood: expected a network with {self.num_classes} outputs for {self!r}, got one "
                             f"with {width} values per example")
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= width:
            raise ValueError(f"{label}: expected integer class labels in 0 .. {width - 1} (the network has {width} "
                             f"outputs), got labels from {low} to {high}")

    def targets(self, y):
        """Labels of any integer dtype as int64 (what torch's categorical and cross-entropy kernels take)."""
        return y.long()

    def __setstate__(self, state):   # files written before the temperature existed
        self.__dict__.update({"temperature": 1.0, **state})

    def __repr__(self):
        args = ([] if self.num_classes is None else [f"num_classes={self.num_classes}"]) + (
            [] if self.temperature == 1.0 else [f"temperature={self.temperature:g}"])
        return f"Categorical({', '.join(args)})"


class GaussianPredictive(NamedTuple):
    """The moments of a regression likelihood's posterior predictive (a mixture of S draws' distributions), each of
    the targets' shape."""

    mean: Tensor
    variance: Tensor


class _Regression(Likelihood):
    """What :class:`Gaussian` and :class:`StudentT` share: targets of the output's shape (``(B,)`` for an output
    ``(B, 1)``), and a noise scale that is known or a latent site."""

    def __init__(self, scale: Optional[float], scale_prior: Optional[dist.TorchDistribution]):
        if scale is None:
            scale_prior = dist.HalfNormal(1.0) if scale_prior is None else scale_prior
            if not isinstance(scale_prior, torch.distributions.Distribution) or scale_prior.event_shape != () \
                    or scale_prior.batch_shape != ():
                raise ValueError(f"scale_prior: expected a scalar pyro distribution of the noise scale, got "
                                 f"{scale_prior!r}")
            self.scale, self.scale_prior = None, scale_prior
        else:
            if scale_prior is not None:
                raise ValueError(f"scale_prior: the prior of a learned noise scale; expected None with a known "
                                 f"scale={scale!r}, got {scale_prior!r}")
            self.scale, self.scale_prior = check_positive(scale, "scale"), None

    @staticmethod
    def _loc(output: Tensor) -> Tensor:
        return output[..., 0] if output.dim() == 2 and output.shape[-1] == 1 else output

    def _noise(self):
        """The noise scale of this run: the known one, or a draw at :data:`NOISE_SITE`."""
        return self.scale if self.scale is not None else pyro.sample(NOISE_SITE, self.scale_prior)

    def latent_sites(self):
        return {} if self.scale is not None else {NOISE_SITE: self.scale_prior}

    def check_targets(self, y, n, output, label="y"):
        shape = (n, *self._loc(output).shape[1:])
        if not torch.is_tensor(y) or tuple(y.shape) != shape:
            raise ValueError(f"{label}: expected a tensor of shape {shape} matching x and the network's output, "
                             f"got {_describe(y)}")
        if not y.is_floating_point():
            raise ValueError(f"{label}: expected floating-point regression targets, got dtype {y.dtype}")
        if not bool(torch.isfinite(y).all()):
            raise ValueError(f"{label}: expected finite regression targets, got "
                             f"{int((~torch.isfinite(y)).sum())} NaN or infinite value(s)")

    def __setstate__(self, state):   # files written before a noise scale could be learned
        self.__dict__.update({"scale_prior": None, **state})

    def _scale_repr(self) -> str:
        return f"scale={self.scale}" if self.scale is not None else f"scale=None, scale_prior={self.scale_prior!r}"


class Gaussian(_Regression):
    """Regression: ``y_i ~ N(f(x_i; w), scale^2)`` elementwise, with a known noise scale, or one learned:
    ``scale ~ scale_prior`` at the latent site :data:`NOISE_SITE`.

    Targets have the shape of the network's output, except that an output ``(B, 1)`` (one regression target, as
    ``nn.Linear(h, 1)`` gives) has targets ``(B,)``.

    The predictive from S draws is the mixture ``1/S sum_s N(f(x; w_s), scale_s^2)``; :meth:`predictive` returns its
    mean and variance, ``mean = 1/S sum_s f_s`` and ``variance = scale^2 + 1/S sum_s (f_s - mean)^2`` (a known
    scale; with a learned one the model's draws give it, :func:`predictive_of`).

    :param float scale: the noise standard deviation, in the units of ``y``; None: learned. Default 1.
    :param scale_prior: the prior of a learned scale, a scalar distribution on the positive numbers. Default
        ``HalfNormal(1)`` (with ``scale=None``).
    """

    def __init__(self, scale: Optional[float] = 1.0, scale_prior: Optional[dist.TorchDistribution] = None):
        super().__init__(scale, scale_prior)

    def distribution(self, output):
        loc = self._loc(output)
        return dist.Normal(loc, self._noise()).to_event(loc.dim() - 1)

    def predictive(self, outputs):
        if self.scale is None:
            raise ValueError("likelihood: a learned noise scale is a latent site; the predictive comes from the "
                             "model's draws (BayesianNetwork.predict), not from the outputs alone")
        locs = self._loc(outputs.flatten(0, 1)).unflatten(0, outputs.shape[:2])
        return GaussianPredictive(locs.mean(0), self.scale**2 + locs.var(0, unbiased=False))

    def __repr__(self):
        return f"Gaussian({self._scale_repr()})"


class StudentT(_Regression):
    """Robust regression: ``y_i ~ StudentT(df, f(x_i; w), scale)`` elementwise (heavy tails: an outlier costs the
    fit far less than under a Gaussian), with a known noise scale or one learned at :data:`NOISE_SITE`.

    Targets as :class:`Gaussian`'s. The predictive of S draws is the mixture of their Student-t distributions; its
    moments (``df > 2``) are ``mean = 1/S sum_s f_s``, ``variance = 1/S sum_s scale_s^2 df / (df - 2) +
    1/S sum_s (f_s - mean)^2`` (:func:`predictive_of`).

    :param float df: the degrees of freedom, > 0. Default 4.
    :param float scale: the noise scale, in the units of ``y``; None (default): learned.
    :param scale_prior: the prior of a learned scale. Default ``HalfNormal(1)`` (with ``scale=None``).
    """

    def __init__(self, df: float = 4.0, scale: Optional[float] = None,
                 scale_prior: Optional[dist.TorchDistribution] = None):
        self.df = float(check_positive(df, "df"))
        super().__init__(scale, scale_prior)

    def distribution(self, output):
        loc = self._loc(output)
        return dist.StudentT(self.df, loc, self._noise()).to_event(loc.dim() - 1)

    def predictive(self, outputs):
        raise ValueError("likelihood: a Student-t predictive comes from the model's draws (BayesianNetwork.predict, "
                         "predictive_of)")

    def __repr__(self):
        return f"StudentT(df={self.df:g}, {self._scale_repr()})"


def predictive_of(observations: list) -> Any:
    """The posterior predictive of S draws' observation distributions ``p(y | x, w_s)`` (each of batch shape
    ``(B,)``, e.g. a Pyro program's observed site under each of S draws from its guide), the mixture
    ``1/S sum_s p(y | x, w_s)``:

    * ``Categorical``: its class probabilities ``(B, C)``, ``1/S sum_s probs_s`` (as :class:`Categorical`'s);
    * ``Normal``: a :class:`GaussianPredictive` of the mixture's moments, ``mean = 1/S sum_s loc_s`` and
      ``variance = 1/S sum_s scale_s^2 + 1/S sum_s (loc_s - mean)^2`` (as :class:`Gaussian`'s);
    * ``StudentT`` (df > 2): the same moments, each draw's variance ``scale_s^2 df / (df - 2)``.

    :raises ValueError: for an empty list or another distribution.
    """
    if not observations:
        raise ValueError("observations: expected at least one distribution, got none")
    bases = [_base(fn) for fn in observations]
    if all(isinstance(fn, torch.distributions.Categorical) for fn in bases):
        return torch.stack([fn.probs for fn in bases]).mean(0)
    if all(isinstance(fn, (torch.distributions.Normal, torch.distributions.StudentT)) for fn in bases):
        locs = torch.stack([fn.loc.expand(fn.batch_shape) for fn in bases])
        variances = torch.stack([fn.variance.expand(fn.batch_shape) for fn in bases])
        return GaussianPredictive(locs.mean(0), variances.mean(0) + locs.var(0, unbiased=False))
    raise ValueError(f"observations: expected Categorical, Normal or StudentT distributions (the predictives bnpfed "
                     f"aggregates), got {type(bases[0]).__name__}")


def _base(fn):
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return fn


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)

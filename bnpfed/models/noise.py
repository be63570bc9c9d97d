"""Laws of a local neuron around its atom with named parameters: the ``noise=`` of
:func:`~bnpfed.models.beta_bernoulli_layer` and of :func:`~bnpfed.matching.match_layer`.

Any callable ``noise(loc, variance) -> Distribution`` (batch shape of ``loc``, one law per coordinate) is a noise law
of the model; :func:`~bnpfed.models.gaussian_noise` is the default. A :class:`NoiseLaw` is such a callable whose
shape parameters have names (Student-t's degrees of freedom), so that a matcher can leave some of them *free* (None)
and estimate them by empirical Bayes: ``StudentTNoise(df=None)`` asks :func:`~bnpfed.matching.match_layer` for the
degrees of freedom, ``StudentTNoise(df=2.0)`` fixes them. A law with a free parameter cannot be sampled from.
"""

from __future__ import annotations

import math
from typing import Mapping

import pyro.distributions as dist
import torch
from torch import Tensor

__all__ = ["NoiseLaw", "StudentTNoise"]


class NoiseLaw:
    """A law of local neurons around their atoms, ``noise(loc, variance) -> Distribution``, with named scalar shape
    parameters, each given or free (None: estimated by the matcher's empirical Bayes).

    A subclass sets :attr:`bounds` (name -> ``(low, high, start)``: the range an estimate may take and where it
    starts) and writes :meth:`law`. ``variance`` is what the model passes: ``sigma2 / s_jd`` (the noise scale
    squared, over the client's precision scale), whatever the law makes of it.

    Usage::

        >>> class LaplaceNoise(NoiseLaw):          # no shape parameter: the scale is sigma2's
        ...     def law(self, loc, variance):
        ...         return dist.Laplace(loc, (variance / 2).sqrt())      # variance sigma2
        >>> LaplaceNoise()(torch.zeros(3), torch.ones(3))
        Laplace(loc: torch.Size([3]), scale: torch.Size([3]))

    :param parameters: the shape parameters by name (those of :attr:`bounds`), each a number or None (free).
    """

    #: name -> (low, high, start) of each shape parameter
    bounds: Mapping[str, tuple] = {}

    def __init__(self, **parameters):
        unknown = sorted(set(parameters) - set(self.bounds))
        if unknown:
            raise ValueError(f"{unknown[0]}: expected a parameter of {type(self).__name__} (one of "
                             f"{sorted(self.bounds)}), got {unknown[0]}={parameters[unknown[0]]!r}")
        self.parameters = {}
        for name, (low, high, _) in self.bounds.items():
            value = parameters.get(name)
            if value is not None:
                value = float(value)
                if not (math.isfinite(value) and low <= value <= high):
                    raise ValueError(f"{name}: expected None (estimated) or a number in [{low:g}, {high:g}], got "
                                     f"{parameters[name]!r}")
            self.parameters[name] = value

    @property
    def free(self) -> tuple:
        """Names of the parameters left free (None)."""
        return tuple(n for n, v in self.parameters.items() if v is None)

    def with_values(self, **values) -> "NoiseLaw":
        """The same law with some parameters set (free ones among them filled)."""
        unknown = sorted(set(values) - set(self.bounds))
        if unknown:
            raise ValueError(f"{unknown[0]}: expected a parameter of {type(self).__name__} (one of "
                             f"{sorted(self.bounds)}), got {unknown[0]}={values[unknown[0]]!r}")
        return type(self)(**{**self.parameters, **values})

    def law(self, loc: Tensor, variance: Tensor, **parameters) -> dist.Distribution:
        """The distribution of neurons with atoms ``loc`` and noise variance ``variance`` at ``parameters``."""
        raise NotImplementedError(f"{type(self).__name__}: a NoiseLaw writes law(loc, variance, **parameters)")

    def __call__(self, loc: Tensor, variance: Tensor) -> dist.Distribution:
        if self.free:
            raise ValueError(f"{self.free[0]}: expected a value to sample or score with, got None (a free parameter "
                             f"of {type(self).__name__}, which only match_layer's empirical Bayes estimates)")
        return self.law(loc, variance, **self.parameters)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.parameters.items())
        return f"{type(self).__name__}({inner})"


class StudentTNoise(NoiseLaw):
    """Student-t noise: ``v ~ StudentT(df, loc, sqrt(variance))`` per coordinate, heavy tailed for small ``df``
    (``variance`` is the squared scale; the variance itself is ``scale^2 df / (df - 2)`` for df > 2).

    Usage::

        >>> noise = StudentTNoise(df=2.0)
        >>> noise(torch.zeros(2), torch.full((2,), 0.04))
        StudentT(df: torch.Size([2]), loc: torch.Size([2]), scale: torch.Size([2]))
        >>> StudentTNoise().free                   # df estimated by match_layer
        ('df',)

    :param float df: degrees of freedom in [0.2, 1000], or None (default): free, estimated by the matcher.
    """

    bounds = {"df": (0.2, 1000.0, 4.0)}

    def __init__(self, df: float | None = None):
        super().__init__(df=df)

    def law(self, loc: Tensor, variance: Tensor, df: float) -> dist.Distribution:
        return dist.StudentT(df, loc, variance.sqrt())

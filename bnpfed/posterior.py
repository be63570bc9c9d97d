"""The one Gaussian posterior type: what a Bayesian client's guide reports, what a fusion rule returns, and what
travels in a Flower record.

A mean-field Gaussian posterior of one sample site (a weight tensor) is ``N(loc, variance)`` elementwise; a whole
network's posterior is ``{site: GaussianPosterior}``.

Usage::

    >>> import torch
    >>> g = GaussianPosterior(torch.zeros(2, 3), torch.full((2, 3), 0.25))
    >>> loc, variance = g                       # unpacks as a pair
    >>> g.scale[0, 0].item()
    0.5
    >>> GaussianPosterior.checked(torch.zeros(2), torch.tensor([1.0, 0.0]), "posterior['w']")
    Traceback (most recent call last):
    ...
    ValueError: posterior['w'] variance: expected all entries > 0, got minimum 0.0
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from bnpfed.validation import check_tensor

__all__ = ["GaussianPosterior"]


class GaussianPosterior(NamedTuple):
    """``N(loc, variance)`` weight by weight, one site; unpacks as ``loc, variance``.

    :param Tensor loc: posterior means, the site's shape.
    :param Tensor variance: posterior variances, the same shape, all > 0.
    """

    loc: Tensor
    variance: Tensor

    @property
    def scale(self) -> Tensor:
        """Posterior standard deviations, ``sqrt(variance)``."""
        return self.variance.sqrt()

    @classmethod
    def checked(cls, loc: Any, variance: Any, label: str = "posterior", shape: Optional[torch.Size] = None
                ) -> "GaussianPosterior":
        """A validated posterior: finite floating-point tensors of one shape (``shape`` if given), variances > 0;
        ``label`` names it in the error message."""
        if shape is None and torch.is_tensor(loc):
            shape = loc.shape
        check_tensor(loc, shape, f"{label} loc")
        check_tensor(variance, shape, f"{label} variance")
        if not bool((variance > 0).all()):
            raise ValueError(f"{label} variance: expected all entries > 0, got minimum {variance.min().item()}")
        return cls(loc, variance)

    @classmethod
    def of(cls, value: Any, label: str = "posterior", shape: Optional[torch.Size] = None) -> "GaussianPosterior":
        """A validated posterior from a ``GaussianPosterior`` or any ``(loc, variance)`` pair."""
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"{label}: expected a pair (loc, variance), got {type(value).__name__}")
        return cls.checked(value[0], value[1], label, shape)

"""Posterior fusion rules for mean-field Gaussian clients.

Ozer et al. (2022), "How to Combine Variational Bayesian Networks in Federated Learning". Each of K clients
holds a mean-field Gaussian posterior over the same weights, ``q_k(w) = N(mu_k, sigma_k^2)`` weight by weight;
the server fuses the K Gaussians of every weight into one Gaussian ``N(mu, sigma^2)`` with client weights
``b_k >= 0`` (normalised inside to ``sum_k b_k = 1``; the paper uses local data set sizes).

Built-in rules, fused mean ``mu`` and variance ``sigma^2`` (``b_max = max_k b_k``):

- ``eaa``: ``mu = sum_k b_k mu_k``, ``sigma^2 = sum_k b_k sigma_k^2``
- ``gaa``: ``mu = sum_k b_k mu_k``, ``sigma^2 = sum_k b_k^2 sigma_k^2``
- ``log_variance``: ``mu = sum_k b_k mu_k``, ``sigma^2 = exp(sum_k b_k log sigma_k^2)``
- ``pooling``: mean and unbiased variance of a sample pooled from the clients, ``floor(b_k N)`` draws from ``q_k``
- ``conflation``: ``mu = sum_k (b_k / sigma_k^2) mu_k / sum_k (b_k / sigma_k^2)``,
  ``sigma^2 = b_max / sum_k (b_k / sigma_k^2)``

A rule is a small pure function ``rule(locs, variances, weights, *, num_samples, generator) -> (loc, variance)``
on already validated tensors; :func:`register_rule` adds one under a name that :func:`fuse`, :func:`fuse_sites`
and everything above them accept.

**Per-coordinate weights.** ``weights`` may also be ``(K, *shape)``: a weight ``b_kd`` per client and coordinate,
normalised coordinate by coordinate (``b_kd / sum_k b_kd``; 0 where client k has nothing to say about coordinate d,
as when the members of one matched global unit hold different subsets of its coordinates,
:mod:`bnpfed.matching.posteriors`). The formulas above then hold coordinate by coordinate, with ``b_max``
the largest weight of each coordinate. The closed-form rules take such weights whole; a rule registered without
``per_coordinate=True`` (``pooling``, and a user's own by default) is called once per pattern of weights (the
coordinates whose weight columns are equal), with those columns' ``(K,)`` weights.

Usage::

    >>> import torch
    >>> locs, variances = torch.tensor([[1.0, 0.0], [5.0, 2.0]]), torch.tensor([[1.0, 1.0], [4.0, 1.0]])
    >>> fuse(locs, variances, "conflation", weights=[30, 10]).loc       # locs: (K, *shape); weights b_k ~ n_k
    tensor([1.3077, 0.5000])
    >>> client_sites = [{"w": (locs[k], variances[k])} for k in range(2)]   # K dicts name -> (loc, variance)
    >>> fuse_sites(client_sites, "eaa", weights=[30, 10])["w"].variance
    tensor([1.7500, 1.0000])
"""

import math
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from bnpfed.posterior import GaussianPosterior
from bnpfed.validation import check_int

__all__ = [
    "GaussianPosterior",
    "FusionRule",
    "available_rules",
    "unregister_rule",
    "average_deterministic",
    "conflation",
    "eaa",
    "fuse",
    "fuse_sites",
    "gaa",
    "log_variance",
    "pooling",
    "register_rule",
]

#: Number of floats one chunk of pooled draws may hold (64 MiB of float32); keeps :func:`pooling` from building a
#: ``num_samples x numel`` tensor when a layer is large.
POOLING_CHUNK_ELEMENTS = 1 << 24

#: Number of floats one block of a rule's ``(K, numel)`` temporaries may hold (4 MiB of float32).
#: :func:`log_variance` and :func:`conflation` work through the weights one block of columns at a time: a block
#: stays in cache, and no ``(K, numel)`` tensor is allocated (for a large layer, the page faults of a fresh
#: allocation of that size cost several times the reading of the inputs: the throughput section of the docs'
#: benchmark page on posterior fusion).
BLOCK_ELEMENTS = 1 << 20


#: ``rule(locs, variances, weights, *, num_samples, generator) -> (loc, variance)``
FusionRule = Callable[..., tuple[Tensor, Tensor]]

_RULES: dict[str, FusionRule] = {}
#: The rules that take per-coordinate weights ``(K, *shape)`` themselves.
_PER_COORDINATE: set[str] = set()


# ----------------------------------------------------------------------------------------------------------------
# Registry


def register_rule(name: str, fn: FusionRule, *, overwrite: bool = False, per_coordinate: bool = False) -> FusionRule:
    """Make ``fn`` available as ``fuse(..., rule=name)``.

    :param str name: the rule's name.
    :param callable fn: ``fn(locs, variances, weights, *, num_samples, generator) -> (loc, variance)``. It
        receives validated tensors: ``locs`` and ``variances`` of shape ``(K, *shape)`` with finite entries and
        ``variances > 0``, ``weights`` of shape ``(K,)`` non-negative and summing to 1, all of one floating dtype
        and device; it returns two tensors of shape ``shape``.
    :param bool overwrite: replace a rule already registered under ``name``; default False raises instead.
    :param bool per_coordinate: ``fn`` also takes ``weights`` of shape ``(K, *shape)``, each coordinate's column
        non-negative and summing to 1 (module docstring); default False: :func:`fuse` calls it once per pattern of
        such weights, with ``(K,)`` weights.
    :returns: ``fn``, so that ``register_rule`` also reads well as ``fn = register_rule("name", fn)``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if not callable(fn):
        raise ValueError(f"fn: expected a callable fn(locs, variances, weights, *, num_samples, generator), got "
                         f"{type(fn).__name__}")
    if name in _RULES and not overwrite:
        raise ValueError(f"name: expected a rule name not registered yet, got {name!r}, which is; pass "
                         "overwrite=True to replace it")
    _RULES[name] = fn
    (_PER_COORDINATE.add if per_coordinate else _PER_COORDINATE.discard)(name)
    return fn


def unregister_rule(name: str) -> FusionRule:
    """Remove the rule ``name`` that :func:`register_rule` added (a plugin's, say) and return it."""
    if name not in _RULES:
        raise ValueError(f"name: expected a registered rule, got {name!r} (registered: {available_rules()})")
    _PER_COORDINATE.discard(name)
    return _RULES.pop(name)


def available_rules() -> list[str]:
    """Names accepted as ``rule``, in registration order (built-ins first)."""
    return list(_RULES)


def _get_rule(rule: str) -> FusionRule:
    if not isinstance(rule, str) or rule not in _RULES:
        raise ValueError(f"rule: expected one of {available_rules()}, got {rule!r}")
    return _RULES[rule]


# ----------------------------------------------------------------------------------------------------------------
# The rules: pure functions on validated tensors, locs/variances (K, *shape), weights (K,)


def _weighted_sum(weights: Tensor, x: Tensor) -> Tensor:
    """``sum_k weights_k x_k`` over the leading client dimension of ``x`` (``weights`` (K,) or per coordinate)."""
    if weights.dim() == 1:
        return torch.tensordot(weights, x, dims=1)
    return (weights * x).sum(dim=0)


def eaa(locs: Tensor, variances: Tensor, weights: Tensor, **_: Any) -> tuple[Tensor, Tensor]:
    """Empirical arithmetic aggregation: ``mu = sum_k b_k mu_k``, ``sigma^2 = sum_k b_k sigma_k^2``.

    Averages means and variances as if they were ordinary parameters (FedAvg on both).
    """
    return _weighted_sum(weights, locs), _weighted_sum(weights, variances)


def gaa(locs: Tensor, variances: Tensor, weights: Tensor, **_: Any) -> tuple[Tensor, Tensor]:
    """Gaussian arithmetic aggregation: the law of ``sum_k b_k w_k`` for independent ``w_k ~ q_k``.

    ``mu = sum_k b_k mu_k``, ``sigma^2 = sum_k b_k^2 sigma_k^2`` (not renormalised, so K agreeing clients with
    uniform weights shrink the variance K times).
    """
    return _weighted_sum(weights, locs), _weighted_sum(weights.square(), variances)


def log_variance(locs: Tensor, variances: Tensor, weights: Tensor, **_: Any) -> tuple[Tensor, Tensor]:
    """Average of log variances: ``mu = sum_k b_k mu_k``, ``sigma^2 = exp(sum_k b_k log sigma_k^2)``.

    The fused variance is the weighted geometric mean of the client variances. The logs and their weighted sum
    are accumulated in float64 whatever the inputs' dtype (in float32, 1000 identical variances came back 0.99996
    times themselves), and only the result is rounded to the inputs' dtype.
    """
    flat = variances.reshape(len(variances), -1)
    variance = torch.empty(flat.shape[1], dtype=flat.dtype, device=flat.device)
    weights64 = weights.to(torch.float64)
    per_coordinate = weights.dim() > 1
    if per_coordinate:
        weights64 = weights64.reshape(len(weights), -1)
    for cols, buffer in _column_blocks(flat, dtype=torch.float64):
        buffer.copy_(flat[:, cols]).log_()
        if per_coordinate:
            variance[cols] = (buffer * weights64[:, cols]).sum(dim=0).exp_()
        else:
            variance[cols] = torch.mv(buffer.t(), weights64).exp_()
    return _weighted_sum(weights, locs), variance.reshape(locs.shape[1:])


def conflation(locs: Tensor, variances: Tensor, weights: Tensor, **_: Any) -> tuple[Tensor, Tensor]:
    """Conflation: the normalised product of the client densities, each raised to ``b_k / b_max``.

    With ``q_k(w) ∝ exp(-(w - mu_k)^2 / (2 sigma_k^2))``,

    ``prod_k q_k(w)^(b_k / b_max) ∝ exp(-sum_k (b_k / b_max) (w - mu_k)^2 / (2 sigma_k^2))``,

    a quadratic in ``w`` with precision ``lambda = sum_k (b_k / b_max) / sigma_k^2`` and linear coefficient
    ``sum_k (b_k / b_max) mu_k / sigma_k^2``. Completing the square gives the Gaussian

    ``mu = sum_k (b_k / sigma_k^2) mu_k / sum_k (b_k / sigma_k^2)``,
    ``sigma^2 = 1 / lambda = b_max / sum_k (b_k / sigma_k^2)``.

    Both are unchanged when all ``b_k`` are scaled by the same factor. With equal weights the exponents are all 1
    and this is the plain product of the K densities.

    The published code forms the product of all variances, which underflows to 0 in float32 at about a dozen
    clients with small variances. Here the sums of precisions ``lambda_k = b_k / sigma_k^2`` are formed directly
    (one division per weight and client, no product), which is exact to rounding unless a precision overflows
    (a variance below about ``b_k * 3e-39`` in float32) or the total falls below the smallest normal number; for
    such inputs the log-precisions ``l_k = log b_k - log sigma_k^2`` are shifted by their maximum ``m`` before
    exponentiating, ``r_k = exp(l_k - m) in [0, 1]`` with ``max_k r_k = 1``, so

    ``mu = sum_k r_k mu_k / sum_k r_k``,  ``log sigma^2 = log b_max - m - log sum_k r_k``,

    which stays finite and accurate for any number of clients and any positive variances.
    """
    num_clients, shape = len(locs), locs.shape[1:]
    flat_locs, flat_variances = locs.reshape(num_clients, -1), variances.reshape(num_clients, -1)
    loc = torch.empty(flat_locs.shape[1], dtype=locs.dtype, device=locs.device)
    variance = torch.empty_like(loc)
    per_coordinate = weights.dim() > 1
    b = weights.reshape(num_clients, -1) if per_coordinate else weights[:, None]
    b_max = b.amax(dim=0) if per_coordinate else weights.max()
    for cols, buffer in _column_blocks(flat_variances):
        bk, bk_max = (b[:, cols], b_max[cols]) if per_coordinate else (b, b_max)
        precisions = torch.div(bk, flat_variances[:, cols], out=buffer)  # lambda_k = b_k / sigma_k^2
        total = precisions.sum(dim=0)
        block_loc = torch.sum(precisions.mul_(flat_locs[:, cols]), dim=0, out=loc[cols]).div_(total)
        if not (_all_normal_positive(total) and _all_finite(block_loc)):
            return _conflation_log_shifted(locs, variances, weights)
        torch.div(bk_max, total, out=variance[cols])
    return loc.reshape(shape), variance.reshape(shape)


def _conflation_log_shifted(locs: Tensor, variances: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`conflation` through shifted log-precisions, finite for any positive variances."""
    per_coordinate = weights.dim() > 1
    b = weights if per_coordinate else weights.reshape(-1, *([1] * (locs.dim() - 1)))
    log_precisions = b.log() - variances.log()
    shift = log_precisions.amax(dim=0)
    relative_precisions = torch.exp(log_precisions - shift)  # in [0, 1]; clients with b_k = 0 give exactly 0
    total = relative_precisions.sum(dim=0)  # >= 1
    loc = (relative_precisions * locs).sum(dim=0) / total
    b_max = weights.amax(dim=0) if per_coordinate else weights.max()
    variance = torch.exp(b_max.log() - shift - total.log())
    return loc, variance


def _column_blocks(flat: Tensor, dtype: torch.dtype | None = None):
    """``(cols, buffer)`` for blocks of columns of a ``(K, N)`` tensor, ``buffer`` an uninitialised ``(K, width)``
    tensor of ``dtype`` (default: ``flat``'s) to write the block's temporary into (reused across blocks)."""
    num_clients, numel = flat.shape
    width = max(1, BLOCK_ELEMENTS // max(1, num_clients))
    buffer = torch.empty(num_clients, min(width, numel), dtype=dtype or flat.dtype, device=flat.device)
    for start in range(0, numel, width):
        stop = min(start + width, numel)
        yield slice(start, stop), buffer[:, : stop - start] if stop - start < buffer.shape[1] else buffer


def _chunked_moments(loc: Tensor, scale: Tensor, count: int, generator: torch.Generator | None
                     ) -> tuple[Tensor, Tensor]:
    """Mean and sum of squared deviations of ``count`` draws from ``N(loc, scale^2)``, drawn in chunks.

    Chunks are merged with the pairwise update of Chan, Golub & LeVeque (1979), which avoids the cancellation of
    ``sum x^2 - n mean^2``.
    """
    chunk = max(1, POOLING_CHUNK_ELEMENTS // max(1, loc.numel()))
    mean = torch.zeros_like(loc)
    sum_sq = torch.zeros_like(loc)
    seen = 0
    while seen < count:
        n = min(chunk, count - seen)
        draws = loc + scale * torch.randn((n, *loc.shape), generator=generator, dtype=loc.dtype,
                                          device=loc.device)
        chunk_mean = draws.mean(dim=0)
        chunk_sum_sq = (draws - chunk_mean).square().sum(dim=0)
        total = seen + n
        delta = chunk_mean - mean
        mean = mean + delta * (n / total)
        sum_sq = sum_sq + chunk_sum_sq + delta.square() * (seen * n / total)
        seen = total
    return mean, sum_sq


def pooling(locs: Tensor, variances: Tensor, weights: Tensor, *, num_samples: int = 1000,
            generator: torch.Generator | None = None, **_: Any) -> tuple[Tensor, Tensor]:
    """Pooling: moment-match a Gaussian to a sample pooled from all clients.

    Client k contributes ``n_k = floor(b_k N)`` draws of every weight from ``q_k`` (``N = num_samples``); with
    ``M = sum_k n_k`` pooled draws ``x_1..x_M``, ``mu = (1/M) sum_i x_i`` and
    ``sigma^2 = 1/(M-1) sum_i (x_i - mu)^2``. As ``N -> infinity`` this tends to the moments of the mixture
    ``sum_k b_k q_k``: ``mu = sum_k b_k mu_k``, ``sigma^2 = sum_k b_k (sigma_k^2 + mu_k^2) - mu^2``.

    The pooled sample is never held whole: each client's draws are reduced in chunks of at most
    :data:`POOLING_CHUNK_ELEMENTS` floats to a mean and a sum of squared deviations, and those are merged
    across clients exactly as if the draws had been concatenated.

    :param int num_samples: ``N``, the size of the pooled sample before flooring.
    :param torch.Generator generator: source of the draws; the same seed gives the same result.
    :raises ValueError: if the floored counts give fewer than two draws in all.
    """
    # b_k N within rounding of the weights' dtype of an integer is that integer (b = 0.7 in float32 is 0.69999999)
    slack = 1 + 4 * torch.finfo(weights.dtype).eps
    counts = [math.floor(b * num_samples * slack) for b in weights.tolist()]
    total = sum(counts)
    if total < 2:
        raise ValueError(f"num_samples: expected enough for at least 2 pooled draws (floor(b_k * num_samples) per "
                         f"client with weights {weights.tolist()}), got {num_samples}, which gives {total}: increase "
                         "num_samples")
    scales = variances.sqrt()
    pooled_mean = torch.zeros_like(locs[0])
    pooled_sum_sq = torch.zeros_like(locs[0])
    seen = 0
    for k, n in enumerate(counts):
        if n == 0:
            continue
        mean, sum_sq = _chunked_moments(locs[k], scales[k], n, generator)
        merged = seen + n
        delta = mean - pooled_mean
        pooled_mean = pooled_mean + delta * (n / merged)
        pooled_sum_sq = pooled_sum_sq + sum_sq + delta.square() * (seen * n / merged)
        seen = merged
    return pooled_mean, pooled_sum_sq / (total - 1)


for _name, _fn, _whole in (("eaa", eaa, True), ("gaa", gaa, True), ("log_variance", log_variance, True),
                           ("pooling", pooling, False), ("conflation", conflation, True)):
    register_rule(_name, _fn, per_coordinate=_whole)


# ----------------------------------------------------------------------------------------------------------------
# Validation at the boundary


def _as_client_stack(x: Any, name: str) -> Tensor:
    """``x`` as a tensor ``(K, *shape)``: a tensor, an array, or a sequence of K per-client tensors."""
    if isinstance(x, Tensor):
        stacked = x
    elif isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0 and any(
            isinstance(item, Tensor) or hasattr(item, "__array__") for item in x):
        items = [torch.as_tensor(item) for item in x]
        for k, item in enumerate(items):
            if item.shape != items[0].shape:
                raise ValueError(f"{name}: expected one tensor of the same shape per client, got shape "
                                 f"{tuple(items[0].shape)} for client 0 but {tuple(item.shape)} for client {k}")
        stacked = torch.stack([item.to(items[0].device) for item in items])
    else:
        try:
            stacked = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{name}: expected a tensor of shape (K, *shape) or a sequence of K equally shaped "
                             f"tensors, got {type(x).__name__}: {error}") from None
    if stacked.dim() == 0:
        raise ValueError(f"{name}: expected a leading client dimension, shape (K, *shape), got a scalar")
    if stacked.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one client (K >= 1), got shape {tuple(stacked.shape)}")
    if stacked.dtype == torch.bool or stacked.is_complex():
        raise ValueError(f"{name}: expected real values, got dtype {stacked.dtype}")
    return stacked


def _all_finite(x: Tensor) -> bool:
    """Whether every entry is finite, in one read: the minimum and maximum are finite (both propagate NaN)."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _all_positive_finite(x: Tensor) -> bool:
    """Whether every entry is finite and > 0, in one read of ``x``."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool((low > 0) & torch.isfinite(high))


def _all_normal_positive(x: Tensor) -> bool:
    """Whether every entry is finite and at least the smallest normal number of its dtype (no precision lost)."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool((low >= torch.finfo(x.dtype).tiny) & torch.isfinite(high))


def _check_finite(x: Tensor, name: str) -> None:
    if not _all_finite(x):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise ValueError(f"{name}: expected finite values, got {x[tuple(bad)].item()} at index {tuple(bad)}")


def _floating_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def _checked_weights(weights: Any, num_clients: int, shape: Optional[torch.Size], device: torch.device) -> Tensor:
    """``weights`` as float64, checked: ``(K,)`` summing to a positive number, or (with ``shape`` given)
    ``(K, *shape)`` with a positive sum at every coordinate; non-negative and finite."""
    expected = f"({num_clients},)" + (f" or {(num_clients, *shape)}" if shape is not None else "")
    try:
        b = torch.as_tensor(weights, dtype=torch.float64).to(device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"weights: expected {num_clients} non-negative numbers (shape {expected}), got "
                         f"{type(weights).__name__}: {error}") from None
    if b.shape != (num_clients,) and (shape is None or b.shape != (num_clients, *shape)):
        raise ValueError(f"weights: expected shape {expected} (one weight per client, or per client and "
                         f"coordinate), got shape {tuple(b.shape)}")
    _check_finite(b, "weights")
    if (b < 0).any():
        raise ValueError(f"weights: expected non-negative numbers, got minimum {b.min().item()}")
    total = b.sum(dim=0)
    if not bool((total > 0).all()):
        where = "" if b.dim() == 1 else f" at coordinate {tuple((total <= 0).nonzero()[0].tolist())}"
        raise ValueError(f"weights: expected a positive sum over the clients{where}, got {total.min().item()}")
    return b


def _normalised_weights(weights: Any, num_clients: int, dtype: torch.dtype, device: torch.device,
                        shape: Optional[torch.Size] = None) -> Tensor:
    """``b_k / sum_j b_j`` as a ``(K,)`` tensor (per coordinate, ``(K, *shape)``, with ``shape`` given); uniform
    when ``weights`` is None."""
    if weights is None:
        return torch.full((num_clients,), 1.0 / num_clients, dtype=dtype, device=device)
    b = _checked_weights(weights, num_clients, shape, device)
    return (b / b.sum(dim=0)).to(dtype)


def _patterns(key: Tensor) -> list[Tensor]:
    """The column indices of ``key`` (rows x N) grouped by equal columns (byte for byte: numpy's unique over the
    columns viewed as opaque records, which sorts N short byte strings instead of N columns of floats)."""
    columns = np.ascontiguousarray(key.cpu().numpy().T)
    records = columns.view(np.dtype((np.void, columns.dtype.itemsize * columns.shape[1]))).ravel()
    _, inverse = np.unique(records, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    bounds = np.flatnonzero(np.diff(inverse[order])) + 1
    return [torch.as_tensor(cols) for cols in np.split(order, bounds)]


def _validated(locs: Any, variances: Any) -> tuple[Tensor, Tensor]:
    locs = _as_client_stack(locs, "locs")
    variances = _as_client_stack(variances, "variances")
    if locs.shape != variances.shape:
        raise ValueError(f"locs and variances: expected the same shape (K, *shape), got locs {tuple(locs.shape)} "
                         f"and variances {tuple(variances.shape)}")
    dtype = _floating_dtype(locs, variances)
    locs = locs.to(dtype)
    variances = variances.to(dtype=dtype, device=locs.device)
    _check_finite(locs, "locs")
    if not _all_positive_finite(variances):  # then find the first bad entry and name it
        _check_finite(variances, "variances")
        bad = (variances <= 0).nonzero()[0].tolist()
        raise ValueError(f"variances: expected entries > 0, got {variances[tuple(bad)].item()} at index "
                         f"{tuple(bad)}")
    return locs, variances


# ----------------------------------------------------------------------------------------------------------------
# Public entry points


def fuse(locs: Any, variances: Any, rule: str, weights: Any = None, *, num_samples: int = 1000,
         generator: torch.Generator | None = None) -> GaussianPosterior:
    """Fuse K clients' Gaussian posteriors ``N(mu_k, sigma_k^2)`` weight by weight into one.

    Parameters
    ----------
    locs : Tensor, array or sequence of K tensors, shape ``(K, *shape)``
        Client means ``mu_k``.
    variances : same as ``locs``
        Client variances ``sigma_k^2 > 0``.
    rule : str
        One of :func:`available_rules`: ``"eaa"``, ``"gaa"``, ``"log_variance"``, ``"pooling"``,
        ``"conflation"`` or a name added by :func:`register_rule`.
    weights : shape ``(K,)`` or ``(K, *shape)``, optional
        Client weights ``b_k >= 0`` (e.g. local data set sizes), normalised to sum to 1; uniform by default. Per
        client and coordinate, ``b_kd``, normalised coordinate by coordinate (module docstring).
    num_samples : int
        ``N`` for ``"pooling"``: client k contributes ``floor(b_k N)`` draws. Default 1000.
    generator : torch.Generator, optional
        Random source for ``"pooling"``; the same seed gives the same result.

    Returns
    -------
    GaussianPosterior
        ``(loc, variance)``, each of shape ``shape`` and the inputs' floating dtype.

    Examples
    --------
    Two clients ``N(1, 1)`` and ``N(5, 4)`` with equal weights (Figure 2 of the paper):

    >>> fuse(torch.tensor([[1.0], [5.0]]), torch.tensor([[1.0], [4.0]]), "conflation")
    GaussianPosterior(loc=tensor([1.8000]), variance=tensor([0.8000]))
    """
    fn = _get_rule(rule)
    check_int(num_samples, "num_samples", low=1)
    locs, variances = _validated(locs, variances)
    shape, K = locs.shape[1:], locs.shape[0]
    raw = None if weights is None else _checked_weights(weights, K, shape, locs.device)
    if raw is not None and raw.dim() > 1 and rule not in _PER_COORDINATE:
        # one call per pattern of weights, each with its (K,) weights: a rule of whole-client weights
        flat_w, flat_locs, flat_var = raw.reshape(K, -1), locs.reshape(K, -1), variances.reshape(K, -1)
        loc, variance = torch.empty_like(flat_locs[0]), torch.empty_like(flat_locs[0])
        for cols in _patterns(flat_w):
            b = flat_w[:, cols[0]]
            part = fuse(flat_locs[:, cols], flat_var[:, cols], rule, b, num_samples=num_samples, generator=generator)
            loc[cols], variance[cols] = part.loc, part.variance
        return GaussianPosterior(loc.reshape(shape), variance.reshape(shape))
    b = (torch.full((K,), 1.0 / K, dtype=locs.dtype, device=locs.device) if raw is None
         else (raw / raw.sum(dim=0)).to(locs.dtype))
    loc, variance = fn(locs, variances, b, num_samples=num_samples, generator=generator)
    for what, value in (("loc", loc), ("variance", variance)):
        if not isinstance(value, Tensor) or value.shape != shape:
            got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"type {type(value).__name__}"
            raise ValueError(f"rule: expected {rule!r} to return (loc, variance) tensors of shape {tuple(shape)}, "
                             f"got a {what} of {got}")
    return GaussianPosterior(loc, variance)


def fuse_sites(sites: Sequence[Mapping[str, tuple[Any, Any]]], rule: str, weights: Any = None,
               **kwargs: Any) -> dict[str, GaussianPosterior]:
    """Fuse whole networks: every site (e.g. a layer's weight) with :func:`fuse`, under the same ``weights``.

    :param sites: K dicts, one per client, ``name -> (loc, variance)``; every client has the same names and
        shapes.
    :param str rule: as in :func:`fuse`.
    :param weights: ``(K,)`` client weights ``b_k``, as in :func:`fuse`.
    :param kwargs: ``num_samples`` and ``generator``, passed to :func:`fuse`.
    :returns: ``name -> GaussianPosterior(loc, variance)``, in client 0's order.
    """
    _get_rule(rule)
    if isinstance(sites, Mapping) or not isinstance(sites, Sequence) or len(sites) == 0:
        raise ValueError(f"sites: expected a non-empty sequence of per-client dicts name -> (loc, variance), got "
                         f"{type(sites).__name__}" + (" of length 0" if isinstance(sites, Sequence) else ""))
    for k, client in enumerate(sites):
        if not isinstance(client, Mapping):
            raise ValueError(f"sites[{k}]: expected a dict name -> (loc, variance), got {type(client).__name__}")
    _normalised_weights(weights, len(sites), torch.float64, torch.device("cpu"))
    names = list(sites[0])
    for k, client in enumerate(sites):
        missing, extra = set(names) - set(client), set(client) - set(names)
        if missing or extra:
            key = sorted(missing or extra)[0]
            raise ValueError(f"sites: expected the same site names in every client (client 0 has {names}), got "
                             f"client {k} {'without' if missing else 'with an extra'} site {key!r}")
    fused = {}
    for name in names:
        pairs = []
        for k, client in enumerate(sites):
            pair = client[name]
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"sites[{k}][{name!r}]: expected a (loc, variance) pair, got "
                                 f"{type(pair).__name__}")
            pairs.append((torch.as_tensor(pair[0]), torch.as_tensor(pair[1])))
        for k, (loc, variance) in enumerate(pairs):
            for what, value in (("loc", loc), ("variance", variance)):
                if value.shape != pairs[0][0].shape:
                    raise ValueError(f"sites: expected site {name!r} of shape {tuple(pairs[0][0].shape)} (client 0's "
                                     f"loc) in every client, got {tuple(value.shape)} in client {k}'s {what}")
        try:
            fused[name] = fuse([p[0] for p in pairs], [p[1] for p in pairs], rule, weights, **kwargs)
        except ValueError as error:
            raise ValueError(f"site {name!r}: {error}") from None
    return fused


def average_deterministic(params_list: Any, weights: Any = None) -> Tensor:
    """Weighted average ``sum_k b_k theta_k`` of a deterministic parameter held by every client.

    The paper fuses the non-Bayesian parameters of a network (convolutions, biases) this way, with the same
    normalised client weights ``b_k`` as the Bayesian ones.

    :param params_list: K equally shaped tensors, or one tensor of shape ``(K, *shape)``.
    :param weights: ``(K,)`` client weights ``b_k >= 0``, normalised to sum to 1 (or ``(K, *shape)``, normalised
        coordinate by coordinate); uniform by default.
    :returns: a tensor of shape ``shape`` and the parameters' floating dtype.
    """
    params = _as_client_stack(params_list, "params_list")
    params = params.to(_floating_dtype(params))
    _check_finite(params, "params_list")
    b = _normalised_weights(weights, params.shape[0], params.dtype, params.device, params.shape[1:])
    return _weighted_sum(b, params)

"""Posterior fusion from sums over clients: the form secure aggregation can compute.

Secure aggregation (SecAgg+, Bell et al. 2020, after Bonawitz et al. 2017) lets a server learn the sum over clients
of vectors the clients hold, and nothing else about any one vector. The weight-wise rules of :mod:`bnpfed.combine`
need no more than such sums. With client weights ``b_k = n_k / N`` (``N = sum_k n_k``), ``b_max = max_k b_k``:

- ``eaa``: ``mu = sum_k b_k mu_k``, ``sigma^2 = sum_k b_k sigma_k^2``
- ``gaa``: ``mu = sum_k b_k mu_k``, ``sigma^2 = sum_k b_k^2 sigma_k^2``
- ``log_variance``: ``mu = sum_k b_k mu_k``, ``log sigma^2 = sum_k b_k log sigma_k^2``
- ``conflation``: ``lambda = sum_k (b_k / b_max) / sigma_k^2``, ``mu = sum_k (b_k / b_max) mu_k / sigma_k^2 / lambda``,
  ``sigma^2 = 1 / lambda``
- a deterministic parameter: ``theta = sum_k b_k theta_k``

(``pooling`` draws from each client's posterior: not a sum of fixed statistics, so not here.) The weights come from
the clients' example counts, which the server knows.

**Centred and scaled at a public reference.** Secure aggregation sums integers: each client clips its statistics to
``[-c, c]`` and quantises them to ``Q`` levels (stochastic rounding, unbiased, error below one level ``2c / Q``).
So that one ``c`` suits every statistic, a client sends each one relative to a reference posterior
``N(mu_g, v_g)`` every client and the server hold (in a federation, the global posterior the server sent this
round), coordinate by coordinate:

- location: ``b_k (mu_k - mu_g) / sqrt(v_g)`` (and ``b_k (theta_k - theta_g)`` for a deterministic parameter);
- ``eaa`` variance ``b_k sigma_k^2 / v_g``; ``gaa`` ``b_k^2 sigma_k^2 / v_g``; ``log_variance``
  ``b_k (log sigma_k^2 - log v_g)``;
- ``conflation``: precision ``(b_k / b_max) v_g / sigma_k^2`` and precision-weighted location
  ``(b_k / b_max) (v_g / sigma_k^2) (mu_k - mu_g) / sqrt(v_g)``.

The server, knowing the reference, undoes the centring and scaling exactly (:func:`fuse_sums`). Each statistic is
then a shift in reference standard deviations or a ratio of variances, the same whatever the layer's scale; each
travels in two limbs (:func:`split_limbs`), so that the quantisation error of a sum over K clients is below
``K (2c / Q)^2 / 2c`` in those units (:func:`quantisation_bound`: 1.8e-11 at 10 clients with ``c = 2^16``).

**Clients that drop out.** When only some of the clients' vectors enter the sum (SecAgg+ completes a round without
the clients that dropped), ``weight_total = sum_k b_k`` over those clients and ``max_weight_ratio = b_max /
b_max'`` (``b_max'`` their largest weight) make :func:`fuse_sums` give the rule over the clients that remain, with
their weights renormalised, exactly as :func:`bnpfed.combine.fuse` of those clients.

Usage::

    >>> import torch
    >>> from bnpfed.combine import fuse
    >>> locs, variances, counts = torch.tensor([[1.0], [5.0]]), torch.tensor([[1.0], [4.0]]), [30, 10]
    >>> ref_loc, ref_var = torch.zeros(1), torch.ones(1)
    >>> addends = [sum_statistics("conflation", locs[k], variances[k], ref_loc, ref_var, weight=counts[k] / 40,
    ...                           max_weight=30 / 40) for k in range(2)]
    >>> sums = {name: addends[0][name] + addends[1][name] for name in addends[0]}
    >>> fused = fuse_sums("conflation", sums, ref_loc, ref_var)
    >>> fused.loc, fuse(locs, variances, "conflation", weights=counts).loc
    (tensor([1.3077]), tensor([1.3077]))
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor

from bnpfed.posterior import GaussianPosterior
from bnpfed.validation import check_choice, check_positive

__all__ = ["SECURE_RULES", "deterministic_from_sum", "deterministic_statistic", "fuse_sums", "join_limbs",
           "quantisation_bound", "quantization_range", "split_limbs", "statistic_names", "sum_statistics"]

#: The rules of :mod:`bnpfed.combine` that need only sums over clients.
SECURE_RULES = ("eaa", "gaa", "log_variance", "conflation")

#: The statistics each rule sums, by name: ``loc`` and one for the variance (conflation: its two).
_STATISTICS = {"eaa": ("loc", "variance"), "gaa": ("loc", "variance"), "log_variance": ("loc", "log-variance"),
               "conflation": ("precision", "precision-loc")}

#: SecAgg+'s modulus: masked vectors are summed modulo ``2^32``.
MODULUS_BITS = 32


def statistic_names(rule: str) -> tuple[str, str]:
    """The names of the two statistics ``rule`` sums per Bayesian weight (``("loc", "variance")`` for ``eaa``)."""
    check_choice(rule, SECURE_RULES, "rule")
    return _STATISTICS[rule]


def _check_weight(weight: float, name: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1:
        raise ValueError(f"{name}: expected a number in (0, 1] (a client's share n_k / N), got {weight!r}")
    return float(weight)


def _check_pair(loc: Tensor, variance: Tensor, what: str) -> None:
    if loc.shape != variance.shape:
        raise ValueError(f"{what}: expected a loc and a variance of one shape, got {tuple(loc.shape)} and "
                         f"{tuple(variance.shape)}")
    if not bool(torch.isfinite(loc).all()):
        raise ValueError(f"{what}: expected a finite loc")
    if not bool(((variance > 0) & torch.isfinite(variance)).all()):
        raise ValueError(f"{what}: expected variances > 0 and finite, got minimum {variance.min().item()}")


def sum_statistics(rule: str, loc: Tensor, variance: Tensor, reference_loc: Tensor, reference_variance: Tensor, *,
                   weight: float, max_weight: float) -> dict[str, Tensor]:
    """Client k's addends of the sums ``rule`` fuses from, centred and scaled at the reference (module docstring).

    :param str rule: one of :data:`SECURE_RULES`.
    :param Tensor loc: ``mu_k``, this client's posterior means of one weight tensor.
    :param Tensor variance: ``sigma_k^2``, of the same shape.
    :param Tensor reference_loc: ``mu_g``, the public reference the server also holds, same shape.
    :param Tensor reference_variance: ``v_g``, same shape.
    :param float weight: ``b_k = n_k / N``.
    :param float max_weight: ``b_max``, the largest client weight (used by conflation).
    :returns: ``{name: tensor}`` for the names of :func:`statistic_names`.
    """
    names = statistic_names(rule)
    b, b_max = _check_weight(weight, "weight"), _check_weight(max_weight, "max_weight")
    if b > b_max * (1 + 1e-12):
        raise ValueError(f"max_weight: expected at least weight={b}, got {b_max}")
    _check_pair(loc, variance, "loc, variance")
    _check_pair(reference_loc, reference_variance, "reference_loc, reference_variance")
    if loc.shape != reference_loc.shape:
        raise ValueError(f"reference_loc: expected the shape of loc, {tuple(loc.shape)}, got "
                         f"{tuple(reference_loc.shape)}")
    shift = (loc - reference_loc) / reference_variance.sqrt()   # in reference standard deviations
    if rule == "conflation":
        precision = (b / b_max) * reference_variance / variance
        return {names[0]: precision, names[1]: precision * shift}
    if rule == "eaa":
        spread = b * variance / reference_variance
    elif rule == "gaa":
        spread = b * b * variance / reference_variance
    else:
        spread = b * (variance.log() - reference_variance.log())
    return {names[0]: b * shift, names[1]: spread}


def fuse_sums(rule: str, sums: Mapping[str, Tensor], reference_loc: Tensor, reference_variance: Tensor, *,
              weight_total: float = 1.0, max_weight_ratio: float = 1.0) -> GaussianPosterior:
    """The fused posterior of one weight tensor from the sums over clients of :func:`sum_statistics`.

    :param Mapping sums: ``{name: sum over the clients}`` for the names of :func:`statistic_names`.
    :param float weight_total: ``sum_k b_k`` over the clients in the sums (1 when every client is).
    :param float max_weight_ratio: ``b_max / b_max'``: the largest weight the clients used over the largest among
        those in the sums (1 when the largest client is in them).
    :returns: what :func:`bnpfed.combine.fuse` gives for those clients (to rounding and quantisation).
    """
    names = statistic_names(rule)
    check_positive(weight_total, "weight_total")
    check_positive(max_weight_ratio, "max_weight_ratio")
    missing = [n for n in names if n not in sums]
    if missing:
        raise ValueError(f"sums: expected the statistics {list(names)} of rule {rule!r}, got {sorted(sums)}")
    _check_pair(reference_loc, reference_variance, "reference_loc, reference_variance")
    first, second = sums[names[0]], sums[names[1]]
    scale = reference_variance.sqrt()
    if rule == "conflation":
        if not bool((first > 0).all()):
            raise ValueError(f"sums: expected a positive sum of precisions, got minimum {first.min().item()} (the "
                             "quantisation of secure aggregation is coarser than the precisions: raise its range)")
        return GaussianPosterior(reference_loc + scale * second / first,
                                 reference_variance / (first * max_weight_ratio))
    loc = reference_loc + scale * first / weight_total
    if rule == "eaa":
        variance = reference_variance * second / weight_total
    elif rule == "gaa":
        variance = reference_variance * second / weight_total ** 2
    else:
        variance = reference_variance * torch.exp(second / weight_total)
    return GaussianPosterior(loc, variance)


def deterministic_statistic(param: Tensor, reference: Tensor, *, weight: float) -> Tensor:
    """Client k's addend ``b_k (theta_k - theta_g)`` of a deterministic parameter's weighted average."""
    b = _check_weight(weight, "weight")
    if param.shape != reference.shape:
        raise ValueError(f"reference: expected the shape of param, {tuple(param.shape)}, got "
                         f"{tuple(reference.shape)}")
    return b * (param - reference)


def deterministic_from_sum(total: Tensor, reference: Tensor, *, weight_total: float = 1.0) -> Tensor:
    """``sum_k b_k theta_k / sum_k b_k`` from the sum of :func:`deterministic_statistic` over the clients."""
    check_positive(weight_total, "weight_total")
    return reference + total / weight_total


def quantization_range(num_clients: int) -> int:
    """The largest power of two ``Q`` with ``num_clients * Q`` below SecAgg+'s modulus ``2^32``: the finest
    quantisation whose sum over the clients cannot wrap around (``Q = 2^28`` for 10 clients)."""
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 2:
        raise ValueError(f"num_clients: expected an int >= 2 (secure aggregation sums over two or more clients), got "
                         f"{num_clients!r}")
    return 1 << (MODULUS_BITS - math.ceil(math.log2(num_clients + 1)))


def split_limbs(x: Tensor, clipping_range: float, quantization_range: int) -> tuple[Tensor, Tensor]:
    """``x`` (entries in ``[-c, c]``) as two arrays whose SecAgg+ sums give the sum of ``x`` almost exactly.

    SecAgg+ rounds each value to one of ``Q`` levels ``-c + i * 2c / Q`` (stochastically: unbiased, off by less than
    one level ``s = 2c / Q``), and ``Q`` is at most ``2^32 / K``: one array alone keeps ~28 bits, too few for
    statistics that span orders of magnitude (variance ratios from 1e-4 to 1e4). So ``x`` travels as two limbs:
    ``hi``, ``x`` rounded to the nearest level (which SecAgg+ then quantises without loss: with ``c`` and ``Q``
    powers of two the levels are exact in floating point), and ``lo = (x - hi) * 2c / s``, the remainder scaled up
    to ``[-c, c]``, whose rounding error shrinks by ``s / 2c`` on the way back (:func:`join_limbs`): each client's
    value is off by less than ``s^2 / 2c``."""
    c = float(clipping_range)
    step = 2.0 * c / quantization_range
    hi = torch.floor((x + c) / step + 0.5) * step - c
    return hi, (x - hi) * (2.0 * c / step)


def join_limbs(hi: Tensor, lo: Tensor, clipping_range: float, quantization_range: int) -> Tensor:
    """The value (or sum over clients) of :func:`split_limbs`'s two limbs (or of their sums)."""
    step = 2.0 * float(clipping_range) / quantization_range
    return hi + lo * (step / (2.0 * float(clipping_range)))


def quantisation_bound(clipping_range: float, quantization_range: int, num_clients: int) -> float:
    """Bound on the error of one statistic summed over K clients in two limbs (:func:`split_limbs`): each client's
    value is off by less than ``s^2 / 2c`` (``s = 2c / Q``, one level), the sum by less than ``K s^2 / 2c``."""
    check_positive(clipping_range, "clipping_range")
    step = 2.0 * clipping_range / quantization_range
    return num_clients * step * step / (2.0 * clipping_range)

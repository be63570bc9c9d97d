"""PFNM's operating point chosen on the clients' own held-out data: the narrowest global network whose accuracy is
within one standard error of the best.

Empirical Bayes estimates each hidden layer's noise variance ``sigma2`` from the clients' weights alone; how far
apart two units may be and still be one atom follows from it, and so does the global width. The estimate describes
the weights, not the function: a smaller ``sigma2`` keeps more units apart, a wider and (on MNIST) more accurate
network, a larger one merges more (the docs' benchmark page on one-shot matching draws that plane). The operating
point is
chosen the way a model size is chosen elsewhere in statistics, by the *one-standard-error rule* (Breiman et al.,
*Classification and Regression Trees*, 1984; Hastie, Tibshirani & Friedman, *The Elements of Statistical Learning*,
section 7.10): among candidates of increasing size, the smallest whose held-out accuracy is within one standard
error of the best one's.

The candidates are the empirical-Bayes match (``sigma2`` estimated, factor 1) and, for each ``factor f`` of
``noise_factors``, the match with every group's ``sigma2`` set to ``f`` times its estimate (the other
hyper-parameters still estimated). Each client scores every candidate's global network on its own held-out split
and sends one ``K x K`` matrix of counts, ``C^T C`` with ``C[i, k] = 1`` when candidate ``k`` classifies held-out
example ``i`` correctly (:func:`co_correct_counts`): sums over examples, which the server adds up (secure
aggregation would do) and from which every accuracy and every *paired* standard error of a difference follows
(:func:`paired_standard_errors`). No example and no prediction leaves a client.

For candidates ``b`` and ``k`` on the same ``n`` examples, with ``d_i = c_bi - c_ki``,

    mean(d) = (n_b - n_k) / n,        mean(d^2) = (n_b + n_k - 2 n_bk) / n,
    SE(a_b - a_k) = sqrt((mean(d^2) - mean(d)^2) / (n - 1)),

``n_b = C[b, b]`` the examples ``b`` gets right and ``n_bk = C[b, k]`` those both get right: the sample standard
deviation of the per-example differences over ``sqrt(n)``. Pairing matters: two networks that make mostly the same
mistakes have a difference far more certain than either accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from bnpfed.federated.config import PFNMConfig
from bnpfed.federated.results import Selection
from bnpfed.federated.server import pfnm_step
from bnpfed.matching import SpecMatch
from bnpfed.metrics import count_parameters
from bnpfed.validation import check_positives

__all__ = ["co_correct_counts", "paired_standard_errors", "one_standard_error_choice", "OperatingPoint",
           "candidate_scores_step", "check_noise_to_scale", "select_operating_point", "NOISE_FACTORS"]

#: The default factors of the estimated noise variance: the estimate itself (1) and candidates on either side, the
#: finer steps where MNIST's accuracy-width plane bends (the docs' benchmark page on one-shot matching).
NOISE_FACTORS = (2.0, 1.4, 0.8, 0.65, 0.5, 0.4, 0.3)


def co_correct_counts(correct) -> np.ndarray:
    """``C^T C`` of a ``(n, K)`` 0/1 matrix ``C`` (``C[i, k]``: candidate ``k`` right on example ``i``): the
    ``(K, K)`` int64 counts of examples both candidates get right (its diagonal: those each gets right). What a
    client sends; the server adds the clients' matrices up."""
    c = np.asarray(correct)
    if c.ndim != 2 or not c.shape[1] or not np.isin(c, (0, 1)).all():
        raise ValueError(f"correct: expected an (n, K) matrix of 0/1 (or bool) with K >= 1, got shape {c.shape}")
    c = c.astype(np.int64)
    return c.T @ c


def _check_counts(counts, total) -> tuple[np.ndarray, int]:
    counts = np.asarray(counts)
    if (counts.ndim != 2 or counts.shape[0] != counts.shape[1] or not counts.shape[0]
            or not np.issubdtype(counts.dtype, np.integer) or (counts != counts.T).any() or (counts < 0).any()):
        raise ValueError(f"counts: expected a symmetric (K, K) matrix of non-negative integer counts (C^T C), got "
                         f"shape {counts.shape} {counts.dtype}")
    if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 2:
        raise ValueError(f"total: expected the number n >= 2 of held-out examples scored, got {total!r}")
    diagonal = np.diag(counts)
    if (diagonal > total).any() or (counts > np.minimum.outer(diagonal, diagonal)).any():
        raise ValueError(f"counts: expected C^T C of {total} examples (no count above a diagonal entry, no diagonal "
                         f"entry above {total}), got {counts.tolist()}")
    return counts.astype(np.float64), int(total)


def paired_standard_errors(counts, total: int, reference: int) -> tuple[np.ndarray, np.ndarray]:
    """Every candidate's held-out accuracy and the standard error of its difference from candidate ``reference``,
    paired over the same ``total`` examples (the module's formula), from the summed counts ``C^T C``.

    :returns: ``(accuracy, se)``, each of length K; ``se[reference] = 0``.
    """
    counts, n = _check_counts(counts, total)
    K = len(counts)
    if isinstance(reference, bool) or not isinstance(reference, (int, np.integer)) or not 0 <= reference < K:
        raise ValueError(f"reference: expected a candidate index in [0, {K}), got {reference!r}")
    right = np.diag(counts)
    mean = (right[reference] - right) / n
    square = (right[reference] + right - 2 * counts[reference]) / n
    variance = np.maximum(square - mean ** 2, 0.0) * n / (n - 1)   # the sample variance of d_i (rounding: >= 0)
    return right / n, np.sqrt(variance / n)


def one_standard_error_choice(counts, total: int, sizes: Sequence[int], tolerance: float = 1.0) -> int:
    """The one-standard-error rule: the candidate of fewest ``sizes`` (parameters) among those whose held-out
    accuracy is at most ``tolerance`` paired standard errors below the best one's (the best: the most accurate, the
    smaller on a tie); of equal sizes the more accurate. ``tolerance=0``: the most accurate candidate."""
    counts, n = _check_counts(counts, total)
    K = len(counts)
    if len(sizes) != K or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in sizes):
        raise ValueError(f"sizes: expected {K} positive integers (each candidate's parameters), got {list(sizes)!r}")
    tolerance = float(tolerance)
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance: expected a number of standard errors >= 0, got {tolerance!r}")
    right = np.diag(counts)
    best = min(range(K), key=lambda k: (-right[k], sizes[k], k))
    accuracy, se = paired_standard_errors(counts.astype(np.int64), n, best)
    eligible = [k for k in range(K) if accuracy[best] - accuracy[k] <= tolerance * se[k] + 1e-12]
    return min(eligible, key=lambda k: (sizes[k], -right[k], k))


@torch.no_grad()
def candidate_scores_step(nets: Sequence[nn.Module], x: Tensor, y: Tensor, batch_size: int = 1024) -> np.ndarray:
    """A client's step: every candidate global network on the client's held-out ``(x, y)``, returned as the
    ``(K, K)`` counts :func:`co_correct_counts` (nothing per example leaves the client)."""
    if not len(nets):
        raise ValueError("nets: expected at least one candidate network, got none")
    if len(x) != len(y):
        raise ValueError(f"x, y: expected as many labels as inputs, got {len(x)} and {len(y)}")
    correct = np.zeros((len(y), len(nets)), dtype=np.int64)
    for k, net in enumerate(nets):
        net = net.eval()
        for i in range(0, len(x), batch_size):
            correct[i:i + batch_size, k] = (net(x[i:i + batch_size]).argmax(-1) == y[i:i + batch_size]).numpy()
    return co_correct_counts(correct)


def check_noise_to_scale(pfnm: PFNMConfig) -> None:
    """Refuse a PFNM config whose noise variance is not left to empirical Bayes (nothing for the candidates to
    scale), before anything trains."""
    if pfnm.fixed:
        raise ValueError("pfnm: expected an empirical-Bayes config for select='operating-point' (it scales the "
                         "estimated sigma2), got hyperparameters='fixed' or constants='reference'")
    if pfnm.sigma2 is not None:
        raise ValueError(f"pfnm.sigma2: expected None (estimated) for select='operating-point', which scales the "
                         f"estimate, got {pfnm.sigma2!r}")


@dataclass
class OperatingPoint:
    """One candidate of :func:`select_operating_point`: its noise factor (None: the empirical-Bayes estimate), the
    per-group ``sigma2`` it matched with, its match and its global parameter count."""

    factor: Optional[float]
    sigma2: tuple[float, ...]
    match: SpecMatch
    parameters: int


def _estimated_sigma2(match: SpecMatch) -> tuple[float, ...]:
    out = []
    for group in match.spec.groups:
        h = match.layer_results[group.name].hyperparameters
        out.append(float(h["sigma2"]))
    return tuple(out)


def select_operating_point(local_models: Sequence[nn.Module], class_counts, validation: Sequence, pfnm: PFNMConfig,
                           *, noise_factors: Sequence[float] = NOISE_FACTORS, tolerance: float = 1.0, seed: int,
                           test=None, input_shape=None,
                           reestimate: Optional[Callable[[SpecMatch], SpecMatch]] = None,
                           activity: Optional[Sequence] = None, batch_size: int = 1024) -> Selection:
    """PFNM's one-shot match at the operating point the one-standard-error rule picks on the clients' held-out
    splits (the module's docstring).

    :param validation: per client, its held-out ``(x, y)``; together at least two examples.
    :param PFNMConfig pfnm: an empirical-Bayes config with ``sigma2`` left to the estimate (the noise is what the
        candidates vary).
    :param noise_factors: the factors of the estimated ``sigma2``, each > 0 and none 1 (factor 1 is the
        empirical-Bayes match itself, always a candidate).
    :param float tolerance: standard errors of the rule, >= 0 (0: the most accurate candidate).
    :param test: optional ``(x, y)`` whose accuracy is recorded in the curve (never used to choose).
    :param input_shape, reestimate, activity: as for
        :func:`~bnpfed.federated.methods.select_hyperparameters`.
    :returns: a :class:`~bnpfed.federated.results.Selection` with ``by="operating-point"``, the chosen config
        (``sigma2`` per group as it matched; None when the estimate itself won), its match, and the curve: per
        candidate ``factor``, ``sigma2``, ``hidden``, ``parameters``, ``validation``, ``se`` (of its difference from
        the best), ``chosen`` (and ``test``).
    """
    check_noise_to_scale(pfnm)
    factors = check_positives(noise_factors, "noise_factors")
    if any(f == 1.0 for f in factors) or len(set(factors)) != len(factors):
        raise ValueError(f"noise_factors: expected distinct factors other than 1 (the estimate itself is always a "
                         f"candidate), got {list(noise_factors)!r}")
    tolerance = float(tolerance)
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance: expected a number of standard errors >= 0, got {tolerance!r}")
    total = sum(len(y) for _, y in validation)
    if total < 2:
        raise ValueError(f"validation: expected at least two held-out examples over the clients, got {total}")

    def matched(config):
        match = pfnm_step(local_models, class_counts, config, seed=seed, round=1, input_shape=input_shape,
                          activity=activity)
        return reestimate(match) if reestimate is not None else match

    base = matched(pfnm)
    estimate = _estimated_sigma2(base)
    candidates = [OperatingPoint(None, estimate, base, count_parameters(base.network()))]
    for f in sorted(factors, reverse=True):
        sigma2 = tuple(f * s for s in estimate)
        match = matched(replace(pfnm, sigma2=sigma2))
        candidates.append(OperatingPoint(f, sigma2, match, count_parameters(match.network())))
    candidates.sort(key=lambda c: -(1.0 if c.factor is None else c.factor))   # from the most merging
    nets = [c.match.network() for c in candidates]
    counts = sum(candidate_scores_step(nets, x, y, batch_size) for x, y in validation)   # the server's sum
    sizes = [c.parameters for c in candidates]
    chosen = one_standard_error_choice(counts, total, sizes, tolerance)
    best = min(range(len(candidates)), key=lambda k: (-counts[k, k], sizes[k], k))
    accuracy, se = paired_standard_errors(counts, total, best)
    curve = []
    for k, (c, net) in enumerate(zip(candidates, nets)):
        point = dict(factor=1.0 if c.factor is None else c.factor, sigma2=list(c.sigma2),
                     hidden=c.match.hidden_sizes, parameters=c.parameters, validation=float(accuracy[k]),
                     se=float(se[k]), chosen=k == chosen)
        if test is not None:
            with torch.no_grad():
                net.eval()
                point["test"] = float(torch.cat([net(test[0][i:i + batch_size]).argmax(-1)
                                                 for i in range(0, len(test[0]), batch_size)]).eq(test[1])
                                      .double().mean())
        curve.append(point)
    pick = candidates[chosen]
    config = pfnm if pick.factor is None else replace(pfnm, sigma2=pick.sigma2)
    selection = Selection(config, "operating-point", float(accuracy[chosen]), match=pick.match)
    selection.curve = curve
    return selection

"""Classification metrics on predicted probabilities: accuracy, NLL, calibration error, Brier score, model size.

Also out-of-distribution detection (ood_scores, ood_auroc); ROC AUC by scikit-learn, well kept and exact on ties.
And regression metrics of a posterior predictive given as S draws' observation distributions (:func:`regression_report`:
RMSE, NLL, central predictive intervals and their coverage).

Every metric takes ``probs`` of shape ``(N, C)`` (rows are predictive distributions over C classes, e.g. a
Bayesian network's Monte Carlo averaged softmax) and integer ``labels`` of shape ``(N,)``, and returns a Python
float, so that results can be printed or written as JSON as they are.

Usage::

    report = classification_report(probs, labels)   # {"accuracy": ..., "nll": ..., "ece": ..., "brier": ...}
    report = calibration_report(probs, labels)      # {"accuracy", "nll", "ece" (100 bins), "ece15", "brier"}
    aurocs = ood_auroc(probs_in, probs_out)         # {"auroc_max_prob": ..., "auroc_entropy": ...}
    debiased_calibration_error(probs, labels)       # Kumar et al.'s debiased L2 ECE, equal-mass bins
    bootstrap_intervals(probs, labels, seed=0)      # {"accuracy": (low, high), "nll": ..., "ece15": ..., ...}
    paired_bootstrap(probs_a, probs_b, labels)      # {"accuracy": {"difference", "low", "high"}, ...}: a - b

Confidence intervals are percentile bootstrap intervals over the test examples (Efron & Tibshirani 1993, ch. 13):
the test split is resampled with replacement, every metric recomputed on each resample (the binned calibration
errors re-binned), and the interval is the resampled values' central ``level`` quantiles. A paired interval resamples
the same examples for both predictors, so that what the examples share (an image hard for both) cancels in the
difference.
"""

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch
from scipy.signal import fftconvolve
from scipy.special import stdtr
from torch import Tensor, nn

from bnpfed.validation import check_float, check_int

__all__ = [
    "CHANCE_MARGIN",
    "NLL_EPS",
    "INTERVAL_LEVEL",
    "ROW_SUM_ATOL",
    "accuracy",
    "BOOTSTRAP_RESAMPLES",
    "INTERVAL_METRICS",
    "bootstrap_intervals",
    "brier_score",
    "calibration_gaps",
    "calibration_report",
    "chance_accuracy",
    "chance_warning",
    "classification_report",
    "count_parameters",
    "debiased_calibration_error",
    "ece_from_gaps",
    "ece_noise_floor",
    "expected_calibration_error",
    "nll",
    "ood_auroc",
    "ood_scores",
    "paired_bootstrap",
    "regression_report",
    "regression_scores",
    "regression_summary",
]

#: The probability mass of the central predictive interval a regression reports (its ``coverage`` and ``width``).
INTERVAL_LEVEL = 0.9

#: Default lower clamp of :func:`nll` on the probability of the true label; only keeps ``log 0`` finite.
NLL_EPS = 1e-12

#: How far above chance (:func:`chance_accuracy`) a global model's accuracy must be for the commands not to warn that
#: it learnt nothing (:func:`chance_warning`).
CHANCE_MARGIN = 0.02

#: How far a row of ``probs`` may sum from 1 (float32 softmax outputs are off by ~1e-7; averages of many less so).
ROW_SUM_ATOL = 1e-4


def _validated_probs(probs: Any, name: str = "probs") -> Tensor:
    """``probs`` as a floating ``(N, C)`` tensor of distributions; messages name the argument ``name``."""
    # plain Python numbers are read in double precision, not torch's float32 default
    probs = torch.as_tensor(probs, dtype=torch.float64) if isinstance(probs, (list, tuple)) else torch.as_tensor(probs)
    if probs.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor of shape (N, C), got shape {tuple(probs.shape)}")
    if probs.shape[0] == 0 or probs.shape[1] == 0:
        raise ValueError(f"{name}: expected at least one example and one class, got shape {tuple(probs.shape)}")
    if not probs.dtype.is_floating_point:
        raise ValueError(f"{name}: expected floating-point probabilities, got dtype {probs.dtype}")
    if not torch.isfinite(probs).all():
        raise ValueError(f"{name}: expected finite values, got NaN or inf")
    if (probs < 0).any():
        raise ValueError(f"{name}: expected non-negative values, got minimum {probs.min().item()}")
    row_sums = probs.sum(dim=1, dtype=torch.float64)
    worst = (row_sums - 1).abs().argmax()
    if (row_sums[worst] - 1).abs() > ROW_SUM_ATOL:
        raise ValueError(f"{name}: expected rows summing to 1 (within {ROW_SUM_ATOL}), got row {worst.item()} summing "
                         f"to {row_sums[worst].item()}")
    return probs


def _validated(probs: Any, labels: Any) -> tuple[Tensor, Tensor]:
    """``probs`` as a floating ``(N, C)`` tensor of distributions and ``labels`` as ``(N,)`` class indices."""
    probs = _validated_probs(probs)
    labels = torch.as_tensor(labels, device=probs.device)
    if labels.dtype == torch.bool or labels.dtype.is_floating_point or labels.is_complex():
        raise ValueError(f"labels: expected integer class indices, got dtype {labels.dtype}")
    if labels.shape != probs.shape[:1]:
        raise ValueError(f"labels: expected shape (N,) = ({probs.shape[0]},) to match probs, got shape "
                         f"{tuple(labels.shape)}")
    if (labels < 0).any() or (labels >= probs.shape[1]).any():
        raise ValueError(f"labels: expected values in [0, {probs.shape[1] - 1}] for probs with {probs.shape[1]} "
                         f"classes, got range [{labels.min().item()}, {labels.max().item()}]")
    return probs, labels.long()


def _accuracy(probs: Tensor, labels: Tensor) -> float:
    return (probs.argmax(dim=1) == labels).double().mean().item()


def _nll(probs: Tensor, labels: Tensor, eps: float) -> float:
    p_true = probs.gather(1, labels[:, None])[:, 0].double()
    return -p_true.clamp_min(eps).log().mean().item()


def _calibration_gaps(probs: Tensor, labels: Tensor, n_bins: int) -> Tensor:
    confidences, predictions = probs.double().max(dim=1)
    correct = (predictions == labels).double()
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=probs.device)
    # bin b holds confidences in (edges[b], edges[b + 1]]; a confidence of exactly 0 (impossible for a max over
    # a distribution) would go to the first bin
    bins = (torch.bucketize(confidences, edges, right=False) - 1).clamp_(0, n_bins - 1)
    # per bin: sum over the bin of (correct - confidence) = |B_b| (acc(B_b) - conf(B_b))
    return torch.zeros(n_bins, dtype=torch.float64, device=probs.device).index_add_(0, bins, correct - confidences)


def _expected_calibration_error(probs: Tensor, labels: Tensor, n_bins: int) -> float:
    return (_calibration_gaps(probs, labels, n_bins).abs().sum() / len(labels)).item()


def _brier_score(probs: Tensor, labels: Tensor) -> float:
    one_hot = torch.nn.functional.one_hot(labels, probs.shape[1]).double()
    return (probs.double() - one_hot).square().sum(dim=1).mean().item()


def _ood_scores(probs: Tensor) -> dict[str, Tensor]:
    probs = probs.double()
    # xlogy(0, 0) = 0, so a zero probability adds nothing to the entropy
    return {"max_prob": probs.max(dim=1).values, "neg_entropy": torch.special.xlogy(probs, probs).sum(dim=1)}


def accuracy(probs: Any, labels: Any) -> float:
    """Fraction of examples whose most probable class is the label: ``(1/N) sum_n [argmax_c p_nc = y_n]``.

    Ties go to the lowest class index.
    """
    return _accuracy(*_validated(probs, labels))


def nll(probs: Any, labels: Any, eps: float = NLL_EPS) -> float:
    """Mean negative log-likelihood of the labels: ``-(1/N) sum_n log max(p_{n, y_n}, eps)``.

    :param float eps: lower clamp on the probability of the true label, there only so that a prediction of
        exactly 0 gives a large finite loss (``-log eps``, about 27.6 by default) instead of ``inf``; it changes
        nothing for probabilities above ``eps``. Pass ``eps=0`` for the unclamped value.
    """
    check_float(eps, "eps", low=0.0, high=1.0, high_open=True, what="a number in [0, 1)")
    return _nll(*_validated(probs, labels), eps)


def expected_calibration_error(probs: Any, labels: Any, n_bins: int = 15) -> float:
    """Expected calibration error over equal-width confidence bins (Guo et al., 2017).

    With confidence ``conf_n = max_c p_nc`` and bins ``B_b = {n : conf_n in (b/M, (b+1)/M]}``, ``M = n_bins``:

    ``ECE = sum_b (|B_b| / N) |acc(B_b) - conf(B_b)|``,

    where ``acc(B_b)`` is the accuracy and ``conf(B_b)`` the mean confidence of the examples in the bin; empty
    bins contribute 0.

    :param int n_bins: number of bins ``M``; default 15 (Guo et al.). Ozer et al. (2022) report ECE with 100
        bins: pass ``n_bins=100`` to compare with their tables.
    """
    check_int(n_bins, "n_bins", low=1)
    return _expected_calibration_error(*_validated(probs, labels), n_bins)


def _poisson_binomial_pmf(p: np.ndarray) -> np.ndarray:
    """(n + 1,) the law of the number of successes of independent Bernoulli(p_i) trials: a product of the n
    polynomials ``(1 - p_i) + p_i z``, multiplied pairwise (by FFT above 64 trials), O(n log^2 n)."""
    if p.size <= 64:
        pmf = np.ones(1)
        for q in p:
            pmf = np.concatenate([pmf * (1.0 - q), [0.0]]) + np.concatenate([[0.0], pmf * q])
        return pmf
    half = p.size // 2
    pmf = fftconvolve(_poisson_binomial_pmf(p[:half]), _poisson_binomial_pmf(p[half:]))
    return np.clip(pmf, 0.0, None)   # the FFT's rounding leaves entries of about -1e-17 where the law is 0


def _ece_noise_floor(probs: Tensor, n_bins: int) -> float:
    confidences = probs.double().max(dim=1).values
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=probs.device)
    bins = (torch.bucketize(confidences, edges, right=False) - 1).clamp_(0, n_bins - 1)
    confidences, bins = confidences.cpu().numpy(), bins.cpu().numpy()
    total = 0.0
    for b in np.unique(bins):
        p = confidences[bins == b]
        pmf = _poisson_binomial_pmf(p)
        total += float(pmf @ np.abs(np.arange(pmf.size) - p.sum()))
    return total / confidences.size


def ece_noise_floor(probs: Any, n_bins: int = 15) -> float:
    """The expected calibration error of a *perfectly calibrated* predictor that gives these confidences: what
    :func:`expected_calibration_error` measures on average when prediction n is right with probability exactly
    ``conf_n`` (independently), i.e. the part of an ECE that the finite test split alone produces.

    ``floor = (1/N) sum_b E|S_b - sum_{n in B_b} conf_n|`` with ``S_b`` the number of right predictions in bin b, a
    Poisson-binomial variable (its law computed exactly), the bins those of :func:`expected_calibration_error`. An
    ECE at its floor is as calibrated as the test split can tell; with many bins and few examples the floor is not
    small: with the 100 bins of the posterior-fusion paper on 10,000 test images it is of the order of a good MNIST
    classifier's whole ECE (the docs' benchmark page on calibration), so an ECE half of such a classifier's may lie
    below what a perfectly calibrated predictor with its confidences shows.

    One example predicted at 0.8 (right with probability 0.8, then off by 0.2, else by 0.8)::

        >>> round(ece_noise_floor([[0.8, 0.2]]), 6)
        0.32

    :param int n_bins: number of equal-width confidence bins, as for :func:`expected_calibration_error`.
    """
    check_int(n_bins, "n_bins", low=1)
    return _ece_noise_floor(_validated_probs(probs), n_bins)


def calibration_gaps(probs: Any, labels: Any, n_bins: int = 15) -> Tensor:
    """(n_bins,) per confidence bin of :func:`expected_calibration_error`, ``sum_{n in B_b} ([y_n = yhat_n] -
    conf_n)``: sums over examples, so the gaps of several shards add up to the gaps of their union, and
    ``ECE = sum_b |gap_b| / N`` (:func:`ece_from_gaps`) is the union's ECE (how federated evaluation gets the
    test split's ECE from the clients' shards)."""
    check_int(n_bins, "n_bins", low=1)
    return _calibration_gaps(*_validated(probs, labels), n_bins)


def ece_from_gaps(gaps: Any, num_examples: int) -> float:
    """The expected calibration error of ``num_examples`` examples from their bins' :func:`calibration_gaps`."""
    num_examples = check_int(num_examples, "num_examples", low=1)
    return float(torch.as_tensor(gaps, dtype=torch.float64).abs().sum() / num_examples)


def brier_score(probs: Any, labels: Any) -> float:
    """Multi-class Brier score: ``(1/N) sum_n sum_c (p_nc - [y_n = c])^2``, in ``[0, 2]``.

    For two classes this is twice the binary Brier score ``(1/N) sum_n (p_n1 - y_n)^2``.
    """
    return _brier_score(*_validated(probs, labels))


def classification_report(probs: Any, labels: Any, n_bins: int = 15) -> dict[str, float]:
    """All four metrics at once: ``{"accuracy", "nll", "ece", "brier"}``, validating the inputs once.

    ``nll`` uses :data:`NLL_EPS` and ``ece`` uses ``n_bins`` bins.
    """
    check_int(n_bins, "n_bins", low=1)
    probs, labels = _validated(probs, labels)
    return {
        "accuracy": _accuracy(probs, labels),
        "nll": _nll(probs, labels, eps=NLL_EPS),
        "ece": _expected_calibration_error(probs, labels, n_bins),
        "brier": _brier_score(probs, labels),
    }


def calibration_report(probs: Any, labels: Any) -> dict[str, float]:
    """Accuracy, NLL, calibration and Brier score under the names the command line reports, validating once.

    Exactly the keys ``{"accuracy", "nll", "ece", "ece15", "brier"}``: ``ece`` uses 100 equal-width bins, as
    Ozer et al. (2022) report it, and ``ece15`` the 15 bins of Guo et al. (2017) (what
    :func:`classification_report` calls ``ece`` by default); ``nll`` uses :data:`NLL_EPS`.
    """
    probs, labels = _validated(probs, labels)
    return {
        "accuracy": _accuracy(probs, labels),
        "nll": _nll(probs, labels, eps=NLL_EPS),
        "ece": _expected_calibration_error(probs, labels, 100),
        "ece15": _expected_calibration_error(probs, labels, 15),
        "brier": _brier_score(probs, labels),
    }


def _check_debiased_examples(n: int) -> None:
    if n < 2:
        raise ValueError(f"probs: the debiased calibration error needs at least 2 examples (each bin's variance "
                         f"term divides by its count - 1), got {n}")


def _debiased_squared(counts: Tensor, confidences: Tensor, correct: Tensor, n_bins: int) -> Tensor:
    """(B,) the debiased squared L2 calibration error (:func:`debiased_calibration_error`) of B resamples of the
    examples, each given as ``counts`` (B, K): how many times it holds each of K examples, which ``confidences`` and
    ``correct`` (K,) list *sorted by confidence* (ties by index). A resample's sorted order is then example k repeated
    ``counts[:, k]`` times, in order; each equal-mass bin's sums are differences of the cumulative sums over that
    order, read at the bin's boundaries (no sort per resample)."""
    n = int(round(float(counts[0].sum())))
    m = min(n_bins, n // 2)   # every bin then holds at least 2 examples
    # bin b holds the positions p with floor(p m / n) = b: [ceil(b n / m), ceil((b + 1) n / m))
    bounds = ((torch.arange(m + 1) * n + m - 1) // m).double()   # in integers: exact
    filled = counts.cumsum(1)                                    # positions taken by examples 0..k
    k = torch.searchsorted(filled, bounds.expand(len(counts), -1).contiguous(), right=True)
    k = k.clamp_(max=counts.shape[1] - 1)
    before = torch.cat([torch.zeros(len(counts), 1, dtype=torch.float64), filled], 1).gather(1, k)

    def cumulative(values: Tensor) -> Tensor:   # sum of values over the first `bounds` positions
        sums = torch.cat([torch.zeros(len(counts), 1, dtype=torch.float64), (counts * values).cumsum(1)], 1)
        return sums.gather(1, k) + (bounds - before) * values[k]

    size = bounds.diff()
    mean_conf = cumulative(confidences.double()).diff(dim=1) / size
    mean_acc = cumulative(correct.double()).diff(dim=1) / size
    per_bin = (mean_acc - mean_conf).square() - mean_acc * (1 - mean_acc) / (size - 1)
    return (size / n * per_bin).sum(-1)


def debiased_calibration_error(probs: Any, labels: Any, n_bins: int = 15) -> float:
    """The debiased estimate of the top-label L2 calibration error of Kumar, Liang & Ma (2019), "Verified
    uncertainty calibration" (NeurIPS), section 5, with their equal-mass bins.

    The examples are sorted by confidence ``conf_n = max_c p_nc`` (ties by their index) and cut into
    ``M = min(n_bins, N // 2)`` bins of equal mass: the example at position ``p`` (0-based) of that order is in bin
    ``floor(p M / N)``, so each bin holds ``floor(N / M)`` or ``ceil(N / M)`` >= 2 examples. With ``a_b`` the accuracy,
    ``s_b`` the mean confidence and ``n_b`` the count of bin b,

    ``ECE_debiased^2 = sum_b (n_b / N) [(a_b - s_b)^2 - a_b (1 - a_b) / (n_b - 1)]``

    and the error is ``sqrt(max(ECE_debiased^2, 0))``. The plug-in term ``(a_b - s_b)^2`` overestimates the squared
    gap by the variance of ``a_b``; the second term removes it (unbiased when a bin's examples share one probability
    of being right), so a calibrated predictor scores near 0 however few examples a bin holds: the test split's noise,
    which a binned ECE (:func:`expected_calibration_error`, :func:`ece_noise_floor`) keeps, is estimated and taken
    out. It is an L2 error (a root mean square gap), not the L1 ECE, and not comparable with it number for number.

    Two bins, {0.6, 0.6} and {0.8, 0.8}, every prediction right: ``sqrt(0.5 * 0.4^2 + 0.5 * 0.2^2) = sqrt(0.1)``::

        >>> round(debiased_calibration_error([[0.8, 0.2], [0.8, 0.2], [0.6, 0.4], [0.6, 0.4]], [0, 0, 0, 0]), 6)
        0.316228

    :param int n_bins: the number of equal-mass bins ``M``, at most ``N // 2``; default 15 (as the 15 bins of
        ``ece15``).
    """
    check_int(n_bins, "n_bins", low=1)
    probs, labels = _validated(probs, labels)
    _check_debiased_examples(len(labels))
    confidences, predictions = probs.double().max(dim=1)
    correct = (predictions == labels).double()
    order = torch.sort(confidences, stable=True).indices
    ones = torch.ones(1, len(labels), dtype=torch.float64, device=probs.device)
    return float(_debiased_squared(ones.cpu(), confidences[order].cpu(), correct[order].cpu(), n_bins)
                 .clamp_min(0).sqrt())


#: The metrics :func:`bootstrap_intervals` and :func:`paired_bootstrap` resample: accuracy, NLL (with
#: :data:`NLL_EPS`), Brier score, the ECE with ``ece_bins`` equal-width bins (``ece``) and with Guo et al.'s 15
#: (``ece15``), and the debiased L2 calibration error with 15 equal-mass bins (``ece_debiased``,
#: :func:`debiased_calibration_error`).
INTERVAL_METRICS = ("accuracy", "nll", "brier", "ece", "ece15", "ece_debiased")

#: Default number of bootstrap resamples. With 1,000 an end point of a 95 % interval moves by about a tenth of the
#: interval's width from one seed to another (the 2.5 % quantile of 1,000 draws has about 25 draws below it).
BOOTSTRAP_RESAMPLES = 1000

#: Resamples computed at once (bounds memory at about ``_RESAMPLE_CHUNK * N`` indices, not results).
_RESAMPLE_CHUNK = 100


class _Resampler:
    """What the metrics of one predictor need per test example, to recompute them on resamples of the examples, each
    resample given by how many times it holds each example (so that every metric is a matrix product or a cumulative
    sum over the examples, not a loop)."""

    def __init__(self, probs: Tensor, labels: Tensor, ece_bins: int):
        probs = probs.double().cpu()
        labels = labels.cpu()
        self.n = len(labels)
        self.ece_bins = ece_bins
        confidences, predictions = probs.max(dim=1)
        correct = (predictions == labels).double()
        nll = -probs.gather(1, labels[:, None])[:, 0].clamp_min(NLL_EPS).log()
        brier = (probs - torch.nn.functional.one_hot(labels, probs.shape[1]).double()).square().sum(1)
        self.means = torch.stack([correct, nll, brier], 1)              # (N, 3): the metrics that are means
        self.gaps = {}                                                  # bins -> (N, bins): each example's gap in its bin
        for m in {ece_bins, 15}:
            edges = torch.linspace(0, 1, m + 1, dtype=torch.float64)
            bins = (torch.bucketize(confidences, edges, right=False) - 1).clamp_(0, m - 1)
            self.gaps[m] = torch.zeros(self.n, m, dtype=torch.float64).index_put_(
                (torch.arange(self.n), bins), correct - confidences)
        self.order = torch.sort(confidences, stable=True).indices      # position -> example
        self.sorted_confidences, self.sorted_correct = confidences[self.order], correct[self.order]

    def metrics(self, counts: Tensor, which: Sequence[str]) -> dict[str, Tensor]:
        """Each metric in ``which`` on each resample, ``counts``: (B, N) how many times each holds each example; (B,)
        each."""
        out = {}
        means = counts @ self.means / self.n if any(m in ("accuracy", "nll", "brier") for m in which) else None
        for name in which:
            if name in ("accuracy", "nll", "brier"):
                out[name] = means[:, ("accuracy", "nll", "brier").index(name)]
            elif name in ("ece", "ece15"):
                out[name] = (counts @ self.gaps[self.ece_bins if name == "ece" else 15]).abs().sum(1) / self.n
            else:   # ece_debiased: the resample sorted by confidence, ties by index, as the original
                out[name] = _debiased_squared(counts[:, self.order], self.sorted_confidences, self.sorted_correct,
                                              15).clamp_min(0).sqrt()
        return out


def _check_bootstrap(metrics, resamples, level, seed, ece_bins) -> tuple[str, ...]:
    if isinstance(metrics, str) or not all(isinstance(m, str) for m in metrics) or not metrics:
        raise ValueError(f"metrics: expected a non-empty sequence of names from {list(INTERVAL_METRICS)}, got "
                         f"{metrics!r}")
    unknown = [m for m in metrics if m not in INTERVAL_METRICS]
    if unknown:
        raise ValueError(f"metrics: expected names from {list(INTERVAL_METRICS)}, got {unknown}")
    check_int(resamples, "resamples", low=2)
    check_float(level, "level", low=0.0, high=1.0, low_open=True, high_open=True, what="a number in (0, 1)")
    check_int(seed, "seed", low=0)
    check_int(ece_bins, "ece_bins", low=1)
    return tuple(dict.fromkeys(metrics))


def _bootstrap(resamplers: Sequence[_Resampler], metrics: tuple[str, ...], resamples: int,
               seed: int) -> list[dict[str, np.ndarray]]:
    """Every resampler's metrics on the same ``resamples`` resamples of the test examples: resample r takes the
    indices ``numpy.random.default_rng(seed).integers(0, N, size=(resamples, N))[r]``."""
    n = resamplers[0].n
    rng = np.random.default_rng(seed)
    values: list[dict[str, list]] = [{m: [] for m in metrics} for _ in resamplers]
    for start in range(0, resamples, _RESAMPLE_CHUNK):
        idx = torch.from_numpy(rng.integers(0, n, size=(min(_RESAMPLE_CHUNK, resamples - start), n)))
        counts = torch.zeros(idx.shape, dtype=torch.float64).scatter_add_(1, idx, torch.ones(idx.shape,
                                                                                             dtype=torch.float64))
        for out, resampler in zip(values, resamplers):
            for name, v in resampler.metrics(counts, metrics).items():
                out[name].append(v.numpy())
    return [{m: np.concatenate(v[m]) for m in metrics} for v in values]


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    low, high = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def bootstrap_intervals(probs: Any, labels: Any, *, metrics: Sequence[str] = INTERVAL_METRICS,
                        resamples: int = BOOTSTRAP_RESAMPLES, level: float = 0.95, seed: int = 0,
                        ece_bins: int = 100) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap confidence intervals of the metrics over the test examples: ``{metric: (low, high)}``.

    Resample r draws N examples with replacement, ``numpy.random.default_rng(seed).integers(0, N, size=(resamples,
    N))[r]``; each metric is recomputed on it (the binned ones re-binned: equal-width bins by each example's
    confidence, the debiased error's equal-mass bins from the resample's own order), and the interval is the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled values (``numpy.quantile``'s linear
    interpolation). The interval says how much the number would move on another test split of the same size from the
    same distribution, with the model held fixed (not over training seeds).

    A binned ECE is biased upwards by the test split's noise (:func:`ece_noise_floor`), and its bootstrap distribution
    more so (a resample repeats examples, which adds noise); its interval sits above the point estimate when the ECE
    is near its floor. ``ece_debiased`` is the one to compare calibration with.

    :param metrics: names from :data:`INTERVAL_METRICS` (default: all).
    :param int resamples: bootstrap resamples, >= 2; default :data:`BOOTSTRAP_RESAMPLES`.
    :param float level: the interval's coverage, in (0, 1); default 0.95.
    :param int seed: seed of the resampling (the same seed and inputs give the same interval).
    :param int ece_bins: equal-width bins of ``ece`` (``ece15`` has 15); default 100 (Ozer et al.'s).
    """
    metrics = _check_bootstrap(metrics, resamples, level, seed, ece_bins)
    probs, labels = _validated(probs, labels)
    if "ece_debiased" in metrics:
        _check_debiased_examples(len(labels))
    values = _bootstrap([_Resampler(probs, labels, ece_bins)], metrics, resamples, seed)[0]
    return {m: _interval(values[m], level) for m in metrics}


def paired_bootstrap(probs_a: Any, probs_b: Any, labels: Any, *, metrics: Sequence[str] = INTERVAL_METRICS,
                     resamples: int = BOOTSTRAP_RESAMPLES, level: float = 0.95, seed: int = 0,
                     ece_bins: int = 100) -> dict[str, dict[str, float]]:
    """The difference of each metric between two predictors on the same test examples, ``a - b``, with a paired
    percentile bootstrap interval: ``{metric: {"difference": a - b, "low": ..., "high": ...}}``.

    Both predictors are scored on the *same* resamples (as :func:`bootstrap_intervals` draws them), and the interval
    is the quantiles of the resampled differences: what the two share (examples hard for both) cancels, so the
    paired interval of a difference is much narrower than the two intervals side by side suggest. An interval that
    excludes 0 says the test split resolves the difference (at ``level``); one that holds 0 says it does not.

    :param probs_a: ``(N, C)`` the first predictor's test probabilities.
    :param probs_b: ``(N, C)`` the second's, on the same examples in the same order.
    :param labels: ``(N,)`` the labels.
    The other parameters are :func:`bootstrap_intervals`'.
    """
    metrics = _check_bootstrap(metrics, resamples, level, seed, ece_bins)
    probs_a, labels = _validated(probs_a, labels)
    probs_b = _validated_probs(probs_b, "probs_b")
    if probs_b.shape != probs_a.shape:
        raise ValueError(f"probs_b: expected the shape of probs_a, {tuple(probs_a.shape)} (the same examples and "
                         f"classes), got {tuple(probs_b.shape)}")
    if "ece_debiased" in metrics:
        _check_debiased_examples(len(labels))
    a, b = _Resampler(probs_a, labels, ece_bins), _Resampler(probs_b, labels, ece_bins)
    point_a, point_b = (r.metrics(torch.ones(1, r.n, dtype=torch.float64), metrics) for r in (a, b))
    values_a, values_b = _bootstrap([a, b], metrics, resamples, seed)
    out = {}
    for m in metrics:
        low, high = _interval(values_a[m] - values_b[m], level)
        out[m] = {"difference": float(point_a[m][0] - point_b[m][0]), "low": low, "high": high}
    return out


def ood_scores(probs: Any) -> dict[str, Tensor]:
    """Per-example out-of-distribution scores of predictive distributions, higher meaning more in-distribution.

    ``{"max_prob": max_c p_nc, "neg_entropy": sum_c p_nc log p_nc}`` (minus the predictive entropy, with
    ``0 log 0 = 0``), each a float64 tensor of shape ``(N,)`` on the device of ``probs``.
    """
    return _ood_scores(_validated_probs(probs))


def ood_auroc(probs_in: Any, probs_out: Any) -> dict[str, float]:
    """Area under the ROC curve of telling in-distribution inputs (the positive class) from out-of-distribution ones.

    Each input is scored by :func:`ood_scores` (``auroc_max_prob`` by the maximum probability, ``auroc_entropy``
    by minus the predictive entropy); the AUROC is ``P(score_in > score_out) + P(score_in = score_out) / 2`` over
    an in- and an out-of-distribution input drawn at random, computed by ``sklearn.metrics.roc_auc_score``. 1 means
    perfect separation, 0.5 no better than chance.

    :param probs_in: ``(N_in, C)`` predictive distributions on in-distribution inputs.
    :param probs_out: ``(N_out, C)`` predictive distributions on out-of-distribution inputs, over the same C classes.

    >>> ood_auroc([[0.9, 0.1], [0.2, 0.8]], [[0.5, 0.5], [0.6, 0.4]])
    {'auroc_max_prob': 1.0, 'auroc_entropy': 1.0}
    """
    from sklearn.metrics import roc_auc_score

    probs_in, probs_out = _validated_probs(probs_in, "probs_in"), _validated_probs(probs_out, "probs_out")
    if probs_in.shape[1] != probs_out.shape[1]:
        raise ValueError(f"probs_in and probs_out: expected the same number of classes C, got probs_in of shape "
                         f"{tuple(probs_in.shape)} and probs_out of shape {tuple(probs_out.shape)}")
    scores_in, scores_out = _ood_scores(probs_in), _ood_scores(probs_out)
    is_in = [1] * probs_in.shape[0] + [0] * probs_out.shape[0]

    def auroc(key: str) -> float:
        scores = torch.cat([scores_in[key].cpu(), scores_out[key].cpu()]).numpy()
        return float(roc_auc_score(is_in, scores))

    return {"auroc_max_prob": auroc("max_prob"), "auroc_entropy": auroc("neg_entropy")}


def count_parameters(module: nn.Module) -> int:
    """Number of scalar parameters of ``module`` (each shared parameter counted once), the model size."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    return sum(p.numel() for p in module.parameters())


def chance_accuracy(class_counts: Any) -> float:
    """The accuracy of always answering the most frequent class: the largest class's share of ``class_counts``
    (``(C,)`` examples per class, e.g. ``torch.bincount`` of a test split's labels).

    >>> chance_accuracy([10, 30, 60])
    0.6
    """
    counts = torch.as_tensor(class_counts, dtype=torch.float64)
    if counts.dim() != 1 or not len(counts) or bool((counts < 0).any()) or not float(counts.sum()) > 0:
        raise ValueError(f"class_counts: expected examples per class, >= 0 with a positive total, got "
                         f"{counts.tolist()}")
    return float(counts.max() / counts.sum())


def chance_warning(method: str, accuracy: float, chance: float) -> Optional[str]:
    """The warning the commands (and a Flower run) give a global model whose test ``accuracy`` is at chance, no more
    than :data:`CHANCE_MARGIN` above ``chance`` (:func:`chance_accuracy` of the test labels); None above it.

    >>> chance_warning("pfnm", 0.9, 0.1) is None
    True
    >>> chance_warning("pfnm", 0.1, 0.1)[:45]
    'pfnm: test accuracy 0.100 is at chance (0.100'
    """
    if accuracy > chance + CHANCE_MARGIN:
        return None
    return (f"{method}: test accuracy {accuracy:.3f} is at chance ({chance:.3f}, the largest class's share): training "
            "diverged or did not learn (check the learning rate, too large or too small, the epochs and the data)")


def _components(observations) -> tuple[Tensor, Tensor, Optional[float]]:
    """``(locs, scales, df)`` of S observation distributions (``(S, N)`` each; ``df`` None for Normals)."""
    bases = []
    for fn in observations:
        while isinstance(fn, torch.distributions.Independent):
            fn = fn.base_dist
        bases.append(fn)
    if all(isinstance(fn, torch.distributions.Normal) for fn in bases):
        df = None
    elif all(isinstance(fn, torch.distributions.StudentT) for fn in bases):
        dfs = {float(d) for fn in bases for d in torch.as_tensor(fn.df).reshape(-1).tolist()}
        if len(dfs) != 1:
            raise ValueError(f"observations: expected Student-t distributions of one df, got {sorted(dfs)}")
        df = dfs.pop()
    else:
        raise ValueError(f"observations: expected Normal or StudentT distributions (a regression's), got "
                         f"{type(bases[0]).__name__}")
    locs = torch.stack([fn.loc.expand(fn.batch_shape).reshape(-1) for fn in bases]).double()
    scales = torch.stack([fn.scale.expand(fn.batch_shape).reshape(-1) for fn in bases]).double()
    return locs, scales, df


def _mixture_cdf(value: Tensor, locs: Tensor, scales: Tensor, df: Optional[float]) -> Tensor:
    z = (value - locs) / scales
    if df is None:
        return torch.special.ndtr(z).mean(0)
    return torch.from_numpy(stdtr(df, z.numpy())).mean(0)


def regression_scores(observations: Any, y: Any, level: float = INTERVAL_LEVEL) -> dict[str, Tensor]:
    """Per example, the posterior predictive of S draws, the mixture ``p(y | x) = 1/S sum_s p_s(y | x)`` of their
    observation distributions (Normal or Student-t, one df), scored at the target ``y``:

    * ``mean``: the mixture's mean, ``1/S sum_s loc_s``;
    * ``log_density``: ``log p(y | x)``, by log-sum-exp over the draws;
    * ``pit``: the probability integral transform ``F(y) = 1/S sum_s F_s(y)`` (uniform on [0, 1] for a calibrated
      predictive);
    * ``lower``, ``upper``: the central interval of probability ``level``, the mixture's quantiles
      ``F^{-1}((1 -+ level) / 2)`` (by bisection on its CDF, to 1e-9 of the interval's scale).

    :param observations: S distributions of batch shape ``(N,)`` (e.g.
        :meth:`~bnpfed.clients.BayesianClient.sample_observations`).
    :param y: ``(N,)`` real-valued targets.
    :param float level: in (0, 1). Default :data:`INTERVAL_LEVEL` (0.9).
    :returns: ``{name: (N,) float64 tensor}``.
    """
    level = check_float(level, "level", low=0.0, high=1.0, low_open=True, high_open=True)
    if not isinstance(observations, (list, tuple)) or not observations:
        raise ValueError(f"observations: expected a non-empty list of distributions, got {type(observations).__name__}")
    locs, scales, df = _components(observations)
    y = torch.as_tensor(y)
    if y.shape != locs.shape[1:] or not y.is_floating_point() or not bool(torch.isfinite(y).all()):
        raise ValueError(f"y: expected finite real-valued targets of shape {tuple(locs.shape[1:])}, got "
                         f"{tuple(y.shape)} of dtype {y.dtype}")
    y = y.double()
    S = locs.shape[0]
    if df is None:
        logs = torch.distributions.Normal(locs, scales).log_prob(y)
    else:
        logs = torch.distributions.StudentT(df, locs, scales).log_prob(y)
    log_density = torch.logsumexp(logs, 0) - math.log(S)
    spread = scales.max(0).values
    low = locs.min(0).values - 1e3 * spread
    high = locs.max(0).values + 1e3 * spread
    bounds = []
    for p in ((1 - level) / 2, (1 + level) / 2):
        lo, hi = low.clone(), high.clone()
        for _ in range(80):   # 2^-80 of 2000 scales: far below float64's own resolution of the quantile
            mid = (lo + hi) / 2
            below = _mixture_cdf(mid, locs, scales, df) < p
            lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
        bounds.append((lo + hi) / 2)
    return {"mean": locs.mean(0), "log_density": log_density, "pit": _mixture_cdf(y, locs, scales, df),
            "lower": bounds[0], "upper": bounds[1]}


def regression_report(observations: Any, y: Any, level: float = INTERVAL_LEVEL) -> dict[str, float]:
    """A regression's posterior predictive scored on its test targets (:func:`regression_scores`):
    ``{"rmse", "nll", "coverage", "width"}``: the root mean squared error of the predictive mean, the mean negative
    log predictive density, the share of targets inside the central ``level`` interval (``level`` for a calibrated
    predictive) and the interval's mean width, in the units of ``y``."""
    return regression_summary(regression_scores(observations, y, level), y)


def regression_summary(scores: dict, y: Any) -> dict[str, float]:
    """:func:`regression_report` of per-example ``scores`` (:func:`regression_scores`, e.g. of several chunks of a
    test split concatenated) against the targets ``y``."""
    y = torch.as_tensor(y).double()
    inside = (scores["lower"] <= y) & (y <= scores["upper"])
    return {"rmse": float((scores["mean"] - y).square().mean().sqrt()), "nll": float(-scores["log_density"].mean()),
            "coverage": float(inside.double().mean()), "width": float((scores["upper"] - scores["lower"]).mean())}

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
"""

import math
from typing import Any, Optional

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
    "brier_score",
    "calibration_gaps",
    "calibration_report",
    "chance_accuracy",
    "chance_warning",
    "classification_report",
    "count_parameters",
    "ece_from_gaps",
    "ece_noise_floor",
    "expected_calibration_error",
    "nll",
    "ood_auroc",
    "ood_scores",
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

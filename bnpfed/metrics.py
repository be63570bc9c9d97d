"""Classification metrics on predicted probabilities: accuracy, NLL, calibration error, Brier score, model size.

Every metric takes ``probs`` of shape ``(N, C)`` (rows are predictive distributions over C classes, e.g. a
Bayesian network's Monte Carlo averaged softmax) and integer ``labels`` of shape ``(N,)``, and returns a Python
float, so that results can be printed or written as JSON as they are.

Usage::

    report = classification_report(probs, labels)   # {"accuracy": ..., "nll": ..., "ece": ..., "brier": ...}
"""

from typing import Any

import torch
from torch import Tensor, nn

from bnpfed.validation import check_float, check_int

__all__ = [
    "NLL_EPS",
    "ROW_SUM_ATOL",
    "accuracy",
    "brier_score",
    "classification_report",
    "count_parameters",
    "expected_calibration_error",
    "nll",
]

#: Default lower clamp of :func:`nll` on the probability of the true label; only keeps ``log 0`` finite.
NLL_EPS = 1e-12

#: How far a row of ``probs`` may sum from 1 (float32 softmax outputs are off by ~1e-7; averages of many less so).
ROW_SUM_ATOL = 1e-4


def _validated(probs: Any, labels: Any) -> tuple[Tensor, Tensor]:
    """``probs`` as a floating ``(N, C)`` tensor of distributions and ``labels`` as ``(N,)`` class indices."""
    # plain Python numbers are read in double precision, not torch's float32 default
    probs = torch.as_tensor(probs, dtype=torch.float64) if isinstance(probs, (list, tuple)) else torch.as_tensor(probs)
    labels = torch.as_tensor(labels, device=probs.device)
    if probs.dim() != 2:
        raise ValueError(f"probs must be 2-D of shape (N, C), got shape {tuple(probs.shape)}")
    if probs.shape[0] == 0 or probs.shape[1] == 0:
        raise ValueError(f"probs must hold at least one example and one class, got shape {tuple(probs.shape)}")
    if not probs.dtype.is_floating_point:
        raise ValueError(f"probs must be floating point probabilities, got dtype {probs.dtype}")
    if not torch.isfinite(probs).all():
        raise ValueError("probs must be finite, got NaN or inf")
    if (probs < 0).any():
        raise ValueError(f"probs must be non-negative, got minimum {probs.min().item()}")
    row_sums = probs.sum(dim=1, dtype=torch.float64)
    worst = (row_sums - 1).abs().argmax()
    if (row_sums[worst] - 1).abs() > ROW_SUM_ATOL:
        raise ValueError(f"probs rows must sum to 1 (within {ROW_SUM_ATOL}); row {worst.item()} sums to "
                         f"{row_sums[worst].item()}")
    if labels.dtype == torch.bool or labels.dtype.is_floating_point or labels.is_complex():
        raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
    if labels.shape != probs.shape[:1]:
        raise ValueError(f"labels must have shape (N,) = ({probs.shape[0]},) to match probs, got shape "
                         f"{tuple(labels.shape)}")
    if (labels < 0).any() or (labels >= probs.shape[1]).any():
        raise ValueError(f"labels must lie in [0, {probs.shape[1] - 1}] for probs with {probs.shape[1]} classes, "
                         f"got range [{labels.min().item()}, {labels.max().item()}]")
    return probs, labels.long()


def _accuracy(probs: Tensor, labels: Tensor) -> float:
    return (probs.argmax(dim=1) == labels).double().mean().item()


def _nll(probs: Tensor, labels: Tensor, eps: float) -> float:
    p_true = probs.gather(1, labels[:, None])[:, 0].double()
    return -p_true.clamp_min(eps).log().mean().item()


def _expected_calibration_error(probs: Tensor, labels: Tensor, n_bins: int) -> float:
    confidences, predictions = probs.double().max(dim=1)
    correct = (predictions == labels).double()
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=probs.device)
    # bin b holds confidences in (edges[b], edges[b + 1]]; a confidence of exactly 0 (impossible for a max over
    # a distribution) would go to the first bin
    bins = (torch.bucketize(confidences, edges, right=False) - 1).clamp_(0, n_bins - 1)
    # per bin: sum over the bin of (correct - confidence) = |B_b| (acc(B_b) - conf(B_b))
    gaps = torch.zeros(n_bins, dtype=torch.float64, device=probs.device).index_add_(0, bins, correct - confidences)
    return (gaps.abs().sum() / len(labels)).item()


def _brier_score(probs: Tensor, labels: Tensor) -> float:
    one_hot = torch.nn.functional.one_hot(labels, probs.shape[1]).double()
    return (probs.double() - one_hot).square().sum(dim=1).mean().item()


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


def count_parameters(module: nn.Module) -> int:
    """Number of scalar parameters of ``module`` (each shared parameter counted once), the model size."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return sum(p.numel() for p in module.parameters())

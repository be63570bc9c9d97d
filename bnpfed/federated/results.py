"""The experiment harness's records: one row of a table (:class:`MethodResult`), PFNM's hyper-parameter selection
(:class:`Selection`) and a whole experiment (:class:`ExperimentResult`), as :mod:`bnpfed.federated.methods` produces
them (and re-exports them)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
from torch import Tensor

from bnpfed.federated.config import PFNMConfig
from bnpfed.matching import SpecMatch
from bnpfed.metrics import paired_bootstrap
from bnpfed.report import json_safe

__all__ = ["REGRESSION", "ExperimentResult", "MethodResult", "Selection"]

#: A regression's fields of a row (:class:`MethodResult`), left out of a classification's.
REGRESSION = ("rmse", "coverage", "interval_width")


@dataclass
class MethodResult:
    """One row of an experiment's table.

    :param str method: the row's name (a method, or ``local-mean`` / ``local-min`` / ``local-max``).
    :param float accuracy: test accuracy of the method's final global model (``nll``, ``ece``, ``brier`` likewise;
        ECE with the experiment's ``ece_bins``).
    :param list hidden: widths of the global model's hidden permutations (an MLP's hidden layers; a CNN's conv
        channels, then its hidden units), :func:`~bnpfed.federated.experiment.network_widths`.
    :param int parameters: its number of parameters (a Bayesian weight counts once).
    :param int rounds: communication rounds it took.
    :param float server_seconds: wall time of the server's aggregation (matching, fusion, averaging) summed over
        the rounds; local training and evaluation are not included.
    :param float mean_sigma: the mean posterior standard deviation of the Bayesian weights (NaN for deterministic
        methods).
    :param float ece15: the ECE with 15 bins (``ece`` has the experiment's ``ece_bins``).
    :param float ece_debiased: Kumar et al.'s debiased L2 calibration error, 15 equal-mass bins
        (:func:`~bnpfed.metrics.debiased_calibration_error`): the test split's noise taken out, so calibration
        differences show where a binned ECE sits at its floor.
    :param float ece_floor: the ECE (``ece_bins``) that a perfectly calibrated model with the same confidences would
        show on the test split (:func:`~bnpfed.metrics.ece_noise_floor`): an ``ece`` near it is as calibrated as the
        test split can tell; NaN where the probabilities were not at hand (Flower's shard sums).
    :param float auroc_max_prob: with an out-of-distribution test set (``Experiment(ood=...)``), the AUROC of telling
        in- from out-of-distribution inputs by the maximum predicted probability (``auroc_entropy``: by the
        predictive entropy); NaN without one.
    :param int width: the sum of ``hidden`` (set when the experiment ends).
    :param dict intervals: 95 % percentile bootstrap intervals over the test examples, ``{metric: [low, high]}`` for
        ``accuracy``, ``nll``, ``brier``, ``ece``, ``ece15``, ``ece_debiased`` (:func:`~bnpfed.metrics.
        bootstrap_intervals`, seeded by the experiment's seed); empty for ``local-mean``, a mean over the clients'
        models rather than one model.
    :param list history: the metrics after every round (dicts; see :class:`~bnpfed.federated.federation.RoundRecord`).
    :param list hyperparameters: PFNM's hyper-parameters per hidden layer of the final match, estimated or fixed
        (:func:`~bnpfed.federated.server.match_hyperparameters`); empty for the other methods.
    :param str note: what distinguishes the row.
    :param float rmse: a regression's (the dataset's ``task``): the root mean squared error of the posterior
        predictive's mean on the test split (``nll`` its mean negative log predictive density; ``accuracy``, ``ece``
        and ``brier`` NaN); ``coverage`` the share of test targets inside its central 90 % interval,
        ``interval_width`` the interval's mean width. NaN for a classification, whose rows leave them out of
        :meth:`ExperimentResult.as_dict`.
    """

    method: str
    accuracy: float
    nll: float = math.nan
    ece: float = math.nan
    brier: float = math.nan
    hidden: list = field(default_factory=list)
    parameters: int = 0
    rounds: int = 1
    server_seconds: float = math.nan
    mean_sigma: float = math.nan
    ece15: float = math.nan
    ece_floor: float = math.nan
    ece_debiased: float = math.nan
    auroc_max_prob: float = math.nan
    auroc_entropy: float = math.nan
    width: int = 0
    intervals: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    hyperparameters: list = field(default_factory=list)
    note: str = ""
    rmse: float = math.nan
    coverage: float = math.nan
    interval_width: float = math.nan

    #: The row's global model's probabilities on the test split (``(N, C)``), when the metrics came with them: not a
    #: field (not written to JSON); what the intervals and the paired comparisons resample.
    test_probs = None

    @classmethod
    def from_metrics(cls, method: str, metrics: dict, **fields) -> "MethodResult":
        """A row from a metrics dict (``accuracy``, ``nll``, ``ece``, ``brier``, e.g. ``Experiment.report(probs)``;
        a regression's ``rmse``, ``nll``, ``coverage``, ``interval_width``) and any other fields; the test
        probabilities a :class:`~bnpfed.federated.experiment.Report` carries (``metrics.probs``), if any, become
        :attr:`test_probs`."""
        if "rmse" in metrics:
            return cls(method=method, accuracy=math.nan, nll=metrics["nll"], **{k: metrics[k] for k in REGRESSION},
                       **fields)
        extra = {k: metrics[k] for k in ("ece15", "ece_floor", "ece_debiased", "auroc_max_prob", "auroc_entropy",
                                         "intervals") if k in metrics}
        row = cls(method=method, accuracy=metrics["accuracy"], nll=metrics["nll"], ece=metrics["ece"],
                  brier=metrics["brier"], **extra, **fields)
        if getattr(metrics, "probs", None) is not None:
            row.test_probs = metrics.probs
        return row

    def as_dict(self) -> dict:
        """The row as a dict; a classification's leaves out the regression's fields (:data:`REGRESSION`)."""
        row = asdict(self)
        if all(isinstance(row[k], float) and math.isnan(row[k]) for k in REGRESSION):
            for k in REGRESSION:
                del row[k]
        return row


@dataclass
class Selection:
    """PFNM's hyper-parameters as :func:`~bnpfed.federated.methods.select_hyperparameters` (a grid) or
    :func:`~bnpfed.federated.operating_point.select_operating_point` chose them.

    :param PFNMConfig config: the PFNM config with the chosen ``sigma2``, ``sigma0_2``, ``gamma0``.
    :param str by: ``"none"``, ``"federated"``, ``"pooled-train"`` or ``"operating-point"``.
    :param float score: the chosen candidate's validation accuracy (NaN when nothing was selected).
    :param list curve: every candidate's ``sigma2, sigma0_2, gamma0, hidden, validation`` (and ``test``, when a
        test split was given); for ``"operating-point"`` its ``factor, sigma2, hidden, parameters, validation, se,
        chosen`` (and ``test``).
    :param SpecMatch match: the chosen candidate's one-shot matching (batch-norm statistics re-estimated).
    """

    config: PFNMConfig
    by: str
    score: float = math.nan
    curve: list = field(default_factory=list)
    match: Optional[SpecMatch] = field(default=None, repr=False)

    def as_dict(self) -> dict:
        return {"by": self.by, "sigma2": self.config.sigma2, "sigma0_2": self.config.sigma0_2,
                "gamma0": self.config.gamma0, "validation_accuracy": self.score, "curve": self.curve}


@dataclass
class ExperimentResult:
    """What :func:`~bnpfed.federated.methods.run_experiment` produced.

    Attributes: ``settings`` (every config as plain values), ``rows`` (:class:`MethodResult` s in the order run),
    ``local_accuracies`` (each client's test accuracy, when its local model was trained), ``selection`` (PFNM's,
    when PFNM ran), ``client_sizes``, ``warnings`` (a method that diverged or sits at chance accuracy, said
    plainly), ``comparisons`` (every row's paired difference from the ensemble's on the same test examples,
    :meth:`paired`, when an ensemble row ran), and, not serialised, ``local_models``, ``class_counts`` and
    ``test_labels``.
    """

    settings: dict
    rows: list[MethodResult]
    client_sizes: list[int]
    local_accuracies: list[float] = field(default_factory=list)
    selection: Optional[Selection] = None
    warnings: list[str] = field(default_factory=list)
    local_models: list = field(default_factory=list, repr=False)
    class_counts: Optional[np.ndarray] = field(default=None, repr=False)
    global_models: dict = field(default_factory=dict, repr=False)
    comparisons: list[dict] = field(default_factory=list)
    test_labels: Optional[Tensor] = field(default=None, repr=False)

    def row(self, method: str) -> MethodResult:
        """The row named ``method``."""
        for r in self.rows:
            if r.method == method:
                return r
        raise KeyError(f"no row for method {method!r}; rows: {[r.method for r in self.rows]}")

    def paired(self, a: str, b: str, **kwargs) -> dict[str, dict[str, float]]:
        """Row ``a``'s metrics minus row ``b``'s on the same test examples, each with its paired bootstrap interval
        (:func:`~bnpfed.metrics.paired_bootstrap`; ``kwargs`` go to it: ``metrics``, ``resamples``, ``level``,
        ``seed``, ``ece_bins``). Both rows must carry their test probabilities (every row of one model does; not
        ``local-mean``)."""
        rows = {name: self.row(name) for name in (a, b)}
        for name, row in rows.items():
            if row.test_probs is None or self.test_labels is None:
                raise ValueError(f"{name}: expected a row that kept its test probabilities (one global model), got "
                                 f"{name!r} without them")
        return paired_bootstrap(rows[a].test_probs, rows[b].test_probs, self.test_labels, **kwargs)

    def as_dict(self) -> dict:
        """JSON-ready (NaN becomes None): settings, rows (with their per-round histories), client sizes, local
        accuracies, selection, warnings."""
        return json_safe({"settings": self.settings, "rows": [r.as_dict() for r in self.rows],
                          "client_sizes": self.client_sizes, "local_accuracies": self.local_accuracies,
                          "selection": None if self.selection is None else self.selection.as_dict(),
                          "warnings": self.warnings, "comparisons": self.comparisons})

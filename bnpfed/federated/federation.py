"""The round loop every in-process federation shares: J clients hold their partitions of a dataset; each round the
server samples some of them (:func:`~bnpfed.federated.server.sample_clients`), they train locally, the server
aggregates (the subclass's step), and the global model is evaluated on the test split.

Subclasses: :class:`~bnpfed.federated.pfnm.PFNMFederation` (neuron matching),
:class:`~bnpfed.federated.fusion.FusionFederation` (posterior fusion) and
:class:`~bnpfed.federated.fusion.FedAvgFederation` (parameter averaging). They implement :meth:`Federation._round`
(train the sampled clients, aggregate) and :meth:`Federation.predict_proba`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from bnpfed.data import Dataset
from bnpfed.federated.clients import batch_norm_moments_step
from bnpfed.federated.server import batch_norm_steps, sample_clients
from bnpfed.metrics import (classification_report, debiased_calibration_error, ece_noise_floor,
                            expected_calibration_error, regression_scores, regression_summary)
from bnpfed.validation import check_fraction, check_int

__all__ = ["EVAL_CHUNK", "Federation", "RoundRecord", "check_parts", "reestimate_statistics"]

#: Test examples per forward pass in evaluation (bounds memory, not results).
EVAL_CHUNK = 2048


@dataclass
class RoundRecord:
    """What one round did: the clients sampled, their normalised weights ``b_k`` (empty when the method has none),
    and the metrics afterwards: ``round``, ``accuracy``, ``nll``, ``ece``, ``brier`` of the global model on the test
    split, ``server_seconds`` (the server's aggregation: matching, fusion or averaging), ``seconds`` (the whole
    round: local training, aggregation and evaluation), and the method's own (``hidden``, ``mean_sigma``, ...)."""

    round: int
    sampled: list[int]
    weights: list[float]
    metrics: dict


def check_parts(parts, n: int) -> list[Tensor]:
    """``parts`` as J non-empty int64 index tensors into a split of ``n`` examples."""
    if isinstance(parts, (str, bytes, Mapping)) or not isinstance(parts, Sequence) or len(parts) == 0:
        raise ValueError(f"parts: expected a non-empty list of per-client index arrays, got {type(parts).__name__}")
    checked = []
    for k, part in enumerate(parts):
        idx = np.asarray(part.numpy() if torch.is_tensor(part) else part)
        if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
            raise ValueError(f"parts[{k}]: expected a non-empty 1-D array of integer indices, got dtype "
                             f"{idx.dtype} and shape {idx.shape}")
        if idx.min() < 0 or idx.max() >= n:
            raise ValueError(f"parts[{k}]: expected indices in [0, {n - 1}] (the train split's size), got range "
                             f"[{idx.min()}, {idx.max()}]")
        checked.append(torch.as_tensor(idx.astype(np.int64)))
    return checked


def reestimate_statistics(layers: Sequence[str], client_inputs: Sequence[Tensor], batch_size: int,
                          network_of: Callable[[int, dict], nn.Module]) -> dict[str, Tensor]:
    """In process, the clients' and the server's steps of re-estimating batch-norm statistics, one layer at a time
    (:func:`~bnpfed.federated.server.batch_norm_steps`): client k (holding the training inputs ``client_inputs[k]``)
    sends :func:`~bnpfed.federated.clients.batch_norm_moments_step` of ``network_of(k, statistics)`` -- its network
    (the global one, or FedMA's aligned one) carrying the statistics set so far. Returns them all, for
    :func:`~bnpfed.federated.server.with_statistics`; empty without batch norm (``layers`` empty)."""
    def moments_of(layer: str, statistics: dict) -> list:
        return [batch_norm_moments_step(network_of(k, statistics), x, batch_size, layer)
                for k, x in enumerate(client_inputs)]

    return batch_norm_steps(layers, moments_of)


class Federation(ABC):
    """J clients, a server, and the round loop.

    :param Dataset dataset: the train split (partitioned among the clients) and the test split (evaluation).
    :param parts: J index arrays into ``dataset.y_train``, one per client.
    :param int seed: the experiment's seed (:mod:`bnpfed.seeding`).
    :param float fraction: share of the clients sampled per round.
    :param int ece_bins: bins of the expected calibration error. Default 15.

    Attributes: ``num_clients`` (J), ``client_data`` (each client's ``(x, y)``), ``sizes`` (their ``n_k``),
    ``round`` (rounds completed), ``history`` (the :class:`RoundRecord` s so far).
    """

    #: The method's name in results.
    method: str = ""
    #: The tasks (:data:`~bnpfed.data.TASKS`) this federation runs: a regression needs a Bayesian predictive of real
    #: values, which weight-wise posterior fusion has (:class:`~bnpfed.federated.fusion.FusionFederation`).
    tasks: tuple[str, ...] = ("classification",)

    def __init__(self, dataset: Dataset, parts: Sequence, *, seed: int, fraction: float = 1.0, ece_bins: int = 15):
        if not isinstance(dataset, Dataset):
            raise ValueError(f"dataset: expected a bnpfed.data.Dataset, got {type(dataset).__name__}")
        if dataset.task not in self.tasks:
            raise ValueError(f"dataset: {dataset.name!r} is a {dataset.task}; {type(self).__name__} runs "
                             f"{' and '.join(self.tasks)} only (a regression: weight-wise posterior fusion, "
                             "FusionFederation)")
        self.dataset = dataset
        self.seed = check_int(seed, "seed", low=0)
        self.fraction = check_fraction(fraction, "fraction")
        self.ece_bins = check_int(ece_bins, "ece_bins", low=1)
        self.parts = check_parts(parts, len(dataset.y_train))
        self.num_clients = len(self.parts)
        self.client_data = [(dataset.x_train[idx], dataset.y_train[idx]) for idx in self.parts]
        self.sizes = [len(idx) for idx in self.parts]
        self.round = 0
        self.history: list[RoundRecord] = []
        #: (N, C) the global model's probabilities on the test split at the last evaluation (None before one)
        self.test_probs: Optional[Tensor] = None

    def sample_clients(self, round: int) -> list[int]:
        """The clients of round ``round``: :func:`~bnpfed.federated.server.sample_clients`."""
        return sample_clients(self.num_clients, self.fraction, seed=self.seed, round=round)

    def run_round(self) -> RoundRecord:
        """One round: sample, train locally, aggregate, evaluate."""
        start = time.perf_counter()
        t = self.round + 1
        sampled = self.sample_clients(t)
        weights, extra = self._round(t, sampled)
        self.round = t
        metrics = {"round": t, **self.evaluate(), **extra}
        metrics["seconds"] = time.perf_counter() - start
        record = RoundRecord(round=t, sampled=sampled, weights=list(weights), metrics=metrics)
        self.history.append(record)
        return record

    def run(self, rounds: int, *, callback: Optional[Callable[[RoundRecord], None]] = None) -> list[RoundRecord]:
        """Run ``rounds`` more rounds; ``callback(record)`` after each. Returns their records."""
        check_int(rounds, "rounds", low=1)
        records = []
        for _ in range(rounds):
            records.append(self.run_round())
            if callback is not None:
                callback(records[-1])
        return records

    def evaluate(self) -> dict[str, float]:
        """``accuracy``, ``nll``, ``ece`` (``ece_bins`` bins), ``ece15`` (15 bins) and ``brier`` of the global model on
        the test split, ``ece_debiased`` (:func:`~bnpfed.metrics.debiased_calibration_error`, where the test split
        has 2 examples or more), and ``ece_floor``: the ECE (``ece_bins`` bins) a perfectly calibrated model with the
        same confidences would show on it (:func:`~bnpfed.metrics.ece_noise_floor`). The test probabilities are kept
        as ``test_probs`` (the last evaluation's). For a regression, ``rmse``, ``nll``, ``coverage`` and
        ``interval_width`` of the posterior predictive's central 90 % interval
        (:func:`~bnpfed.metrics.regression_report`)."""
        if self.dataset.task == "regression":
            return self._evaluate_regression()
        x = self.dataset.x_test
        probs = torch.cat([self.predict_proba(x[i:i + EVAL_CHUNK]) for i in range(0, len(x), EVAL_CHUNK)])
        self.test_probs = probs
        out = classification_report(probs, self.dataset.y_test, n_bins=self.ece_bins)
        out["ece15"] = expected_calibration_error(probs, self.dataset.y_test, 15)
        if len(probs) >= 2:
            out["ece_debiased"] = debiased_calibration_error(probs, self.dataset.y_test)
        out["ece_floor"] = ece_noise_floor(probs, self.ece_bins)
        return out

    def _evaluate_regression(self) -> dict[str, float]:
        x, y = self.dataset.x_test, self.dataset.y_test
        chunks = [regression_scores(self.predict_observations(x[i:i + EVAL_CHUNK]), y[i:i + EVAL_CHUNK])
                  for i in range(0, len(x), EVAL_CHUNK)]
        out = regression_summary({k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}, y)
        out["interval_width"] = out.pop("width")
        return out

    def predict_observations(self, x: Tensor) -> list:
        """The global model's posterior predictive on ``x`` as S draws' observation distributions (a regression's;
        :meth:`~bnpfed.clients.BayesianClient.sample_observations`)."""
        raise ValueError(f"{type(self).__name__} has no posterior predictive of real values")

    @abstractmethod
    def _round(self, round: int, sampled: list[int]) -> tuple[list[float], dict]:
        """Train the sampled clients and aggregate; return the clients' weights and the round's own metrics
        (``server_seconds`` at least)."""

    @abstractmethod
    def predict_proba(self, x: Tensor) -> Tensor:
        """``(N, C)`` class probabilities of the global model (after the last round)."""

"""Federated rounds of variational Bayesian clients fused on a server (Ozer et al. 2022), and the FedAvg baseline.

"How to Combine Variational Bayesian Networks in Federated Learning": each of C clients holds a mean-field
Gaussian posterior over the Bayesian weights of a shared architecture (in the paper only the fully connected
weight matrices; convolutions and biases stay deterministic). Round ``t = 1 .. T``:

1. every client holds the global model: the fused posterior (``load_posterior``) and the averaged deterministic
   parameters (``load_deterministic``); a client that was not sampled last round holds it too;
2. the server samples ``m = max(1, floor(fraction * C))`` clients without replacement;
3. each sampled client k runs SVI on its ``n_k`` examples for E local epochs (:meth:`BayesianClient.fit`),
   starting from the global model;
4. the server fuses the sampled clients' posteriors weight by weight with one rule of :mod:`bnpfed.combine`
   (``eaa``, ``gaa``, ``log_variance``, ``pooling``, ``conflation``) under client weights ``b_k`` (``"size"``:
   ``b_k = n_k / sum_{j sampled} n_j``; ``"uniform"``: ``b_k = 1 / m``), and averages the deterministic
   parameters with the same ``b_k`` (:func:`bnpfed.combine.average_deterministic`);
5. the global model is evaluated on the test set: accuracy, NLL, ECE, Brier score of the posterior predictive
   (the softmax averaged over S weight draws), and the mean posterior standard deviation of the Bayesian weights.

The baseline is FedAvg (McMahan et al. 2017) on the same architecture, with the same partition, sampled clients,
client weights, local schedule and optimiser: :class:`DeterministicClient` s whose parameters are averaged.

No fusion math lives here: the server calls :func:`bnpfed.combine.fuse_sites` and
:func:`bnpfed.combine.average_deterministic`.

Randomness: every random step draws from a seed derived from ``config.seed`` by :func:`derive_seed` (a
``numpy.random.SeedSequence`` of ``(seed, stream, round, client)``): the network's initialisation
(``INIT``), the clients sampled in round t (``SAMPLING``, a ``numpy.random.Generator``), client k's local fit in
round t (``FIT``), the pooling rule's draws in round t (``POOLING``, a ``torch.Generator``) and the predictive
draws of the evaluation after round t (``PREDICT``). Every rule and the baseline therefore start from the same
network and see the same sampled clients; the same seed gives the same results, and Torch's global random state
is left untouched.

Defaults (why): they suit the bundled digits data (C = 10 clients of about 135 examples, MLP 64-100-10), where
they bring every rule to FedAvg's accuracy in about five rounds. With the paper's N(0, 1) prior and clients that
small, the KL term of ``-ELBO / n_k`` is about 200 nats per example against a likelihood of about 2, and its
gradient on each posterior scale never changes sign, so Adam moves every ``log sigma`` up by about ``lr`` per
step until the likelihood pushes back. Starting the scales at ``init_scale=1e-2`` and taking few steps per round
(batch 32, E = 2 local epochs: 10 steps on a digits client) at ``lr=1e-2`` lets the means learn as fast as FedAvg's
weights while the scales grow by about 10% per round; the rules then differ through the spread they give the
fused posterior (GAA and conflation divide its variance by about C a round, pooling widens it by the
clients' disagreement). With larger clients, lower ``lr`` as the steps per round grow (the Fashion-MNIST
benchmark, 94 steps of 64 examples per epoch, uses ``lr=1e-3``). Local reparameterisation is on, as in the paper. See
``benchmarks/fusion.md`` for the numbers.

Usage::

    ds = load_dataset("digits")
    parts = partition_homogeneous(ds.y_train.numpy(), 10, seed=0)
    result = run_fusion_experiment(ds, parts, FusionConfig(rounds=5, local_epochs=2), progress=True)
    result.histories["conflation"].final        # {"round": 5, "accuracy": ..., "ece": ..., "mean_sigma": ...}
    result.summary_rows()                       # one row per rule, then FedAvg

    federation = FusionFederation(ds, parts, FusionConfig(), rule="eaa")      # one rule, round by round
    record = federation.run_round()             # record.sampled, record.weights, record.metrics
    federation.global_posterior                 # {"1.weight": FusedGaussian(loc, variance), ...}
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import pyro.distributions as dist
import torch
from torch import Tensor, nn

from bnpfed.combine import FusedGaussian, available_rules, average_deterministic, fuse_sites
from bnpfed.data import Dataset
from bnpfed.inference.svi import BayesianClient, DeterministicClient
from bnpfed.metrics import classification_report
from bnpfed.models import IIDPrior, LeNet, mlp, only_linear_weights
from bnpfed.models.bayesian import seeded
from bnpfed.report import json_safe

__all__ = [
    "ARCHITECTURES",
    "bayesian_client",
    "CLIENT_WEIGHTS",
    "FEDAVG",
    "FIT",
    "INIT",
    "POOLING",
    "PREDICT",
    "PRIORS",
    "SAMPLING",
    "FederatedHistory",
    "FedAvgFederation",
    "FusionConfig",
    "FusionExperiment",
    "FusionFederation",
    "RoundRecord",
    "build_network",
    "derive_seed",
    "run_fusion_experiment",
]

#: Architectures :func:`build_network` builds.
ARCHITECTURES = ("mlp", "lenet")
#: Which parameters are Bayesian: ``"linear-weights"`` (the paper: weight matrices of fully connected layers) or
#: ``"all"`` (every parameter, convolutions and biases included).
PRIORS = ("linear-weights", "all")
#: Client weighting schemes ``b_k``.
CLIENT_WEIGHTS = ("uniform", "size")
#: Name of the FedAvg baseline in results.
FEDAVG = "fedavg"

#: Streams of :func:`derive_seed`, one per kind of random step: the initial network, the clients sampled in a
#: round, a client's local fit, the pooling rule's draws, the predictive draws of an evaluation.
INIT, SAMPLING, FIT, POOLING, PREDICT = range(5)

#: Test examples per forward pass in evaluation (bounds memory, not results).
EVAL_CHUNK = 2048


def derive_seed(seed: int, *keys: int) -> int:
    """A 32-bit seed for one random step, derived from the experiment's ``seed`` and non-negative integer ``keys``
    (``stream, round, client``) with ``numpy.random.SeedSequence``: different keys give independent streams."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1, dtype=np.uint32)[0])


@dataclass(frozen=True)
class FusionConfig:
    """Settings of a federated fusion experiment; the data and its partition are passed separately (the number of
    clients C is the number of index sets in the partition).

    Usage::

        FusionConfig()                                              # digits-sized defaults, all five rules
        FusionConfig(rules=("eaa", "conflation"), arch="lenet", rounds=5, local_epochs=1, weights="uniform")

    :param tuple rules: fusion rules to run, names from :func:`bnpfed.combine.available_rules`. Default all five.
    :param bool fedavg: also run the deterministic FedAvg baseline. Default True.
    :param str arch: ``"mlp"`` (ReLU MLP with ``hidden`` widths) or ``"lenet"`` (LeNet-5, square images).
        Default ``"mlp"``.
    :param tuple hidden: hidden widths of the MLP. Default ``(100,)``.
    :param str prior: ``"linear-weights"`` (the paper's choice: only ``nn.Linear`` weight matrices are Bayesian) or
        ``"all"``. Default ``"linear-weights"``.
    :param float prior_scale: standard deviation of the ``N(0, prior_scale^2)`` prior of every Bayesian weight.
        Default 1 (the paper's).
    :param float init_scale: initial posterior standard deviation of every Bayesian weight. Default ``1e-2``.
    :param float fraction: fraction of the clients sampled each round; ``m = max(1, floor(fraction * C))``.
        Default 1.
    :param int rounds: T, communication rounds. Default 5.
    :param int local_epochs: E, passes over the local data per round. Default 2.
    :param int batch_size: mini-batch size of local training. Default 32.
    :param float lr: Adam learning rate of local training, Bayesian and FedAvg alike. Default ``1e-2`` (digits;
        see the module's notes for larger clients).
    :param str weights: client weights ``b_k``: ``"size"`` (proportional to the local data size, over the clients
        sampled that round; the paper's) or ``"uniform"``. Default ``"size"``.
    :param bool local_reparameterization: train and predict with the local reparameterisation trick (the paper
        does). Default True.
    :param int num_predictive_samples: S, weight draws averaged in the posterior predictive. Default 10.
    :param int pooling_samples: N of the pooling rule (client k contributes ``floor(b_k N)`` draws). Default 1000.
    :param int ece_bins: equal-width bins of the expected calibration error. Default 100, as in the paper's
        tables (:func:`bnpfed.metrics.expected_calibration_error` defaults to 15).
    :param int seed: the one seed every random step derives from (:func:`derive_seed`), >= 0. Default 0.
    """

    rules: tuple[str, ...] = ("eaa", "gaa", "log_variance", "pooling", "conflation")
    fedavg: bool = True
    arch: str = "mlp"
    hidden: tuple[int, ...] = (100,)
    prior: str = "linear-weights"
    prior_scale: float = 1.0
    init_scale: float = 1e-2
    fraction: float = 1.0
    rounds: int = 5
    local_epochs: int = 2
    batch_size: int = 32
    lr: float = 1e-2
    weights: str = "size"
    local_reparameterization: bool = True
    num_predictive_samples: int = 10
    pooling_samples: int = 1000
    ece_bins: int = 100
    seed: int = 0

    def __post_init__(self):
        rules = self.rules
        if isinstance(rules, str) or not isinstance(rules, Sequence):
            raise ValueError(f"rules: expected a sequence of rule names from {available_rules()}, got {rules!r}")
        object.__setattr__(self, "rules", tuple(rules))
        for rule in self.rules:
            if rule not in available_rules():
                raise ValueError(f"rules: unknown rule {rule!r}; expected names from {available_rules()}")
        if len(set(self.rules)) != len(self.rules):
            raise ValueError(f"rules: each rule at most once, got {list(self.rules)}")
        if not self.rules and not self.fedavg:
            raise ValueError("rules is empty and fedavg=False: nothing to run")
        _check_choice(self.arch, ARCHITECTURES, "arch")
        _check_choice(self.prior, PRIORS, "prior")
        _check_choice(self.weights, CLIENT_WEIGHTS, "weights")
        hidden = self.hidden
        if isinstance(hidden, (str, int)) or not isinstance(hidden, Sequence):
            raise ValueError(f"hidden: expected a sequence of positive ints (hidden widths), got {hidden!r}")
        object.__setattr__(self, "hidden", tuple(hidden))
        for i, width in enumerate(self.hidden):
            _check_int(width, f"hidden[{i}]", low=1)
        for name in ("prior_scale", "init_scale", "lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or not (
                0 < self.fraction <= 1):
            raise ValueError(f"fraction: expected a number in (0, 1], got {self.fraction!r}")
        for name in ("rounds", "local_epochs", "batch_size", "num_predictive_samples", "pooling_samples",
                     "ece_bins"):
            _check_int(getattr(self, name), name, low=1)
        _check_int(self.seed, "seed", low=0)
        for name in ("fedavg", "local_reparameterization"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")

    @property
    def methods(self) -> tuple[str, ...]:
        """What :func:`run_fusion_experiment` runs, in order: the rules, then ``"fedavg"`` if enabled."""
        return self.rules + ((FEDAVG,) if self.fedavg else ())


@dataclass
class RoundRecord:
    """What one round did: which clients were sampled, with which normalised weights ``b_k``, and the global
    model's test metrics afterwards (``round``, ``accuracy``, ``nll``, ``ece``, ``brier``, ``mean_sigma`` for
    Bayesian federations, ``train_loss`` — the sampled clients' mean last-epoch loss — and ``seconds``)."""

    round: int
    sampled: list[int]
    weights: list[float]
    metrics: dict[str, float]


@dataclass
class FederatedHistory:
    """Per-round metrics of one method (a fusion rule, or ``"fedavg"``): ``rounds[t - 1]`` is the metric dict after
    round t (see :class:`RoundRecord`), plus the clients sampled in each round."""

    method: str
    rounds: list[dict[str, float]] = field(default_factory=list)
    sampled: list[list[int]] = field(default_factory=list)

    @property
    def final(self) -> dict[str, float]:
        """The metrics after the last round."""
        if not self.rounds:
            raise ValueError(f"{self.method}: no round has run yet")
        return self.rounds[-1]

    def metric(self, name: str) -> list[float]:
        """One metric over the rounds, e.g. ``history.metric("accuracy")``."""
        return [r[name] for r in self.rounds]


@dataclass
class FusionExperiment:
    """The result of :func:`run_fusion_experiment`: the config, the clients' data sizes, and one
    :class:`FederatedHistory` per method (rules in the config's order, then ``"fedavg"``)."""

    config: FusionConfig
    client_sizes: list[int]
    histories: dict[str, FederatedHistory]

    def summary_rows(self) -> list[dict]:
        """One row per method with its final ``accuracy, nll, ece, brier, mean_sigma`` (NaN for FedAvg, which has
        no posterior) and the ``seconds`` all its rounds took."""
        rows = []
        for method, history in self.histories.items():
            final = history.final
            rows.append({
                "method": method,
                "accuracy": final["accuracy"],
                "nll": final["nll"],
                "ece": final["ece"],
                "brier": final["brier"],
                "mean_sigma": final.get("mean_sigma", math.nan),
                "seconds": sum(r["seconds"] for r in history.rounds),
            })
        return rows

    def to_dict(self) -> dict:
        """Plain Python (JSON-ready; NaN becomes None): config, client sizes, every method's rounds."""
        return json_safe({
            "config": asdict(self.config),
            "client_sizes": self.client_sizes,
            "histories": {m: {"rounds": h.rounds, "sampled": h.sampled} for m, h in self.histories.items()},
        })


def build_network(arch: str, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (100,)
                  ) -> nn.Module:
    """The plain network of an experiment: ``"mlp"`` (flattens its input; ``hidden`` widths) or ``"lenet"``
    (LeNet-5 on ``(C, H, H)`` images)."""
    _check_choice(arch, ARCHITECTURES, "arch")
    input_shape = tuple(input_shape)
    if arch == "mlp":
        return mlp(math.prod(input_shape), list(hidden), num_classes)
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ValueError(f"arch='lenet' needs square images, input_shape (C, H, H); got input_shape "
                         f"{input_shape} (use arch='mlp' for flat data)")
    return LeNet(in_channels=input_shape[0], image_size=input_shape[1], num_classes=num_classes)


def bayesian_client(config: FusionConfig, network: nn.Module) -> BayesianClient:
    """A Bayesian client of ``network`` with the experiment's prior (N(0, prior_scale^2) on the fully connected
    weights only, the paper's choice, or on every parameter), initial posterior scale and local reparameterisation;
    the in-process federation and the Flower client app both build their clients here."""
    weight_prior = dist.Normal(0.0, float(config.prior_scale))
    prior = only_linear_weights(weight_prior) if config.prior == "linear-weights" else IIDPrior(weight_prior)
    return BayesianClient(network, prior, init_scale=config.init_scale,
                          local_reparameterization=config.local_reparameterization)


class _Federation(ABC):
    """What the Bayesian and the FedAvg federation share: data, client sampling, client weights, the round loop."""

    method: str

    def __init__(self, dataset: Dataset, parts: Sequence, config: FusionConfig):
        if not isinstance(dataset, Dataset):
            raise ValueError(f"dataset: expected a bnpfed.data.Dataset, got {type(dataset).__name__}")
        if not isinstance(config, FusionConfig):
            raise ValueError(f"config: expected a FusionConfig, got {type(config).__name__}")
        self.dataset = dataset
        self.config = config
        self.parts = _check_parts(parts, len(dataset.y_train))
        self.num_clients = len(self.parts)
        #: Clients sampled per round, ``max(1, floor(fraction * C))``.
        self.clients_per_round = max(1, int(math.floor(config.fraction * self.num_clients + 1e-9)))
        #: Local data of each client, ``(x, y)``.
        self.client_data = [(dataset.x_train[idx], dataset.y_train[idx]) for idx in self.parts]
        #: Rounds completed.
        self.round = 0
        with seeded(derive_seed(config.seed, INIT)):  # the same initial network for every method
            self.network = build_network(config.arch, dataset.input_shape, dataset.num_classes, config.hidden)

    def sample_clients(self, round: int) -> list[int]:
        """The clients sampled in round ``round`` (1-based), sorted: all of them when ``fraction`` is 1, else
        ``clients_per_round`` drawn without replacement by a ``numpy.random.Generator`` seeded with
        ``derive_seed(seed, SAMPLING, round)``."""
        if self.clients_per_round == self.num_clients:
            return list(range(self.num_clients))
        rng = np.random.default_rng(derive_seed(self.config.seed, SAMPLING, round))
        return sorted(int(k) for k in rng.choice(self.num_clients, self.clients_per_round, replace=False))

    def client_weights(self, sampled: Sequence[int]) -> list[float]:
        """Normalised ``b_k`` of the sampled clients: ``n_k / sum_j n_j`` over them (``"size"``) or ``1 / m``."""
        if self.config.weights == "uniform":
            return [1.0 / len(sampled)] * len(sampled)
        sizes = [len(self.parts[k]) for k in sampled]
        return [n / sum(sizes) for n in sizes]

    def fit_seed(self, round: int, client: int) -> int:
        """Seed of client ``client`` 's local fit in round ``round``: ``derive_seed(seed, FIT, round, client)``."""
        return derive_seed(self.config.seed, FIT, round, client)

    def run_round(self) -> RoundRecord:
        """One round: broadcast the global model, sample, train locally, aggregate, evaluate on the test set."""
        start = time.perf_counter()
        t = self.round + 1
        self.broadcast()
        sampled = self.sample_clients(t)
        losses = []
        for k in sampled:
            x, y = self.client_data[k]
            losses.append(self._fit(k, x, y, seed=self.fit_seed(t, k)))
        weights = self.client_weights(sampled)
        self._aggregate(t, sampled, weights)
        self.round = t
        metrics = {"round": t, **self.evaluate(), "train_loss": float(np.mean(losses))}
        metrics["seconds"] = time.perf_counter() - start
        return RoundRecord(round=t, sampled=sampled, weights=weights, metrics=metrics)

    def evaluate(self) -> dict[str, float]:
        """Test-set ``accuracy, nll, ece`` (``config.ece_bins`` bins) and ``brier`` of the global model."""
        x = self.dataset.x_test
        probs = torch.cat([self._predict(x[i:i + EVAL_CHUNK]) for i in range(0, len(x), EVAL_CHUNK)])
        return classification_report(probs, self.dataset.y_test, n_bins=self.config.ece_bins)

    @abstractmethod
    def broadcast(self) -> None:
        """Implemented by each subclass."""

    def _fit(self, k: int, x: Tensor, y: Tensor, seed: int) -> float:
        """Client k's local epochs (Bayesian and deterministic clients share ``fit``); its last epoch's loss."""
        c = self.clients[k]
        c.fit(x, y, epochs=self.config.local_epochs, batch_size=self.config.batch_size, lr=self.config.lr, seed=seed)
        return c.losses_[-1]

    @abstractmethod
    def _aggregate(self, round: int, sampled: list[int], weights: list[float]) -> None:
        """Implemented by each subclass."""

    @abstractmethod
    def _predict(self, x: Tensor) -> Tensor:
        """Implemented by each subclass."""


class FusionFederation(_Federation):
    """C variational Bayesian clients and a server that fuses their posteriors with one rule, round by round.

    Usage::

        federation = FusionFederation(ds, parts, FusionConfig(rounds=3), rule="conflation")
        for _ in range(3):
            record = federation.run_round()        # .sampled, .weights, .metrics
        federation.global_posterior                # {site: FusedGaussian(loc, variance)}

    :param Dataset dataset: train split (partitioned) and test split (evaluation).
    :param parts: C index arrays into ``dataset.y_train``, one per client (e.g. from
        :func:`bnpfed.federated.partition_homogeneous`).
    :param FusionConfig config: the experiment's settings.
    :param str rule: the fusion rule, one of :func:`bnpfed.combine.available_rules`.

    Attributes: ``clients`` (C :class:`BayesianClient` s), ``global_model`` (the server's
    :class:`BayesianClient`, holding the global model, used for evaluation), ``global_posterior`` (the last fused
    ``{site: FusedGaussian}``), ``global_deterministic`` (the last averaged deterministic parameters), ``round``.
    """

    def __init__(self, dataset: Dataset, parts: Sequence, config: FusionConfig, rule: str):
        super().__init__(dataset, parts, config)
        if rule not in available_rules():
            raise ValueError(f"rule: expected one of {available_rules()}, got {rule!r}")
        self.method = rule
        self.rule = rule

        self.global_model = bayesian_client(config, self.network)
        self.clients = [bayesian_client(config, self.network) for _ in range(self.num_clients)]
        self.global_posterior: dict[str, FusedGaussian] = {
            name: FusedGaussian(loc, variance) for name, (loc, variance) in self.global_model.posterior().items()}
        self.global_deterministic: dict[str, Tensor] = self.global_model.deterministic_state()

    def pooling_seed(self, round: int) -> int:
        """Seed of the ``torch.Generator`` of the pooling rule in round ``round``: ``derive_seed(seed, POOLING,
        round)`` (passed to every rule; the others draw nothing)."""
        return derive_seed(self.config.seed, POOLING, round)

    def broadcast(self) -> None:
        """Every client (sampled or not) takes the global model: the fused posterior and the averaged
        deterministic parameters."""
        for c in self.clients:
            c.load_posterior(self.global_posterior)
            c.load_deterministic(self.global_deterministic)

    def _aggregate(self, round, sampled, weights):
        generator = torch.Generator().manual_seed(self.pooling_seed(round))
        self.global_posterior = fuse_sites([self.clients[k].posterior() for k in sampled], self.rule, weights,
                                           num_samples=self.config.pooling_samples, generator=generator)
        states = [self.clients[k].deterministic_state() for k in sampled]
        self.global_deterministic = {name: average_deterministic([s[name] for s in states], weights)
                                     for name in self.global_deterministic}
        self.global_model.load_posterior(self.global_posterior)
        self.global_model.load_deterministic(self.global_deterministic)

    def _predict(self, x):
        return self.global_model.predict_proba(x, num_samples=self.config.num_predictive_samples,
                                               seed=derive_seed(self.config.seed, PREDICT, self.round))

    def evaluate(self) -> dict[str, float]:
        """As :meth:`_Federation.evaluate`, plus ``mean_sigma``: the mean posterior standard deviation over every
        Bayesian weight of the global model."""
        metrics = super().evaluate()
        total = sum(g.variance.sqrt().sum().item() for g in self.global_posterior.values())
        count = sum(g.variance.numel() for g in self.global_posterior.values())
        metrics["mean_sigma"] = total / count
        return metrics


class FedAvgFederation(_Federation):
    """The FedAvg baseline: C :class:`DeterministicClient` s of the same network (same initialisation, partition,
    sampled clients, weights ``b_k`` and local schedule as :class:`FusionFederation`), averaged every round.

    Attributes: ``clients``, ``global_model`` (a :class:`DeterministicClient` holding the average),
    ``global_state``, ``round``.
    """

    method = FEDAVG

    def __init__(self, dataset: Dataset, parts: Sequence, config: FusionConfig):
        super().__init__(dataset, parts, config)
        self.global_model = DeterministicClient(self.network)
        self.clients = [DeterministicClient(self.network) for _ in range(self.num_clients)]
        self.global_state: dict[str, Tensor] = self.global_model.state()

    def broadcast(self) -> None:
        for c in self.clients:
            c.load_state(self.global_state)

    def _aggregate(self, round, sampled, weights):
        states = [self.clients[k].state() for k in sampled]
        self.global_state = {name: average_deterministic([s[name] for s in states], weights)
                             for name in self.global_state}
        self.global_model.load_state(self.global_state)

    def _predict(self, x):
        return self.global_model.predict_proba(x)


def run_fusion_experiment(
    dataset: Dataset,
    parts: Sequence,
    config: Optional[FusionConfig] = None,
    *,
    progress: bool = False,
    callback: Optional[Callable[[str, RoundRecord], None]] = None,
) -> FusionExperiment:
    """Run ``config.rounds`` federated rounds for every rule in ``config.rules`` and for FedAvg, one method after
    the other, each from the same initial network.

    :param Dataset dataset: the loaded dataset (see :func:`bnpfed.data.load_dataset`).
    :param parts: C index arrays into ``dataset.y_train``, one per client.
    :param FusionConfig config: settings; default ``FusionConfig()``.
    :param bool progress: show a tqdm progress bar (on stderr) over all methods' rounds. Default False.
    :param callback: called as ``callback(method, record)`` after every round (a :class:`RoundRecord`).
    :returns: a :class:`FusionExperiment`.
    """
    from tqdm import tqdm

    config = FusionConfig() if config is None else config
    if not isinstance(config, FusionConfig):
        raise ValueError(f"config: expected a FusionConfig, got {type(config).__name__}")
    if callback is not None and not callable(callback):
        raise ValueError(f"callback: expected a callable (method, record) or None, got {callback!r}")
    histories = {}
    sizes: list[int] = []
    with tqdm(total=len(config.methods) * config.rounds, disable=not progress, desc="federated rounds",
              unit="round") as bar:
        for method in config.methods:
            federation = (FedAvgFederation(dataset, parts, config) if method == FEDAVG
                          else FusionFederation(dataset, parts, config, method))
            sizes = [len(p) for p in federation.parts]
            history = FederatedHistory(method)
            for _ in range(config.rounds):
                record = federation.run_round()
                history.rounds.append(record.metrics)
                history.sampled.append(record.sampled)
                bar.set_postfix(method=method, accuracy=f"{record.metrics['accuracy']:.3f}")
                bar.update()
                if callback is not None:
                    callback(method, record)
            histories[method] = history
    return FusionExperiment(config=config, client_sizes=sizes, histories=histories)


def _check_parts(parts, n: int) -> list[np.ndarray]:
    if isinstance(parts, (str, bytes, Mapping)) or not isinstance(parts, Sequence) or len(parts) == 0:
        raise ValueError(f"parts: expected a non-empty list of per-client index arrays, got {type(parts).__name__}")
    checked = []
    for k, part in enumerate(parts):
        idx = np.asarray(part.numpy() if torch.is_tensor(part) else part)
        if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
            raise ValueError(f"parts[{k}]: expected a non-empty 1-D array of integer indices, got dtype "
                             f"{idx.dtype} and shape {idx.shape}")
        if idx.min() < 0 or idx.max() >= n:
            raise ValueError(f"parts[{k}]: indices must lie in [0, {n - 1}] (the train split's size), got range "
                             f"[{idx.min()}, {idx.max()}]")
        checked.append(torch.as_tensor(idx.astype(np.int64)))
    return checked


def _check_choice(value, choices: Sequence[str], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def _check_int(value, name: str, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")

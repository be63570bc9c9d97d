"""The PFNM experiments (Yurochkin et al. 2019, section 4): J clients train MLPs on their partitions; the server
matches them into one global network in one communication round, or refines it over a few; compared with the local
models, their ensemble, FedAvg and k-means.

Everything here is orchestration: local training is :class:`~bnpfed.inference.DeterministicClient`, matching is
:func:`~bnpfed.inference.multilayer.match_networks`, averaging is :func:`~bnpfed.combine.average_deterministic`.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Literal, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from bnpfed.data import Dataset
from bnpfed.federated.baselines import ensemble_proba, fedavg_network, kmeans_layer_fn
from bnpfed.federated.partition import (
    class_counts,
    partition_dirichlet,
    partition_homogeneous,
    train_validation_split,
)
from bnpfed.inference import REFERENCE_CONSTANTS, DeterministicClient
from bnpfed.inference.multilayer import NetworkMatch, match_networks, network_from_layers
from bnpfed.metrics import count_parameters
from bnpfed.models import mlp, reference_init_

__all__ = ["PFNMSettings", "MethodResult", "PFNMRun", "LocalSchedule", "run_pfnm_experiment", "width_sweep",
           "client_split", "initial_network", "local_schedule", "train_client", "METHODS"]

#: Methods a run can include; ``pfnm-rounds`` and ``fedavg-rounds`` only when ``rounds > 1``.
METHODS = ("local", "ensemble", "fedavg", "fedavg-shared", "kmeans", "pfnm", "pfnm-rounds", "fedavg-rounds")


@dataclass(frozen=True)
class PFNMSettings:
    """One PFNM experiment. Defaults are the reference code's (``experiment.py``): 10 epochs of Adam (AMSGrad),
    batch 32, learning rate 0.01, L2 1e-6, weights N(0, 0.1^2) and biases 0.1, sigma2 = sigma0_2 = gamma0 = 1,
    5 matching sweeps; communication rounds retrain 5 epochs with the learning rate decayed by 0.99 per round.

    :param constants: ``"bnpfed"`` (popularity factor 2, no caps: the exact objective) or ``"reference"``
        (:data:`~bnpfed.inference.REFERENCE_CONSTANTS`).
    :param select: how sigma2 / sigma0_2 / gamma0 are chosen from the grids: ``"none"`` (use the given values),
        ``"federated"`` (each client holds out ``holdout`` of its data; candidates are scored by the clients on
        their held-out splits, the federated way), or ``"pooled-train"`` (accuracy on all clients' pooled training
        data, as the reference code does -- a federation does not have it).
    """

    clients: int = 10
    hidden: tuple[int, ...] = (100,)
    partition: Literal["homogeneous", "dirichlet"] = "homogeneous"
    alpha: float = 0.5
    min_size: int = 10
    epochs: int = 10
    batch_size: int = 32
    lr: float = 0.01
    weight_decay: float = 1e-6
    shared_init: bool = False
    sigma2: float = 1.0
    sigma0_2: float = 1.0
    gamma0: float = 1.0
    constants: Literal["bnpfed", "reference"] = "bnpfed"
    objective: Literal["map", "marginal"] = "map"
    direction: Literal["bottom-up", "top-down"] = "bottom-up"
    sweeps: int = 5
    rounds: int = 1
    round_epochs: int = 5
    lr_decay: float = 0.99
    select: Literal["none", "federated", "pooled-train"] = "none"
    grid_sigma2: tuple[float, ...] = (0.05, 0.1, 0.3, 1.0)
    grid_sigma0_2: tuple[float, ...] = (1.0,)
    grid_gamma0: tuple[float, ...] = (1e-3, 1.0)
    holdout: float = 0.1
    methods: tuple[str, ...] = METHODS
    seed: int = 0

    def __post_init__(self):
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        if not self.hidden or any(int(h) < 1 for h in self.hidden):
            raise ValueError(f"hidden must list at least one positive width, got {self.hidden}")
        if self.partition not in ("homogeneous", "dirichlet"):
            raise ValueError(f"partition must be 'homogeneous' or 'dirichlet', got {self.partition!r}")
        if self.constants not in ("bnpfed", "reference"):
            raise ValueError(f"constants must be 'bnpfed' or 'reference', got {self.constants!r}")
        if self.select not in ("none", "federated", "pooled-train"):
            raise ValueError(f"select must be 'none', 'federated' or 'pooled-train', got {self.select!r}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
        if not 0 < self.holdout < 1:
            raise ValueError(f"holdout must be in (0, 1), got {self.holdout}")

    def matcher_kwargs(self) -> dict:
        extra = dict(REFERENCE_CONSTANTS) if self.constants == "reference" else {}
        return dict(objective=self.objective, direction=self.direction, sweeps=self.sweeps, seed=self.seed, **extra)


@dataclass
class MethodResult:
    """One row of the results table."""

    method: str
    accuracy: float
    hidden: list[int]
    parameters: int
    rounds: int
    seconds: float = float("nan")
    note: str = ""


@dataclass
class PFNMRun:
    """Everything a run produced: the table rows, per-round histories, the local accuracies and the selection."""

    settings: PFNMSettings
    rows: list[MethodResult]
    local_accuracies: list[float]
    history: dict = field(default_factory=dict)  # method -> list of per-round dicts
    selection: dict = field(default_factory=dict)
    curve: list = field(default_factory=list)  # (sigma2, sigma0_2, gamma0, width, accuracy) of every candidate
    local_models: list = field(default_factory=list, repr=False)  # the clients' trained networks (not serialised)
    class_counts: np.ndarray | None = field(default=None, repr=False)
    # method ("pfnm", "pfnm-rounds") -> the global network's (weight, bias) layers after its last round (not serialised)
    global_layers: dict = field(default_factory=dict, repr=False)

    def row(self, method: str) -> MethodResult:
        for r in self.rows:
            if r.method == method:
                return r
        raise KeyError(f"no row for method {method!r}; rows: {[r.method for r in self.rows]}")

    def as_dict(self) -> dict:
        return {"settings": asdict(self.settings), "rows": [asdict(r) for r in self.rows],
                "local_accuracies": self.local_accuracies, "history": self.history, "selection": self.selection,
                "curve": self.curve}


@torch.no_grad()
def _accuracy(net: nn.Module, x, y) -> float:
    return float((net.eval()(x).argmax(-1) == y).double().mean())


@dataclass(frozen=True)
class LocalSchedule:
    """What every client does in one communication round: ``epochs`` of Adam at learning rate ``lr``; client j's
    fit draws from seed ``seed * 100_003 + j`` (:func:`train_client`)."""

    epochs: int
    lr: float
    seed: int


def local_schedule(settings: PFNMSettings, round: int) -> LocalSchedule:
    """The local training of round ``round`` (1-based): round 1 trains ``epochs`` at ``lr`` from the clients'
    initialisations; a later round r retrains ``round_epochs`` at ``lr * lr_decay ** (r - 1)``."""
    if round < 1:
        raise ValueError(f"round must be >= 1, got {round}")
    if round == 1:
        return LocalSchedule(settings.epochs, settings.lr, settings.seed)
    return LocalSchedule(settings.round_epochs, settings.lr * settings.lr_decay ** (round - 1), settings.seed + round)


def client_split(settings: PFNMSettings, y_train: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every client's training indices into ``y_train`` and its held-out indices (empty unless
    ``settings.select == "federated"``), as ``(train, validation)`` lists of J arrays."""
    J = settings.clients
    if settings.partition == "homogeneous":
        parts = partition_homogeneous(y_train, J, seed=settings.seed)
    else:
        parts = partition_dirichlet(y_train, J, alpha=settings.alpha, min_size=settings.min_size,
                                    seed=settings.seed)
    if settings.select != "federated":
        return parts, [np.zeros(0, dtype=np.int64) for _ in parts]
    splits = [train_validation_split(p, settings.holdout, seed=settings.seed + j) for j, p in enumerate(parts)]
    return [s.train for s in splits], [s.validation for s in splits]


def train_client(net: nn.Module, x, y, settings: PFNMSettings, client: int, schedule: LocalSchedule) -> nn.Module:
    """Client ``client`` 's local step: a copy of ``net`` trained on its ``(x, y)`` by AMSGrad with the settings'
    batch size and L2 strength; returns the trained copy in eval mode."""
    fitted = DeterministicClient(net).fit(x, y, epochs=schedule.epochs, batch_size=settings.batch_size,
                                          lr=schedule.lr, seed=schedule.seed * 100_003 + client, amsgrad=True,
                                          weight_decay=settings.weight_decay)
    return fitted.net.eval()


def initial_network(settings: PFNMSettings, client: int, in_features: int, num_classes: int, *,
                    shared: bool) -> nn.Module:
    """Client ``client`` 's MLP before any training, in the reference initialisation: one seed for every client
    when ``shared``, else its own."""
    seed = settings.seed if shared else settings.seed * 100_003 + client + 1
    net = mlp(in_features, list(settings.hidden), num_classes)
    return reference_init_(net, generator=torch.Generator().manual_seed(seed))


def _train_clients(nets, data, settings: PFNMSettings, schedule: LocalSchedule, *, progress) -> list:
    out = []
    for j, (net, (x, y)) in enumerate(zip(nets, data)):
        out.append(train_client(net, x, y, settings, j, schedule))
        progress(1)
    return out


def _initial_nets(settings: PFNMSettings, in_features: int, num_classes: int, *, shared: bool) -> list[nn.Module]:
    return [initial_network(settings, j, in_features, num_classes, shared=shared) for j in range(settings.clients)]


def run_pfnm_experiment(dataset: Dataset, settings: PFNMSettings = PFNMSettings(), *, progress: bool = True,
                        log: Callable[[str], None] | None = None) -> PFNMRun:
    """Run every method of ``settings.methods`` on ``dataset`` (flattened for the MLPs) and return the results.

    Usage::

        ds = load_dataset("digits", standardize=False)
        run = run_pfnm_experiment(ds, PFNMSettings(clients=5, epochs=5), progress=False)
        print(run.row("pfnm").accuracy, run.row("pfnm").hidden)
    """
    ds = dataset.flat()
    x_train, y_train, x_test, y_test = ds.x_train, ds.y_train, ds.x_test, ds.y_test
    C, D = ds.num_classes, ds.input_shape[0]
    methods = set(settings.methods)
    train_idx, val_idx = client_split(settings, y_train.numpy())
    counts = class_counts(y_train.numpy(), train_idx, C)
    sizes = np.array([len(i) for i in train_idx], dtype=np.float64)
    client_data = [(x_train[torch.as_tensor(i)], y_train[torch.as_tensor(i)]) for i in train_idx]
    match_kw = settings.matcher_kwargs()

    n_steps = settings.clients * (1 + ("fedavg-shared" in methods or "fedavg-rounds" in methods))
    n_steps += settings.clients * 2 * (settings.rounds - 1)
    bar = tqdm(total=n_steps, desc="client training", disable=not progress, leave=False)
    rows: list[MethodResult] = []
    history: dict = {}
    global_layers: dict = {}

    # local models, trained once, from independent (reference) initialisations
    local = _train_clients(_initial_nets(settings, D, C, shared=settings.shared_init), client_data, settings,
                           local_schedule(settings, 1), progress=bar.update)
    local_acc = [_accuracy(n, x_test, y_test) for n in local]
    width = list(settings.hidden)
    n_params = count_parameters(local[0])
    if "local" in methods:
        for name, value in (("local (mean)", np.mean(local_acc)), ("local (min)", np.min(local_acc)),
                            ("local (max)", np.max(local_acc))):
            rows.append(MethodResult(name, float(value), width, n_params, 0))
    if "ensemble" in methods:
        acc = float((ensemble_proba(local, x_test).argmax(-1) == y_test).double().mean())
        rows.append(MethodResult("ensemble", acc, [h * settings.clients for h in width],
                                 n_params * settings.clients, 1))
    if "fedavg" in methods:
        note = "shared init" if settings.shared_init else "no shared init"
        rows.append(MethodResult("fedavg (1 round)", _accuracy(fedavg_network(local, sizes), x_test, y_test), width,
                                 n_params, 1, note=note))
    shared = None
    if "fedavg-shared" in methods or "fedavg-rounds" in methods:
        shared = local if settings.shared_init else _train_clients(
            _initial_nets(settings, D, C, shared=True), client_data, settings, local_schedule(settings, 1),
            progress=bar.update)
        if "fedavg-shared" in methods and not settings.shared_init:
            rows.append(MethodResult("fedavg (1 round)", _accuracy(fedavg_network(shared, sizes), x_test, y_test),
                                     width, n_params, 1, note="shared init"))

    if settings.rounds > 1 and "fedavg-rounds" in methods:
        global_net = fedavg_network(shared, sizes)
        hist = [dict(round=1, accuracy=_accuracy(global_net, x_test, y_test), hidden=width)]
        for r in range(2, settings.rounds + 1):
            trained = _train_clients([global_net] * settings.clients, client_data, settings,
                                     local_schedule(settings, r), progress=bar.update)
            global_net = fedavg_network(trained, sizes)
            hist.append(dict(round=r, accuracy=_accuracy(global_net, x_test, y_test), hidden=width))
        history["fedavg"] = hist
        rows.append(MethodResult(f"fedavg ({settings.rounds} rounds)", hist[-1]["accuracy"], width, n_params,
                                 settings.rounds, note="shared init"))
    selection, curve = {"by": settings.select}, []
    if methods & {"pfnm", "kmeans", "pfnm-rounds"}:
        # PFNM one-shot, with the hyper-parameters chosen as asked
        def match(nets, s2, s02, g) -> NetworkMatch:
            return match_networks(nets, counts, sigma2=s2, sigma0_2=s02, gamma0=g, **match_kw)

        best = None
        if settings.select == "none":
            hyper = (settings.sigma2, settings.sigma0_2, settings.gamma0)
            best = match(local, *hyper)
        else:
            if settings.select == "federated":
                val = [(x_train[torch.as_tensor(i)], y_train[torch.as_tensor(i)]) for i in val_idx]
            else:
                pooled = torch.as_tensor(np.concatenate(train_idx))
                val = [(x_train[pooled], y_train[pooled])]
            best_score = -1.0
            for hyper_c in itertools.product(settings.grid_sigma2, settings.grid_sigma0_2, settings.grid_gamma0):
                candidate = match(local, *hyper_c)
                net = candidate.network()
                correct = sum(float((net(x).argmax(-1) == y).double().sum()) for x, y in val)
                score = correct / sum(len(y) for _, y in val)
                curve.append(dict(sigma2=hyper_c[0], sigma0_2=hyper_c[1], gamma0=hyper_c[2],
                                  hidden=candidate.hidden_sizes, validation=score,
                                  test=_accuracy(net, x_test, y_test)))
                narrower = best is not None and sum(candidate.hidden_sizes) < sum(best.hidden_sizes)
                if score > best_score or (score == best_score and narrower):
                    best, best_score, hyper = candidate, score, hyper_c
            selection["validation_accuracy"] = best_score
        selection.update(sigma2=hyper[0], sigma0_2=hyper[1], gamma0=hyper[2])
        global_net = best.network()
        global_layers["pfnm"] = best.layers
        pfnm_acc = _accuracy(global_net, x_test, y_test)
        if "pfnm" in methods:
            rows.append(MethodResult("pfnm (1 round)", pfnm_acc, best.hidden_sizes, count_parameters(global_net), 1,
                                     seconds=best.seconds, note=f"selected by {settings.select}"))
        if "kmeans" in methods:
            km = match_networks(local, counts, layer_fn=kmeans_layer_fn(best.hidden_sizes), direction="bottom-up",
                                seed=settings.seed)
            km_net = km.network()
            rows.append(MethodResult("k-means", _accuracy(km_net, x_test, y_test), km.hidden_sizes,
                                     count_parameters(km_net), 1, seconds=km.seconds))

        # communication rounds: each client gets its slice of the global net back, retrains, the server re-matches
        if settings.rounds > 1 and "pfnm-rounds" in methods:
            current, result = local, best
            hist = [dict(round=1, accuracy=pfnm_acc, hidden=best.hidden_sizes, seconds=best.seconds)]
            for r in range(2, settings.rounds + 1):
                starts = [network_from_layers(result.client_slice(j)) for j in range(settings.clients)]
                current = _train_clients(starts, client_data, settings, local_schedule(settings, r),
                                         progress=bar.update)
                result = match(current, *hyper)
                acc = _accuracy(result.network(), x_test, y_test)
                hist.append(dict(round=r, accuracy=acc, hidden=result.hidden_sizes, seconds=result.seconds))
                if log:
                    log(f"pfnm round {r}: accuracy {acc:.4f}, hidden {result.hidden_sizes}, {result.seconds:.2f} s")
            history["pfnm"] = hist
            global_layers["pfnm-rounds"] = result.layers
            net = result.network()
            rows.append(MethodResult(f"pfnm ({settings.rounds} rounds)", hist[-1]["accuracy"], result.hidden_sizes,
                                     count_parameters(net), settings.rounds,
                                     seconds=float(np.mean([h["seconds"] for h in hist]))))
    bar.close()
    return PFNMRun(settings=settings, rows=rows, local_accuracies=local_acc, history=history, selection=selection,
                   curve=curve, local_models=local, class_counts=counts, global_layers=global_layers)


def width_sweep(dataset: Dataset, settings: PFNMSettings, *, sigma2: Sequence[float], gamma0: Sequence[float],
                constants: Sequence[str] = ("bnpfed", "reference"), progress: bool = True) -> list[dict]:
    """Accuracy against global width: train the local models once (:func:`run_pfnm_experiment`), then match them
    with every (sigma2, gamma0) under each set of constants (``settings.sigma0_2`` fixed; the reference constants
    with the reference's top-down order).

    :returns: one dict per point: constants, sigma2, gamma0, hidden, width (sum of hidden sizes), accuracy, seconds.
    """
    ds = dataset.flat()
    run = run_pfnm_experiment(ds, replace(settings, methods=("local",), select="none", rounds=1), progress=progress)
    points = []
    grid = list(itertools.product(constants, sigma2, gamma0))
    for name, s2, g in tqdm(grid, desc="matching", disable=not progress, leave=False):
        kw = replace(settings, constants=name).matcher_kwargs()
        if name == "reference":
            kw["direction"] = "top-down"
        r = match_networks(run.local_models, run.class_counts, sigma2=s2, sigma0_2=settings.sigma0_2, gamma0=g,
                           **kw)
        points.append(dict(constants=name, sigma2=s2, gamma0=g, hidden=r.hidden_sizes, width=sum(r.hidden_sizes),
                           accuracy=_accuracy(r.network(), ds.x_test, ds.y_test), seconds=r.seconds))
    return points

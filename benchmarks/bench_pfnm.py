"""PFNM on real MNIST against the published reference code's figures (Yurochkin et al. 2019, section 4).

Needs MNIST in torchvision's layout (``--data-dir``, default ``../shared/data/mnist``); skips otherwise.
Pixels stay in [0, 1] and local training uses the reference's settings (784-100-10, Adam with AMSGrad, batch 32,
10 epochs, lr 0.01, L2 1e-6, weights N(0, 0.1^2), biases 0.1), sigma2 = sigma0_2 = gamma0 = 1, 5 sweeps.

Parts (each writes JSON lines to ``--out`` and can be resumed: finished configurations are skipped):

* ``reference``: J in {10, 25} x {homogeneous, Dirichlet(0.5)} x seeds 0-4: local models, ensemble, FedAvg
  (one round, no shared init), k-means, and PFNM with bnpfed's constants (bottom-up) and with the reference
  constants (top-down), the same local models for both, with global width and matching seconds;
* ``width``: accuracy against global width (J = 10, homogeneous, seed 0), sweeping sigma2 and gamma0 under both
  sets of constants;
* ``rounds``: PFNM with communication against multi-round FedAvg and the ensemble (J = 25, 10 rounds);
* ``eb``: empirical-Bayes matching (bnpfed's default: every hyper-parameter estimated per layer from the clients'
  weights) for J in {10, 25} x {IID, Dirichlet(0.5)} x seeds 0-4, beside the local models and the ensemble, with the
  estimates per layer, the sweeps they took and the matching seconds; on the same local models also fixed
  sigma2 = sigma0_2 = gamma0 = 1 (for the time ratio);
* ``frontier``: issue 53's target (a), seed by seed for J in {10, 25} x {IID, Dirichlet(0.5)}: the local models, the
  ensemble and the default one-shot PFNM, then on the same local models accuracy against width at factors of the
  estimated noise variance, averaged and (under label skew) pooled output layers, each point with its bootstrap
  intervals and its paired difference from the ensemble;
* ``frontier-fedavg``: target (a)'s FedAvg row, one round from a shared initialisation on the frontier's settings;
* ``plane``: the accuracy-width plane (J = 10, IID, seed 0): fixed-hyper-parameter sweeps of sigma2 under both
  objectives (MAP and marginal), to put the empirical-Bayes points beside;
* ``start``: PFNM's communication rounds warm-started from the previous assignment (the published code's way, the
  default) against re-matching from scratch every round, on the same local models (J = 25, 10 rounds);
* ``cnn``: LeNet (``--dataset mnist`` or ``fashion-mnist``): local models, ensemble, one-shot FedAvg, one-shot
  PFNM (empirical Bayes), FedMA layer-wise, and ``--rounds`` rounds of PFNM with communication against FedAvg;
* ``cifar``: CIFAR-10 (``--dataset cifar10``) with FedMA's simple-cnn (``--arch simple-cnn-bn``: with batch norms),
  J = 10, Dirichlet(0.5) and IID: every method of the convolutional benchmark, one JSON line per method as it ends;
* ``compress``: one-shot PFNM with bnpfed's defaults (dead units left out, empirical Bayes from both starts)
  against the behaviour before on the same local models (``--arch``, ``--dataset``, ``--partitions``), with
  parameters (dense, and the nonzero ones of the global network);
* ``operating``: one-shot PFNM at the operating point chosen on the clients' held-out splits
  (``select="operating-point"``, ``--arch``), with every candidate of the choice;
* ``shrink``: PFNM with communication (``--rounds``, ``--arch``, ``--partitions``) held to the ensemble's size from
  round 2 on (``max_params="ensemble", limit_from_round=2``) against the model's own size in every round (the
  default), on the same local models, with the global parameters of every round;
* ``pooled``: one-shot PFNM and the same match with the clients' own output layers pooled log-linearly with
  class-share weights (``pfnm-pooled``), beside the local models and the ensemble (``--arch``, ``--dataset``,
  ``--partitions``);
* ``targets-b``: issue 53's restated target (b), one set of local models per setting: the ensemble; one shot,
  bnpfed's default PFNM, PFNM at fractions of the ensemble's size, weight matching and OT fusion; FedMA at half the
  ensemble's parameters (one round) and ``--rounds`` rounds of PFNM held to the ensemble's size from round 2, every
  output layer ``heads="auto"``; dense and nonzero parameters, intervals and paired differences from the ensemble;
* ``cnn-timing``: LeNet's groups matched for J = 25 (IID, seed 0): seconds per group, best of 3, empirical Bayes
  and fixed hyper-parameters;
* ``deep``: 784-100-100-10, top-down against bottom-up under both sets of constants (J = 10, homogeneous, seed 0);
* ``timing``: matching seconds per round at J = 25 (homogeneous and Dirichlet, seed 0) with the process's default
  BLAS threads, best of 3, under both sets of constants (run it on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from bnpfed.data import load_dataset
from bnpfed.federated.config import PFNM_NETWORK, PFNM_TRAINING, PartitionConfig, PFNMConfig, TrainingConfig
from bnpfed.federated.fusion import FedAvgFederation
from bnpfed.federated.methods import ExperimentConfig, Experiment, run_experiment, run_method, width_sweep
from bnpfed.federated.pfnm import PFNMFederation
from bnpfed.federated.server import match_hyperparameters, pfnm_step
from bnpfed.clients.augment import AUGMENTATIONS
from bnpfed.matching import pooled_network
from bnpfed.metrics import count_parameters
from bnpfed.experimental import ExperimentalOptions

HERE = Path(__file__).parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "mnist"
#: The reference's matching: sigma2 = sigma0_2 = gamma0 = 1, 5 sweeps (PFNMConfig's defaults).
PFNM = PFNMConfig()


def _done(out: Path) -> set:
    if not out.exists():
        return set()
    return {json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()}


def _emit(out: Path, key: str, payload: dict) -> None:
    with out.open("a") as f:
        f.write(json.dumps({"key": key, **payload}) + "\n")
    print(key, json.dumps(payload)[:300], flush=True)


def _configs(J: int, partition: str, seed: int, **extra) -> dict:
    config = ExperimentConfig(seed=seed, **extra)
    return dict(partition=PartitionConfig(clients=J, partition=partition), network=PFNM_NETWORK,
                training=PFNM_TRAINING, pfnm=PFNM, config=config)


def _training(name: str) -> TrainingConfig:
    """The local training of a data set's clients: the cifar part's schedule (:data:`CIFAR_TRAINING`) on CIFAR-10,
    PFNM's reference training otherwise; every part that trains CIFAR-10 clients shares their local models."""
    return CIFAR_TRAINING if name == "cifar10" else PFNM_TRAINING


def _row(r) -> dict:
    return dict(accuracy=r.accuracy, hidden=r.hidden, seconds=r.server_seconds)


def part_reference(ds, out: Path, seeds, Js) -> None:
    done = _done(out)
    for J in Js:
        for partition in ("iid", "dirichlet"):
            for seed in seeds:
                key = f"reference/J={J}/{partition}/seed={seed}"
                if key in done:
                    continue
                t0 = time.perf_counter()
                experiment = Experiment(ds, **_configs(J, partition, seed))
                result = run_experiment(ds, **_configs(J, partition, seed, methods=(
                    "local", "ensemble", "fedavg-oneshot", "kmeans", "pfnm")))
                ref = pfnm_step(result.local_models, result.class_counts,
                                replace(PFNM, constants="reference", direction="top-down"), seed=seed, round=1)
                rows = {r.method: _row(r) for r in result.rows}
                rows["pfnm (reference constants)"] = dict(
                    accuracy=experiment.evaluate_network(ref.network())["accuracy"], hidden=ref.hidden_sizes,
                    seconds=ref.seconds)
                _emit(out, key, dict(J=J, partition=partition, seed=seed, rows=rows,
                                     wall_seconds=time.perf_counter() - t0))


def part_width(ds, out: Path) -> None:
    key = "width/J=10/iid/seed=0"
    if key in _done(out):
        return
    points = width_sweep(ds, sigma2=(0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6, 2.0, 3.0), gamma0=(1e-3, 1.0),
                         **_configs(10, "iid", 0))
    _emit(out, key, dict(points=points))


def part_rounds(ds, out: Path, J: int = 25, rounds: int = 10) -> None:
    for partition in ("iid", "dirichlet"):
        key = f"rounds/J={J}/{partition}/seed=0"
        if key in _done(out):
            continue
        result = run_experiment(ds, **_configs(J, partition, 0, rounds=rounds, methods=(
            "local", "ensemble", "pfnm", "pfnm-rounds", "fedavg")))
        rows = {r.method: _row(r) for r in result.rows}
        history = {"pfnm": result.row("pfnm-rounds").history, "fedavg": result.row("fedavg").history}
        _emit(out, key, dict(rows=rows, history=history))


def part_start(ds, out: Path, J: int = 25, rounds: int = 10) -> None:
    """Warm-started against cold re-matching, the same local models and schedule for both."""
    for partition in ("iid", "dirichlet"):
        key = f"start/J={J}/{partition}/seed=0"
        if key in _done(out):
            continue
        experiment = Experiment(ds, **_configs(J, partition, 0))
        local = experiment.local_models()
        ensemble = run_experiment(ds, **_configs(J, partition, 0, methods=("ensemble",))).row("ensemble")
        history, wall = {}, {}
        for name, warm in (("warm", True), ("cold", False)):
            t0 = time.perf_counter()
            federation = PFNMFederation(ds, experiment.parts, network=PFNM_NETWORK, training=PFNM_TRAINING,
                                        pfnm=replace(PFNM, warm_start=warm), seed=0, initial_models=local)
            history[name] = [r.metrics for r in federation.run(rounds)]
            wall[name] = time.perf_counter() - t0
        _emit(out, key, dict(rows={"ensemble": _row(ensemble)}, history=history, wall_seconds=wall))


def part_deep(ds, out: Path) -> None:
    key = "deep/J=10/iid/seed=0"
    if key in _done(out):
        return
    configs = _configs(10, "iid", 0, methods=("local", "ensemble"))
    configs["network"] = replace(PFNM_NETWORK, hidden=(100, 100))
    result = run_experiment(ds, **configs)
    experiment = Experiment(ds, **configs)
    rows = {r.method: _row(r) for r in result.rows}
    for constants in ("bnpfed", "reference"):
        for direction in ("top-down", "bottom-up"):
            r = pfnm_step(result.local_models, result.class_counts,
                          replace(PFNM, constants=constants, direction=direction), seed=0, round=1)
            rows[f"pfnm {constants} {direction}"] = dict(
                accuracy=experiment.evaluate_network(r.network())["accuracy"], hidden=r.hidden_sizes,
                seconds=r.seconds)
    _emit(out, key, dict(rows=rows))


def part_timing(ds, out: Path) -> None:
    for partition in ("iid", "dirichlet"):
        key = f"timing/J=25/{partition}/seed=0"
        if key in _done(out):
            continue
        experiment = Experiment(ds, **_configs(25, partition, 0))
        local = experiment.local_models()
        rows = {}
        for constants in ("bnpfed", "reference"):
            config = replace(PFNM, constants=constants,
                             direction="top-down" if constants == "reference" else "bottom-up")
            results = [pfnm_step(local, experiment.class_counts, config, seed=0, round=1) for _ in range(3)]
            best = min(results, key=lambda r: r.seconds)
            rows[constants] = dict(seconds=best.seconds, hidden=best.hidden_sizes,
                                   lsa_seconds=best.layer_results[0].lsa_seconds,
                                   rematches=len(best.layer_results[0].rematches))
        _emit(out, key, dict(rows=rows))


def _accuracy(net, ds) -> float:
    with torch.no_grad():
        return float((net.eval()(ds.x_test).argmax(-1) == ds.y_test).double().mean())


def _nonzero(net) -> int:
    """The parameters of ``net`` that are not exactly 0 (a matched global unit is 0 on every column of the units
    below that none of its members' clients holds: its size if stored sparse)."""
    return sum(int((p != 0).sum()) for p in net.parameters())


def _layers(match) -> list[dict]:
    """Per hidden layer: the final hyper-parameters (mu0 summarised by its mean), sweeps, convergence."""
    out = []
    for h in match_hyperparameters(match):
        mu0 = h.pop("mu0")
        out.append(dict(h, mu0_mean=float(np.mean(mu0)) if mu0 else float("nan")))
    return out


def part_eb(ds, out: Path, seeds, Js) -> None:
    done = _done(out)
    for J in Js:
        for partition in ("iid", "dirichlet"):
            for seed in seeds:
                key = f"eb/J={J}/{partition}/seed={seed}"
                if key in done:
                    continue
                configs = _configs(J, partition, seed, methods=("local", "ensemble", "pfnm"))
                configs["pfnm"] = PFNMConfig()   # empirical Bayes: nothing set by hand
                result = run_experiment(ds, **configs)
                rows = {r.method: _row(r) for r in result.rows}
                eb = result.selection.match
                rows["pfnm"]["layers"] = _layers(eb)
                fixed = PFNMConfig(hyperparameters="fixed", sigma2=1.0, sigma0_2=1.0, gamma0=1.0)
                match = pfnm_step(result.local_models, result.class_counts, fixed, seed=seed, round=1)
                rows["pfnm fixed 1-1-1"] = dict(accuracy=_accuracy(match.network(), ds), hidden=match.hidden_sizes,
                                                seconds=match.seconds, layers=_layers(match))
                _emit(out, key, dict(J=J, partition=partition, seed=seed, rows=rows))


def part_plane(ds, out: Path) -> None:
    key = "plane/J=10/iid/seed=0"
    if key in _done(out):
        return
    result = run_experiment(ds, **_configs(10, "iid", 0, methods=("local",)))
    points = []
    for objective in ("map", "marginal"):
        for sigma2 in (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.3, 1.6, 2.0, 3.0):
            for gamma0 in (1e-3, 1.0):
                config = PFNMConfig(hyperparameters="fixed", objective=objective, sigma2=sigma2, sigma0_2=1.0,
                                    gamma0=gamma0)
                match = pfnm_step(result.local_models, result.class_counts, config, seed=0, round=1)
                points.append(dict(objective=objective, sigma2=sigma2, gamma0=gamma0, hidden=match.hidden_sizes,
                                   width=sum(match.hidden_sizes), accuracy=_accuracy(match.network(), ds)))
    _emit(out, key, dict(points=points))


def part_cnn(ds, out: Path, seeds, Js, *, name: str = "mnist", rounds: int = 3, layerwise: int = 2,
             partitions=("iid", "dirichlet"), arch: str = "lenet") -> None:
    """Convolutional PFNM (issues 10, 18): ``arch`` (LeNet; on CIFAR-10 also FedMA's simple-cnn and simple-cnn-bn) on
    MNIST / Fashion-MNIST / CIFAR-10, J = 10, IID and Dirichlet(0.5): local models,
    ensemble, one-shot FedAvg without shared init, one-shot PFNM (empirical Bayes), FedMA layer-wise
    (``layerwise`` epochs of retraining per matched layer), and ``rounds`` rounds of PFNM with communication against
    multi-round FedAvg (the reference schedule: 5 local epochs per later round)."""
    done = _done(out)
    for J in Js:
        for partition in partitions:
            for seed in seeds:
                key = f"cnn/{name}/J={J}/{partition}/seed={seed}" + (f"/rounds={rounds}" if rounds != 3 else "") + (
                    f"/{arch}" if arch != "lenet" else "")
                if key in done:
                    continue
                t0 = time.perf_counter()
                configs = _configs(J, partition, seed, rounds=rounds, methods=(
                    "local", "ensemble", "fedavg-oneshot", "pfnm", "fedma", "pfnm-rounds", "fedavg"))
                configs["network"] = replace(PFNM_NETWORK, arch=arch)
                configs["pfnm"] = PFNMConfig(layerwise_retrain=layerwise)
                result = run_experiment(ds, **configs)
                rows = {r.method: dict(_row(r), parameters=r.parameters, history=[
                    dict(round=h["round"], accuracy=h["accuracy"], hidden=h.get("hidden"),
                         parameters=h.get("parameters"), server_seconds=h.get("server_seconds"))
                    for h in r.history]) for r in result.rows}
                _emit(out, key, dict(J=J, partition=partition, seed=seed, dataset=name, arch=arch, source=ds.source,
                                     rounds=rounds, rows=rows,
                                     wall_seconds=time.perf_counter() - t0))


def _pending(done, base: str, methods) -> list[str]:
    """The methods whose line under ``base`` is not in ``done`` yet (``local``'s first line is ``local-mean``)."""
    return [m for m in methods if f"{base}/{'local-mean' if m == 'local' else m}" not in done]


def _run_pending(ds, out: Path, base: str, todo, configs: dict, line) -> None:
    """Every method of ``todo`` on one :class:`Experiment` of ``configs`` (so they share its local models), a JSON
    line ``base/<row>`` per row as it ends: ``line(row, seconds since the method started)``."""
    experiment = Experiment(ds, **configs)
    for method in todo:
        t0 = time.perf_counter()
        for r in run_method(experiment, method):
            _emit(out, f"{base}/{r.method}", line(r, time.perf_counter() - t0))
    experiment.close()


#: PFNM's reference schedule at Adam's usual rate: at 0.01 simple-cnn learns CIFAR-10 far worse (3 epochs on 5,000
#: images: 0.29 test accuracy against 0.43 at 0.001)
CIFAR_TRAINING = replace(PFNM_TRAINING, lr=1e-3)
CIFAR_METHODS = ("local", "ensemble", "pfnm", "fedavg-oneshot", "fedma", "pfnm-rounds", "fedavg")


def part_cifar(ds, out: Path, seeds, Js, *, rounds: int = 10, layerwise: int = 2, partitions=("dirichlet", "iid"),
               arch: str = "simple-cnn") -> None:
    """Issue 18's CIFAR-10 rows: ``arch`` (FedMA's simple-cnn or simple-cnn-bn), J = 10, Dirichlet(0.5) and IID:
    local models (:data:`CIFAR_TRAINING`), ensemble, one-shot PFNM (empirical Bayes), one-shot FedAvg, FedMA
    layer-wise (``layerwise``
    epochs of retraining per matched layer), then ``rounds`` rounds of PFNM with communication and of FedAvg (the
    reference schedule: 10 local epochs in round 1, 5 in later ones). One JSON line per method as it ends
    (resumable: finished methods are skipped; the local models are retrained, deterministically, by a resumed run)."""
    done = _done(out)
    for J in Js:
        for partition in partitions:
            for seed in seeds:
                base = f"cifar/{arch}/J={J}/{partition}/seed={seed}/rounds={rounds}"
                todo = _pending(done, base, CIFAR_METHODS)
                if not todo:
                    continue
                configs = _configs(J, partition, seed, rounds=rounds, methods=tuple(todo))
                configs["network"] = replace(PFNM_NETWORK, arch=arch)
                configs["training"] = CIFAR_TRAINING
                configs["pfnm"] = PFNMConfig(layerwise_retrain=layerwise)
                _run_pending(ds, out, base, todo, configs, lambda r, seconds: dict(
                    J=J, partition=partition, seed=seed, arch=arch, source=ds.source, rounds=rounds,
                    method=r.method, accuracy=r.accuracy, hidden=r.hidden, parameters=r.parameters,
                    seconds=r.server_seconds, wall_seconds=seconds, history=[
                        dict(round=h["round"], accuracy=h["accuracy"], hidden=h.get("hidden"),
                             parameters=h.get("parameters")) for h in r.history]))


#: NIID-Bench's FedAvg schedule (Li et al., ICDE 2022: 10 parties, 50 rounds of 10 local epochs, batch 64, weight
#: decay 1e-5): with its optimiser (``"sgd"``: SGD at 0.01, momentum 0.9) or with this project's CIFAR-10 optimiser
#: (``"adam"``: Adam at 1e-3, AMSGrad).
NIID_TRAINING = {"adam": TrainingConfig(epochs=10, batch_size=64, lr=1e-3, weight_decay=1e-5, amsgrad=True),
                 "sgd": TrainingConfig(epochs=10, batch_size=64, lr=0.01, weight_decay=1e-5, optimizer="sgd",
                                       momentum=0.9)}
NIID_CACHE = Path.home() / ".cache" / "bnpfed-bench"


def part_niid(ds, out: Path, seeds, *, rounds: int = 50, arch: str = "simple-cnn", optimizer: str = "sgd",
              augment: str = "none") -> None:
    """The CIFAR-10 issue's anchor: FedAvg on NIID-Bench's schedule (:data:`NIID_TRAINING` of ``optimizer``),
    simple-cnn, J = 10, Dirichlet(0.5), from a shared initialisation; ``augment="crop-flip"`` trains with
    NIID-Bench's random crops and flips (``TrainingConfig.augment``). One JSON line per round as it ends (key
    ``.../round=t``), the global network checkpointed beside the cached local models after every round, so that a
    stopped run resumes at the next round with the numbers it would have had (every round's training draws from
    ``(seed, FIT, round, client)`` and starts a fresh optimiser)."""
    training = replace(NIID_TRAINING[optimizer], augment=augment)
    tag = ("" if optimizer == "adam" else "/" + optimizer) + ("" if augment == "none" else "/" + augment)
    for seed in seeds:
        base = f"niid/{arch}{tag}/J=10/dirichlet/seed={seed}"
        finished = [int(k.rsplit("=", 1)[1]) for k in _done(out) if k.startswith(base + "/round=")]
        start = max(finished, default=0)
        if start >= rounds:
            continue
        parts = PartitionConfig(clients=10, partition="dirichlet").split(ds.y_train.numpy(), seed=seed)
        fed = FedAvgFederation(ds, parts, network=replace(PFNM_NETWORK, arch=arch), training=training,
                               seed=seed, ece_bins=100)
        checkpoint = NIID_CACHE / f"niid_{arch}{tag.replace('/', '_')}_seed{seed}.pt"
        if start:
            saved = torch.load(checkpoint)
            if saved["round"] != start:
                raise SystemExit(f"{checkpoint}: holds round {saved['round']}, the results end at round {start}")
            fed.global_model.load_state(saved["state"])
            fed.global_state, fed.round = fed.global_model.state(), start
        NIID_CACHE.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()

        def after(record):
            torch.save({"round": record.round, "state": fed.global_model.state()}, checkpoint)
            _emit(out, f"{base}/round={record.round}", dict(
                method="fedavg", arch=arch, seed=seed, source=ds.source, round=record.round, optimizer=optimizer,
                augment=augment,
                momentum=training.momentum, local_epochs=training.epochs, batch_size=training.batch_size,
                lr=training.lr,
                accuracy=record.metrics["accuracy"], nll=record.metrics["nll"], ece=record.metrics["ece"],
                parameters=count_parameters(fed.global_model.net), round_seconds=record.metrics["seconds"],
                wall_seconds=time.perf_counter() - t0))

        fed.run(rounds - start, callback=after)


#: NIID-Bench's published FedAvg accuracy on this setting, and Flower's reproduction of it.
NIID_PUBLISHED = {"NIID-Bench (68.2 %)": 0.682, "Flower's reproduction (63.4 %)": 0.634}


def plot_niid(paths, png: Path) -> None:
    """Accuracy and test NLL per round of every ``niid`` run in the JSON-lines files ``paths`` (one curve per
    optimiser and transform), beside the published accuracies."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs: dict = {}
    for path in paths:
        for line in map(json.loads, filter(str.strip, Path(path).read_text().splitlines())):
            if line["key"].startswith("niid/"):
                label = (f"{line['arch']}, {line.get('optimizer', 'adam')}, "
                         f"{'no augmentation' if line.get('augment', 'none') == 'none' else line['augment']}, "
                         f"seed {line['seed']}")
                runs.setdefault(label, {})[line["round"]] = line
    if not runs:
        raise SystemExit(f"{', '.join(map(str, paths))}: no niid lines")
    fig, (acc, nll) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, rounds in runs.items():
        order = sorted(rounds)
        acc.plot(order, [rounds[r]["accuracy"] for r in order], label=label)
        nll.plot(order, [rounds[r]["nll"] for r in order], label=label)
    for (name, value), style in zip(NIID_PUBLISHED.items(), ("--", ":")):
        acc.axhline(value, c="k", ls=style, lw=0.9, label=name)
    acc.set(xlabel="round", ylabel="test accuracy", ylim=(0, 0.75))
    nll.set(xlabel="round", ylabel="test NLL")
    acc.legend(fontsize=7, loc="lower right")
    fig.suptitle("FedAvg on NIID-Bench's CIFAR-10 schedule: 10 clients, Dirichlet(0.5), 10 local epochs a round",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


BASELINE_METHODS = ("local", "ensemble", "pfnm", "weight-matching", "ot-fusion", "ot-fusion-sinkhorn")


def part_baselines(ds, out: Path, seeds, Js, *, name: str = "mnist", partitions=("iid", "dirichlet"),
                   arch: str = "lenet") -> None:
    """Issue 20's conv rows: the alignment baselines (weight matching, Git Re-Basin; OT fusion, exact and Sinkhorn,
    Singh & Jaggi) beside one-shot PFNM, the local models and their ensemble, on the local models of the cnn part's
    settings (the reference training, pixels in [0, 1]). One JSON line per method (resumable; a resumed run retrains
    the local models, deterministically)."""
    done = _done(out)
    for J in Js:
        for partition in partitions:
            for seed in seeds:
                base = f"baselines/{name}/{arch}/J={J}/{partition}/seed={seed}"
                todo = _pending(done, base, BASELINE_METHODS)
                if not todo:
                    continue
                configs = _configs(J, partition, seed, methods=tuple(todo))
                configs["network"] = replace(PFNM_NETWORK, arch=arch)
                _run_pending(ds, out, base, todo, configs, lambda r, seconds: dict(
                    J=J, partition=partition, seed=seed, dataset=name, arch=arch, source=ds.source,
                    method=r.method, accuracy=r.accuracy, nll=r.nll, ece=r.ece, hidden=r.hidden,
                    parameters=r.parameters, seconds=r.server_seconds, wall_seconds=seconds))


def part_cnn_timing(ds, out: Path, name: str = "mnist") -> None:
    """Issue 10's speed target: LeNet's groups matched for J = 25 (IID, seed 0), best of 3, empirical Bayes and fixed
    sigma2 = sigma0_2 = gamma0 = 1, seconds per group (the widest is fc1: 120 units per client)."""
    key = f"cnn-timing/{name}/J=25/iid/seed=0"
    if key in _done(out):
        return
    configs = _configs(25, "iid", 0)
    configs["network"] = replace(PFNM_NETWORK, arch="lenet")
    experiment = Experiment(ds, **configs)
    local = experiment.local_models()
    rows = {}
    for label, config in (("empirical-bayes", PFNMConfig()),
                          ("fixed", PFNMConfig(hyperparameters="fixed", sigma2=1.0, sigma0_2=1.0, gamma0=1.0))):
        results = [pfnm_step(local, experiment.class_counts, config, seed=0, round=1,
                             input_shape=experiment.input_shape) for _ in range(3)]
        groups = {g: min(r.layer_results[g].seconds for r in results) for g in results[0].layer_results}
        best = min(results, key=lambda r: r.seconds)
        rows[label] = dict(seconds=best.seconds, group_seconds=groups, hidden=best.hidden_sizes,
                           sweeps={g: getattr(r, "sweeps_run", None) for g, r in best.layer_results.items()})
    _emit(out, key, dict(rows=rows, threads=torch.get_num_threads()))


def _settings(out: Path, prefix: str, Js, partitions, seeds):
    """``(key, J, partition, seed)`` of every setting whose key (``prefix/J=../partition/seed=..``) is not yet in
    ``out``."""
    done = _done(out)
    for J in Js:
        for partition in partitions:
            for seed in seeds:
                key = f"{prefix}/J={J}/{partition}/seed={seed}"
                if key not in done:
                    yield key, J, partition, seed


def part_compress(ds, out: Path, seeds, Js, *, name: str = "mnist", partitions=("iid", "dirichlet"),
                  arch: str = "lenet") -> None:
    """Compression by default (issue 16): one-shot PFNM with bnpfed's defaults (dead units left out, empirical Bayes
    from both starts) against the behaviour before (``starts="small-noise", inactive="keep"``) on the same local
    models, beside the local models and the ensemble, with parameters and widths."""
    for key, J, partition, seed in _settings(out, f"compress/{name}/{arch}", Js, partitions, seeds):
        configs = _configs(J, partition, seed, methods=("local", "ensemble", "pfnm"))
        configs["network"] = replace(PFNM_NETWORK, arch=arch)
        configs["pfnm"] = PFNMConfig()
        result = run_experiment(ds, **configs)
        rows = {r.method: dict(_row(r), parameters=r.parameters) for r in result.rows}
        rows["pfnm"]["layers"] = _layers(result.selection.match)
        rows["pfnm"]["nonzero"] = _nonzero(result.selection.match.network())
        before = pfnm_step(result.local_models, result.class_counts,
                           PFNMConfig(experimental=ExperimentalOptions(starts="small-noise", inactive="keep")),
                           seed=seed, round=1,
                           input_shape=ds.input_shape)
        net = before.network()
        rows["pfnm (before)"] = dict(accuracy=_accuracy(net, ds), hidden=before.hidden_sizes,
                                     seconds=before.seconds, parameters=count_parameters(net))
        _emit(out, key, dict(dataset=name, arch=arch, J=J, partition=partition, seed=seed, rows=rows))


def part_pooled(ds, out: Path, seeds, Js, *, name: str = "mnist", partitions=("iid", "dirichlet"),
                arch: str = "lenet", pool_temperature=1.0) -> None:
    """PFNM's output rule under label skew: one-shot PFNM (bnpfed's defaults) and the same match with the clients'
    own output layers pooled log-linearly (``pfnm-pooled``, :mod:`bnpfed.matching.pooled_heads`; at
    ``pool_temperature``, keys ``.../T=fit`` when not 1), beside the local models and the ensemble, on the same local
    models."""
    tag = "" if pool_temperature == 1 else f"/T={pool_temperature}"
    for key, J, partition, seed in _settings(out, f"pooled/{name}/{arch}{tag}", Js, partitions, seeds):
        configs = _configs(J, partition, seed, methods=("local", "ensemble", "pfnm", "pfnm:heads=pooled"))
        configs["network"] = replace(PFNM_NETWORK, arch=arch)
        configs["pfnm"] = PFNMConfig(pool_temperature=pool_temperature)
        configs["training"] = _training(name)
        result = run_experiment(ds, **configs)
        rows = {r.method: dict(_row(r), parameters=r.parameters, nll=r.nll, ece=r.ece, note=r.note)
                for r in result.rows}
        _emit(out, key, dict(dataset=name, arch=arch, J=J, partition=partition, seed=seed, rows=rows,
                             pool_temperature=pool_temperature))


def part_shrink(ds, out: Path, seeds, Js, *, name: str = "mnist", partitions=("iid", "dirichlet"),
                arch: str = "lenet", rounds: int = 6, heads: str = "fused", rows: str = "both") -> None:
    """More rounds shrink the global network (PFNM's promise): ``rounds`` rounds of PFNM held to the ensemble's size
    from round 2 on (``max_params="ensemble", limit_from_round=2``: round 1 one-shot at the model's own size, the
    later rounds' budget met as far as the matcher can) and at the model's own size in every round (bnpfed's default),
    both from the same local models, beside the ensemble. ``heads="pooled"``: both federations' global networks
    carry the clients' own output layers pooled (``PFNMConfig.heads``; the budget prices them). CIFAR-10 clients
    train with the cifar part's schedule (:data:`CIFAR_TRAINING`). ``rows="limited"``
    runs the limited federation alone (half the time: for more rounds of a setting whose own-size rows exist)."""
    if rows not in ("both", "limited"):
        raise ValueError(f"rows: expected 'both' or 'limited', got {rows!r}")
    tag = ("" if heads == "fused" else f"/heads={heads}") + ("" if rows == "both" else "/limited")
    for key, J, partition, seed in _settings(out, f"shrink/{name}/{arch}/rounds={rounds}{tag}", Js, partitions,
                                             seeds):
        configs = _configs(J, partition, seed, rounds=rounds, methods=("ensemble",))
        configs["network"] = replace(PFNM_NETWORK, arch=arch)
        configs["training"] = _training(name)
        configs["pfnm"] = PFNMConfig(max_params=None)
        experiment = Experiment(ds, **configs)
        try:
            ensemble = run_method(experiment, "ensemble")[0]
            rows = {"ensemble": dict(_row(ensemble), parameters=ensemble.parameters)}
            pooled = {} if heads == "fused" else dict(heads=heads)
            for label, config in (("ensemble from round 2", PFNMConfig(max_params="ensemble", limit_from_round=2,
                                                                       **pooled)),
                                  ("own size", PFNMConfig(max_params=None, **pooled)))[:2 if rows == "both" else 1]:
                t0 = time.perf_counter()
                federation = PFNMFederation(ds, experiment.parts, network=experiment.network,
                                            training=experiment.training, pfnm=config, seed=seed,
                                            initial_models=experiment.local_models())
                r = experiment.federation_row(federation, rounds)
                search = federation.match.size_searches.get("parameters")
                rows[f"pfnm-rounds ({label})"] = dict(
                    _row(r), parameters=r.parameters, seconds=time.perf_counter() - t0,
                    history=[dict(round=h["round"], accuracy=h["accuracy"], hidden=h.get("hidden"),
                                  parameters=h.get("parameters"), server_seconds=h.get("server_seconds"))
                             for h in r.history],
                    budget=None if search is None else dict(limit=search.limit, met=search.met))
        finally:
            experiment.close()
        _emit(out, key, dict(dataset=name, arch=arch, J=J, partition=partition, seed=seed, rounds=rounds, heads=heads,
                             rows=rows))
    plot_shrink(out, out.with_suffix(".png"))


def plot_shrink(out: Path, png: Path) -> None:
    """The accuracy-parameters plane of the ``shrink`` lines in ``out``: every round of both federations (the limited
    one's rounds numbered), one panel per setting, the ensemble as a star."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines = [line for line in map(json.loads, filter(str.strip, out.read_text().splitlines()))
             if line["key"].startswith("shrink/")]
    if not lines:
        return
    fig, axes = plt.subplots(1, len(lines), figsize=(max(4.2 * len(lines), 6.5), 3.8), squeeze=False)
    for ax, line in zip(axes[0], lines):
        ensemble = line["rows"]["ensemble"]
        for name, row in line["rows"].items():
            if name == "ensemble":
                continue
            limited = "own size" not in name
            xs = [h["parameters"] for h in row["history"]]
            ys = [h["accuracy"] for h in row["history"]]
            ax.plot(xs, ys, "o-" if limited else "s--", label="ensemble's size from round 2" if limited else
                    "own size every round", alpha=0.85)
            if limited:
                for h in row["history"]:
                    ax.annotate(str(h["round"]), (h["parameters"], h["accuracy"]), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
        ax.plot([ensemble["parameters"]], [ensemble["accuracy"]], "k*", ms=12, label="ensemble")
        ax.axvline(ensemble["parameters"], c="grey", lw=0.8, ls=":")
        ax.set(xscale="log", xlabel="global parameters", ylabel="test accuracy",
               title=f"{line['dataset']} {line['partition']} seed {line['seed']}"
                     + (", pooled heads" if line.get("heads") == "pooled" else ""))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        accuracies = [h["accuracy"] for r in line["rows"].values() for h in r.get("history", [])]
        accuracies.append(ensemble["accuracy"])
        ax.set_ylim(max(0.0, min(accuracies) - 0.02), min(1.0, max(accuracies) + 0.03))
    axes[0][0].legend(fontsize=7, loc="lower right")
    archs = ", ".join(sorted({line.get("arch", "lenet") for line in lines}))
    fig.suptitle(f"PFNM rounds, {archs}, J = 10 (numbers: the limited federation's rounds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


#: The size part's row sets: every row, or the FedMA target's (the local models, the ensemble, PFNM at its own size,
#: FedMA at the ensemble's size and at half of it), or FedMA at half of the ensemble's size alone beside them.
SIZE_ROWS = ("all", "fedma", "fedma-half")


def part_size(ds, out: Path, seeds, Js, *, name: str = "mnist", partitions=("iid", "dirichlet"),
              arch: str = "lenet", fedma_epochs: Optional[int] = None, row_set: str = "all",
              fedma_rounds: int = 1) -> None:
    """The accuracy-parameters plane (issue 16): one-shot PFNM with bnpfed's defaults and then with a size asked
    for (``max_width`` for an MLP, ``max_params`` for a CNN: fractions of the model's own size and the ensemble's),
    and for a CNN FedMA's layer-wise scheme (``fedma_epochs`` a group; None: the library's default,
    :func:`~bnpfed.federated.methods.fedma_epochs`, a later round's local epochs: 5 under the reference training)
    without a limit, at the ensemble's size and at half of it, all on the same local models, beside the local models
    and the ensemble; PFNM and every FedMA network also with the clients' own output layers pooled (``pfnm-pooled``,
    ``fedma-pooled``). ``row_set="fedma"`` leaves out PFNM's limits and FedMA without one, ``"fedma-half"``
    also FedMA at the ensemble's size (FedMA at half alone). ``fedma_rounds`` > 1: FedMA with communication (Wang et al.'s rounds: every round
    the clients start from their slices of the global network and the layer-wise scheme runs again, the size limit
    held in every round), each FedMA row with its ``history`` of rounds. CIFAR-10 clients train with the cifar
    part's schedule (:data:`CIFAR_TRAINING`)."""
    if row_set not in SIZE_ROWS:
        raise ValueError(f"row_set: expected one of {SIZE_ROWS}, got {row_set!r}")
    if int(fedma_rounds) != fedma_rounds or fedma_rounds < 1:
        raise ValueError(f"fedma_rounds: expected an integer >= 1, got {fedma_rounds!r}")
    training = _training(name)
    epochs = training.schedule(2).epochs if fedma_epochs is None else fedma_epochs
    tag = "" if epochs == 2 else f"/fedma-epochs={epochs}"   # the keys of the files written with 2 before
    tag += "" if fedma_rounds == 1 else f"/fedma-rounds={fedma_rounds}"
    tag += "" if row_set != "fedma-half" else "/half"
    for key, J, partition, seed in _settings(out, f"size/{name}/{arch}{tag}", Js, partitions, seeds):
        configs = _configs(J, partition, seed, methods=("local", "ensemble", "pfnm", "pfnm:heads=pooled"))
        configs["network"] = replace(PFNM_NETWORK, arch=arch)
        configs["training"] = training
        configs["pfnm"] = PFNMConfig()
        experiment = Experiment(ds, **configs)
        rows = {}
        for method in ("local", "ensemble", "pfnm", "pfnm:heads=pooled"):
            for r in run_method(experiment, method):
                rows[r.method] = dict(_row(r), parameters=r.parameters)
        nets, counts = experiment.local_models(), experiment.class_counts
        ensemble = rows["ensemble"]["parameters"]
        own_params, own_width = rows["pfnm"]["parameters"], rows["pfnm"]["hidden"]
        if row_set != "all":
            limits = []
        elif arch == "mlp":
            limits = [("max_width", int(f * own_width[0])) for f in (0.9, 0.8, 0.7)]
        else:
            limits = [("max_params", int(f * own_params)) for f in (0.8, 0.6, 0.4)]
            limits.append(("max_params", "ensemble"))
        for flag, limit in limits:
            t0 = time.perf_counter()
            try:
                match = pfnm_step(nets, counts, PFNMConfig(**{flag: limit}), seed=seed, round=1,
                                  input_shape=ds.input_shape, activity=experiment.activity())
            except ValueError as error:   # a limit below what any assignment allows
                rows[f"pfnm {flag}={limit}"] = dict(error=str(error))
                continue
            net = match.network()
            search = match.size_searches.get("parameters") or next(iter(match.size_searches.values()))
            rows[f"pfnm {flag}={limit}"] = dict(
                accuracy=_accuracy(net, ds), hidden=match.hidden_sizes, parameters=count_parameters(net),
                seconds=time.perf_counter() - t0, strength=search.strength, matches=len(search.trace),
                limit=ensemble if limit == "ensemble" else limit)
        if arch != "mlp":   # FedMA layer-wise, one round, from the same local models
            fedma_limits = {"all": (None, "ensemble", ensemble // 2), "fedma": ("ensemble", ensemble // 2),
                            "fedma-half": (ensemble // 2,)}[row_set]
            for limit in fedma_limits:
                t0 = time.perf_counter()
                fed = PFNMFederation(experiment.dataset, experiment.parts, network=experiment.network,
                                     training=experiment.training,
                                     pfnm=PFNMConfig(layerwise_retrain=epochs, max_params=limit), seed=seed,
                                     initial_models=nets)
                history = []
                for _ in range(fedma_rounds):
                    fed.run_round()
                    net = fed.match.network()
                    searches = fed.match.size_searches.values()   # FedMA's: one per group
                    history.append(dict(round=len(history) + 1, accuracy=_accuracy(net, ds),
                                        parameters=count_parameters(net), hidden=fed.match.hidden_sizes,
                                        met=all(s.met for s in searches) if searches else None,
                                        seconds=time.perf_counter() - t0))
                label = "" if limit is None else f" max_params={limit}"
                rows["fedma" + label] = dict(
                    accuracy=history[-1]["accuracy"], hidden=fed.match.hidden_sizes,
                    parameters=history[-1]["parameters"], seconds=time.perf_counter() - t0,
                    limit=None if limit is None else ensemble if limit == "ensemble" else limit,
                    **(dict(history=history) if fedma_rounds > 1 else {}))
                pooled = fed.pooled_network()   # the same body, the clients' own output layers pooled
                rows["fedma-pooled" + label] = dict(accuracy=_accuracy(pooled, ds), hidden=fed.match.hidden_sizes,
                                                    parameters=count_parameters(pooled))
        _emit(out, key, dict(dataset=name, arch=arch, J=J, partition=partition, seed=seed, fedma_epochs=epochs,
                             fedma_rounds=fedma_rounds, rows=rows))


def part_operating(ds, out: Path, seeds, Js, *, name: str = "mnist", partitions=("iid", "dirichlet"),
                   arch: str = "mlp") -> None:
    """The operating point chosen on the clients' held-out data (issue 16's targets): one-shot PFNM with
    ``select="operating-point"`` (each client holds 10 percent out and trains on the rest; empirical Bayes, then the
    estimated sigma2 scaled; the narrowest global network within one paired standard error of the best held-out
    accuracy), beside the local models, the ensemble and the empirical-Bayes candidate (factor 1) of the same local
    models, every candidate's width, parameters, held-out and test accuracy in ``curve``."""
    for key, J, partition, seed in _settings(out, f"operating/{name}/{arch}", Js, partitions, seeds):
        configs = _configs(J, partition, seed, methods=("local", "ensemble", "pfnm"), select="operating-point")
        configs["network"] = replace(PFNM_NETWORK, arch=arch)
        configs["pfnm"] = PFNMConfig()
        t0 = time.perf_counter()
        result = run_experiment(ds, **configs)
        rows = {r.method: dict(_row(r), parameters=r.parameters) for r in result.rows}
        curve = result.selection.curve
        estimate = next(c for c in curve if c["factor"] == 1.0)
        rows["pfnm (estimate)"] = dict(accuracy=estimate["test"], hidden=estimate["hidden"],
                                       parameters=estimate["parameters"])
        _emit(out, key, dict(dataset=name, arch=arch, J=J, partition=partition, seed=seed, rows=rows, curve=curve,
                             wall_seconds=time.perf_counter() - t0))


#: The frontier part's factors of the empirical-Bayes noise estimate (1: the default match itself), from the most
#: merging (narrowest) to the least.
FRONTIER_FACTORS = (2.0, 1.4, 1.0, 0.8, 0.65, 0.5, 0.4, 0.3)


def _scored(experiment, net, ensemble_probs) -> dict:
    """A global network's test metrics, their bootstrap intervals over the test examples, and its paired difference
    from the ensemble (``vs_ensemble``: accuracy and NLL, each with its paired 95 % interval)."""
    report = experiment.evaluate_network(net)
    paired = experiment.paired(report.probs, ensemble_probs)
    return dict(accuracy=report["accuracy"], nll=report["nll"], ece15=report["ece15"],
                parameters=count_parameters(net), intervals=experiment.intervals(report.probs),
                vs_ensemble={m: paired[m] for m in ("accuracy", "nll")})


def part_frontier(ds, out: Path, seeds, Js, *, partitions=("iid", "dirichlet")) -> None:
    """Issue 53's restated target (a): one-shot PFNM on MNIST 784-100-10 (the published code's local training),
    accuracy against global width, J in ``Js`` x ``partitions`` x ``seeds`` (seed by seed, so that a stopped run
    holds every setting's first seeds): the local models, the ensemble and bnpfed's default one-shot PFNM (empirical
    Bayes, dead units left out, ``heads="auto"``), then on the same local models the match with every group's sigma2
    at each factor of :data:`FRONTIER_FACTORS` times its estimate (the other hyper-parameters estimated), with the
    averaged output layer and, where the clients' class shares differ, the pooled one; every point with its test
    metrics' bootstrap intervals and its paired difference from the ensemble."""
    from bnpfed.federated.operating_point import _estimated_sigma2

    done = _done(out)
    for seed in seeds:
        for J in Js:
            for partition in partitions:
                key = f"frontier/mnist/mlp/J={J}/{partition}/seed={seed}"
                if key in done:
                    continue
                t0 = time.perf_counter()
                configs = _configs(J, partition, seed, methods=("local", "ensemble", "pfnm"))
                configs["pfnm"] = PFNMConfig()
                experiment = Experiment(ds, **configs)
                results = {r.method: r for m in ("local", "ensemble", "pfnm") for r in run_method(experiment, m)}
                trained = time.perf_counter() - t0
                rows = {m: dict(accuracy=r.accuracy, nll=r.nll, ece15=r.ece15, hidden=r.hidden,
                                parameters=r.parameters, intervals=r.intervals, note=r.note)
                        for m, r in results.items()}
                ensemble = results["ensemble"].test_probs
                base = experiment.selection().match
                estimate = _estimated_sigma2(base)
                pooled = experiment.pfnm_heads("auto") == "pooled"
                points = []
                for factor in FRONTIER_FACTORS:
                    sigma2 = tuple(factor * s for s in estimate)
                    match = base if factor == 1.0 else experiment.one_shot_match(replace(experiment.pfnm,
                                                                                         sigma2=sigma2))
                    point = dict(factor=factor, sigma2=list(sigma2), hidden=match.hidden_sizes,
                                 width=sum(match.hidden_sizes),
                                 fused=_scored(experiment, match.network(), ensemble))
                    if pooled:
                        point["pooled"] = _scored(experiment, pooled_network(match, experiment.local_models()),
                                                  ensemble)
                    points.append(point)
                experiment.close()
                _emit(out, key, dict(dataset="mnist", arch="mlp", J=J, partition=partition, seed=seed, rows=rows,
                                     points=points, train_seconds=trained, wall_seconds=time.perf_counter() - t0))


def part_frontier_fedavg(ds, out: Path, seeds, Js, *, partitions=("iid", "dirichlet")) -> None:
    """Target (a)'s missing one-shot row: FedAvg, one round from a shared initialisation
    (``fedavg-oneshot:init=shared``), on the frontier part's partitions and local training (J in ``Js`` x
    ``partitions`` x ``seeds``), with its test metrics' bootstrap intervals; compared with the frontier lines' ensemble
    and PFNM seed by seed (same partition, same test images) by ``summarize_frontier.py --fedavg``."""
    for key, J, partition, seed in _settings(out, "frontier-fedavg/mnist/mlp", Js, partitions, seeds):
        t0 = time.perf_counter()
        configs = _configs(J, partition, seed, methods=("fedavg-oneshot:init=shared",))
        configs["pfnm"] = PFNMConfig()
        experiment = Experiment(ds, **configs)
        r = run_method(experiment, "fedavg-oneshot:init=shared")[0]
        experiment.close()
        _emit(out, key, dict(dataset="mnist", arch="mlp", J=J, partition=partition, seed=seed,
                             row=dict(accuracy=r.accuracy, nll=r.nll, ece15=r.ece15, intervals=r.intervals,
                                      parameters=r.parameters, note=r.note),
                             wall_seconds=time.perf_counter() - t0))


#: Target (b)'s one-shot sizes: PFNM's size limit as fractions of the ensemble's parameters.
CURVE_FRACTIONS = (2.0, 1.0, 0.5)
#: Target (b)'s one-shot curve: every group's noise variance sigma2 at these factors of its estimate (the others
#: estimated), as target (a)'s frontier sweeps it the other way: a larger sigma2 merges more units.
CURVE_SIGMA2_FACTORS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


def _method_row(experiment, r, ensemble_probs, **extra) -> dict:
    """:func:`_global_row` of a method's row ``r`` (``run_method``'s): its metrics as the row scored them, the
    network the method kept for its nonzero parameters."""
    net = experiment.global_models.get(r.method, {}).get("network")
    paired = experiment.paired(r.test_probs, ensemble_probs)
    return dict(accuracy=r.accuracy, nll=r.nll, ece15=r.ece15, parameters=r.parameters,
                nonzero=None if net is None else _nonzero(net), intervals=r.intervals,
                vs_ensemble={m: paired[m] for m in ("accuracy", "nll")}, note=r.note, **extra)


def _global_row(experiment, net, ensemble_probs, **extra) -> dict:
    """A global network's accuracy, NLL, ECE-15, dense and nonzero parameters, bootstrap intervals over the test
    examples and paired difference from the ensemble (accuracy and NLL, paired 95 % intervals)."""
    return dict(_scored(experiment, net, ensemble_probs), nonzero=_nonzero(net), **extra)


def part_targets_b(ds, out: Path, seeds, Js, *, name: str = "mnist", partitions=("iid", "dirichlet"),
                   arch: str = "lenet", rounds: int = 6) -> None:
    """Issue 53's restated target (b) on one set of local models per setting (the reference training, as the size
    and shrink parts train them): the ensemble; one shot, bnpfed's default PFNM (``heads="auto"``: pooled where the
    class shares differ), PFNM held to :data:`CURVE_FRACTIONS` of the ensemble's parameters (a size asked for) and
    at :data:`CURVE_SIGMA2_FACTORS` times the estimated noise variance (the accuracy-against-size curve, piece
    ``one-shot-curve``), weight matching and OT fusion (exact plan) at one client's size, FedAvg one round from a
    shared initialisation (piece ``fedavg-shared``); with
    communication, FedMA's layer-wise scheme at half the ensemble's parameters (one round, 5 retraining epochs a
    group, ``heads="auto"``, the pooled heads priced in the budget) and ``rounds`` rounds of PFNM held to the
    ensemble's size from round 2 (``heads="auto"``). Every global network with dense and nonzero parameters, its
    test metrics' intervals and its paired difference from the ensemble. One JSON line per setting and piece (keys
    ``targets-b/<dataset>/<arch>/J=../<partition>/seed=../<piece>``; resumable per piece, a resumed setting retrains
    its local models deterministically)."""
    pieces = ("one-shot", "fedma-half", "pfnm-rounds", "one-shot-curve", "fedavg-shared")
    done = _done(out)
    epochs = PFNM_TRAINING.schedule(2).epochs
    for seed in seeds:
        for J in Js:
            for partition in partitions:
                base = f"targets-b/{name}/{arch}/J={J}/{partition}/seed={seed}"
                todo = [p for p in pieces if f"{base}/{p}" not in done]
                if not todo:
                    continue
                t0 = time.perf_counter()
                configs = _configs(J, partition, seed, methods=("ensemble",), rounds=rounds)
                configs["network"] = replace(PFNM_NETWORK, arch=arch)
                configs["training"] = _training(name)
                configs["pfnm"] = PFNMConfig()
                experiment = Experiment(ds, **configs)
                meta = dict(dataset=name, arch=arch, J=J, partition=partition, seed=seed, source=ds.source)
                try:
                    ensemble = run_method(experiment, "ensemble")[0]
                    ens = dict(accuracy=ensemble.accuracy, nll=ensemble.nll, ece15=ensemble.ece15,
                               parameters=ensemble.parameters, intervals=ensemble.intervals)
                    probs = ensemble.test_probs
                    nets = experiment.local_models()
                    local = [experiment.evaluate_network(n)["accuracy"] for n in nets]
                    heads = experiment.pfnm_heads("auto")
                    trained = time.perf_counter() - t0
                    if "one-shot" in todo:
                        rows = {}
                        for method in ("pfnm", "weight-matching", "ot-fusion"):
                            t1 = time.perf_counter()
                            r = run_method(experiment, method)[0]
                            rows[r.method] = _method_row(experiment, r, probs, hidden=r.hidden,
                                                         seconds=time.perf_counter() - t1)
                        for fraction in CURVE_FRACTIONS:
                            limit = int(fraction * ensemble.parameters)
                            t1 = time.perf_counter()
                            config = replace(PFNMConfig(max_params=limit), heads=heads)
                            try:
                                match = experiment.one_shot_match(config)
                            except ValueError as error:   # a limit below what any assignment allows
                                rows[f"pfnm max_params={fraction:g}x"] = dict(error=str(error), limit=limit)
                                continue
                            net = pooled_network(match, nets) if heads == "pooled" else match.network()
                            search = match.size_searches.get("parameters")
                            rows[f"pfnm max_params={fraction:g}x"] = _global_row(
                                experiment, net, probs, hidden=match.hidden_sizes, limit=limit, heads=heads,
                                met=None if search is None else search.met, seconds=time.perf_counter() - t1)
                        _emit(out, f"{base}/one-shot", dict(meta, ensemble=ens, local=local, heads=heads, rows=rows,
                                                            train_seconds=trained))
                    if "one-shot-curve" in todo:
                        from bnpfed.federated.operating_point import _estimated_sigma2

                        base_match = experiment.selection().match
                        estimate = _estimated_sigma2(base_match)
                        points = []
                        for factor in CURVE_SIGMA2_FACTORS:
                            t1 = time.perf_counter()
                            sigma2 = tuple(factor * v for v in estimate)
                            match = experiment.one_shot_match(replace(experiment.pfnm, sigma2=sigma2))
                            net = pooled_network(match, nets) if heads == "pooled" else match.network()
                            points.append(_global_row(experiment, net, probs, factor=factor, sigma2=list(sigma2),
                                                      hidden=match.hidden_sizes, heads=heads,
                                                      seconds=time.perf_counter() - t1))
                        _emit(out, f"{base}/one-shot-curve", dict(meta, ensemble=ens, heads=heads, points=points))
                    if "fedavg-shared" in todo:   # FedAvg, one round from a shared initialisation
                        t1 = time.perf_counter()
                        r = run_method(experiment, "fedavg-oneshot:init=shared")[0]
                        row = _method_row(experiment, r, probs, heads="fused", seconds=time.perf_counter() - t1)
                        _emit(out, f"{base}/fedavg-shared", dict(meta, ensemble=ens, row=row))
                    if "fedma-half" in todo:
                        t1 = time.perf_counter()
                        limit = ensemble.parameters // 2
                        fed = PFNMFederation(experiment.dataset, experiment.parts, network=experiment.network,
                                             training=experiment.training, seed=seed, initial_models=nets,
                                             pfnm=PFNMConfig(layerwise_retrain=epochs, max_params=limit, heads=heads))
                        fed.run_round()
                        net = fed.global_network()
                        searches = fed.match.size_searches.values()
                        row = _global_row(experiment, net, probs, hidden=fed.match.hidden_sizes, limit=limit,
                                          heads=heads, met=all(s.met for s in searches) if searches else None,
                                          seconds=time.perf_counter() - t1)
                        _emit(out, f"{base}/fedma-half", dict(meta, ensemble=ens, fedma_epochs=epochs, row=row))
                    if "pfnm-rounds" in todo:
                        t1 = time.perf_counter()
                        fed = PFNMFederation(ds, experiment.parts, network=experiment.network,
                                             training=experiment.training, seed=seed, initial_models=nets,
                                             pfnm=PFNMConfig(max_params="ensemble", limit_from_round=2, heads=heads))
                        r = experiment.federation_row(fed, rounds)
                        net = fed.global_network()
                        search = fed.match.size_searches.get("parameters")
                        row = _global_row(experiment, net, probs, hidden=r.hidden, heads=heads, rounds=rounds,
                                          limit=None if search is None else search.limit,
                                          met=None if search is None else search.met,
                                          history=[dict(round=h["round"], accuracy=h["accuracy"],
                                                        parameters=h.get("parameters")) for h in r.history],
                                          seconds=time.perf_counter() - t1)
                        _emit(out, f"{base}/pfnm-rounds", dict(meta, ensemble=ens, row=row))
                finally:
                    experiment.close()


PARTS = {"reference": part_reference, "compress": part_compress, "size": part_size, "cnn": part_cnn,
         "shrink": part_shrink, "pooled": part_pooled,
         "operating": part_operating,
         "cifar": part_cifar, "niid": part_niid,
         "cnn-timing": part_cnn_timing,
         "baselines": part_baselines, "targets-b": part_targets_b,
         "eb": part_eb, "frontier": part_frontier, "frontier-fedavg": part_frontier_fedavg, "plane": part_plane,
         "width": part_width, "rounds": part_rounds,
         "start": part_start,
         "deep": part_deep, "timing": part_timing}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA))
    p.add_argument("--out", default=str(HERE / "results" / "pfnm_mnist.jsonl"))
    p.add_argument("--parts", default="reference,width,rounds,start,deep,timing")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--clients", default="10,25")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (local training)")
    p.add_argument("--dataset", choices=("mnist", "fashion-mnist", "cifar10"), default="mnist",
                   help="the data (the cnn part also runs on fashion-mnist and cifar10; --data-dir must hold it: "
                        "for cifar10 torchvision's pickles or the JPEG container cifar10_jpeg.npz)")
    p.add_argument("--arch", choices=("lenet", "simple-cnn", "simple-cnn-bn", "mlp"), default="lenet",
                   help="the cnn part's network (mlp: the size part's MLP)")
    p.add_argument("--rounds", type=int, default=3, help="communication rounds of the cnn and shrink parts")
    p.add_argument("--partitions", default="iid,dirichlet", help="partitions of the cnn part")
    p.add_argument("--fedma-epochs", type=int, default=None,
                   help="the size part's FedMA: retraining epochs a group (default: the library's, a later round's "
                        "local epochs: 5 under the reference training)")
    p.add_argument("--pool-temperature", type=lambda v: v if v == "fit" else float(v), default=1.0,
                   help="the pooled part's pool temperature: a number or fit (chosen by the clients' training data)")
    p.add_argument("--heads", choices=("fused", "pooled"), default="fused",
                   help="the shrink part's global output layer: fused (PFNM's) or pooled (the clients' own heads)")
    p.add_argument("--shrink-rows", choices=("both", "limited"), default="both",
                   help="the shrink part's federations: both (the ensemble's size from round 2, and the own size), "
                        "or the limited one alone")
    p.add_argument("--size-rows", choices=SIZE_ROWS, default="all",
                   help="the size part's rows: all, or fedma (the local models, the ensemble, PFNM at its own size, "
                        "FedMA at the ensemble's size and at half of it), or fedma-half (FedMA at half alone beside "
                        "them)")
    p.add_argument("--fedma-rounds", type=int, default=1,
                   help="the size part's FedMA: communication rounds (each a layer-wise pass from the clients' "
                        "slices, the size limit held every round)")
    p.add_argument("--plot-niid", metavar="PNG", help="draw the niid lines of --out (comma-separated files) into "
                   "PNG and exit")
    p.add_argument("--augment", choices=AUGMENTATIONS, default="none",
                   help="the niid part's local training: NIID-Bench's random crops and flips (crop-flip) or none")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="the niid part's local optimiser: NIID-Bench's (sgd) or this project's CIFAR-10 one (adam)")
    args = p.parse_args(argv)
    if args.plot_niid:
        plot_niid(args.out.split(","), Path(args.plot_niid))
        return
    unknown = [part for part in args.parts.split(",") if part not in PARTS]
    if unknown:
        p.error(f"--parts: unknown part(s) {unknown}; expected names from {list(PARTS)}")
    if args.shrink_rows != "both" and "shrink" not in args.parts.split(","):
        p.error("--shrink-rows: applies to the shrink part only; add shrink to --parts")
    if (args.fedma_rounds != 1 or args.size_rows != "all") and "size" not in args.parts.split(","):
        p.error("--fedma-rounds, --size-rows: apply to the size part only; add size to --parts")
    try:
        # pixels in [0, 1] on the greyscale sets (the reference's scale); CIFAR-10 normalised per channel as FedMA does
        ds = load_dataset(args.dataset, data_dir=args.data_dir, standardize=args.dataset == "cifar10")
    except FileNotFoundError as error:
        print(f"skipped: no {args.dataset} under {args.data_dir} ({error})")
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    Js = [int(j) for j in args.clients.split(",")]
    for part in args.parts.split(","):
        if part in ("reference", "eb", "frontier", "frontier-fedavg"):
            PARTS[part](ds, out, seeds, Js)
        elif part == "cnn":
            part_cnn(ds, out, seeds, Js, name=args.dataset, rounds=args.rounds,
                     partitions=tuple(args.partitions.split(",")), arch=args.arch)
        elif part == "cifar":
            if args.dataset != "cifar10":
                p.error(f"--parts cifar: expected --dataset cifar10, got {args.dataset}")
            part_cifar(ds, out, seeds, Js, rounds=args.rounds, partitions=tuple(args.partitions.split(",")),
                       arch="simple-cnn" if args.arch == "lenet" else args.arch)
        elif part == "niid":
            if args.dataset != "cifar10":
                p.error(f"--parts niid: expected --dataset cifar10, got {args.dataset}")
            part_niid(ds, out, seeds, rounds=args.rounds, optimizer=args.optimizer, augment=args.augment)
        elif part == "baselines":
            part_baselines(ds, out, seeds, Js, name=args.dataset, partitions=tuple(args.partitions.split(",")),
                           arch=args.arch)
        elif part == "compress":
            part_compress(ds, out, seeds, Js, name=args.dataset, partitions=tuple(args.partitions.split(",")),
                          arch=args.arch)
        elif part == "operating":
            part_operating(ds, out, seeds, Js, name=args.dataset, partitions=tuple(args.partitions.split(",")),
                           arch=args.arch)
        elif part == "pooled":
            part_pooled(ds, out, seeds, Js, name=args.dataset, partitions=tuple(args.partitions.split(",")),
                        arch=args.arch, pool_temperature=args.pool_temperature)
        elif part == "shrink":
            part_shrink(ds, out, seeds, Js, name=args.dataset, partitions=tuple(args.partitions.split(",")),
                        arch=args.arch, rounds=args.rounds, heads=args.heads,
                        rows=args.shrink_rows)
        elif part == "size":
            part_size(ds, out, seeds, Js, name=args.dataset, partitions=tuple(args.partitions.split(",")),
                      arch=args.arch, fedma_epochs=args.fedma_epochs, row_set=args.size_rows,
                      fedma_rounds=args.fedma_rounds)
        elif part == "targets-b":
            part_targets_b(ds, out, seeds, Js, name=args.dataset, partitions=tuple(args.partitions.split(",")),
                           arch=args.arch, rounds=args.rounds)
        elif part == "cnn-timing":
            part_cnn_timing(ds, out, name=args.dataset)
        else:
            PARTS[part](ds, out)


if __name__ == "__main__":
    main()

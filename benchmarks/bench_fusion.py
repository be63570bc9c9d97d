"""Benchmarks of posterior fusion (Ozer et al. 2022): the fusion rules, the SVI clients, and the paper's setting.

* ``fuse_throughput``: :func:`bnpfed.combine.fuse` on K clients' posteriors of ``numel`` weights each (float32),
  every rule, against the floor measured in the same run: one plain read of the inputs, ``locs.sum();
  variances.sum()``, and the time of ``torch.log`` on the variances alone (``log_variance`` needs one log per
  client variance). Seconds are the best of ``repeats`` interleaved passes (``pooling``: one call; it draws
  ``num_samples`` = 1000 values of every weight in all, so it is bounded by the normal generator, not by reading
  its inputs). ``--baseline-ref REF`` adds the rules of ``bnpfed/combine.py`` as committed at git ``REF``.
* ``svi_throughput``: training examples per second of :class:`BayesianClient` (with and without local
  reparameterisation) against, in the same run, a plain torch training loop of the same network (Adam,
  cross-entropy), :class:`DeterministicClient`, and a hand-written torch Bayes-by-backprop loop of the same
  objective (weights sampled from the mean-field Gaussian, closed-form KL to the N(0, 1) prior): the MLP 64-100-10
  on the bundled digits data, and LeNet-5 on 28x28 random images with only the fully connected weights Bayesian.
  ``BayesianClient`` runs its default ELBO (:class:`bnpfed.clients.MeanFieldELBO`, the closed-form objective
  computed from the guide's parameters); the rows ``Pyro ELBO`` train the same client through the Pyro program with
  ``TraceMeanField_ELBO`` (two traces per step, and local reparameterisation by the ``TorchFunctionMode`` handler).
* ``paper_setting``: the 10-client IID Fashion-MNIST experiment of the paper's Table 1 (LeNet-5, only fully
  connected weights Bayesian, local reparameterisation, client weights by data size), on a shorter schedule, every
  rule and FedAvg, next to the published accuracy and ECE (100 bins).

Every timing runs on one torch thread (on shared cores, OpenMP regions wait on descheduled peers). Results and the
commands that produced them are in the docs' benchmark page on posterior fusion (docs/benchmarks/fusion.md).

Usage: python benchmarks/bench_fusion.py [--part fuse,svi,paper] [--baseline-ref HEAD] [--svi-repeats 3]
                                         [--rounds 5] ...
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import subprocess
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pyro.infer import TraceMeanField_ELBO
from torch.func import functional_call

from bnpfed.combine import available_rules, fuse
from bnpfed.data import load_dataset
from bnpfed.clients import BayesianClient, DeterministicClient
from bnpfed.models import LeNet, mlp, only_linear_weights
from bnpfed.report import format_table

#: Where the shared offline Fashion-MNIST files live (torchvision layout).
FASHION_MNIST_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "fashion_mnist"

#: Ozer et al. (2022), 10 clients, IID Fashion-MNIST: test accuracy and ECE (100 bins) in percent, as published.
PUBLISHED_ACCURACY = {"fedavg": 89.6, "eaa": 90.1, "gaa": 89.8, "log_variance": 89.9, "pooling": 89.8,
                      "conflation": 89.9}
PUBLISHED_ECE = {"fedavg": 8.0, "eaa": 3.0}

#: The shorter schedule of ``paper_setting`` (the benchmark archive, docs/benchmarks/archive.md, says why).
PAPER_SCHEDULE = dict(rounds=5, local_epochs=1, batch_size=64, lr=1e-3)


def _best_seconds(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ----------------------------------------------------------------------------------------------------------------
# (a) fusion rules


def combine_at(ref: str):
    """``bnpfed/combine.py`` as committed at git ``ref``, loaded as a separate module (its own rule registry), to
    time the working tree against it."""
    source = subprocess.run(["git", "show", f"{ref}:bnpfed/combine.py"], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout
    module = types.ModuleType(f"combine_at_{ref}")
    exec(compile(source, f"{ref}:bnpfed/combine.py", "exec"), module.__dict__)
    return module


def fuse_throughput(clients=(10, 100), numel: int = 1_000_000, *, repeats: int = 7, seed: int = 0,
                    baseline_ref: str | None = None) -> list[dict]:
    """One row per (K, rule): seconds, input GB/s and the ratio to the plain-read floor of the same inputs; with
    ``baseline_ref``, also the deterministic rules of ``combine.py`` as committed at that git ref.

    The floor and every deterministic rule are timed once per pass, ``repeats`` passes, best time kept: on a shared
    machine, interleaving keeps a burst of load from landing on one row only. ``pooling`` is timed once."""
    versions = [("", fuse)]
    if baseline_ref:
        versions.append((f" @ {baseline_ref}", combine_at(baseline_ref).fuse))
    rows = []
    for K in clients:
        g = torch.Generator().manual_seed(seed)
        locs = torch.randn(K, numel, generator=g)
        variances = torch.exp(torch.randn(K, numel, generator=g) - 4)  # sigma around 0.1, spread over decades
        weights = torch.randint(50, 500, (K,), generator=g).float()
        gigabytes = 2 * locs.numel() * locs.element_size() / 1e9
        logs = torch.empty_like(variances)
        timed = {"floor: locs.sum(); variances.sum()": lambda: (locs.sum(), variances.sum()),
                 "(log_variance's own bound: torch.log(variances, out=...))": lambda: torch.log(variances, out=logs)}
        for suffix, fuse_fn in versions:
            for rule in available_rules():
                if rule != "pooling":
                    timed[rule + suffix] = (lambda fn=fuse_fn, rule=rule: fn(locs, variances, rule, weights))
        best = dict.fromkeys(timed, math.inf)
        for _ in range(repeats):
            for name, fn in timed.items():
                best[name] = min(best[name], _best_seconds(fn, 1))
        best["pooling"] = _best_seconds(
            lambda: fuse(locs, variances, "pooling", weights, generator=torch.Generator().manual_seed(seed)), 1)
        floor = best["floor: locs.sum(); variances.sum()"]
        order = [*list(timed)[:2], *available_rules(), *list(timed)[2 + len(available_rules()) - 1:]]
        for name in order:
            rows.append(dict(K=K, rule=name, seconds=best[name], GB_per_s=gigabytes / best[name],
                             over_floor=best[name] / floor))
        del logs
    return rows


# ----------------------------------------------------------------------------------------------------------------
# (b) SVI clients


def _torch_loop(net, x, y, *, epochs, batch_size, lr, seed):
    """The plain training loop: Adam on the mean cross-entropy over shuffled mini-batches."""
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    shuffle = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=shuffle)
        for start in range(0, len(x), batch_size):
            batch = order[start:start + batch_size]
            loss = F.cross_entropy(net(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def _torch_bbb_loop(net, x, y, *, epochs, batch_size, lr, seed, init_scale=1e-2):
    """Bayes by backprop written in plain torch: ``nn.Linear`` weights get a mean-field Gaussian (loc, softplus(rho))
    sampled once per step, the loss is ``(KL(q || N(0, 1)) + n / B * CE_sum(batch)) / n`` as in BayesianClient."""
    n = len(x)
    bayesian = {name for name, module in net.named_modules() if isinstance(module, torch.nn.Linear)}
    bayesian = {f"{name}.weight" for name in bayesian}
    params = dict(net.named_parameters())
    locs = {k: v.detach().clone().requires_grad_() for k, v in params.items() if k in bayesian}
    rho0 = math.log(math.expm1(init_scale))
    rhos = {k: torch.full_like(v, rho0, requires_grad=True) for k, v in locs.items()}
    others = {k: v for k, v in params.items() if k not in bayesian}
    optimizer = torch.optim.Adam([*locs.values(), *rhos.values(), *others.values()], lr=lr)
    shuffle = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(n, generator=shuffle)
        for start in range(0, n, batch_size):
            batch = order[start:start + batch_size]
            scales = {k: F.softplus(r) for k, r in rhos.items()}
            weights = {k: locs[k] + scales[k] * torch.randn_like(scales[k]) for k in locs}
            kl = sum((0.5 * (scales[k].square() + locs[k].square() - 1) - scales[k].log()).sum() for k in locs)
            logits = functional_call(net, {**others, **weights}, (x[batch],))
            loss = (kl + n / len(batch) * F.cross_entropy(logits, y[batch], reduction="sum")) / n
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def svi_throughput(*, epochs: int = 2, seed: int = 0, lenet_examples: int = 2048, repeats: int = 3) -> list[dict]:
    """One row per (network, trainer): examples per second, the slowdown against the plain torch loop and the ratio
    to the hand-written Bayes-by-backprop loop, all by wall-clock time, and that ratio by the CPU time of the
    (single) torch thread, which a loaded machine's waiting does not inflate."""
    digits = load_dataset("digits").flat()
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(lenet_examples, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (lenet_examples,), generator=g)
    setups = [
        ("mlp 64-100-10, digits (1347)", lambda: mlp(64, [100], 10), digits.x_train, digits.y_train, 32),
        (f"lenet 28x28, random ({lenet_examples})", LeNet, images, labels, 64),
    ]
    rows = []
    for network, make, x, y, batch_size in setups:
        torch.manual_seed(seed)
        net = make()
        kwargs = dict(epochs=epochs, batch_size=batch_size, lr=1e-3, seed=seed)
        trainers = [
            ("torch loop", lambda: _torch_loop(copy.deepcopy(net), x, y, **kwargs)),
            ("DeterministicClient", lambda: DeterministicClient(net).fit(x, y, **kwargs)),
            ("torch bayes-by-backprop", lambda: _torch_bbb_loop(copy.deepcopy(net), x, y, **kwargs)),
            ("BayesianClient", lambda: BayesianClient(net, only_linear_weights()).fit(x, y, **kwargs)),
            ("BayesianClient + local reparam.",
             lambda: BayesianClient(net, only_linear_weights(), local_reparameterization=True).fit(x, y, **kwargs)),
            ("BayesianClient, Pyro ELBO",
             lambda: BayesianClient(net, only_linear_weights(), elbo=TraceMeanField_ELBO(max_plate_nesting=1)).fit(
                 x, y, **kwargs)),
            ("BayesianClient + local reparam., Pyro ELBO",
             lambda: BayesianClient(net, only_linear_weights(), local_reparameterization=True,
                                    elbo=TraceMeanField_ELBO(max_plate_nesting=1)).fit(x, y, **kwargs)),
        ]
        best = dict.fromkeys(dict(trainers), math.inf)
        best_cpu = dict(best)
        for _ in range(repeats):  # interleaved, best kept: see fuse_throughput
            for trainer, train in trainers:
                wall, cpu = time.perf_counter(), time.thread_time()
                train()
                best[trainer] = min(best[trainer], time.perf_counter() - wall)
                best_cpu[trainer] = min(best_cpu[trainer], time.thread_time() - cpu)
        baseline = best["torch loop"]
        bbb, bbb_cpu = best["torch bayes-by-backprop"], best_cpu["torch bayes-by-backprop"]
        for trainer, seconds in best.items():
            rows.append(dict(network=network, trainer=trainer, batch=batch_size,
                             examples_per_s=epochs * len(x) / seconds, slowdown=seconds / baseline,
                             vs_bbb=seconds / bbb, vs_bbb_cpu=best_cpu[trainer] / bbb_cpu))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# (c) the paper's Fashion-MNIST setting


def paper_setting(data_dir=FASHION_MNIST_DIR, *, rounds: int = PAPER_SCHEDULE["rounds"],
                  local_epochs: int = PAPER_SCHEDULE["local_epochs"], batch_size: int = PAPER_SCHEDULE["batch_size"],
                  lr: float = PAPER_SCHEDULE["lr"], rules=None, seed: int = 0, json_path=None, progress=True):
    """Rows per method: our final accuracy / ECE / NLL (percent for the first two) next to the published ones, or
    ``None`` with a message when the Fashion-MNIST files are absent."""
    if not Path(data_dir, "FashionMNIST", "raw").is_dir():
        print(f"skipped: no Fashion-MNIST files under {data_dir} (torchvision layout FashionMNIST/raw)")
        return None
    from bnpfed.federated.config import BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig, TrainingConfig
    from bnpfed.federated.methods import ExperimentConfig, run_experiment

    ds = load_dataset("fashion-mnist", data_dir=data_dir)
    methods = (*(rules or available_rules()), "fedavg")
    result = run_experiment(ds, partition=PartitionConfig(clients=10), network=NetworkConfig(arch="lenet"),
                            training=TrainingConfig(epochs=local_epochs, batch_size=batch_size, lr=lr),
                            bayesian=BayesianConfig(prior="linear-weights", local_reparameterization=True),
                            fusion=FusionConfig(weights="size"),
                            config=ExperimentConfig(methods=methods, rounds=rounds, ece_bins=100, seed=seed),
                            progress=progress)
    if json_path:
        from bnpfed.report import write_json

        write_json(json_path, {"benchmark": "fusion/paper_setting", **result.as_dict()})
    rows = []
    for row in result.rows:
        rows.append(dict(method=row.method, accuracy=100 * row.accuracy,
                         published_accuracy=PUBLISHED_ACCURACY.get(row.method, math.nan),
                         ece=100 * row.ece, published_ece=PUBLISHED_ECE.get(row.method, math.nan), nll=row.nll,
                         brier=row.brier, mean_sigma=row.mean_sigma,
                         minutes=sum(h["seconds"] for h in row.history) / 60))
    return rows, result


CIFAR10_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10"
DEFAULT_CIFAR_OUT = str(Path(__file__).parent / "results" / "fusion_cifar10.jsonl")
#: Ozer et al.'s CIFAR-10 figures (LeNet with 400 fc1 inputs, 10 clients IID, 50 rounds x 10 local epochs):
#: accuracy and ECE in percent.
PUBLISHED_CIFAR10 = {"fedavg": (70.09, 3.35), "gaa": (71.29, 3.11), "conflation": (71.17, 2.81)}
#: the published rules first, then the others
CIFAR10_METHODS = ("fedavg", "gaa", "conflation", "eaa", "log_variance", "pooling")


def cifar10_setting(out: Path, data_dir=CIFAR10_DIR, *, partitions=("iid", "dirichlet"),
                    rounds: int = PAPER_SCHEDULE["rounds"], local_epochs: int = PAPER_SCHEDULE["local_epochs"],
                    batch_size: int = PAPER_SCHEDULE["batch_size"], lr: float = PAPER_SCHEDULE["lr"],
                    methods=CIFAR10_METHODS, seed: int = 0) -> list[dict]:
    """Issue 18's posterior-fusion row on CIFAR-10: the paper's LeNet (``lenet-paper``: 400 fc1 inputs on 32x32
    images), 10 clients IID and Dirichlet(0.5), ``rounds`` rounds of ``local_epochs`` (the paper: 50 x 10); one JSON
    line per (partition, method) in ``out`` as it ends (finished ones are skipped). Returns the rows so far."""
    try:
        ds = load_dataset("cifar10", data_dir=data_dir)
    except FileNotFoundError as error:
        print(f"skipped: no CIFAR-10 under {data_dir} ({error})")
        return []
    return resumable_setting(out, ds, "fusion-cifar10", PUBLISHED_CIFAR10, partitions=partitions, rounds=rounds,
                             local_epochs=local_epochs, batch_size=batch_size, lr=lr, methods=methods, seed=seed)


#: Ozer et al.'s Fashion-MNIST figures (Table 1: LeNet-5, 10 clients IID, 50 rounds x 10 local epochs): accuracy
#: and ECE (100 bins) in percent, as in the issue (conflation's ECE from the paper's Table 1).
PUBLISHED_FASHION = {"fedavg": (89.6, 7.99), "eaa": (90.1, 3.0), "gaa": (89.8, math.nan),
                     "log_variance": (89.9, math.nan), "pooling": (89.8, math.nan), "conflation": (89.9, 6.35)}


def paper_long_setting(out: Path, data_dir=FASHION_MNIST_DIR, *, rounds: int = 5, local_epochs: int = 10,
                       batch_size: int = PAPER_SCHEDULE["batch_size"], lr: float = PAPER_SCHEDULE["lr"],
                       methods=("conflation", "fedavg", "eaa"), seed: int = 0) -> list[dict]:
    """Issue 17's paper setting at the paper's local epochs: Fashion-MNIST, 10 clients IID, the published code's
    LeNet-5 (``lenet-paper``) on pixels in [0, 1], fused variances floored at its clamp (``bnpfed fuse --paper``),
    ``rounds`` rounds of ``local_epochs`` local epochs (the paper: 50 x 10) with today's default clients; one JSON line
    per method as it ends, with every round's accuracy and ECE (resumable: finished methods are skipped)."""
    if not Path(data_dir, "FashionMNIST", "raw").is_dir():
        print(f"skipped: no Fashion-MNIST files under {data_dir} (torchvision layout FashionMNIST/raw)")
        return []
    from bnpfed.federated.config import PAPER_MIN_VARIANCE

    ds = load_dataset("fashion-mnist", data_dir=data_dir, standardize=False)
    return resumable_setting(out, ds, "fusion-fashion-paper", PUBLISHED_FASHION, partitions=("iid",), rounds=rounds,
                             local_epochs=local_epochs, batch_size=batch_size, lr=lr, methods=methods, seed=seed,
                             min_variance=PAPER_MIN_VARIANCE)


def resumable_setting(out: Path, ds, name: str, published: dict, *, partitions, rounds: int, local_epochs: int,
                      batch_size: int, lr: float, methods, seed: int = 0, min_variance: float | None = None
                      ) -> list[dict]:
    """The paper's federation (``lenet-paper``, only the fully connected weights Bayesian, local reparameterisation,
    client weights by data size) on ``ds``: per partition and method one JSON line in ``out`` as it ends (finished
    ones are skipped), with the published figures ``published[method] = (accuracy, ECE)`` beside ours. Returns every
    line of ``out``."""
    import json

    from bnpfed.federated.config import BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig, TrainingConfig
    from bnpfed.federated.methods import Experiment, ExperimentConfig, run_method

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()} if out.exists() else set()
    fusion = FusionConfig(weights="size") if min_variance is None else FusionConfig(weights="size",
                                                                                    min_variance=min_variance)
    for partition in partitions:
        base = f"{name}/{partition}/rounds={rounds}/epochs={local_epochs}/seed={seed}"
        todo = [m for m in methods if f"{base}/{m}" not in done]
        if not todo:
            continue
        experiment = Experiment(
            ds, partition=PartitionConfig(clients=10, partition=partition), network=NetworkConfig(arch="lenet-paper"),
            training=TrainingConfig(epochs=local_epochs, batch_size=batch_size, lr=lr),
            bayesian=BayesianConfig(prior="linear-weights", local_reparameterization=True), fusion=fusion,
            config=ExperimentConfig(methods=tuple(todo), rounds=rounds, ece_bins=100, seed=seed),
            log=lambda line: print(f"  {line}", flush=True))
        for method in todo:
            t0 = time.perf_counter()
            for row in run_method(experiment, method):
                figures = published.get(row.method, (math.nan, math.nan))
                line = dict(key=f"{base}/{row.method}", partition=partition, method=row.method, rounds=rounds,
                            local_epochs=local_epochs, source=ds.source, accuracy=100 * row.accuracy,
                            ece=100 * row.ece, ece_floor=100 * row.ece_floor, nll=row.nll, brier=row.brier,
                            mean_sigma=row.mean_sigma, published_accuracy=figures[0], published_ece=figures[1],
                            wall_seconds=time.perf_counter() - t0,
                            history=[dict(round=h["round"], accuracy=h["accuracy"], ece=h.get("ece"),
                                          ece_floor=h.get("ece_floor")) for h in row.history])
                with out.open("a") as f:
                    f.write(json.dumps(line) + "\n")
                print(line["key"], round(line["accuracy"], 2), round(line["ece"], 2), flush=True)
        experiment.close()
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def run(parts=("fuse", "svi", "paper"), *, quick: bool = False, baseline_ref: str | None = None,
        svi_repeats: int = 3, **paper_kwargs) -> None:
    """Print every requested table (``quick``: K = 10 only, one SVI epoch, no paper setting)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # on shared cores, OpenMP regions wait on descheduled peers
    try:
        _run(parts, quick=quick, baseline_ref=baseline_ref, svi_repeats=svi_repeats, **paper_kwargs)
    finally:
        torch.set_num_threads(old)


def _run(parts, *, quick, baseline_ref, svi_repeats, **paper_kwargs):
    if "fuse" in parts:
        print(f"### fuse: K clients x 1M float32 weights, torch threads {torch.get_num_threads()}, "
              "best of 7 interleaved passes")
        print(format_table(fuse_throughput(clients=(10,) if quick else (10, 100), baseline_ref=baseline_ref)))
    if "svi" in parts:
        print(f"\n### SVI client throughput (1 torch thread, lr 1e-3, best of {svi_repeats} interleaved passes)")
        print(format_table(svi_throughput(epochs=1 if quick else 2, repeats=svi_repeats), digits=2))
    if "paper" in parts:
        if quick:
            print("\n### paper setting: skipped in --quick (it takes tens of minutes)")
            return
        schedule = {k: paper_kwargs.get(k, v) for k, v in PAPER_SCHEDULE.items()}
        print(f"\n### paper setting: Fashion-MNIST, 10 clients IID, LeNet-5, {schedule} (1 torch thread)")
        out = paper_setting(**paper_kwargs)
        if out is not None:
            print(format_table(out[0], digits=3))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="fuse,svi,paper",
                        help="comma-separated subset of fuse, svi, paper, cifar10 and paper-long (the last two not "
                        "in the default: hours)")
    parser.add_argument("--cifar-dir", default=str(CIFAR10_DIR), help="CIFAR-10 (pickles or cifar10_jpeg.npz)")
    parser.add_argument("--partitions", default="iid,dirichlet", help="the cifar10 part's partitions")
    parser.add_argument("--out", default=DEFAULT_CIFAR_OUT,
                        help="the JSON lines of the cifar10 part (default results/fusion_cifar10.jsonl) or of "
                        "paper-long (default results/fusion_fashion_paper.jsonl)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=PAPER_SCHEDULE["rounds"])
    parser.add_argument("--local-epochs", type=int, default=PAPER_SCHEDULE["local_epochs"])
    parser.add_argument("--batch-size", type=int, default=PAPER_SCHEDULE["batch_size"])
    parser.add_argument("--lr", type=float, default=PAPER_SCHEDULE["lr"])
    parser.add_argument("--rules", help="comma-separated rules of the paper setting (default all)")
    parser.add_argument("--data-dir", default=str(FASHION_MNIST_DIR), help="torchvision root holding FashionMNIST/raw")
    parser.add_argument("--baseline-ref", metavar="GIT_REF",
                        help="also time the fusion rules of bnpfed/combine.py as committed at this git ref")
    parser.add_argument("--json", metavar="PATH", help="write the paper setting's per-round metrics as JSON")
    parser.add_argument("--svi-repeats", type=int, default=3, metavar="N",
                        help="interleaved passes of the SVI table, best kept (more on a loaded machine)")
    args = parser.parse_args(argv)
    parts = args.part.split(",")
    methods = {"methods": tuple(args.rules.split(","))} if args.rules else {}
    schedule = dict(rounds=args.rounds, local_epochs=args.local_epochs, batch_size=args.batch_size, lr=args.lr)
    long_parts = {   # the parts that run for hours, each writing its own resumable JSON lines
        "paper-long": lambda: paper_long_setting(
            args.out if args.out != DEFAULT_CIFAR_OUT else str(Path(__file__).parent / "results" /
                                                              "fusion_fashion_paper.jsonl"),
            args.data_dir, **schedule, **methods),
        "cifar10": lambda: cifar10_setting(args.out, args.cifar_dir, partitions=tuple(args.partitions.split(",")),
                                           **schedule, **methods),
    }
    for part in [p for p in long_parts if p in parts]:
        torch.set_num_threads(1)
        rows = long_parts[part]()
        print(format_table([{k: v for k, v in r.items() if k not in ("history", "key", "source")} for r in rows],
                           digits=3))
        parts.remove(part)
    if not parts:
        return
    args.part = ",".join(parts)
    run(tuple(args.part.split(",")), quick=args.quick, baseline_ref=args.baseline_ref,
        svi_repeats=args.svi_repeats, rounds=args.rounds,
        local_epochs=args.local_epochs, batch_size=args.batch_size, lr=args.lr,
        rules=args.rules.split(",") if args.rules else None, json_path=args.json, data_dir=args.data_dir)


if __name__ == "__main__":
    print(f"# torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} cores")
    main()

"""Matched posterior fusion on real MNIST / Fashion-MNIST (issue "matching Bayesian neurons", section 4).

Needs the data in torchvision's layout (``--mnist-dir``, ``--fashion-dir``; default ``../shared/data/...``); skips
otherwise. Network 784-100-10, J = 10 clients, inputs standardised with the training split's constants, Bayesian
clients with the paper's N(0, 1) prior on the linear weights (biases deterministic), local reparameterisation, initial
posterior scale 0.01, Adam lr 1e-3, batch 64; the deterministic PFNM clients train with the same schedule.

Parts (JSON lines to ``--out``, resumable: finished configurations are skipped):

* ``oneshot``: for each dataset (the other one is the out-of-distribution set) x {IID, Dirichlet(0.5)} x seeds, one
  round of ``--epochs`` local epochs: rows ``ensemble`` (the Bayesian clients' predictive distributions averaged),
  ``pfnm`` (deterministic clients, empirical-Bayes matching), ``fedavg`` (one round from a shared init), every rule
  weight by weight from the clients' own initialisations, and every rule after matching (``match-<rule>``); each
  with accuracy, NLL, ECE (100 and 15 bins), Brier, OOD AUROC by maximum probability and by entropy, width and
  parameters;
* ``baselines``: KL-fusion, weight matching and OT fusion beside matched fusion (the oneshot settings);
* ``targets-c``: issue 53's restated target (c), seed by seed: the library's default Bayesian clients one shot
  (IID and Dirichlet(0.5)) and over ``--rounds`` rounds (Dirichlet(0.5)), matched and weight-wise fusion beside
  PFNM and FedAvg, every row with its intervals and its paired differences from PFNM and FedAvg;
* ``rounds``: Dirichlet(0.5), ``--rounds`` rounds (``--epochs`` local epochs in round 1, ``--round-epochs`` after):
  matched fusion (``--rule``) against weight-wise fusion with a shared initialisation (the paper's setting) and
  FedAvg, per round.

``--summary`` prints the tables from ``--out`` instead of running.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from bnpfed.data import load_dataset, standardize_together
from bnpfed.federated.config import (LAPLACE_PRIORS, LATER_ROUNDS, ROUND_PRIORS, BayesianConfig, FusionConfig,
                                     NetworkConfig, PartitionConfig, PFNMConfig, TrainingConfig)
from bnpfed.federated.methods import ExperimentConfig, run_experiment
from bnpfed.metrics import paired_bootstrap
from bnpfed.models import IIDPrior
from bnpfed.experimental import ExperimentalOptions

from bench_pfnm import _done, _emit  # noqa: E402  (the resumable JSON-lines files of every real-data benchmark)

HERE = Path(__file__).parent
SHARED = HERE.parent.parent / "shared" / "data"
RULES = ("eaa", "gaa", "log_variance", "pooling", "conflation")
METRICS = ("accuracy", "nll", "ece", "ece_floor", "ece15", "brier", "auroc_max_prob", "auroc_entropy", "width",
           "parameters")
FOLDERS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}


def _data(name: str, dirs: dict):
    raw = load_dataset(name, data_dir=dirs[name], standardize=False)
    other = "fashion-mnist" if name == "mnist" else "mnist"
    ood_raw = load_dataset(other, data_dir=dirs[other], standardize=False)
    ds, (ood,) = standardize_together(raw, ood_raw.x_test)
    return ds, ood


def _bayesian(args) -> BayesianConfig:
    if args.expose:   # only these parameters Bayesian (e.g. "3.weight": the output layer, a last-layer Laplace)
        return BayesianConfig(client=args.client, prior=IIDPrior(expose=args.expose.split(",")),
                              laplace_prior=args.laplace_prior)
    return BayesianConfig(init_scale=args.init_scale, prior_variance=args.prior_variance, kl_weight=args.kl_weight,
                          scale_lr_factor=args.scale_lr_factor, client=args.client, laplace_prior=args.laplace_prior,
                          experimental=ExperimentalOptions(round_prior=args.round_prior))


def _pool_temperature(value: str):
    return value if value == "fit" else float(value)


def _row(r) -> dict:
    out = {m: getattr(r, m) for m in METRICS}
    out.update(hidden=r.hidden, server_seconds=r.server_seconds, mean_sigma=r.mean_sigma, note=r.note,
               history=[{k: h.get(k) for k in ("round", "accuracy", "nll", "ece", "ece_floor", "ece15", "brier",
                                               "hidden", "mean_sigma", "pool_temperature", "temperature")}
                         for h in r.history])
    return out


def _one_round(part: str, methods, datasets, dirs, out: Path, seeds, args) -> None:
    """One round of ``methods`` per dataset x {IID, Dirichlet(0.5)} x seed, one JSON line each (key ``part/...``)."""
    done = _done(out)
    for name in datasets:
        ds, ood = _data(name, dirs)
        for partition in ("iid", "dirichlet"):
            for seed in seeds:
                key = f"{part}/{name}/J={args.clients}/{partition}/seed={seed}{args.tag}"
                if key in done:
                    continue
                t0 = time.perf_counter()
                result = run_experiment(
                    ds, ood=ood, partition=PartitionConfig(clients=args.clients, partition=partition),
                    network=NetworkConfig(hidden=(100,)),
                    training=TrainingConfig(epochs=args.epochs, batch_size=64, lr=args.lr),
                    bayesian=_bayesian(args),
                    fusion=FusionConfig(own_init=True, pool_temperature=args.pool_temperature,
                                        temperature=args.temperature,
                                        align="none" if args.temperature == 1 else "match"),
                    pfnm=PFNMConfig(pool_temperature=args.pool_temperature),
                    config=ExperimentConfig(methods=methods, rounds=1, seed=seed, ece_bins=100,
                                            predictive_samples=args.samples))
                _emit(out, key, dict(dataset=name, partition=partition, seed=seed, J=args.clients, tag=args.tag,
                                     lr=args.lr, init_scale=args.init_scale, epochs=args.epochs,
                                     prior_variance=args.prior_variance, kl_weight=args.kl_weight,
                                     scale_lr_factor=args.scale_lr_factor, client=args.client, expose=args.expose,
                                     pool_temperature=args.pool_temperature, temperature=args.temperature,
                                     laplace_prior=args.laplace_prior,
                                     rows={r.method: _row(r) for r in result.rows}, warnings=result.warnings,
                                     wall_seconds=time.perf_counter() - t0))


def part_oneshot(datasets, dirs, out: Path, seeds, args) -> None:
    methods = (("ensemble-bayesian", "pfnm", "fedavg") + tuple(f"fusion:rule={r}" for r in RULES)
               + tuple(f"match:rule={r}" for r in RULES))
    if args.methods:
        methods = tuple(args.methods.split(","))
    _one_round("oneshot", methods, datasets, dirs, out, seeds, args)


#: Issue 20's rows: the published fusion methods beside matched Bayesian fusion, on the same clients.
BASELINES = ("ensemble-bayesian", "pfnm", "match:rule=eaa", "match:rule=conflation", "kl-fusion", "weight-matching",
             "ot-fusion")


def part_baselines(datasets, dirs, out: Path, seeds, args) -> None:
    """KL-fusion (Claici et al. 2020) of the Bayesian clients, and weight matching and OT fusion of the deterministic
    ones, beside matched fusion (the oneshot part's settings and seeds, so its rows repeat here on the same clients).
    One JSON line per configuration."""
    _one_round("baselines", BASELINES, datasets, dirs, out, seeds, args)


def part_rounds(datasets, dirs, out: Path, seeds, args) -> None:
    done = _done(out)
    for name in datasets:
        ds, ood = _data(name, dirs)
        for seed in seeds:
            key = (f"rounds/{name}/J={args.clients}/dirichlet/seed={seed}/rounds={args.rounds}/rule={args.rule}"
                   f"{args.tag}")
            if key in done:
                continue
            t0 = time.perf_counter()
            matched_only = args.rule in ("pvi", "atom-posterior")   # rules of matched units: no weight-wise row
            methods = ((f"match:rule={args.rule}",) if matched_only
                       else (f"match:rule={args.rule}", f"fusion:rule={args.rule}", "fedavg"))
            result = run_experiment(
                ds, ood=ood, partition=PartitionConfig(clients=args.clients, partition="dirichlet"),
                network=NetworkConfig(hidden=(100,)),
                training=TrainingConfig(epochs=args.epochs, batch_size=64, lr=args.lr, round_epochs=args.round_epochs),
                bayesian=_bayesian(args), fusion=FusionConfig(
                    rule=args.rule, temperature=args.temperature, experimental=ExperimentalOptions(
                        pvi_damping=args.pvi_damping, later_rounds=args.later_rounds),
                    align="match" if matched_only or args.later_rounds != "auto" or args.temperature != 1
                    else "none"),
                config=ExperimentConfig(methods=tuple(args.methods.split(",")) if args.methods else methods,
                                        rounds=args.rounds, seed=seed, ece_bins=100, predictive_samples=args.samples))
            _emit(out, key, dict(dataset=name, partition="dirichlet", seed=seed, J=args.clients, rounds=args.rounds,
                                 tag=args.tag, lr=args.lr, init_scale=args.init_scale, epochs=args.epochs,
                                 round_epochs=args.round_epochs, prior_variance=args.prior_variance,
                                 kl_weight=args.kl_weight, scale_lr_factor=args.scale_lr_factor, client=args.client,
                                 laplace_prior=args.laplace_prior, pvi_damping=args.pvi_damping,
                                 round_prior=args.round_prior,
                                 later_rounds=args.later_rounds, temperature=args.temperature,
                                 rows={r.method: _row(r) for r in result.rows},
                                 warnings=result.warnings,
                                 wall_seconds=time.perf_counter() - t0))


#: Target (c)'s one-shot methods: the Bayesian clients' ensemble, PFNM of deterministic clients, FedAvg one round
#: from a shared initialisation, conflation weight by weight (from a shared initialisation, the paper's setting: each
#: weight-wise rule trains its own clients, so one rule, the paper's best) and every rule after matching (the clients'
#: own initialisations, one set of clients for all).
TARGETS_C_ONESHOT = (("ensemble-bayesian", "pfnm", "fedavg", "fusion:rule=conflation")
                     + tuple(f"match:rule={r}" for r in RULES))
#: Its methods with communication (Dirichlet(0.5)): matched and weight-wise conflation, PFNM's rounds and FedAvg.
TARGETS_C_ROUNDS = ("pfnm-rounds", "fedavg", "fusion:rule=conflation", "match:rule=conflation")
#: The rows every other row is compared with, paired on the test examples.
TARGETS_C_AGAINST = {"pfnm": ("pfnm", "pfnm-rounds"), "fedavg": ("fedavg",)}


def _targets_c_row(r, references: dict, labels, seed: int) -> dict:
    row = {m: getattr(r, m) for m in ("accuracy", "nll", "ece15", "ece_debiased", "brier", "auroc_max_prob",
                                      "auroc_entropy", "width", "parameters", "mean_sigma")}
    row.update(intervals=r.intervals, note=r.note, history=[
        {k: h.get(k) for k in ("round", "accuracy", "nll", "ece15", "brier", "hidden")} for h in r.history])
    row["paired"] = {name: paired_bootstrap(r.test_probs, ref.test_probs, labels, ece_bins=15, seed=seed)
                     for name, ref in references.items() if ref is not r and r.test_probs is not None}
    return row


def part_targets_c(datasets, dirs, out: Path, seeds, args) -> None:
    """Issue 53's restated target (c): Bayesian clients at the library's defaults (:class:`BayesianConfig`, the
    clients at the ELBO's optimum) one shot (IID and Dirichlet(0.5), :data:`TARGETS_C_ONESHOT`) or over ``--rounds``
    rounds (Dirichlet(0.5), :data:`TARGETS_C_ROUNDS`), as ``--c-settings`` says; every row with accuracy, NLL, ECE-15,
    the debiased calibration error, Brier, OOD AUROC (the other data set's test images), their bootstrap intervals
    over the test examples and its paired differences from PFNM and from FedAvg on the same test split (95 % paired
    bootstrap). One JSON line per setting (resumable; seed by seed)."""
    done = _done(out)
    settings = {"oneshot": (("iid", 1), ("dirichlet", 1)), "rounds": (("dirichlet", args.rounds),)}[args.c_settings]
    for seed in seeds:
        for name in datasets:
            ds, ood = _data(name, dirs)
            for partition, rounds in settings:
                key = f"targets-c/{name}/J={args.clients}/{partition}/seed={seed}/rounds={rounds}"
                if key in done:
                    continue
                t0 = time.perf_counter()
                result = run_experiment(
                    ds, ood=ood, partition=PartitionConfig(clients=args.clients, partition=partition),
                    network=NetworkConfig(hidden=(100,)),
                    training=TrainingConfig(epochs=args.epochs, batch_size=64, lr=args.lr,
                                            round_epochs=args.round_epochs),
                    bayesian=BayesianConfig(), fusion=FusionConfig(), pfnm=PFNMConfig(),
                    config=ExperimentConfig(methods=TARGETS_C_ONESHOT if rounds == 1 else TARGETS_C_ROUNDS,
                                            rounds=rounds, seed=seed, ece_bins=15, predictive_samples=args.samples))
                by_name = {r.method: r for r in result.rows}
                references = {label: next(by_name[n] for n in names if n in by_name)
                              for label, names in TARGETS_C_AGAINST.items()}
                _emit(out, key, dict(dataset=name, partition=partition, seed=seed, J=args.clients, rounds=rounds,
                                     epochs=args.epochs, round_epochs=args.round_epochs, lr=args.lr,
                                     bayesian=repr(BayesianConfig()),
                                     rows={r.method: _targets_c_row(r, references, result.test_labels, seed)
                                           for r in result.rows},
                                     warnings=result.warnings, wall_seconds=time.perf_counter() - t0))


def summary(out: Path) -> None:
    """Mean over seeds per (part, dataset, partition, method)."""
    from bnpfed.report import format_table

    groups: dict = {}
    for line in out.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        part = rec["key"].split("/")[0]
        for method, row in rec["rows"].items():
            groups.setdefault((part + rec.get("tag", ""), rec["dataset"], rec["partition"], method), []).append(row)
    table = []
    for (part, dataset, partition, method), rows in groups.items():
        entry = dict(part=part, dataset=dataset, partition=partition, method=method, seeds=len(rows))
        for m in METRICS:
            values = [r[m] for r in rows if r.get(m) is not None and not (isinstance(r[m], float) and math.isnan(r[m]))]
            entry[m] = float(np.mean(values)) if values else None
        table.append(entry)
    print(format_table(table, ["part", "dataset", "partition", "method", "seeds", *METRICS]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mnist-dir", default=str(SHARED / "mnist"))
    p.add_argument("--fashion-dir", default=str(SHARED / "fashion_mnist"))
    p.add_argument("--out", default=str(HERE / "results" / "matched_fusion.jsonl"))
    p.add_argument("--parts", default="oneshot", help="comma-separated: oneshot, rounds, baselines, targets-c")
    p.add_argument("--datasets", default="mnist,fashion-mnist")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--epochs", type=int, default=10, help="local epochs of round 1")
    p.add_argument("--round-epochs", type=int, default=2, help="local epochs of later rounds (rounds part)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--rule", default="conflation", choices=RULES + ("pvi", "atom-posterior"),
                   help="the rule of the rounds part (pvi, atom-posterior: matched fusion only)")
    p.add_argument("--samples", type=int, default=10, help="predictive weight draws")
    p.add_argument("--lr", type=float, default=1e-3, help="local learning rate (Adam)")
    p.add_argument("--init-scale", type=float, default=BayesianConfig().init_scale,
                   help="the Bayesian clients' initial posterior standard deviation")
    p.add_argument("--prior-variance", default="fixed", help="the clients' prior variance: fixed or empirical-bayes")
    p.add_argument("--kl-weight", type=float, default=1.0, help="the clients' KL weight (1: the ELBO)")
    p.add_argument("--scale-lr-factor", type=float, default=1.0, help="the posterior scales' rate as a multiple of lr")
    p.add_argument("--client", default="variational", choices=("variational", "laplace"),
                   help="the Bayesian clients: SVI, or PFNM's trained clients with a diagonal Laplace posterior")
    p.add_argument("--laplace-prior", choices=LAPLACE_PRIORS, default=BayesianConfig().laplace_prior,
                   help="--client laplace: the prior precision, by the evidence (marglik) or a held-out tenth")
    p.add_argument("--expose", default="", help="comma-separated parameter names, the only Bayesian ones (a prior "
                   "N(0, 1) on them; e.g. 3.weight, the output layer of 784-100-10); default: the named prior")
    p.add_argument("--round-prior", choices=ROUND_PRIORS,
                   help="rounds part: a client's prior after round 1, the configured one (default) or the global "
                   "posterior / its slice (posterior as prior, the behaviour before 2026-12-05)")
    p.add_argument("--later-rounds", choices=("auto",) + LATER_ROUNDS, default=FusionConfig().later_rounds,
                   help="rounds part: matched fusion's rounds after the first (FusionConfig.later_rounds)")
    p.add_argument("--pvi-damping", type=float, default=None, help="rule pvi: the factors' damping (default 0.1)")
    p.add_argument("--methods", default="", help="comma-separated methods of the oneshot or rounds part (default: "
                   "all of the part's)")
    p.add_argument("--tag", default="", help="appended to every key (a variant of the settings)")
    p.add_argument("--pool-temperature", type=_pool_temperature, default=1.0,
                   help="the temperature of the pooled rows (pfnm-pooled, match-RULE-pooled): a number or fit")
    p.add_argument("--temperature", type=_pool_temperature, default=1.0,
                   help="the match-RULE rows' predictive temperature (FusionConfig.temperature): a number or fit")
    p.add_argument("--c-settings", choices=("oneshot", "rounds"), default="oneshot",
                   help="targets-c: one shot (IID and Dirichlet(0.5)) or --rounds rounds (Dirichlet(0.5))")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--summary", action="store_true", help="print the tables of --out and stop")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.summary:
        summary(out)
        return
    dirs = {"mnist": args.mnist_dir, "fashion-mnist": args.fashion_dir}
    for name, folder in FOLDERS.items():
        if not (Path(dirs[name]) / folder / "raw").is_dir():
            print(f"skipped: no {name} under {dirs[name]}")
            return
    torch.set_num_threads(args.threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    datasets = args.datasets.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    for part in args.parts.split(","):
        {"oneshot": part_oneshot, "rounds": part_rounds, "baselines": part_baselines,
         "targets-c": part_targets_c}[part](datasets, dirs, out, seeds, args)


if __name__ == "__main__":
    main()

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
* ``deep``: 784-100-100-10, top-down against bottom-up under both sets of constants (J = 10, homogeneous, seed 0);
* ``timing``: matching seconds per round at J = 25 (homogeneous and Dirichlet, seed 0) with the process's default
  BLAS threads, best of 3, under both sets of constants (run it on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bnpfed.data import load_dataset
from bnpfed.federated.pfnm import PFNMSettings, _accuracy, run_pfnm_experiment, width_sweep
from bnpfed.inference import REFERENCE_CONSTANTS
from bnpfed.inference.multilayer import match_networks

HERE = Path(__file__).parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "mnist"


def _done(out: Path) -> set:
    if not out.exists():
        return set()
    return {json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()}


def _emit(out: Path, key: str, payload: dict) -> None:
    with out.open("a") as f:
        f.write(json.dumps({"key": key, **payload}) + "\n")
    print(key, json.dumps(payload)[:300], flush=True)


def part_reference(ds, out: Path, seeds, Js) -> None:
    done = _done(out)
    for J in Js:
        for partition in ("homogeneous", "dirichlet"):
            for seed in seeds:
                key = f"reference/J={J}/{partition}/seed={seed}"
                if key in done:
                    continue
                settings = PFNMSettings(clients=J, partition=partition, seed=seed,
                                        methods=("local", "ensemble", "fedavg", "kmeans", "pfnm"))
                t0 = time.perf_counter()
                run = run_pfnm_experiment(ds, settings, progress=False)
                ref = match_networks(run.local_models, run.class_counts, sigma2=1.0, sigma0_2=1.0, gamma0=1.0,
                                     direction="top-down", sweeps=5, seed=seed, **REFERENCE_CONSTANTS)
                flat = ds.flat()
                rows = {r.method: dict(accuracy=r.accuracy, hidden=r.hidden, seconds=r.seconds) for r in run.rows}
                rows["pfnm (reference constants)"] = dict(
                    accuracy=_accuracy(ref.network(), flat.x_test, flat.y_test), hidden=ref.hidden_sizes,
                    seconds=ref.seconds)
                _emit(out, key, dict(J=J, partition=partition, seed=seed, rows=rows,
                                     wall_seconds=time.perf_counter() - t0))


def part_width(ds, out: Path) -> None:
    key = "width/J=10/homogeneous/seed=0"
    if key in _done(out):
        return
    points = width_sweep(ds, PFNMSettings(clients=10), sigma2=(0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6, 2.0, 3.0),
                         gamma0=(1e-3, 1.0), progress=False)
    _emit(out, key, dict(points=points))


def part_rounds(ds, out: Path, J: int = 25, rounds: int = 10) -> None:
    for partition in ("homogeneous", "dirichlet"):
        key = f"rounds/J={J}/{partition}/seed=0"
        if key in _done(out):
            continue
        settings = PFNMSettings(clients=J, partition=partition, rounds=rounds,
                                methods=("local", "ensemble", "pfnm", "pfnm-rounds", "fedavg-rounds"))
        run = run_pfnm_experiment(ds, settings, progress=False)
        _emit(out, key, dict(rows={r.method: dict(accuracy=r.accuracy, hidden=r.hidden) for r in run.rows},
                             history=run.history))


def part_deep(ds, out: Path) -> None:
    key = "deep/J=10/homogeneous/seed=0"
    if key in _done(out):
        return
    run = run_pfnm_experiment(ds, PFNMSettings(clients=10, hidden=(100, 100), methods=("local", "ensemble")),
                              progress=False)
    flat = ds.flat()
    rows = {r.method: dict(accuracy=r.accuracy, hidden=r.hidden) for r in run.rows}
    for constants in ("bnpfed", "reference"):
        extra = REFERENCE_CONSTANTS if constants == "reference" else {}
        for direction in ("top-down", "bottom-up"):
            r = match_networks(run.local_models, run.class_counts, sigma2=1.0, sigma0_2=1.0, gamma0=1.0,
                               direction=direction, sweeps=5, seed=0, **extra)
            rows[f"pfnm {constants} {direction}"] = dict(
                accuracy=_accuracy(r.network(), flat.x_test, flat.y_test), hidden=r.hidden_sizes, seconds=r.seconds)
    _emit(out, key, dict(rows=rows))


def part_timing(ds, out: Path) -> None:
    for partition in ("homogeneous", "dirichlet"):
        key = f"timing/J=25/{partition}/seed=0"
        if key in _done(out):
            continue
        run = run_pfnm_experiment(ds, PFNMSettings(clients=25, partition=partition, methods=("local",)),
                                  progress=False)
        rows = {}
        for constants in ("bnpfed", "reference"):
            extra = dict(REFERENCE_CONSTANTS, direction="top-down") if constants == "reference" else {}
            results = [match_networks(run.local_models, run.class_counts, sigma2=1.0, sigma0_2=1.0, gamma0=1.0,
                                      sweeps=5, seed=0, **extra) for _ in range(3)]
            best = min(results, key=lambda r: r.seconds)
            rows[constants] = dict(seconds=best.seconds, hidden=best.hidden_sizes,
                                   lsa_seconds=best.layer_results[0].lsa_seconds,
                                   rematches=len(best.layer_results[0].rematches))
        _emit(out, key, dict(rows=rows))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA))
    p.add_argument("--out", default=str(HERE / "results" / "pfnm_mnist.jsonl"))
    p.add_argument("--parts", default="reference,width,rounds,deep,timing")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--clients", default="10,25")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (local training)")
    args = p.parse_args(argv)
    if not (Path(args.data_dir) / "MNIST" / "raw").is_dir():
        print(f"skipped: no MNIST under {args.data_dir}")
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ds = load_dataset("mnist", data_dir=args.data_dir, standardize=False)
    seeds = [int(s) for s in args.seeds.split(",")]
    Js = [int(j) for j in args.clients.split(",")]
    for part in args.parts.split(","):
        {"reference": lambda: part_reference(ds, out, seeds, Js), "width": lambda: part_width(ds, out),
         "rounds": lambda: part_rounds(ds, out), "deep": lambda: part_deep(ds, out),
         "timing": lambda: part_timing(ds, out)}[part]()


if __name__ == "__main__":
    main()

"""The matcher that reads the model: what its general path costs, and what it recovers.

Parts (``--parts``):

* ``cost``: layers drawn from the Gaussian model (J clients, D coordinates, gamma0 = 20, sigma2 = 0.01, sigma0_2 = 1)
  matched with the hyper-parameters given (the marginal objective, the greedy pass and ``--sweeps`` sweeps) by the
  fast path (the closed forms), by the general path on the same Gaussian model (the noise written out as a lambda:
  same assignments) and by the general path with Student-t noise of 3 degrees of freedom (on a layer drawn with it);
  seconds of each, one torch thread;
* ``recovery``: the issue's layers (J = 10, D = 30, sigma0_2 = 0.5, sigma2 = 0.05, gamma0 = 16; Student-t noise of 2
  degrees of freedom) matched by the Gaussian matcher, with ``noise=StudentTNoise(df=2)`` and with the degrees of
  freedom estimated; and layers drawn with concentration 5 (J = 10, D = 10, sigma0_2 = 0.5, sigma2 = 0.05, gamma0 =
  8.7) matched at c = 1, at c = 5 and with c estimated; the adjusted Rand index against the truth and the atom count.

One JSON line per configuration to ``--out``; a configuration already there is skipped.

    python benchmarks/bench_model_matching.py --parts cost --clients 10,25 --dims 50,100,200,400,800
    python benchmarks/bench_model_matching.py --parts recovery --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyro.distributions as dist
import torch
from sklearn.metrics import adjusted_rand_score

from bnpfed.matching import match_layer
from bnpfed.models import StudentTNoise, sample_federated_layer


def gaussian_written_out(loc, variance):
    return dist.Normal(loc, variance.sqrt())


def ari(layer, result) -> float:
    return float(adjusted_rand_score(torch.cat(layer.assignments).numpy(), torch.cat(result.assignments).numpy()))


def done_keys(out: Path) -> set:
    if not out.exists():
        return set()
    return {json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()}


def write(out: Path, row: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def cost(args, out: Path) -> None:
    done = done_keys(out)
    for J in args.clients:
        for D in args.dims:
            key = f"cost/J={J}/D={D}/sweeps={args.sweeps}"
            if key in done:
                continue
            fixed = dict(hyperparameters="fixed", sigma2=0.01, sigma0_2=1.0, gamma0=20.0, mu0=0.0,
                         objective="marginal", sweeps=args.sweeps, seed=0, stop_at_fixed_point=False)
            layer = sample_federated_layer(J, D, seed=0, gamma0=20.0, sigma2=0.01, sigma0_2=1.0)
            heavy = sample_federated_layer(J, D, seed=0, gamma0=20.0, sigma2=0.01, sigma0_2=1.0,
                                           noise=StudentTNoise(df=3.0))
            row = dict(key=key, J=J, D=D, sweeps=args.sweeps, neurons=sum(len(a) for a in layer.assignments),
                       atoms=layer.num_atoms)
            for name, neurons, noise in (("fast", layer.neurons, None), ("general", layer.neurons,
                                                                         gaussian_written_out),
                                         ("student_t", heavy.neurons, StudentTNoise(df=3.0))):
                t0 = time.perf_counter()
                r = match_layer(neurons, noise=noise, **fixed)
                row[name + "_s"] = round(time.perf_counter() - t0, 3)
                row[name + "_atoms"] = r.num_atoms
                row[name + "_rematches"] = len(r.rematches)
            row["general_over_fast"] = round(row["general_s"] / row["fast_s"], 1)
            write(out, row)


def recovery(args, out: Path) -> None:
    done = done_keys(out)
    for seed in args.seeds:
        key = f"recovery/student-t/seed={seed}"
        if key not in done:
            layer = sample_federated_layer(10, 30, seed=seed, gamma0=16.0, sigma2=0.05, sigma0_2=0.5,
                                           noise=StudentTNoise(df=2.0))
            row = dict(key=key, seed=seed, atoms=layer.num_atoms)
            for name, noise in (("gaussian", None), ("student_t_df2", StudentTNoise(df=2.0)),
                                ("student_t_free", StudentTNoise())):
                t0 = time.perf_counter()
                r = match_layer(layer.neurons, seed=0, noise=noise)
                row[name] = dict(ari=round(ari(layer, r), 4), atoms=r.num_atoms, seconds=round(
                    time.perf_counter() - t0, 2), **{k: round(v, 4) for k, v in r.hyperparameters.items()
                                                     if k != "mu0"})
            write(out, row)
        key = f"recovery/concentration-5/seed={seed}"
        if key not in done:
            layer = sample_federated_layer(10, 10, seed=seed, gamma0=8.7, sigma2=0.05, sigma0_2=0.5,
                                           concentration=5.0)
            row = dict(key=key, seed=seed, atoms=layer.num_atoms)
            for name, c in (("c1", 1.0), ("c5", 5.0), ("c_free", None)):
                r = match_layer(layer.neurons, seed=0, concentration=c)
                row[name] = dict(ari=round(ari(layer, r), 4), atoms=r.num_atoms,
                                 **{k: round(v, 4) for k, v in r.hyperparameters.items() if k != "mu0"})
            write(out, row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="cost,recovery", help="comma-separated: cost, recovery")
    parser.add_argument("--clients", default="10,25", help="J values of the cost part")
    parser.add_argument("--dims", default="50,100,200,400,800", help="D values of the cost part")
    parser.add_argument("--sweeps", type=int, default=1, help="sweeps after the greedy pass (cost part)")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="seeds of the recovery part")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default="benchmarks/results/model_matching.jsonl")
    args = parser.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    args.dims = [int(x) for x in args.dims.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",")]
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    parts = args.parts.split(",")
    if "recovery" in parts:
        recovery(args, out)
    if "cost" in parts:
        cost(args, out)


if __name__ == "__main__":
    main()

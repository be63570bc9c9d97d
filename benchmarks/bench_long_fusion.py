"""Posterior fusion at the paper's length: 60 rounds of every rule (and FedAvg) on the bundled digits.

GAA and conflation divide the fused variance by about the number of clients every round; without a floor the
variance leaves float32 after a few dozen rounds and the run diverges. This runs the defaults of ``bnpfed fuse``
(10 IID clients, MLP 64-100-10, 2 local epochs of Adam at 1e-2, N(0, 1) prior on the weight matrices, the fused
variances floored at ``FusionConfig.min_variance`` = 1e-16) for 60 rounds and prints, per method, the final
accuracy, NLL, ECE (100 bins, as in the paper), the smallest fused variance reached, how many weights sit at the
floor, and whether every round's numbers were finite. ``--min-variance`` changes the floor (0 turns it off, to see
the divergence).

Usage: python benchmarks/bench_long_fusion.py [--rounds 60] [--min-variance 1e-16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from bnpfed.combine import available_rules
from bnpfed.data import load_dataset
from bnpfed.federated.config import BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig, TrainingConfig
from bnpfed.federated.fusion import FedAvgFederation, FusionFederation
from bnpfed.clients import TrainingDiverged
from bnpfed.report import format_table

COLUMNS = ["method", "rounds", "accuracy", "nll", "ece_100", "mean_sigma", "min_variance", "floored", "all_finite",
           "seconds", "diverged"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--min-variance", type=float, default=FusionConfig().min_variance)
    p.add_argument("--json", help="write the rows (with per-round histories) here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ds = load_dataset("digits")
    parts = PartitionConfig(clients=10).split(ds.y_train.numpy(), seed=0)
    network, training = NetworkConfig(), TrainingConfig()
    rows, out = [], {}
    for method in (*available_rules(), "fedavg"):
        t0 = time.perf_counter()
        if method == "fedavg":
            federation = FedAvgFederation(ds, parts, network=network, training=training, seed=0, ece_bins=100)
        else:
            federation = FusionFederation(ds, parts, network=network, training=training, bayesian=BayesianConfig(),
                                          fusion=FusionConfig(rule=method, min_variance=args.min_variance), seed=0,
                                          ece_bins=100)
        diverged = ""
        try:
            federation.run(args.rounds)
        except TrainingDiverged as error:
            diverged = f"round {federation.round + 1}: {str(error).split(':')[0]}"
        history = [r.metrics for r in federation.history]
        last = history[-1]
        finite = all(math.isfinite(h[m]) for h in history for m in ("accuracy", "nll", "ece", "brier"))
        rows.append(dict(method=method, rounds=len(history), accuracy=last["accuracy"], nll=last["nll"],
                         ece_100=last["ece"], mean_sigma=last.get("mean_sigma", math.nan),
                         min_variance=min((h.get("min_variance", math.nan) for h in history), default=math.nan),
                         floored=last.get("floored", 0), all_finite=finite, seconds=time.perf_counter() - t0,
                         diverged=diverged or "no"))
        out[method] = history
    print(f"posterior fusion on digits, 10 IID clients, {args.rounds} rounds, min_variance {args.min_variance:g}")
    print(format_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "histories": out}, f, default=str)


if __name__ == "__main__":
    main()

"""Class shares without class counts (issue: pre-trained models in, one global model out).

PFNM's server weighs each client's output coordinates by its class shares. A user with pre-trained networks often
lacks the counts; ``bnpfed match`` then estimates them from each network's own output layer
(:mod:`bnpfed.matching.class_shares`). This benchmark trains label-skewed federations (MNIST-style data split into
J shards of 7 random classes each, or Dirichlet(0.5)), with PFNM's reference schedule (bnpfed's MLP 784-100-10,
pixels in [0, 1]), and matches the same local models with the true counts, with uniform shares, and with the
estimate (and its variants, for the record): one JSON line per federation in ``--out``, PFNM's test accuracy each.

Usage: python benchmarks/bench_class_shares.py [--data-dir ../shared/data] [--out benchmarks/results/class_shares.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
FEDERATIONS = (("digits", 3, "shards7"), ("digits", 10, "dirichlet"), ("mnist", 3, "shards7"),
               ("mnist", 10, "dirichlet"), ("fashion-mnist", 3, "shards7"), ("fashion-mnist", 10, "dirichlet"))


def parts_of(y: np.ndarray, J: int, kind: str, C: int) -> list[np.ndarray]:
    from bnpfed.federated.config import PartitionConfig

    if kind == "dirichlet":
        return PartitionConfig(clients=J, partition="dirichlet", alpha=0.5).split(y, seed=0)
    rng = np.random.default_rng(0)
    parts = []
    for _ in range(J):
        idx = np.flatnonzero(np.isin(y, rng.choice(C, 7, replace=False)))
        parts.append(rng.choice(idx, len(y) // J, replace=False))
    return parts


def one(name: str, J: int, kind: str, data_dir: Path) -> dict:
    from bnpfed.data import load_dataset
    from bnpfed.federated.clients import initial_network, train_network
    from bnpfed.federated.config import PFNM_NETWORK, PFNM_TRAINING, TrainingConfig
    from bnpfed.federated.partition import class_counts
    from bnpfed.matching import derive_spec, match_by_spec
    from bnpfed.matching.class_shares import estimate_class_shares

    folder = None if name == "digits" else str(data_dir / name.replace("-", "_"))
    ds = load_dataset(name, data_dir=folder, standardize=False)
    y, C = ds.y_train.numpy(), ds.num_classes
    parts = parts_of(y, J, kind, C)
    training = PFNM_TRAINING if name != "digits" else TrainingConfig(epochs=20, lr=0.01)
    nets = [train_network(initial_network(PFNM_NETWORK, ds.input_shape, C, seed=0, client=j), ds.x_train[p],
                          ds.y_train[p], training, seed=0, round=1, client=j) for j, p in enumerate(parts)]
    spec = derive_spec(nets[0], ds.input_shape)

    def accuracy(counts) -> float:
        net = match_by_spec(nets, counts, spec, input_shape=ds.input_shape, template=nets[0], seed=0).network()
        with torch.no_grad():
            return float((net(ds.x_test).argmax(-1) == ds.y_test).double().mean())

    row = {"data": name, "J": J, "partition": kind,
           "true counts": accuracy(torch.tensor(class_counts(y, parts, C), dtype=torch.float64)),
           "uniform": accuracy(torch.ones(J, C)), "estimated (bnpfed)": accuracy(estimate_class_shares(nets, spec))}
    for T in (1.0, 0.25):
        row[f"estimated, T = {T}"] = accuracy(estimate_class_shares(nets, spec, temperature=T))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=str(HERE.parent.parent / "shared" / "data"))
    parser.add_argument("--out", default=str(HERE / "results" / "class_shares.jsonl"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    done = {(r["data"], r["J"], r["partition"]) for r in map(json.loads, out.read_text().splitlines())} \
        if out.exists() else set()
    for name, J, kind in FEDERATIONS:
        if (name, J, kind) in done:
            continue
        try:
            row = one(name, J, kind, Path(args.data_dir))
        except FileNotFoundError as error:
            print(f"skipped {name}: {error}")
            continue
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

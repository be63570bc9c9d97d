"""What random crops and flips cost a local fit: one epoch of simple-cnn on CIFAR-10-shaped images (made here, no
data needed), SGD at batch 64, without transforms, with ``"crop"`` and with ``"crop-flip"``, alternated in one
process, best of ``repeats``; and the transform alone per batch. The extra memory of a transform is its padded copy
of the batch and the output, ``B C ((H + 8)(W + 8) + H W)`` floats, freed after the step.

Usage: python benchmarks/bench_augment.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch

from bnpfed.federated.clients import build_network
from bnpfed.federated.config import NetworkConfig
from bnpfed.clients import DeterministicClient
from bnpfed.clients.augment import AUGMENTATIONS, PADDING, augmenter
from bnpfed.report import format_table

SHAPE = (3, 32, 32)
BATCH = 64


def run(quick: bool = False, repeats: int = 3) -> list[dict]:
    n = 640 if quick else 2_560
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, *SHAPE, generator=g), torch.randint(10, (n,), generator=g)
    fit = {a: [] for a in AUGMENTATIONS}
    for _ in range(repeats):
        for augment in AUGMENTATIONS:          # alternated, so drift on a shared machine hits every row alike
            torch.manual_seed(0)
            client = DeterministicClient(build_network(NetworkConfig(arch="simple-cnn"), SHAPE, 10))
            t0 = time.perf_counter()
            client.fit(x, y, epochs=1, batch_size=BATCH, lr=0.01, optimizer="sgd", seed=0, augment=augment)
            fit[augment].append(time.perf_counter() - t0)
    batch = x[:BATCH]
    c, h, w = SHAPE
    extra = BATCH * c * ((h + 2 * PADDING) * (w + 2 * PADDING) + h * w) * batch.element_size()
    rows = []
    for augment in AUGMENTATIONS:
        transform = augmenter(augment)
        if transform is None:
            alone = 0.0
        else:
            draws = torch.Generator().manual_seed(1)
            t0 = time.perf_counter()
            for _ in range(50):
                transform(batch, draws)
            alone = (time.perf_counter() - t0) / 50
        best = min(fit[augment])
        rows.append({"augment": augment, "epoch s (best)": round(best, 3),
                     "x none": round(best / min(fit["none"]), 3),
                     "transform ms / batch": round(1e3 * alone, 3),
                     "extra MiB / batch": 0.0 if transform is None else round(extra / 2**20, 2)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="640 images instead of 2,560")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"simple-cnn, {SHAPE}, batch {BATCH}, SGD, one epoch; torch threads {torch.get_num_threads()}")
    print(format_table(run(args.quick, args.repeats)))


if __name__ == "__main__":
    main()

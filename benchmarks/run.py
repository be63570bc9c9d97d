"""``make bench``: run every benchmark and print its table.

Usage: python benchmarks/run.py [--only matching,...] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bnpfed.report import format_table  # noqa: E402


def bench_matching(quick: bool):
    import bench_matching

    configs = [(10, 795), (30, 795)] if quick else None
    print(format_table(bench_matching.run(configs)))


def bench_fusion_fn(quick: bool):
    import bench_fusion

    bench_fusion.run(quick=quick)  # fusion rules, SVI clients, and (not --quick) the paper's Fashion-MNIST setting


def bench_scaling_fn(quick: bool):
    import bench_scaling

    # the J-scaling table: trained MNIST shards when MNIST is in ../shared/data/mnist, else layers from the model;
    # this machine's results kept (and reused by the next make bench) beside the cached local models, not in
    # benchmarks/results (the recorded runs)
    from pathlib import Path
    clients = (10, 25, 50) if quick else bench_scaling.CLIENTS
    source = "trained" if (Path(bench_scaling.DEFAULT_DATA) / "MNIST" / "raw").is_dir() else "model"
    out = bench_scaling.DEFAULT_CACHE / f"scaling_{source}.jsonl"
    print(f"(results: {out})")
    rows = bench_scaling.run(("mlp",), clients, threads=1, progress=False, out=out, source=source)
    source = rows[0]["source"] if rows else "?"
    print(f"local models: {source}; one thread; seconds of pfnm_step")
    print(format_table(bench_scaling.table(rows)))


def bench_secure_fn(quick: bool):
    import bench_secure

    bench_secure.main(["--quick"] if quick else [])   # posterior fusion under SecAgg+ against plain, same process


def bench_augment_fn(quick: bool):
    import bench_augment

    bench_augment.main(["--quick"] if quick else [])   # a local epoch with random crops (and flips) against none


def bench_pooled_fn(quick: bool):
    import bench_pooled

    bench_pooled.main(["--quick"] if quick else [])   # pooled heads and their posterior against the fused layer


BENCHMARKS = {"matching": bench_matching, "scaling": bench_scaling_fn, "fusion": bench_fusion_fn,
              "secure": bench_secure_fn, "augment": bench_augment_fn, "pooled": bench_pooled_fn}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset of " + ", ".join(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="small configurations only")
    args = parser.parse_args(argv)
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"numpy {np.__version__}, torch threads {torch.get_num_threads()}")
    for name in args.only.split(","):
        if name not in BENCHMARKS:
            raise SystemExit(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
        print(f"\n## {name}")
        t0 = time.perf_counter()
        BENCHMARKS[name](args.quick)
        print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()

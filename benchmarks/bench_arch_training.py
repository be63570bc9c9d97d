"""Which local training should the convolutional networks get by default? (issue 53, item 6)

The clients' local accuracies (each client's network on the whole test split) of the CNNs under three schedules:
Adam (with AMSGrad, batch 32, L2 1e-6: ``PFNM_TRAINING``) at 1e-2, the PFNM reference code's MLP setting and every
architecture's default before issue 53; the same at 1e-3 (``CNN_LR``); and the FedMA reference code's local training
(SGD, momentum 0.9, no weight decay, lr 0.01, batch 64). FedMA's simple-cnn on CIFAR-10 and LeNet on Fashion-MNIST and
MNIST, J = 10, IID, pixels in [0, 1] as ``bnpfed pfnm`` reads them (``--standardize``: standardised), ``--epochs``
local epochs, seeds ``--seeds``. One JSON line per (data, arch, epochs, schedule, seed) to ``--out`` as it ends
(resumable: finished keys are skipped).

    python benchmarks/bench_arch_training.py [--datasets cifar10,fashion-mnist,mnist] [--seeds 0,1,2] [--epochs 2]
    python benchmarks/bench_arch_training.py --summary
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from bnpfed.data import load_dataset
from bnpfed.federated import PFNM_NETWORK, PFNM_TRAINING, ExperimentConfig, PartitionConfig, run_experiment

from bench_pfnm import _done, _emit  # noqa: E402

HERE = Path(__file__).parent
SHARED = HERE.parent.parent / "shared" / "data"
#: (dataset, its folder under --data-root, arch).
SETTINGS = [("cifar10", "cifar10", "simple-cnn"), ("fashion-mnist", "fashion_mnist", "lenet"),
            ("mnist", "mnist", "lenet")]
#: name -> the training over PFNM_TRAINING's: Adam (with AMSGrad) at 1e-2 (PFNM's MLP setting, the CNNs' default
#: before issue 53) and at 1e-3 (CNN_LR), and the FedMA reference code's local training (main.py's train_net: SGD,
#: momentum 0.9, no weight decay; run.sh: lr 0.01, batch 64).
SCHEDULES = {"adam-1e-2": dict(lr=1e-2), "adam-1e-3": dict(lr=1e-3),
             "sgd-fedma": dict(optimizer="sgd", momentum=0.9, lr=0.01, batch_size=64, weight_decay=0.0,
                               amsgrad=False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default=str(SHARED))
    ap.add_argument("--datasets", default=",".join(s[0] for s in SETTINGS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--standardize", action="store_true",
                    help="standardise the inputs (default: pixels in [0, 1], bnpfed pfnm's default)")
    ap.add_argument("--out", default=str(HERE / "results" / "arch_training.jsonl"))
    ap.add_argument("--summary", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.summary:
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        print("| data | arch | epochs | local training | seeds | clients' mean accuracy, per seed | mean over seeds | "
              "client min-max |")
        print("|---|---|---|---|---|---|---|---|")
        groups: dict = {}
        for r in rows:
            groups.setdefault((r["dataset"], r["arch"], r["epochs"], r["schedule"]), []).append(r)
        for (data, arch, epochs, schedule), rs in groups.items():
            rs.sort(key=lambda r: r["seed"])
            means = [r["local_mean"] for r in rs]
            low = min(min(r["local_accuracies"]) for r in rs)
            high = max(max(r["local_accuracies"]) for r in rs)
            print(f"| {data} | {arch} | {epochs} | {schedule} | {','.join(str(r['seed']) for r in rs)} | "
                  f"{', '.join(f'{m:.4f}' for m in means)} | **{statistics.mean(means):.4f}** | "
                  f"{low:.3f}-{high:.3f} |")
        return
    torch.set_num_threads(1)
    done = _done(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    wanted = args.datasets.split(",")
    loaded: dict = {}
    for seed in map(int, args.seeds.split(",")):
        for name, folder, arch in SETTINGS:
            if name not in wanted:
                continue
            for schedule, changes in SCHEDULES.items():
                if schedule not in args.schedules.split(","):
                    continue
                key = f"{name}/{arch}/epochs={args.epochs}/{schedule}/seed={seed}"
                if key in done:
                    continue
                if not (Path(args.data_root) / folder).exists():
                    print(f"{key}: skipped, no data under {Path(args.data_root) / folder}", flush=True)
                    continue
                if name not in loaded:
                    loaded[name] = load_dataset(name, data_dir=Path(args.data_root) / folder,
                                                standardize=args.standardize)
                data = loaded[name]
                start = time.perf_counter()
                result = run_experiment(
                    data, partition=PartitionConfig(clients=10, partition="iid"),
                    network=replace(PFNM_NETWORK, arch=arch),
                    training=replace(PFNM_TRAINING, epochs=args.epochs, **changes),
                    config=ExperimentConfig(methods=("local",), seed=seed))
                accuracies = [float(a) for a in result.local_accuracies]
                _emit(out, key, dict(dataset=name, arch=arch, epochs=args.epochs, schedule=schedule, seed=seed,
                                     clients=10, partition="iid", standardize=args.standardize,
                                     local_accuracies=accuracies,
                                     local_mean=statistics.mean(accuracies),
                                     seconds=time.perf_counter() - start))


if __name__ == "__main__":
    main()

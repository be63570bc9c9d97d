"""Which default brings a Bayesian client to its variational optimum? (issue 51, part 4)

One client at the paper's N(0, 1) prior and the ELBO (no tempering), 784-100-10 on MNIST (the 6,000 digits of
``bench_client_optimum.py``: the first of a seeded shuffle, pixels in [0, 1], so that the 117 pixels that are 0 in
every image give their first-layer weights no likelihood gradient and their optimum is the prior) or 64-100-10 on
the bundled digits; local reparameterisation, initial posterior sd 0.01, Adam at lr 1e-3 (MNIST; 1e-2 on digits, the
federations' default), batch 64. Grid: the scales' learning rate ``scale_lr = F * lr`` (F = 1: one rate for all, the
recorded behaviour) x local epochs. Each row: test accuracy, NLL, ECE (100 bins) of the predictive (10 draws), the
last epoch's -ELBO/n, whether the fit says it converged, and the mean posterior sd of the untouched weights against
the prior's 1. JSON lines to ``--out`` (resumable).

    python benchmarks/bench_client_defaults.py [--dataset mnist|digits] [--summary]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bnpfed.clients import BayesianClient
from bnpfed.data import load_dataset
from bnpfed.metrics import expected_calibration_error
from bnpfed.models import mlp, only_linear_weights

from bench_pfnm import _done, _emit  # noqa: E402

HERE = Path(__file__).parent
SHARED = HERE.parent.parent / "shared" / "data"
#: (scale-rate factor F, epochs) per dataset.
GRID = {"mnist": [(1.0, 10), (1.0, 40), (10.0, 10), (10.0, 40), (30.0, 10), (30.0, 40)],
        "digits": [(1.0, 20), (1.0, 100), (10.0, 20), (10.0, 100), (30.0, 20), (30.0, 100)]}


def _scores(p: torch.Tensor, y: torch.Tensor) -> dict:
    return dict(accuracy=float((p.argmax(1) == y).float().mean()),
                nll=float(-p[torch.arange(len(y)), y].clamp_min(1e-12).log().mean()),
                ece=float(expected_calibration_error(p, y, n_bins=100)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=sorted(GRID), default="mnist")
    ap.add_argument("--mnist-dir", default=str(SHARED / "mnist"))
    ap.add_argument("--out", default=str(HERE / "results" / "client_defaults.jsonl"))
    ap.add_argument("--summary", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.summary:
        print("| data | F = scale_lr / lr | epochs | accuracy | NLL | ECE (100) | -ELBO/n | converged | "
              "untouched sd (prior 1) | s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for line in out.read_text().splitlines():
            r = json.loads(line)
            print(f"| {r['dataset']} | {r['scale_factor']:g} | {r['epochs']} | {r['accuracy']:.4f} | {r['nll']:.3f} "
                  f"| {r['ece']:.4f} | {r['losses'][-1]:.4f} | {r['converged']} | {r['sd_untouched']:.3f} | "
                  f"{r['seconds']:.0f} |")
        return
    torch.set_num_threads(1)
    if args.dataset == "mnist":
        ds = load_dataset("mnist", data_dir=args.mnist_dir, standardize=False)
        idx = torch.randperm(len(ds.x_train), generator=torch.Generator().manual_seed(0))[:6000]
        x, y, x_test, lr = ds.x_train[idx].flatten(1), ds.y_train[idx], ds.x_test.flatten(1), 1e-3
    else:
        ds = load_dataset("digits", standardize=False)
        x, y, x_test, lr = ds.x_train.flatten(1), ds.y_train, ds.x_test.flatten(1), 1e-2
    untouched = x.abs().amax(0) == 0
    done = _done(out)
    for factor, epochs in GRID[args.dataset]:
        key = f"{args.dataset}/F={factor:g}/epochs={epochs}"
        if key in done:
            continue
        t0 = time.perf_counter()
        torch.manual_seed(0)
        c = BayesianClient(mlp(x.shape[1], [100], 10), only_linear_weights(), local_reparameterization=True)
        c.fit(x, y, epochs=epochs, batch_size=64, lr=lr, scale_lr=factor * lr, seed=0)
        sd = c.posterior()["1.weight"].variance.sqrt()
        _emit(out, key, dict(dataset=args.dataset, scale_factor=factor, epochs=epochs,
                             **_scores(c.predict_proba(x_test, num_samples=10, seed=0), ds.y_test),
                             sd_untouched=float(sd[:, untouched].mean()) if bool(untouched.any()) else float("nan"),
                             untouched_inputs=int(untouched.sum()), losses=c.losses_, converged=c.converged_,
                             seconds=time.perf_counter() - t0))


if __name__ == "__main__":
    main()

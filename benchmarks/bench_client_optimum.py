"""Does one Bayesian client reach its variational optimum, and what does the prior do there? (issue 17, part 1)

One MNIST client: 6,000 training digits (the first IID tenth of a seeded shuffle), pixels in [0, 1] (so the pixels
that are 0 in every one of its images give their first-layer weights no likelihood gradient: their optimum is the
prior), 784-100-10, local reparameterisation, initial posterior sd 0.01, Adam lr 1e-3, batch 64, ``--epochs`` epochs.
Grid: prior (the paper's N(0, 1), or the empirical-Bayes variance per weight matrix, EmpiricalBayesPrior) x the
scales' learning rate (``scale_lr = F * lr``, F = 1 is the recorded behaviour) x the KL weight lambda (1: the ELBO;
< 1: tempered). Each row: test accuracy, NLL, ECE (100 bins) of the predictive (10 draws), mean posterior sd of
each layer and of the untouched weights, the prior's sd there, the last epoch's -ELBO/n and whether the fit
converged. A deterministic client with the same schedule is the reference row. JSON lines to ``--out``
(resumable).

    python benchmarks/bench_client_optimum.py [--epochs 10] [--summary]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bnpfed.data import load_dataset
from bnpfed.clients import BayesianClient, DeterministicClient, MeanFieldELBO
from bnpfed.metrics import expected_calibration_error
from bnpfed.models import EmpiricalBayesPrior, mlp, only_linear_weights

from bench_pfnm import _done, _emit  # noqa: E402

HERE = Path(__file__).parent
SHARED = HERE.parent.parent / "shared" / "data"


def _scores(p: torch.Tensor, y: torch.Tensor) -> dict:
    return dict(accuracy=float((p.argmax(1) == y).float().mean()),
                nll=float(-p[torch.arange(len(y)), y].clamp_min(1e-12).log().mean()),
                ece=float(expected_calibration_error(p, y, n_bins=100)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mnist-dir", default=str(SHARED / "mnist"))
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", default=str(HERE / "results" / "client_optimum.jsonl"))
    ap.add_argument("--summary", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.summary:
        print("| prior | scale_lr / lr | KL weight | accuracy | NLL | ECE (100) | sd fc1 | sd untouched (prior sd) "
              "| sd fc2 | -ELBO/n | converged | s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for line in out.read_text().splitlines():
            r = json.loads(line)
            if r["prior"] == "deterministic":
                print(f"| deterministic | - | - | {r['accuracy']:.4f} | {r['nll']:.3f} | {r['ece']:.4f} | - | - | - | "
                      f"- | - | {r['seconds']:.0f} |")
                continue
            print(f"| {r['prior']} | {r['scale_factor']:g} | {r['kl_weight']:g} | {r['accuracy']:.4f} | "
                  f"{r['nll']:.3f} | {r['ece']:.4f} | {r['sd_fc1']:.3f} | {r['sd_untouched']:.3f} "
                  f"({r['prior_sd_fc1']:.3f}) | {r['sd_fc2']:.3f} | {r['losses'][-1]:.3f} | {r['converged']} | "
                  f"{r['seconds']:.0f} |")
        return
    torch.set_num_threads(1)
    ds = load_dataset("mnist", data_dir=args.mnist_dir, standardize=False)
    idx = torch.randperm(len(ds.x_train), generator=torch.Generator().manual_seed(0))[:6000]
    x, y = ds.x_train[idx], ds.y_train[idx]
    untouched = (x.abs().amax(0) == 0).reshape(-1)
    done = _done(out)
    key = f"deterministic/epochs={args.epochs}"
    if key not in done:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        c = DeterministicClient(mlp(784, [100], 10)).fit(x, y, epochs=args.epochs, batch_size=64, lr=1e-3, seed=0)
        _emit(out, key, dict(prior="deterministic", **_scores(c.predict_proba(ds.x_test), ds.y_test),
                             seconds=time.perf_counter() - t0))
    for prior_name in ("normal(0,1)", "empirical-bayes"):
        for factor in (1.0, 10.0):
            for kl_weight in (1.0, 0.1, 0.01):
                key = f"{prior_name}/F={factor:g}/lambda={kl_weight:g}/epochs={args.epochs}"
                if key in done:
                    continue
                t0 = time.perf_counter()
                torch.manual_seed(0)
                prior = only_linear_weights() if prior_name == "normal(0,1)" else EmpiricalBayesPrior()
                c = BayesianClient(mlp(784, [100], 10), prior, local_reparameterization=True,
                                   elbo=MeanFieldELBO(kl_weight=kl_weight))
                c.fit(x, y, epochs=args.epochs, batch_size=64, lr=1e-3, scale_lr=factor * 1e-3, seed=0)
                post = c.posterior()
                sd1, sd2 = post["1.weight"].variance.sqrt(), post["3.weight"].variance.sqrt()
                prior_sd = c.bnn.prior_distributions()["1.weight"].base_dist.scale.reshape(-1)[0].item()
                _emit(out, key, dict(prior=prior_name, scale_factor=factor, kl_weight=kl_weight, epochs=args.epochs,
                                     **_scores(c.predict_proba(ds.x_test, num_samples=10, seed=0), ds.y_test),
                                     sd_fc1=float(sd1.mean()), sd_untouched=float(sd1[:, untouched].mean()),
                                     untouched_inputs=int(untouched.sum()), prior_sd_fc1=prior_sd,
                                     sd_fc2=float(sd2.mean()), losses=c.losses_, converged=c.converged_,
                                     seconds=time.perf_counter() - t0))


if __name__ == "__main__":
    main()

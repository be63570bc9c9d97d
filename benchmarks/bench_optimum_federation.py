"""Why do the averaging rules fall to chance when the clients' scales learn, and which objective should the defaults
declare: the ELBO, or a KL-tempered one with its weight chosen on each client's held-out split? (issue 51, part 4)

Two parts, on the bundled digits (64-100-10, the N(0, 1) prior on the weight matrices, local reparameterisation):

* ``federation``: ``bnpfed fuse``'s defaults (J = 10 IID clients of about 135 examples, 2 local epochs a round of
  Adam at 1e-2, batch 32, 5 rounds) under a rule, with the guide's scales at ``F`` times the means' rate, optionally
  E local epochs a round. After every round: the global model's test accuracy and NLL, the clients' own (each
  client's posterior after its local fit, predicting alone; their mean) and the clients' mean posterior sd.
* ``tempering``: each client of that partition alone, 20 % of its examples held out (``holdout_split``), fitted for
  100 epochs at ``F = 10`` under ``lambda KL - sum log-lik`` for each lambda of a grid; the held-out NLL that would
  choose lambda per client, the test accuracy and NLL, the mean posterior sd.

JSON lines to ``--out`` (resumable); ``--summary`` prints the tables of the docs' calibration page.

    python benchmarks/bench_optimum_federation.py --part federation
    python benchmarks/bench_optimum_federation.py --part tempering
    python benchmarks/bench_optimum_federation.py --summary
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from bnpfed.clients import BayesianClient, MeanFieldELBO
from bnpfed.data import load_dataset
from bnpfed.federated.config import BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig, TrainingConfig
from bnpfed.federated.fusion import FusionFederation
from bnpfed.federated.partition import holdout_split
from bnpfed.models import mlp, only_linear_weights

from bench_pfnm import _done, _emit  # noqa: E402

HERE = Path(__file__).parent
#: (F, rule, local epochs a round, rounds) of the federation part.
FEDERATIONS = [(1.0, "eaa", 2, 5), (10.0, "eaa", 2, 5), (10.0, "conflation", 2, 5), (10.0, "gaa", 2, 5),
               (10.0, "eaa", 20, 5), (10.0, "eaa", 100, 2)]
#: The KL weights of the tempering part.
KL_WEIGHTS = (1.0, 0.3, 0.1, 0.03, 0.01)


def _scores(p: torch.Tensor, y: torch.Tensor) -> dict:
    return dict(acc=round(float((p.argmax(1) == y).float().mean()), 4),
                nll=round(float(-p[torch.arange(len(y)), y].clamp_min(1e-12).log().mean()), 3))


def federation(ds, parts, out: Path) -> None:
    done = _done(out)
    for factor, rule, epochs, rounds in FEDERATIONS:
        key = f"federation/F={factor:g}/{rule}/E={epochs}"
        if any(k.startswith(key + "/") for k in done):
            continue
        t0 = time.perf_counter()
        fed = FusionFederation(ds, parts, network=NetworkConfig(), training=TrainingConfig(epochs=epochs),
                               bayesian=BayesianConfig(scale_lr_factor=factor), fusion=FusionConfig(rule=rule),
                               seed=0)
        for r in range(rounds):
            fed.run_round()
            own = [_scores(c.predict_proba(ds.x_test, num_samples=10, seed=0), ds.y_test) for c in fed.clients]
            sd = [float(torch.cat([v.variance.sqrt().flatten() for v in c.posterior().values()]).mean())
                  for c in fed.clients]
            _emit(out, f"{key}/round={r + 1}", dict(
                part="federation", F=factor, rule=rule, epochs=epochs, round=r + 1,
                global_=_scores(fed.predict_proba(ds.x_test), ds.y_test),
                client_acc=round(sum(c["acc"] for c in own) / len(own), 4),
                client_nll=round(sum(c["nll"] for c in own) / len(own), 3), client_sd=round(sum(sd) / len(sd), 3),
                converged=[c.converged_ for c in fed.clients], seconds=round(time.perf_counter() - t0)))


def tempering(ds, parts, out: Path) -> None:
    done = _done(out)
    train, held = holdout_split(parts, 0.2, 0)
    for j in range(len(parts)):
        x, y = ds.x_train[torch.as_tensor(train[j])], ds.y_train[torch.as_tensor(train[j])]
        xv, yv = ds.x_train[torch.as_tensor(held[j])], ds.y_train[torch.as_tensor(held[j])]
        for kl in KL_WEIGHTS:
            key = f"tempering/client={j}/kl={kl:g}"
            if key in done:
                continue
            t0 = time.perf_counter()
            torch.manual_seed(0)
            c = BayesianClient(mlp(64, [100], 10), only_linear_weights(), local_reparameterization=True,
                               elbo=MeanFieldELBO(kl_weight=kl))
            c.fit(x, y, epochs=100, batch_size=32, lr=1e-2, scale_lr=10 * 1e-2, seed=0)
            sd = c.posterior()["1.weight"].variance.sqrt()
            _emit(out, key, dict(part="tempering", j=j, n=len(y), n_held_out=len(yv), kl=kl,
                                 val=_scores(c.predict_proba(xv, num_samples=10, seed=0), yv),
                                 test=_scores(c.predict_proba(ds.x_test, num_samples=10, seed=0), ds.y_test),
                                 sd_all=round(float(sd.mean()), 3), loss=round(c.losses_[-1], 3),
                                 converged=c.converged_, seconds=round(time.perf_counter() - t0, 1)))


def summary(out: Path) -> None:
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    print("| F | rule | local epochs | round | global accuracy | global NLL | clients' own accuracy | "
          "clients' own NLL | clients' mean sd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in (r for r in rows if r["part"] == "federation"):
        print(f"| {r['F']:g} | {r['rule']} | {r['epochs']} | {r['round']} | {r['global_']['acc']:.4f} | "
              f"{r['global_']['nll']:.3f} | {r['client_acc']:.4f} | {r['client_nll']:.3f} | {r['client_sd']:.3f} |")
    temper = [r for r in rows if r["part"] == "tempering"]
    if not temper:
        return
    by = defaultdict(list)
    for r in temper:
        by[r["kl"]].append(r)
    print("\n| KL weight | held-out NLL | test accuracy | test NLL | mean sd (first layer) | converged |")
    print("|---|---|---|---|---|---|")
    for kl, rs in by.items():
        n = len(rs)
        print(f"| {kl:g} | {sum(r['val']['nll'] for r in rs) / n:.3f} | {sum(r['test']['acc'] for r in rs) / n:.4f} "
              f"| {sum(r['test']['nll'] for r in rs) / n:.3f} | {sum(r['sd_all'] for r in rs) / n:.3f} | "
              f"{sum(bool(r['converged']) for r in rs)} of {n} |")
    best = {}
    for r in temper:
        if r["j"] not in best or r["val"]["nll"] < best[r["j"]]["val"]["nll"]:
            best[r["j"]] = r
    chosen = [best[j] for j in sorted(best)]
    n, kls = len(chosen), ", ".join(f"{b['kl']:g}" for b in chosen)
    print(f"| chosen per client on its held-out split ({kls}) | "
          f"{sum(b['val']['nll'] for b in chosen) / n:.3f} | {sum(b['test']['acc'] for b in chosen) / n:.4f} | "
          f"{sum(b['test']['nll'] for b in chosen) / n:.3f} | {sum(b['sd_all'] for b in chosen) / n:.3f} | |")
    print(f"\n{sum(r['seconds'] for r in temper):.0f} s for the {len(temper)} tempering fits "
          f"({len(KL_WEIGHTS)} per client)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("federation", "tempering"), default="federation")
    ap.add_argument("--out", default=str(HERE / "results" / "optimum_federation.jsonl"))
    ap.add_argument("--summary", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.summary:
        summary(out)
        return
    torch.set_num_threads(1)
    ds = load_dataset("digits")
    parts = PartitionConfig().split(ds.y_train.numpy(), seed=0)
    (federation if args.part == "federation" else tempering)(ds, parts, out)


if __name__ == "__main__":
    main()

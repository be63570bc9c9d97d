"""Posterior fusion under secure aggregation (SecAgg+): what the quantisation costs, and what the protocol costs.

For each rule of :data:`bnpfed.combine.secure.SECURE_RULES`, a Flower federation of J clients on the in-process grid
(:class:`bnpfed.flower.local.LocalGrid`: every SecAgg+ stage is a real Flower message through Flower's own
``SecAggPlusWorkflow`` and ``secaggplus_mod``, without processes or network) is run plain
(:class:`~bnpfed.flower.strategies.PosteriorFusionStrategy`) and under SecAgg+
(:class:`~bnpfed.flower.secure.SecureFusionStrategy`), same settings and seed, in the same process. One JSON line per
(rule, mode): wall seconds of the whole run, per round; the server step's seconds (for SecAgg+ this is the protocol:
its four stages, the clients' key agreement and masking included, as the grid runs them in process); the test
accuracy / NLL / ECE; and for SecAgg+ the largest difference of the global posterior from the plain run's (means in
units of the plain global standard deviation, variances relative).

Usage: python benchmarks/bench_secure.py [--clients 10] [--rounds 2] [--dataset digits] [--data-dir DIR]
       [--rules eaa,...] [--out benchmarks/results/secure_fusion.jsonl] [--quick]
       python benchmarks/bench_secure.py --loopback [--clients 10] [--rounds 1] [--out ...]   (real processes)
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent


def run_one(rule: str, secure: bool, clients: int, rounds: int, dataset: str, data_dir: str | None) -> tuple:
    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    config = {"method": "fusion", "rule": rule, "rounds": rounds, "dataset": dataset, "epochs": 1,
              "secure-aggregation": secure}
    node_config = {"data-dir": data_dir} if data_dir else None
    start = time.perf_counter()
    result = run_federation(LocalGrid(client_app, clients, node_config=node_config), config)
    return result, time.perf_counter() - start


def difference(secure: dict, plain: dict) -> dict:
    """Largest |secure - plain| of the global means in plain standard deviations, of the variances relative."""
    loc, var, param = 0.0, 0.0, 0.0
    for key, value in plain.items():
        kind, _, site = key.partition("/")
        if kind == "loc":
            sd = np.sqrt(plain[f"variance/{site}"].astype(np.float64))
            loc = max(loc, float(np.max(np.abs(secure[key] - value) / sd)))
        elif kind == "variance":
            var = max(var, float(np.max(np.abs(secure[key] - value) / value)))
        else:
            param = max(param, float(np.max(np.abs(secure[key] - value))))
    return {"loc_in_sd": loc, "variance_relative": var, "param_absolute": param}


def run(clients: int, rounds: int, dataset: str, data_dir: str | None, out: Path | None, rules=None) -> list[dict]:
    from bnpfed.combine.secure import SECURE_RULES

    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    run_one("eaa", True, 2, 1, dataset, data_dir)   # warm-up: the first SVI fit and key agreement of a process
    rows = []
    for rule in rules or SECURE_RULES:
        plain = plain_row = None   # the plain run, which SecAgg+'s is compared with
        for secure in (False, True):
            result, seconds = run_one(rule, secure, clients, rounds, dataset, data_dir)
            last = result.history[-1]
            row = {"rule": rule, "mode": "secagg+" if secure else "plain", "clients": clients, "rounds": rounds,
                   "dataset": dataset, "seconds": seconds, "seconds_per_round": seconds / rounds,
                   "server_seconds": float(np.mean([r["server_seconds"] for r in result.history])),
                   "accuracy": last.get("accuracy"), "nll": last.get("nll"), "ece": last.get("ece")}
            if secure:
                row.update(difference(result.arrays, plain.arrays),
                           quantisation_bound=last["quantisation_bound"])
                row["round_ratio"] = row["seconds_per_round"] / plain_row["seconds_per_round"]
            else:
                plain, plain_row = result, row
            rows.append(row)
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    return rows


def run_loopback(clients: int, rounds: int, out: Path | None) -> list[dict]:
    """The same comparison on a real deployment: a SuperLink and ``clients`` SuperNodes as separate processes on
    127.0.0.1 (the test harness's :func:`flower_harness.loopback`), ``flwr run`` of the example app, conflation on
    the bundled digits; runs plain, SecAgg+, plain again (the plain time is their mean). Wall seconds from ``flwr
    run`` to the run's ``finished:completed`` (polled every 3 s)."""
    import sys
    import tempfile

    sys.path.insert(0, str(HERE.parent / "tests"))
    from flower_harness import loopback

    rows = []
    config = {"method": "fusion", "rule": "conflation", "rounds": rounds, "epochs": 1}
    with tempfile.TemporaryDirectory() as root, loopback(Path(root), seconds=7200, num_nodes=clients) as deployment:
        for k, secure in enumerate((False, True, False)):
            start = time.perf_counter()
            ((_, summary, _),) = list(deployment.run({f"run{k}": {**config, "secure-aggregation": secure}}))
            seconds = time.perf_counter() - start
            server = float(np.mean([r["server_seconds"] for r in summary["results"]["rounds"]]))
            row = {"rule": "conflation", "mode": "secagg+" if secure else "plain", "where": "loopback",
                   "clients": clients, "rounds": rounds, "dataset": "digits", "seconds": seconds,
                   "seconds_per_round": seconds / rounds, "server_seconds": server}
            rows.append(row)
            print(json.dumps(row), flush=True)
    plain = float(np.mean([r["seconds_per_round"] for r in rows if r["mode"] == "plain"]))
    rows[1]["round_ratio"] = rows[1]["seconds_per_round"] / plain
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return rows


def table(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        out.append({"rule": r["rule"], "mode": r["mode"], "J": r["clients"], "s/round": f"{r['seconds_per_round']:.1f}",
                    "server s": f"{r['server_seconds']:.2f}", "x plain": f"{r.get('round_ratio', 1.0):.2f}",
                    "acc": f"{r['accuracy']:.4f}", "ece": f"{r['ece']:.4f}",
                    "max dloc/sd": f"{r['loc_in_sd']:.1e}" if "loc_in_sd" in r else "-",
                    "max dvar/var": f"{r['variance_relative']:.1e}" if "variance_relative" in r else "-"})
    return out


def main(argv=None):
    from bnpfed.report import format_table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--rules", default=None, help="comma-separated subset of the rules (default all four)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="conflation only, 3 clients, one round")
    parser.add_argument("--loopback", action="store_true", help="on a loopback deployment (separate processes)")
    args = parser.parse_args(argv)
    if args.loopback:
        for row in run_loopback(args.clients, args.rounds, args.out):
            print(json.dumps(row))
        return
    if args.quick:
        rows = run(3, 1, "digits", None, args.out, rules=("conflation",))
    else:
        rows = run(args.clients, args.rounds, args.dataset, args.data_dir, args.out,
                   rules=tuple(args.rules.split(",")) if args.rules else None)
    print(format_table(table(rows)))


if __name__ == "__main__":
    main()

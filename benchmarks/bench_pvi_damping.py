"""PVI's damping (issue 53, item 4): final accuracy, NLL and calibration, and what is left of a round-1 error, for
each damping rho, over seeds, on ``bnpfed fuse``'s own settings.

Each configuration is one ``bnpfed fuse --align match --rule pvi --experimental pvi-damping=RHO`` run (the command's
defaults otherwise: the bundled digits, J = 10 IID clients, MLP 100, 2 local epochs, N(0, 1) prior), ``--rounds``
rounds, its JSON kept whole in the line (per-round metrics of ``match-pvi`` and of ``pfnm`` rounds, every final
metric's bootstrap interval over the test examples). A client's factor moves rho of the way to its new value from the
second round on, so a round-1 error in a factor is ``(1 - rho) ** (R - 1)`` of itself after R rounds when the later
updates are exact (a Gaussian likelihood: ``tests/test_pvi_damping.py``); the line records that number beside the
measured ones.

JSON lines to ``--out``, resumable (finished keys are skipped). ``--summary`` prints the table from ``--out``.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/bench_pvi_damping.py --dampings 0.1,0.3,0.5,1 \\
        --seeds 0,1,2 --rounds 10 --out benchmarks/results/pvi_damping_digits.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent


def _done(out: Path) -> set:
    if not out.exists():
        return set()
    return {json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()}


#: The prototype of a harmonic schedule (the k-th update of a factor moves 1/k of the way), run as ``rho="harmonic"``.
HARMONIC = HERE / "results" / "pvi_damping_harmonic.py.txt"


def run_one(rho, seed: int, rounds: int, extra: list[str]) -> dict:
    """One ``bnpfed fuse`` run of PVI at damping ``rho`` (a number, or ``"harmonic"``: the prototype
    :data:`HARMONIC`); returns its JSON document."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        schedule = isinstance(rho, str)
        head = [sys.executable, str(HARMONIC)] if schedule else [sys.executable, "-m", "bnpfed.cli"]
        damping = [] if schedule else ["--experimental", f"pvi-damping={rho}"]
        command = head + ["fuse", "--align", "match", "--rule", "pvi", "--no-fedavg", "--rounds", str(rounds),
                          "--seed", str(seed), *damping, "--no-progress", "--json", str(path)] + extra
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if schedule:   # "harmonic" or "harmonic-floor=F": rho_k = max(1/k, F)
            env["PVI_HARMONIC_FLOOR"] = rho.partition("=")[2] or "0"
        subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        return json.loads(path.read_text())


def error_left(rho, r: int) -> float:
    """The share of a round-1 factor error left after round ``r`` when the later updates are exact."""
    if isinstance(rho, str):   # prod_{k=2..r} (1 - max(1/k, floor))
        floor = float(rho.partition("=")[2] or 0)
        left = 1.0
        for k in range(2, r + 1):
            left *= 1 - max(1.0 / k, floor)
        return left
    return (1 - rho) ** (r - 1)


def summarize(document: dict, rho, rounds: int) -> dict:
    """The line's numbers: the final row of ``match-pvi`` (with intervals), its per-round history, and the closed-form
    share of a round-1 factor error left after each round."""
    results = document["results"]
    rows = {row["method"]: row for row in results["runs"][0]["rows"]}
    history = [{k: r.get(k) for k in ("round", "accuracy", "nll", "ece15", "ece_debiased", "brier", "mean_sigma",
                                      "hidden", "improper", "cavity_at_prior")}
               for r in results["rounds"] if r["method"] == "match-pvi"]
    keep = ("accuracy", "nll", "ece", "ece15", "ece_debiased", "brier", "width", "mean_sigma", "intervals")
    return {"rows": {m: {k: row.get(k) for k in keep} for m, row in rows.items()}, "history": history,
            "error_left": [error_left(rho, r) for r in range(1, rounds + 1)]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dampings", default="0.1,0.3,0.5,1",
                   help="numbers in (0, 1], harmonic or harmonic-floor=F (the prototype: rho_k = max(1/k, F))")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tag", default="", help="appended to the key (for runs with --extra)")
    p.add_argument("--extra", default="", help="further bnpfed fuse flags, one string (e.g. '--dataset mnist ...')")
    p.add_argument("--out", type=Path, default=HERE / "results" / "pvi_damping_digits.jsonl")
    p.add_argument("--summary", action="store_true", help="print the table from --out instead of running")
    args = p.parse_args(argv)
    if args.summary:
        print_summary(args.out)
        return
    done = _done(args.out)
    extra = args.extra.split()
    for rho in [x if x.startswith("harmonic") else float(x) for x in args.dampings.split(",")]:
        for seed in [int(x) for x in args.seeds.split(",")]:
            key = f"pvi/rho={rho}/seed={seed}/rounds={args.rounds}{args.tag}"
            if key in done:
                continue
            t0 = time.perf_counter()
            line = dict(key=key, rho=rho, seed=seed, rounds=args.rounds, extra=args.extra,
                        **summarize(run_one(rho, seed, args.rounds, extra), rho, args.rounds),
                        wall_seconds=time.perf_counter() - t0)
            with args.out.open("a") as f:
                f.write(json.dumps(line) + "\n")
            print(key, line["rows"]["match-pvi"]["accuracy"], f"{line['wall_seconds']:.0f}s", flush=True)


def label(rho: str) -> str:
    """A damping's name in the table: the number, ``1/k (harmonic)`` or ``max(1/k, F)``."""
    if rho == "harmonic":
        return "1/k (harmonic)"
    if rho.startswith("harmonic-floor="):
        return f"max(1/k, {rho.partition('=')[2]})"
    return rho


def print_summary(out: Path, at=(5, 10, 25)) -> None:
    """A markdown table, one line per damping (and rounds of the run): the share of a round-1 error left after the
    rounds ``at`` (closed form), the mean over seeds of accuracy and NLL at each (the seeds' range in brackets), the
    final round's ECE-15, the mean of the seeds' 95 % bootstrap intervals of the final accuracy (half-width), and how
    many seeds end below their round-1 accuracy (a run that came apart)."""
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    groups: dict = {}
    for line in lines:
        groups.setdefault((str(line["rho"]), line["rounds"], line.get("extra", "")), []).append(line)
    head = ["damping", "rounds", "seeds", *(f"error left after {r}" for r in at),
            *(f"accuracy, round {r}" for r in at), *(f"NLL, round {r}" for r in at), "ECE-15, last round",
            "accuracy interval (last round)", "seeds below round 1"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    order = sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0].startswith("harmonic"),
                                                   kv[0][0] if kv[0][0].startswith("harmonic") else float(kv[0][0])))
    for (rho, rounds, _), group in order:
        def cell(metric, r, digits=4):
            values = [next(h[metric] for h in g["history"] if h["round"] == r) for g in group]
            if len(values) == 1:
                return f"{values[0]:.{digits}f}"
            return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"
        left = [f"{error_left(rho if rho.startswith('harmonic') else float(rho), r):.3f}" for r in at]
        intervals = [g["rows"]["match-pvi"]["intervals"]["accuracy"] for g in group]
        widths = [(high - low) / 2 for low, high in intervals]
        below = sum(1 for g in group if g["history"][-1]["accuracy"] < g["history"][0]["accuracy"])
        print("| " + " | ".join([
            label(rho), str(rounds), ",".join(str(g["seed"]) for g in group),
            *left, *(cell("accuracy", r) if r <= rounds else "-" for r in at),
            *(cell("nll", r, 3) if r <= rounds else "-" for r in at), cell("ece15", rounds),
            f"+/- {statistics.mean(widths):.4f}", f"{below} of {len(group)}"]) + " |")


if __name__ == "__main__":
    main()

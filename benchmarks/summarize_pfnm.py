"""Tables (and the width plot) from the JSON lines written by ``bench_pfnm.py``.

Usage: python benchmarks/summarize_pfnm.py benchmarks/results/pfnm_mnist_*.jsonl [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bnpfed.report import format_table  # noqa: E402

# The published reference code run on this machine (the PFNM issue): seed 0, and the mean over seeds 0-4 (J = 10).
PUBLISHED = {
    ("homogeneous", "seed0"): dict(local=0.94, ensemble=0.969, fedavg=0.124, pfnm=0.9665, width=408, seconds=4.3),
    ("dirichlet", "seed0"): dict(local=0.73, ensemble=0.951, fedavg=0.174, pfnm=0.953, width=389, seconds=4.1),
    ("homogeneous", "mean"): dict(ensemble=0.9692, pfnm=0.9681, width=413),
    ("dirichlet", "mean"): dict(ensemble=0.9503, pfnm=0.9499, width=388),
}


#: Row names written by earlier versions of bench_pfnm.py, and partition names, as they are called now.
ALIASES = {"local (mean)": "local-mean", "fedavg (1 round)": "fedavg-oneshot", "k-means": "kmeans",
           "pfnm (1 round)": "pfnm", "homogeneous": "iid"}


def load(paths):
    records = {}
    for path in paths:
        for line in open(path):
            if line.strip():
                rec = json.loads(line)
                if "rows" in rec:
                    rec["rows"] = {ALIASES.get(k, k): v for k, v in rec["rows"].items()}
                if "partition" in rec:
                    rec["partition"] = ALIASES.get(rec["partition"], rec["partition"])
                key = "/".join(ALIASES.get(part, part) for part in rec["key"].split("/"))
                records[key] = rec
    return records


def pareto(points):
    """Points (width, accuracy) not beaten by a narrower-or-equal point with higher-or-equal accuracy."""
    front, best = [], -1.0
    for w, a in sorted(points, key=lambda p: (p[0], -p[1])):
        if a > best:
            front.append((w, a))
            best = a
    return front


def dominates(front_a, front_b):
    """Every point of front_b has a point of front_a at no larger width with at least its accuracy."""
    return all(any(wa <= wb and aa >= ab for wa, aa in front_a) for wb, ab in front_b)


def reference_tables(records):
    groups = defaultdict(list)
    for key, rec in records.items():
        if key.startswith("reference/"):
            groups[(rec["J"], rec["partition"])].append(rec)
    out = []
    for (J, partition), recs in sorted(groups.items()):
        recs.sort(key=lambda r: r["seed"])
        for label, chosen in (("seed 0", [r for r in recs if r["seed"] == 0]), (f"mean of {len(recs)} seeds", recs)):
            if not chosen:
                continue

            def m(method, field="accuracy"):
                vals = [r["rows"][method][field] for r in chosen]
                vals = [sum(v) if isinstance(v, list) else v for v in vals]
                return float(np.mean(vals))

            out.append(dict(J=J, partition=partition, seeds=label, local_mean=m("local-mean"),
                            ensemble=m("ensemble"), fedavg_no_shared=m("fedavg-oneshot"), kmeans=m("kmeans"),
                            pfnm=m("pfnm"), pfnm_width=m("pfnm", "hidden"), pfnm_s=m("pfnm", "seconds"),
                            ref_constants=m("pfnm (reference constants)"),
                            ref_width=m("pfnm (reference constants)", "hidden"),
                            ref_s=m("pfnm (reference constants)", "seconds")))
    return out


def eb_tables(records):
    """Mean over seeds (and seed 0) of the eb/ records: local, ensemble, EB PFNM and fixed 1-1-1 PFNM."""
    groups = defaultdict(list)
    for key, rec in records.items():
        if key.startswith("eb/"):
            groups[(rec["J"], rec["partition"])].append(rec)
    out = []
    for (J, partition), recs in sorted(groups.items()):
        recs.sort(key=lambda r: r["seed"])
        for label, chosen in (("seed 0", [r for r in recs if r["seed"] == 0]), (f"mean of {len(recs)} seeds", recs)):
            if not chosen:
                continue

            def m(method, field="accuracy"):
                vals = [r["rows"][method][field] for r in chosen]
                return float(np.mean([sum(v) if isinstance(v, list) else v for v in vals]))

            name = "homogeneous" if partition == "iid" else partition   # the published table's word
            published = PUBLISHED.get((name, "seed0" if label == "seed 0" else "mean"), {}) if J == 10 else {}
            out.append(dict(J=J, partition=partition, seeds=label, local_mean=m("local-mean"), ensemble=m("ensemble"),
                            eb_pfnm=m("pfnm"), eb_width=m("pfnm", "hidden"), eb_s=m("pfnm", "seconds"),
                            fixed_111=m("pfnm fixed 1-1-1"), fixed_width=m("pfnm fixed 1-1-1", "hidden"),
                            fixed_s=m("pfnm fixed 1-1-1", "seconds"),
                            published=published.get("pfnm", float("nan")),
                            published_width=published.get("width", float("nan"))))
    return out


def eb_estimates(records):
    out = []
    for key, rec in sorted(records.items()):
        if key.startswith("eb/"):
            (layer,) = rec["rows"]["pfnm"]["layers"][:1]
            out.append(dict(J=rec["J"], partition=rec["partition"], seed=rec["seed"], sigma2=layer["sigma2"],
                            sigma0_2=layer["sigma0_2"], gamma0=layer["gamma0"], sweeps=layer["sweeps"],
                            converged=layer["converged"], width=sum(rec["rows"]["pfnm"]["hidden"]),
                            seconds=rec["rows"]["pfnm"]["seconds"]))
    return out


def plot_plane(points, eb_records, width_record, path):
    """Accuracy against global width: fixed-hyper-parameter sweeps of both objectives, the reference constants'
    sweep, and empirical Bayes as one point per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for objective, marker in (("map", "o"), ("marginal", "s")):
        mine = sorted((q["width"], q["accuracy"]) for q in points if q["objective"] == objective)
        ax.scatter(*zip(*mine), marker=marker, alpha=0.6, label=f"fixed hyper-parameters, {objective} objective")
        ax.step(*zip(*pareto(mine)), where="post", alpha=0.5)
    if width_record:
        ref = sorted((q["width"], q["accuracy"]) for q in width_record["points"] if q["constants"] == "reference")
        ax.scatter(*zip(*ref), marker="^", alpha=0.6, label="reference constants (sigma2 swept)")
    for seed_rec in eb_records:
        row = seed_rec["rows"]["pfnm"]
        ax.scatter(sum(row["hidden"]), row["accuracy"], marker="*", s=160, color="crimson", zorder=5,
                   label="empirical Bayes (one per seed)" if seed_rec is eb_records[0] else None)
    pub = PUBLISHED[("homogeneous", "mean")]
    ax.scatter(pub["width"], pub["pfnm"], marker="X", s=120, color="black", zorder=5,
               label="published code (mean of seeds 0-4)")
    ax.set(xlabel="global hidden size", ylabel="test accuracy", xscale="log",
           title="PFNM on MNIST (J = 10, IID): accuracy against global width")
    ax.set_ylim(0.94, 0.975)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("paths", nargs="+")
    p.add_argument("--plot", help="PNG of accuracy against global width")
    p.add_argument("--plane-plot", help="PNG of the accuracy-width plane with the empirical-Bayes points")
    args = p.parse_args(argv)
    records = load(args.paths)

    rows = reference_tables(records)
    if rows:
        print("## One-shot PFNM on MNIST, 784-100-10 (this repo)")
        print(format_table(rows))
        print("\n## The published reference code on this machine (from the issue)")
        print(format_table([dict(partition=k[0], seeds=k[1], **v) for k, v in PUBLISHED.items()]))

    width = records.get("width/J=10/iid/seed=0")
    if width:
        pts = width["points"]
        print("\n## Accuracy against global width (J = 10, homogeneous, seed 0)")
        print(format_table(sorted(pts, key=lambda q: (q["constants"], q["width"])),
                           ["constants", "sigma2", "gamma0", "width", "accuracy", "seconds"]))
        fronts = {c: pareto([(q["width"], q["accuracy"]) for q in pts if q["constants"] == c])
                  for c in ("bnpfed", "reference")}
        for c, f in fronts.items():
            print(f"Pareto front, {c} constants: " + ", ".join(f"({w}, {a:.4f})" for w, a in f))
        print("bnpfed front dominates the reference-constants front:", dominates(fronts["bnpfed"], fronts["reference"]))
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 4))
            for c, marker in (("bnpfed", "o"), ("reference", "s")):
                mine = [(q["width"], q["accuracy"]) for q in pts if q["constants"] == c]
                ax.scatter(*zip(*mine), marker=marker, label=f"{c} constants", alpha=0.7)
                ax.step(*zip(*fronts[c]), where="post", alpha=0.6)
            ax.set(xlabel="global hidden size", ylabel="test accuracy", xscale="log",
                   title="PFNM on MNIST (J=10, homogeneous): accuracy against width")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)

    eb = eb_tables(records)
    if eb:
        print("\n## Empirical-Bayes PFNM (bnpfed's default, nothing set by hand) on MNIST")
        print(format_table(eb))
        print("\n## Its estimates per seed (hidden layer 1)")
        print(format_table(eb_estimates(records)))
    plane = records.get("plane/J=10/iid/seed=0")
    if plane and args.plane_plot:
        plot_plane(plane["points"], [r for k, r in records.items() if k.startswith("eb/J=10/iid/")],
                   records.get("width/J=10/iid/seed=0"), args.plane_plot)

    for key, rec in sorted(records.items()):
        if key.startswith("rounds/"):
            print(f"\n## PFNM with communication: {key}")
            hist = rec["history"]
            table = [dict(round=h["round"], pfnm=h["accuracy"], pfnm_width=sum(h["hidden"]),
                          pfnm_s=h.get("seconds", float("nan")), fedavg=f["accuracy"])
                     for h, f in zip(hist["pfnm"], hist["fedavg"])]
            print(format_table(table))
            print("ensemble:", rec["rows"]["ensemble"]["accuracy"], " local (mean):",
                  rec["rows"]["local-mean"]["accuracy"])
        if key.startswith("start/"):
            print(f"\n## PFNM rounds warm-started from the previous assignment vs re-matched from scratch: {key}")
            hist = rec["history"]
            table = [dict(round=w["round"], warm=w["accuracy"], warm_width=sum(w["hidden"]),
                          warm_s=w["server_seconds"], cold=c["accuracy"], cold_width=sum(c["hidden"]),
                          cold_s=c["server_seconds"]) for w, c in zip(hist["warm"], hist["cold"])]
            print(format_table(table))
            print("ensemble:", rec["rows"]["ensemble"]["accuracy"])
        if key.startswith("deep/"):
            print(f"\n## Two hidden layers (784-100-100-10): {key}")
            print(format_table([dict(method=k, accuracy=v["accuracy"], hidden=v["hidden"])
                                for k, v in rec["rows"].items()]))


if __name__ == "__main__":
    main()

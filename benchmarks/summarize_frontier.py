"""Tables (markdown) and a figure of ``bench_pfnm.py --parts frontier``'s lines: one-shot PFNM on MNIST 784-100-10,
accuracy against global width over seeds, beside the ensemble and the published PFNM code's points.

    python benchmarks/summarize_frontier.py benchmarks/results/pfnm_frontier_mnist.jsonl \\
        [--plot benchmarks/results/pfnm_frontier_mnist.png]

Per (J, partition): the ensemble, bnpfed's default one-shot PFNM and each noise factor's match, each as the mean over
the seeds finished with a 95 % t-interval over them (n >= 2; one seed: its bootstrap interval over the test examples,
marked ``b``), its mean width, and the paired difference from the same seed's ensemble (mean over seeds with its
t-interval; one seed: the paired bootstrap interval).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

#: The published PFNM code's one-shot points on this machine, its own local models (docs/benchmarks/archive.md,
#: "PFNM on MNIST against the published reference code"; J = 25 IID from docs/benchmarks/one-shot.md): (J, partition)
#: -> (seeds, accuracy, width, its own ensemble or None).
PUBLISHED = {(10, "iid"): ("0-4", 0.9681, 413, 0.9692), (10, "dirichlet"): ("0-4", 0.9499, 388, 0.9503),
             (25, "iid"): ("0", 0.9513, 419, None)}
#: two-sided 95 % Student t quantiles by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def interval(values, bootstrap=None, *, digits: int = 4, signed: bool = False) -> str:
    """``mean [low, high]``: a t-interval over ``values`` (n >= 2), else ``bootstrap`` (the one seed's, marked
    ``b``), else the mean alone; ``digits`` decimals, with a sign when ``signed`` (a difference)."""
    form = f"{'+' if signed else ''}.{digits}f"
    m = statistics.mean(values)
    if len(values) >= 2:
        half = T975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
        return f"{m:{form}} [{m - half:{form}}, {m + half:{form}}]"
    if bootstrap is not None:
        return f"{m:{form}} [{bootstrap[0]:{form}}, {bootstrap[1]:{form}}] b"
    return f"{m:{form}}"


def mean_interval(values, bootstrap=None) -> str:
    return interval(values, bootstrap)


def signed_interval(values, bootstrap=None) -> str:
    return interval(values, bootstrap, signed=True)


def load(paths) -> dict:
    groups: dict = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                groups.setdefault((d["J"], d["partition"]), []).append(d)
    return groups


def at_width(line: dict, head: str, width: float):
    """One seed's accuracy and paired difference from its ensemble at ``width`` units: linear in log width between
    the two points of the frontier around it (ordered by width); None outside the points' range."""
    points = sorted(line["points"], key=lambda q: q["width"])
    for a, b in zip(points, points[1:]):
        if a["width"] <= width <= b["width"] and b["width"] > a["width"]:
            t = (math.log(width) - math.log(a["width"])) / (math.log(b["width"]) - math.log(a["width"]))
            return tuple((1 - t) * x + t * y for x, y in (
                (a[head]["accuracy"], b[head]["accuracy"]),
                (a[head]["vs_ensemble"]["accuracy"]["difference"], b[head]["vs_ensemble"]["accuracy"]["difference"])))
    return None


def table(J: int, partition: str, lines: list) -> str:
    seeds = ",".join(str(d["seed"]) for d in sorted(lines, key=lambda d: d["seed"]))
    one = lines[0] if len(lines) == 1 else None
    out = [f"**J = {J}, {'IID' if partition == 'iid' else 'Dirichlet(0.5)'}**, seeds {seeds}:", "",
           "| global network | width | accuracy | minus the ensemble (paired) | NLL |", "|---|---|---|---|---|"]
    ens = [d["rows"]["ensemble"]["accuracy"] for d in lines]
    out.append(f"| ensemble of the J clients | {J * 100} | "
               f"{mean_interval(ens, one and one['rows']['ensemble']['intervals']['accuracy'])} | 0 | "
               f"{statistics.mean(d['rows']['ensemble']['nll'] for d in lines):.3f} |")
    heads = [("fused", "averaged output layer")]
    if any("pooled" in p for d in lines for p in d["points"]):
        heads.append(("pooled", "pooled output layers"))
    for key, label in heads:
        for k, point in enumerate(lines[0]["points"]):
            ps = [d["points"][k][key] for d in lines]
            widths = [d["points"][k]["width"] for d in lines]
            acc = [p["accuracy"] for p in ps]
            diff = [p["vs_ensemble"]["accuracy"]["difference"] for p in ps]
            b = one and one["points"][k][key]
            paired = b and (b["vs_ensemble"]["accuracy"]["low"], b["vs_ensemble"]["accuracy"]["high"])
            name = (f"**bnpfed default** (sigma2 estimated), {label}" if point["factor"] == 1.0
                    else f"sigma2 = {point['factor']:g} x estimate, {label}")
            out.append(f"| {name} | {statistics.mean(widths):.0f} | "
                       f"{mean_interval(acc, b and b['intervals']['accuracy'])} | {signed_interval(diff, paired)}"
                       f" | {statistics.mean(p['nll'] for p in ps):.3f} |")
    published = PUBLISHED.get((J, partition))
    if published:
        for key, label in heads:
            at = [at_width(d, key, published[2]) for d in lines]
            if all(a is not None for a in at):
                out.append(f"| bnpfed at the published width ({published[2]} units, interpolated), {label} | "
                           f"{published[2]} | {mean_interval([a[0] for a in at])} | "
                           f"{signed_interval([a[1] for a in at])} | - |")
        s, acc, width, ensemble = published
        against = "-" if ensemble is None else f"{acc - ensemble:+.4f} (its own ensemble {ensemble})"
        out.append(f"| published PFNM code (seeds {s}, its own local models) | {width} | {acc} | {against} | - |")
    return "\n".join(out)


def plot(groups: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import NullFormatter, ScalarFormatter

    keys = sorted(groups, key=lambda k: (k[0], k[1] != "iid"))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        lines = groups[key]
        for head, style in (("fused", "o-"), ("pooled", "s--")):
            if head not in lines[0]["points"][0]:
                continue
            xs = [statistics.mean(d["points"][k]["width"] for d in lines) for k in range(len(lines[0]["points"]))]
            ys = [statistics.mean(d["points"][k][head]["accuracy"] for d in lines)
                  for k in range(len(lines[0]["points"]))]
            ax.plot(xs, ys, style, label=f"bnpfed, {'averaged' if head == 'fused' else 'pooled'} output layer")
        ens = statistics.mean(d["rows"]["ensemble"]["accuracy"] for d in lines)
        ax.axhline(ens, color="grey", linestyle=":", label="ensemble (same clients)")
        if key in PUBLISHED:
            _, acc, width, own = PUBLISHED[key]
            ax.plot([width], [acc], "r*", markersize=12, label="published code")
            if own is not None:
                ax.axhline(own, color="red", linestyle=":", linewidth=0.8, label="published code's ensemble")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"J = {key[0]}, {'IID' if key[1] == 'iid' else 'Dirichlet(0.5)'} ({len(lines)} seeds)")
        ax.set_xlabel("global width (hidden units)")
        ax.set_ylabel("MNIST test accuracy")
    for ax in axes[0]:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fedavg_table(groups: dict, path: str) -> str:
    """FedAvg one round from a shared initialisation (``bench_pfnm.py --parts frontier-fedavg``) beside the same
    seeds' ensemble and default PFNM of the frontier lines: accuracy and NLL as means over the seeds with t-intervals,
    and FedAvg minus the ensemble and minus PFNM seed by seed (same partition, same test images), averaged with their
    t-intervals over the seeds."""
    fedavg = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            fedavg[(d["J"], d["partition"], d["seed"])] = d["row"]
    out = ["| J | partition | seeds | FedAvg one round, shared init | NLL | minus the ensemble | minus bnpfed's PFNM "
           "(default) |", "|---|---|---|---|---|---|---|"]
    for (J, partition), lines in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "iid")):
        pairs = [(d, fedavg[(J, partition, d["seed"])]) for d in sorted(lines, key=lambda d: d["seed"])
                 if (J, partition, d["seed"]) in fedavg]
        if not pairs:
            continue
        seeds = ",".join(str(d["seed"]) for d, _ in pairs)
        accuracy = mean_interval([f["accuracy"] for _, f in pairs])
        nll = statistics.mean(f["nll"] for _, f in pairs)
        ensemble = signed_interval([f["accuracy"] - d["rows"]["ensemble"]["accuracy"] for d, f in pairs])
        pfnm = signed_interval([f["accuracy"] - d["rows"]["pfnm"]["accuracy"] for d, f in pairs])
        out.append(f"| {J} | {partition} | {seeds} | {accuracy} | {nll:.3f} | {ensemble} | {pfnm} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+")
    p.add_argument("--plot", help="write the accuracy-width figure here (PNG)")
    p.add_argument("--fedavg", metavar="JSONL", help="print only the table of FedAvg one round from a shared "
                   "initialisation (bench_pfnm.py --parts frontier-fedavg's lines) against these frontier lines")
    args = p.parse_args(argv)
    groups = load(args.paths)
    if args.fedavg:
        print(fedavg_table(groups, args.fedavg))
        return
    for (J, partition), lines in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "iid")):
        print(table(J, partition, lines))
        print()
    if args.plot:
        plot(groups, args.plot)


if __name__ == "__main__":
    main()

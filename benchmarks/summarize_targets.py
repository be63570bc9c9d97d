"""Tables (markdown) and figures of issue 53's restated targets (b) and (c).

    python benchmarks/summarize_targets.py b benchmarks/results/targets_b_lenet.jsonl \\
        [--plot benchmarks/results/targets_b_lenet.png]
    python benchmarks/summarize_targets.py c benchmarks/results/targets_c.jsonl \\
        [--plot benchmarks/results/targets_c.png]

**(b)**, CNNs with communication (``bench_pfnm.py --parts targets-b``): per data set and partition, seed by seed,
FedMA at half the ensemble's parameters and PFNM's rounds held to the ensemble's size, each against the same seed's
ensemble (points, dense and nonzero parameters as multiples of the ensemble's); seeds 0-2 of those two come from the
lines recorded before the part existed (:data:`RECORDED`, the same script's ``size`` and ``shrink`` parts on the same
local training), marked with their output layer. Then the one-shot curve (``one-shot`` and ``one-shot-curve``
pieces) beside weight matching and OT fusion.

**(c)**, Bayesian clients (``bench_matched_fusion.py --parts targets-c``): per setting, every method's metrics as the
mean over the seeds with a 95 % t-interval over them, and its paired differences from PFNM and from FedAvg: the mean
over the seeds of each seed's difference on the same test images, with its t-interval over the seeds, and how many
seeds' paired bootstrap intervals (over the test examples) exclude 0 either way.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from summarize_frontier import T975, interval, mean_interval, signed_interval

HERE = Path(__file__).parent
RESULTS = HERE / "results"
#: Seeds 0-2 of target (b)'s two rows with communication, recorded before the ``targets-b`` part (2026-12-03 to
#: 12-05, ``bench_pfnm.py --parts size --size-rows fedma`` and ``--parts shrink``, the same reference training):
#: (piece, dataset, partition) -> (file, row, output layer). FedMA under Fashion-MNIST Dirichlet(0.5) and PFNM's rounds
#: under Dirichlet(0.5) were recorded with pooled heads where the fused ones missed (MNIST Dirichlet seeds 0 and 1:
#: fused only).
RECORDED = {
    ("fedma-half", "mnist", "iid"): ("pfnm_size_mnist_fedma5_iid.jsonl", "fedma max_params=308530", "fused"),
    ("fedma-half", "mnist", "dirichlet"): ("pfnm_size_mnist_fedma5_dirichlet.jsonl", "fedma max_params=308530",
                                           "fused"),
    ("fedma-half", "fashion-mnist", "iid"): ("pfnm_size_fashion_fedma5_iid.jsonl", "fedma max_params=308530",
                                             "fused"),
    ("fedma-half", "fashion-mnist", "dirichlet"): ("fedma_pooled_priced.jsonl", "pooled", "pooled"),
    ("pfnm-rounds", "mnist", "iid"): ("pfnm_shrink.jsonl", "limited", "fused"),
    ("pfnm-rounds", "mnist", "dirichlet"): ("pfnm_shrink.jsonl", "limited", "fused"),
    ("pfnm-rounds", "fashion-mnist", "iid"): ("pfnm_shrink_fashion.jsonl", "limited", "fused"),
    ("pfnm-rounds", "fashion-mnist", "dirichlet"): ("pfnm_shrink_pooled.jsonl", "limited", "pooled"),
}
#: MNIST Dirichlet(0.5) seed 2's PFNM rounds with pooled heads (its fused heads missed).
RECORDED_POOLED_MNIST = "pfnm_shrink_pooled_mnist.jsonl"
SETTINGS = (("mnist", "iid"), ("mnist", "dirichlet"), ("fashion-mnist", "iid"), ("fashion-mnist", "dirichlet"))
NAMES = {"mnist": "MNIST", "fashion-mnist": "Fashion-MNIST", "iid": "IID", "dirichlet": "Dirichlet(0.5)"}


def _few(values, bootstrap=None, signed: bool = False) -> str:
    """A mean over seeds: with a t-interval from three seeds on, with the seeds' own values for two (a t-interval
    from two is 12.7 standard errors wide), with ``bootstrap`` (marked b) for one."""
    if len(values) == 2:
        sign = "+" if signed else ""
        return f"{statistics.mean(values):{sign}.4f} ({values[0]:{sign}.4f}, {values[1]:{sign}.4f})"
    return (signed_interval if signed else mean_interval)(values, bootstrap)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _seed(key: str) -> int:
    return int(next(part for part in key.split("/") if part.startswith("seed="))[5:])


# ------------------------------------------------------------------------------------------------------------ (b)


def _recorded(piece: str, dataset: str, partition: str) -> dict:
    """Seed -> {accuracy, parameters, nonzero (None), ensemble, heads} of the lines recorded before ``targets-b``."""
    path, row, heads = RECORDED[(piece, dataset, partition)]
    out = {}
    for d in _lines(RESULTS / path):
        if path == "fedma_pooled_priced.jsonl":
            out[d["seed"]] = dict(accuracy=d["pooled"]["accuracy"], parameters=d["pooled"]["parameters"],
                                  ensemble=d["ensemble"]["accuracy"], ensemble_parameters=d["ensemble"]["parameters"],
                                  heads=heads)
            continue
        if d["dataset"] != dataset or d["partition"] != partition:
            continue
        rows = d["rows"]
        name = row if row in rows else next(k for k in rows if k.startswith("pfnm-rounds (") and "own" not in k)
        out[d["seed"]] = dict(accuracy=rows[name]["accuracy"], parameters=rows[name]["parameters"],
                              ensemble=rows["ensemble"]["accuracy"],
                              ensemble_parameters=rows["ensemble"]["parameters"], heads=heads)
    if piece == "pfnm-rounds" and (dataset, partition) == ("mnist", "dirichlet"):
        for d in _lines(RESULTS / RECORDED_POOLED_MNIST):
            r = d["rows"]["pfnm-rounds (ensemble from round 2)"]
            out[d["seed"]] = dict(accuracy=r["accuracy"], parameters=r["parameters"],
                                  ensemble=d["rows"]["ensemble"]["accuracy"],
                                  ensemble_parameters=d["rows"]["ensemble"]["parameters"], heads="pooled")
    return out


def _measured(lines: list, piece: str, dataset: str, partition: str) -> dict:
    out = {}
    for d in lines:
        if d["key"].endswith("/" + piece) and d["dataset"] == dataset and d["partition"] == partition:
            r = d["row"]
            out[d["seed"]] = dict(accuracy=r["accuracy"], parameters=r["parameters"], nonzero=r["nonzero"],
                                  ensemble=d["ensemble"]["accuracy"], ensemble_parameters=d["ensemble"]["parameters"],
                                  heads=r["heads"], met=r.get("met"))
    return out


def _cell(r: dict) -> str:
    points = 100 * (r["accuracy"] - r["ensemble"])
    size = f"{r['parameters'] / r['ensemble_parameters']:.2f}x"
    if r.get("nonzero") is not None:
        size += f", nonzero {r['nonzero'] / r['ensemble_parameters']:.2f}x"
    heads = "" if r["heads"] == "fused" else " pooled"
    return f"{r['accuracy']:.4f} ({points:+.2f}; {size}{heads})"


def _within(r: dict, fraction: float) -> bool:
    """Within 1 point of the ensemble at no more than ``fraction`` of its parameters."""
    return r["accuracy"] >= r["ensemble"] - 0.01 and r["parameters"] <= fraction * r["ensemble_parameters"]


def table_b(lines: list) -> str:
    out = ["| data | partition | seed | ensemble | **FedMA at half** (points; parameters x ensemble) | "
           "**PFNM rounds at the ensemble's size** (6 rounds) | run |",
           "|---|---|---|---|---|---|---|"]
    summary = []
    for dataset, partition in SETTINGS:
        fedma = {**_recorded("fedma-half", dataset, partition), **_measured(lines, "fedma-half", dataset, partition)}
        rounds = {**_recorded("pfnm-rounds", dataset, partition),
                  **_measured(lines, "pfnm-rounds", dataset, partition)}
        seeds = sorted(set(fedma) | set(rounds))
        for seed in seeds:
            f, r = fedma.get(seed), rounds.get(seed)
            ensemble = (f or r)["ensemble"]
            when = "targets-b" if "nonzero" in (f or r) else "size, shrink"
            out.append(f"| {NAMES[dataset]} | {NAMES[partition]} | {seed} | {ensemble:.4f} | "
                       f"{_cell(f) if f else '-'} | {_cell(r) if r else '-'} | {when} |")
        counts = []
        for label, rows, fraction in (("FedMA at half", fedma, 0.5), ("PFNM rounds", rounds, 1.0)):
            diffs = [rows[s]["accuracy"] - rows[s]["ensemble"] for s in sorted(rows)]
            met = sum(_within(rows[s], fraction) for s in rows)
            mean = interval([100 * d for d in diffs], digits=2, signed=True)
            counts.append(f"{label} {met} of {len(rows)} (points, mean over the seeds [t-interval]: {mean})")
        summary.append(f"* {NAMES[dataset]}, {NAMES[partition]}: " + "; ".join(counts))
    return "\n".join(out) + "\n\nWithin 1 point of the ensemble at no more than the size asked for:\n\n" + "\n".join(
        summary)


def table_curve(lines: list) -> str:
    out = ["| data | partition | seeds | ensemble | global network | parameters (x ensemble) | nonzero (x ensemble) | "
           "accuracy | minus the ensemble (paired) |", "|---|---|---|---|---|---|---|---|---|"]
    for dataset, partition in SETTINGS:
        shots = [d for d in lines if d["key"].endswith("/one-shot") and d["dataset"] == dataset
                 and d["partition"] == partition]
        curves = {d["seed"]: d for d in lines if d["key"].endswith("/one-shot-curve") and d["dataset"] == dataset
                  and d["partition"] == partition}
        fedavg = {d["seed"]: d for d in lines if d["key"].endswith("/fedavg-shared") and d["dataset"] == dataset
                  and d["partition"] == partition}
        if not shots:
            continue
        seeds = ",".join(str(d["seed"]) for d in shots)
        ensemble = _few([d["ensemble"]["accuracy"] for d in shots])
        entries: dict = {}
        for d in shots:
            for name, r in d["rows"].items():
                if "error" not in r:
                    entries.setdefault(name, []).append(r)
            for p in curves.get(d["seed"], {}).get("points", []):
                entries.setdefault(f"PFNM, sigma2 {p['factor']:g} x its estimate", []).append(p)
            if d["seed"] in fedavg:
                entries.setdefault("FedAvg, one round from a shared initialisation", []).append(
                    fedavg[d["seed"]]["row"])
        for name, rows in entries.items():
            label = {"pfnm": "PFNM, bnpfed's default", "weight-matching": "weight matching (Git Re-Basin)",
                     "ot-fusion": "OT fusion (exact plan)"}.get(name, name)
            if name.startswith("pfnm max_params="):
                label = f"PFNM asked for {name.split('=')[1]} the ensemble's parameters"
            size = statistics.mean(d["ensemble"]["parameters"] for d in shots)
            params = statistics.mean(r["parameters"] for r in rows) / size
            nonzero = [r["nonzero"] for r in rows if r.get("nonzero") is not None]
            nz = f"{statistics.mean(nonzero) / size:.2f}" if nonzero else "-"
            diffs = [r["vs_ensemble"]["accuracy"]["difference"] for r in rows]
            boot = (rows[0]["vs_ensemble"]["accuracy"]["low"], rows[0]["vs_ensemble"]["accuracy"]["high"])
            acc_boot = rows[0]["intervals"]["accuracy"]
            out.append(f"| {NAMES[dataset]} | {NAMES[partition]} | {seeds} | {ensemble} | {label} | {params:.2f} | "
                       f"{nz} | {_few([r['accuracy'] for r in rows], acc_boot)} | "
                       f"{_few(diffs, boot, signed=True)} |")
    return "\n".join(out)


def plot_b(lines: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, (dataset, partition) in zip(axes.flat, SETTINGS):
        fedma = {**_recorded("fedma-half", dataset, partition), **_measured(lines, "fedma-half", dataset, partition)}
        rounds = {**_recorded("pfnm-rounds", dataset, partition),
                  **_measured(lines, "pfnm-rounds", dataset, partition)}
        ensembles = [r["ensemble"] for r in fedma.values()]
        size = statistics.mean(r["ensemble_parameters"] for r in fedma.values())
        ax.scatter([size] * len(ensembles), ensembles, marker="*", s=160, color="black",
                   label="ensemble", zorder=3)
        ax.scatter([r["parameters"] for r in fedma.values()], [r["accuracy"] for r in fedma.values()], marker="^",
                   color="tab:green", label="FedMA at half (1 round)", zorder=3)
        ax.scatter([r["parameters"] for r in rounds.values()], [r["accuracy"] for r in rounds.values()], marker="s",
                   color="tab:blue", label="PFNM rounds at the ensemble's size (6)", zorder=3)
        first = True
        for d in lines:
            if d["dataset"] != dataset or d["partition"] != partition:
                continue
            if d["key"].endswith("/one-shot-curve"):
                pts = sorted(d["points"], key=lambda p: p["parameters"])
                ax.plot([p["parameters"] for p in pts], [p["accuracy"] for p in pts], "o-", color="tab:orange",
                        alpha=0.7, label="one-shot PFNM, sigma2 1.5-8 x its estimate" if first else None)
                first = False
            if d["key"].endswith("/fedavg-shared"):
                ax.scatter([d["row"]["parameters"]], [d["row"]["accuracy"]], marker="D", color="tab:cyan", s=40,
                           label="FedAvg, one round from a shared init", zorder=4)
            if d["key"].endswith("/one-shot"):
                for name, marker, color in (("pfnm", "o", "tab:red"), ("weight-matching", "x", "tab:purple"),
                                            ("ot-fusion", "+", "tab:brown")):
                    r = d["rows"][name]
                    ax.scatter([r["parameters"]], [r["accuracy"]], marker=marker, color=color, s=60,
                               label={"pfnm": "one-shot PFNM (default)", "weight-matching": "weight matching",
                                      "ot-fusion": "OT fusion"}[name], zorder=4)
                limited = [r for name, r in d["rows"].items() if name.startswith("pfnm max_params=")
                           and "error" not in r]
                ax.scatter([r["parameters"] for r in limited], [r["accuracy"] for r in limited], marker="v",
                           color="tab:pink", label="one-shot PFNM asked for 2, 1, 0.5x the ensemble", zorder=4)
        ax.axvline(size, ls=":", color="grey")
        ax.axvline(size / 2, ls=":", color="lightgrey")
        ax.set_xscale("log")
        ax.set_xlabel("parameters of the global network (dense)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"LeNet, {NAMES[dataset]}, {NAMES[partition]}, J = 10")
        ax.set_ylim(0.0, 1.0)
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------------------ (c)


C_METRICS = (("accuracy", "accuracy", 4), ("nll", "NLL", 3), ("ece15", "ECE-15", 4), ("brier", "Brier", 4),
             ("auroc_max_prob", "OOD AUROC", 3))
C_LABELS = {"ensemble": "ensemble of the Bayesian clients", "pfnm": "PFNM (deterministic clients)",
            "pfnm-rounds": "PFNM rounds (deterministic clients)", "fedavg": "FedAvg (shared initialisation)",
            "eaa": "EAA, weight by weight", "gaa": "GAA, weight by weight", "conflation": "conflation, weight by weight",
            "match-eaa": "matched EAA", "match-gaa": "matched GAA", "match-log_variance": "matched log-variance",
            "match-pooling": "matched pooling", "match-conflation": "matched conflation"}


def _c_groups(lines: list) -> dict:
    """(dataset, partition, rounds) -> the ``targets-c`` lines of that setting."""
    groups: dict = {}
    for d in lines:
        groups.setdefault((d["dataset"], d["partition"], d["rounds"]), []).append(d)
    return groups


def _resolved(lines: list, method: str, against: str, metric: str) -> str:
    """``better/worse`` counts of seeds whose paired bootstrap interval excludes 0 (lower is better but for accuracy
    and AUROC)."""
    better = worse = 0
    for d in lines:
        p = d["rows"][method]["paired"].get(against, {}).get(metric)
        if p is None:
            continue
        sign = 1 if metric == "accuracy" else -1
        if (sign > 0 and p["low"] > 0) or (sign < 0 and p["high"] < 0):
            better += 1
        elif (sign > 0 and p["high"] < 0) or (sign < 0 and p["low"] > 0):
            worse += 1
    return f"{better}/{worse}"


def tables_c(lines: list) -> str:
    parts = []
    for (dataset, partition, rounds), group in sorted(_c_groups(lines).items(),
                                                      key=lambda kv: (kv[0][0], kv[0][2], kv[0][1] != "iid")):
        seeds = ",".join(str(d["seed"]) for d in sorted(group, key=lambda d: d["seed"]))
        title = f"**{NAMES[dataset]}, {NAMES[partition]}, " + ("one shot" if rounds == 1 else f"{rounds} rounds") + \
            f"**, seeds {seeds}"
        head = "| method | " + " | ".join(label for _, label, _ in C_METRICS) + " |"
        out = [title, "", head, "|---|" + "---|" * len(C_METRICS)]
        methods = [m for m in group[0]["rows"] if all(m in d["rows"] for d in group)]   # in every seed's line
        for method in methods:
            cells = [interval([d["rows"][method][m] for d in group], digits=digits) for m, _, digits in C_METRICS]
            out.append(f"| {C_LABELS.get(method, method)} | " + " | ".join(cells) + " |")
        for against in ("pfnm", "fedavg"):
            ref = next(m for m in methods if m == against or m == f"{against}-rounds")
            out += ["", f"Minus {C_LABELS[ref]}, paired on the same test images (mean over the seeds [t-interval]; "
                        "seeds resolved better/worse by the paired bootstrap):", "",
                    head.replace("| method |", "| method |"), "|---|" + "---|" * len(C_METRICS)]
            for method in methods:
                if method == ref:
                    continue
                cells = []
                for m, _, digits in C_METRICS:
                    diffs = [d["rows"][method][m] - d["rows"][ref][m] for d in group]
                    cell = interval(diffs, digits=digits, signed=True)
                    if m != "auroc_max_prob":
                        cell += f" ({_resolved(group, method, against, m)})"
                    cells.append(cell)
                out.append(f"| {C_LABELS.get(method, method)} | " + " | ".join(cells) + " |")
        parts.append("\n".join(out))
    return "\n\n".join(parts)


def plot_c(lines: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted(_c_groups(lines).items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1] != "iid"))
    metrics = (("nll", "NLL"), ("ece15", "ECE-15"), ("auroc_max_prob", "OOD AUROC (max prob.)"))
    fig, axes = plt.subplots(len(metrics), len(groups), figsize=(5 * len(groups), 3.6 * len(metrics)), squeeze=False)
    for col, ((dataset, partition, rounds), group) in enumerate(groups):
        methods = [m for m in group[0]["rows"] if m not in ("pfnm", "pfnm-rounds")
                   and all(m in d["rows"] for d in group)]
        ref = "pfnm" if "pfnm" in group[0]["rows"] else "pfnm-rounds"
        for row, (metric, label) in enumerate(metrics):
            ax = axes[row][col]
            for i, method in enumerate(methods):
                diffs = [d["rows"][method][metric] - d["rows"][ref][metric] for d in group]
                m = statistics.mean(diffs)
                half = (T975[len(diffs) - 1] * statistics.stdev(diffs) / math.sqrt(len(diffs))
                        if len(diffs) > 1 else 0)
                ax.errorbar([m], [i], xerr=[[half], [half]], fmt="o", color="tab:blue" if method.startswith("match")
                            else "tab:grey", capsize=3)
            ax.axvline(0, color="black", lw=0.8)
            ax.set_yticks(range(len(methods)))
            ax.set_yticklabels([C_LABELS.get(m, m) for m in methods], fontsize=7)
            ax.set_xlabel(f"{label} minus PFNM's (paired; mean, 95 % t over seeds)", fontsize=8)
            ax.tick_params(axis="x", labelsize=7)
            if row == 0:
                when = "one shot" if rounds == 1 else f"{rounds} rounds"
                ax.set_title(f"{NAMES[dataset]}, {NAMES[partition]}, {when}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", choices=("b", "c"))
    p.add_argument("paths", nargs="+", help="the part's JSON-lines files")
    p.add_argument("--plot", metavar="PNG")
    args = p.parse_args(argv)
    lines = [line for path in args.paths for line in _lines(path)]
    if args.target == "b":
        print(table_b(lines))
        print()
        print(table_curve(lines))
        if args.plot:
            plot_b(lines, args.plot)
    else:
        print(tables_c(lines))
        if args.plot:
            plot_c(lines, args.plot)


if __name__ == "__main__":
    main()

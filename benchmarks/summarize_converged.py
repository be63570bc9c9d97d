"""The second paper's comparisons re-measured with the clients at the ELBO's optimum (issue 51, part 4): tables of
the ``bnpfed fuse --json`` records in ``benchmarks/results/converged/`` (one file a command, named
``<dataset>_<mode>_F<scale-lr-factor>_s<seed>.json``; mode ``rounds``, ``oneshot`` or ``match``).

Each table row: a method's accuracy per seed with its 95 % bootstrap interval over the test examples (the row's own,
``intervals``), the mean over the seeds present, NLL, ECE (100 bins), the debiased calibration error and the mean
posterior sd (means over the seeds). The commands that wrote the records (``--threads 1 --no-progress --json FILE``
added to each)::

    D=../shared/data; for S in 0 1 2; do for F in 10 1; do
      bnpfed fuse --dataset mnist --data-dir $D/mnist --lr 1e-3 --batch-size 64 --seed $S --scale-lr-factor $F \\
          --rule all --rounds 5 --epochs 2                                                     # mode rounds
      bnpfed fuse ... --rule all --rounds 1 --epochs 10                                        # mode oneshot
      bnpfed fuse ... --align match --rule eaa,gaa,log_variance,pooling,conflation --rounds 1 --epochs 10   # match
    done; done            # and --dataset fashion-mnist --data-dir $D/fashion_mnist

    python benchmarks/summarize_converged.py
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "converged"
NAME = re.compile(r"(?P<dataset>[a-z-]+)_(?P<mode>rounds|oneshot|match)_F(?P<F>[0-9.]+)_s(?P<seed>\d+)\.json$")


def main() -> None:
    runs = defaultdict(dict)   # (dataset, mode, F) -> seed -> rows
    for path in sorted(RESULTS.glob("*.json")):
        m = NAME.match(path.name)
        if m is None:
            continue
        record = json.loads(path.read_text())
        run = record["results"]["runs"][0]
        runs[m["dataset"], m["mode"], float(m["F"])][int(m["seed"])] = (run["rows"], run["warnings"])
    for (dataset, mode, factor), by_seed in sorted(runs.items()):
        seeds = sorted(by_seed)
        print(f"\n### {dataset}, {mode}, F = {factor:g} (seeds {', '.join(map(str, seeds))})\n")
        print("| method | " + " | ".join(f"accuracy, seed {s} [95 %]" for s in seeds)
              + " | mean accuracy | NLL | ECE (100) | debiased CE | mean sigma |")
        print("|---|" + "---|" * len(seeds) + "---|---|---|---|---|")
        methods = [row["method"] for row in by_seed[seeds[0]][0]]
        for method in methods:
            rows = [next(r for r in by_seed[s][0] if r["method"] == method) for s in seeds
                    if any(r["method"] == method for r in by_seed[s][0])]
            if len(rows) != len(seeds):
                continue
            cells = [f"{r['accuracy']:.4f} [{r['intervals']['accuracy'][0]:.4f}, {r['intervals']['accuracy'][1]:.4f}]"
                     for r in rows]
            n = len(rows)
            sigma = [r["mean_sigma"] for r in rows if r.get("mean_sigma") == r.get("mean_sigma")
                     and r.get("mean_sigma") is not None]
            print(f"| {method} | " + " | ".join(cells)
                  + f" | {sum(r['accuracy'] for r in rows) / n:.4f} | {sum(r['nll'] for r in rows) / n:.3f} | "
                  f"{sum(r['ece'] for r in rows) / n:.4f} | {sum(r['ece_debiased'] for r in rows) / n:.4f} | "
                  + (f"{sum(sigma) / len(sigma):.3g}" if sigma else "-") + " |")
        warned = sorted({w.split(":")[0] for s in seeds for w in by_seed[s][1] if "had not converged" in w})
        if warned:
            print(f"\nclients' last fits not converged (the run's warnings): {', '.join(warned)}")


if __name__ == "__main__":
    main()

"""Which units should a client call dead? Its training data alone, or its held-out split too (issue 53, item 5)

PFNM's clients report the units inactive on their data (``unit_activity_step``: exactly 0 wherever the unit enters
the next layer) and the server leaves them out of matching (``inactive="drop"``). Here each client holds out
``--holdout`` of its examples (``ExperimentConfig(select="federated")``'s split: it trains on the rest), and the same
local models are matched under each rule of what is dead:

* ``train``: inactive on the client's training split (the rule since 2026-12);
* ``held-out``: inactive on its training split and on its held-out split (activity = the larger of the two);
* ``margin-M``: inactive on the training split with the unit's largest pre-activation there below ``-M`` times its
  standard deviation there (a unit that comes within M standard deviations of firing is kept; the MLP only);
* ``keep``: no unit left out (``inactive="keep"``).

For each rule: the units left out (over the J clients), how many of them fire on at least one test image, the
(test image, unit) firings they lose, and the one-shot PFNM global network at bnpfed's defaults (empirical Bayes,
output layer ``heads="auto"``): test accuracy with its paired bootstrap interval against the ``train`` rule's on the
same test images, hidden widths and parameters. MNIST and Fashion-MNIST, PFNM's
784-100-10 MLP and training, J = 10. One JSON line per (data, partition, seed) to ``--out`` (resumable).

    python benchmarks/bench_dead_units.py [--data-root ../shared/data] [--seeds 0,1] [--partitions iid,dirichlet]
    python benchmarks/bench_dead_units.py --summary
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from bnpfed.data import load_dataset
from bnpfed.federated import (PFNM_NETWORK, PFNM_TRAINING, ExperimentConfig, PartitionConfig, pfnm_step,
                              unit_activity_step)
from bnpfed.federated.experiment import Experiment
from bnpfed.matching import pooled_network
from bnpfed.metrics import count_parameters, paired_bootstrap

from bench_pfnm import _done, _emit  # noqa: E402

HERE = Path(__file__).parent
SHARED = HERE.parent.parent / "shared" / "data"
FOLDERS = {"mnist": "mnist", "fashion-mnist": "fashion_mnist"}
MARGINS = (0.1, 0.25)


@torch.no_grad()
def _hidden(net: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The MLP's pre-activations, one (N, H) tensor per hidden layer (the outputs of every Linear but the last)."""
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    out, h = [], x.reshape(len(x), -1)
    for layer in linears[:-1]:
        h = layer(h)
        out.append(h)
        h = h.relu()
    return out


def _rules(net: nn.Module, x: torch.Tensor, held_out: torch.Tensor, input_shape, batch_size: int) -> dict:
    """Per rule, this client's report (per group, a unit's activity; 0: dead under the rule)."""
    train = unit_activity_step(net, x, input_shape, batch_size)
    other = unit_activity_step(net, held_out, input_shape, batch_size)
    groups = sorted(train)
    rules = {"train": train, "held-out": {g: torch.maximum(train[g], other[g]) for g in groups}}
    z = _hidden(net, x)
    for margin in MARGINS:
        report = {}
        for g, pre in zip(groups, z):
            near = pre.amax(0) > -margin * pre.std(0)
            report[g] = torch.where(near & (train[g] == 0), torch.ones_like(train[g]), train[g])
        rules[f"margin-{margin:g}"] = report
    return rules


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default=str(SHARED))
    ap.add_argument("--datasets", default="mnist,fashion-mnist")
    ap.add_argument("--partitions", default="iid,dirichlet")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--holdout", type=float, default=0.1)
    ap.add_argument("--standardize", action="store_true",
                    help="standardise the inputs (default: pixels in [0, 1], bnpfed pfnm's default)")
    ap.add_argument("--out", default=str(HERE / "results" / "dead_units.jsonl"))
    ap.add_argument("--summary", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.summary:   # per data, partition and rule: means over the seeds run
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        print("| data | partition | seeds | rule | units left out (of 1,000) | of them firing on test images | "
              "(test image, unit) firings lost | **accuracy** | points against train, paired 95 % (per seed) | "
              "hidden | parameters |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        groups: dict = {}
        for r in rows:
            groups.setdefault((r["dataset"], r["partition"]), []).append(r)
        for (data, partition), rs in groups.items():
            seeds = ",".join(str(r["seed"]) for r in sorted(rs, key=lambda r: r["seed"]))
            for rule in rs[0]["rules"]:
                def mean(field):
                    return statistics.mean(r["rules"][rule][field] for r in rs)
                hidden = statistics.mean(sum(r["rules"][rule]["hidden"]) for r in rs)
                paired = "the reference" if rule == "train" else "; ".join(
                    f"{100 * p['difference']:+.2f} [{100 * p['low']:+.2f}, {100 * p['high']:+.2f}]"
                    for p in (r["rules"][rule]["against_train"] for r in rs))
                print(f"| {data} | {partition} | {seeds} | {rule} | {mean('dropped'):.1f} | "
                      f"{mean('dropped_firing_on_test'):.1f} | {mean('firings_lost'):.1f} | "
                      f"**{mean('accuracy'):.4f}** | {paired} | {hidden:.1f} | {mean('parameters'):,.0f} |")
        return
    torch.set_num_threads(1)
    done = _done(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    loaded: dict = {}
    for seed in map(int, args.seeds.split(",")):
        for name in args.datasets.split(","):
            for partition in args.partitions.split(","):
                key = f"{name}/{partition}/seed={seed}"
                if key in done:
                    continue
                if not (Path(args.data_root) / FOLDERS[name]).exists():
                    print(f"{key}: skipped, no data under {Path(args.data_root) / FOLDERS[name]}", flush=True)
                    continue
                if name not in loaded:
                    loaded[name] = load_dataset(name, data_dir=Path(args.data_root) / FOLDERS[name],
                                                standardize=args.standardize)
                data = loaded[name]
                start = time.perf_counter()
                experiment = Experiment(data, partition=PartitionConfig(clients=10, partition=partition),
                                        network=PFNM_NETWORK, training=PFNM_TRAINING,
                                        config=ExperimentConfig(methods=("pfnm",), seed=seed, select="federated",
                                                                holdout=args.holdout))
                models = experiment.local_models()
                batch = PFNM_TRAINING.batch_size
                shape = experiment.input_shape
                reports = [_rules(net, x, data.x_train[torch.as_tensor(held)], shape, batch)
                           for net, (x, _), held in zip(models, experiment.client_data, experiment.validation_parts)]
                on_test = [unit_activity_step(net, data.x_test, shape, batch) for net in models]
                firings = [[(h > 0).sum(0) for h in _hidden(net, data.x_test)] for net in models]
                config = experiment.pfnm   # heads="auto" resolved by the clients' class shares
                results, probs = {}, {}
                for rule in list(reports[0]) + ["keep"]:
                    activity = None if rule == "keep" else [r[rule] for r in reports]
                    dropped = firing = lost = 0
                    for j in range(len(models)):
                        if activity is None:
                            break
                        for i, g in enumerate(sorted(activity[j])):
                            dead = activity[j][g] == 0
                            dropped += int(dead.sum())
                            firing += int((dead & (on_test[j][g] > 0)).sum())
                            lost += int(firings[j][i][dead].sum())
                    match = pfnm_step(models, experiment.class_counts, config, seed=seed, round=1,
                                      input_shape=shape, activity=activity)
                    net = pooled_network(match, models) if config.heads == "pooled" else match.network()
                    scores = experiment.evaluate_network(net)
                    with torch.no_grad():
                        probs[rule] = torch.cat([net.eval()(data.x_test[i:i + 2048]).softmax(-1)
                                                 for i in range(0, len(data.x_test), 2048)])
                    paired = paired_bootstrap(probs[rule], probs["train"], data.y_test, metrics=("accuracy",),
                                              seed=seed)["accuracy"]
                    results[rule] = dict(dropped=dropped, dropped_firing_on_test=firing, firings_lost=lost,
                                         accuracy=scores["accuracy"], nll=scores["nll"],
                                         hidden=list(match.hidden_sizes), parameters=count_parameters(net),
                                         against_train=paired)
                local = [experiment.evaluate_network(n)["accuracy"] for n in models]
                experiment.close()
                _emit(out, key, dict(dataset=name, partition=partition, seed=seed, clients=10, holdout=args.holdout,
                                     standardize=args.standardize, heads=config.heads,
                                     local_mean=statistics.mean(local),
                                     test_images=len(data.x_test), rules=results,
                                     seconds=time.perf_counter() - start))


if __name__ == "__main__":
    main()

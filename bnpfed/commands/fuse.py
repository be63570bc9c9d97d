"""``bnpfed fuse``: federated variational Bayesian networks fused by every rule of Ozer et al. (2022), against
FedAvg: a table of final test metrics, and optionally per-round JSON and a plot."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bnpfed.combine import available_rules
from bnpfed.commands._args import dataset_name, fraction, positive_float, positive_int, positive_ints
from bnpfed.data import DATASET_NAMES, NPZ_PREFIX, load_dataset
from bnpfed.federated import partition_dirichlet, partition_homogeneous
from bnpfed.federated.fusion import (ARCHITECTURES, CLIENT_WEIGHTS, FEDAVG, PRIORS, FusionConfig,
                                     run_fusion_experiment)
from bnpfed.report import format_table, write_json

PARTITIONS = ("iid", "dirichlet")
#: Metrics the plot shows, one panel each.
PLOTTED = ("accuracy", "nll", "ece", "brier", "mean_sigma")


def rule_list(value: str) -> tuple[str, ...]:
    """argparse type of ``--rule``: ``all`` or a comma-separated list of rule names."""
    if value == "all":
        return tuple(available_rules())
    rules = tuple(r.strip() for r in value.split(",") if r.strip())
    unknown = [r for r in rules if r not in available_rules()]
    if not rules or unknown:
        raise argparse.ArgumentTypeError(f"unknown rule(s) {unknown or [value]}; expected 'all' or a comma-separated "
                                         f"list of {', '.join(available_rules())}")
    if len(set(rules)) != len(rules):
        raise argparse.ArgumentTypeError(f"rule listed twice in {value!r}")
    return rules


def add_parser(sub):
    d = FusionConfig()
    p = sub.add_parser(
        "fuse",
        help="federated Bayesian networks fused by each posterior fusion rule, against FedAvg",
        description="Partition a dataset among clients, train mean-field Gaussian Bayesian networks on them with SVI "
        "and fuse their posteriors on a server every round with each rule of Ozer et al. (2022) (eaa, gaa, "
        "log_variance, pooling, conflation); deterministic parameters are averaged with the same client weights. "
        "FedAvg on the same network is the baseline. Prints each method's final test accuracy, NLL, ECE "
        f"({d.ece_bins} bins by default, as in the paper), Brier score and mean posterior sigma.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dataset", type=dataset_name, default="digits",
                   help=f"{', '.join(DATASET_NAMES)} or {NPZ_PREFIX}PATH (digits needs no files)")
    p.add_argument("--data-dir", metavar="DIR", help="torchvision root for mnist / fashion-mnist / cifar10")
    p.add_argument("--download", action="store_true", help="let torchvision download missing files into --data-dir")
    p.add_argument("--clients", type=positive_int, default=10, help="number of clients C")
    p.add_argument("--fraction", type=fraction, default=d.fraction,
                   help="fraction of clients sampled per round (max(1, floor(fraction * C)))")
    p.add_argument("--rounds", type=positive_int, default=d.rounds, help="communication rounds T")
    p.add_argument("--local-epochs", type=positive_int, default=d.local_epochs, help="local epochs E per round")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size)
    p.add_argument("--lr", type=positive_float, default=d.lr, help="Adam learning rate (Bayesian and FedAvg)")
    p.add_argument("--rule", type=rule_list, default="all",
                   help=f"'all' or a comma-separated list of {', '.join(available_rules())}")
    p.add_argument("--no-fedavg", action="store_true", help="skip the FedAvg baseline")
    p.add_argument("--partition", choices=PARTITIONS, default="iid",
                   help="iid (homogeneous) or dirichlet (label-Dirichlet, see --alpha)")
    p.add_argument("--alpha", type=positive_float, default=0.5, help="Dirichlet concentration of --partition dirichlet")
    p.add_argument("--arch", choices=ARCHITECTURES, default=d.arch, help="MLP, or LeNet-5 for square images")
    p.add_argument("--hidden", type=positive_ints, default=",".join(map(str, d.hidden)),
                   help="hidden widths of the MLP, comma-separated")
    p.add_argument("--prior", choices=PRIORS, default=d.prior,
                   help="which parameters are Bayesian: linear-weights (the paper) or all")
    p.add_argument("--prior-scale", type=positive_float, default=d.prior_scale, help="prior N(0, scale^2) per weight")
    p.add_argument("--init-scale", type=positive_float, default=d.init_scale, help="initial posterior sigma")
    p.add_argument("--weights", choices=CLIENT_WEIGHTS, default=d.weights,
                   help="client weights b_k: proportional to local data size, or uniform")
    p.add_argument("--no-local-reparameterization", action="store_true",
                   help="sample weights instead of pre-activations (local reparameterisation is on by default)")
    p.add_argument("--samples", type=positive_int, default=d.num_predictive_samples,
                   help="weight draws S of the posterior predictive")
    p.add_argument("--pooling-samples", type=positive_int, default=d.pooling_samples, help="N of the pooling rule")
    p.add_argument("--ece-bins", type=positive_int, default=d.ece_bins,
                   help="bins of the expected calibration error (the paper uses 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random step (partition included), >= 0")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (one is fastest for small networks)")
    p.add_argument("--json", metavar="PATH", help="write the config and every method's per-round metrics as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the metrics per round, one line per method")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    if args.seed < 0:
        return _error(f"--seed: expected an int >= 0, got {args.seed}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        ds = load_dataset(args.dataset, data_dir=args.data_dir, download=args.download)
    except (ValueError, FileNotFoundError, ImportError) as error:
        return _error(f"--dataset {args.dataset}: {error}")
    labels = ds.y_train.numpy()
    if args.clients > len(labels):
        return _error(f"--clients {args.clients}: more clients than the {len(labels)} training examples")
    try:
        if args.partition == "iid":
            parts = partition_homogeneous(labels, args.clients, seed=args.seed)
        else:
            parts = partition_dirichlet(labels, args.clients, alpha=args.alpha, seed=args.seed,
                                        min_size=min(10, len(labels) // args.clients))
        config = FusionConfig(
            rules=args.rule, fedavg=not args.no_fedavg, arch=args.arch, hidden=args.hidden, prior=args.prior,
            prior_scale=args.prior_scale, init_scale=args.init_scale, fraction=args.fraction, rounds=args.rounds,
            local_epochs=args.local_epochs, batch_size=args.batch_size, lr=args.lr, weights=args.weights,
            local_reparameterization=not args.no_local_reparameterization, num_predictive_samples=args.samples,
            pooling_samples=args.pooling_samples, ece_bins=args.ece_bins, seed=args.seed)
        if args.arch == "lenet" and (len(ds.input_shape) != 3 or ds.input_shape[1] != ds.input_shape[2]):
            return _error(f"--arch lenet needs square images, but {args.dataset} has inputs of shape "
                          f"{ds.input_shape}; use --arch mlp")
    except (ValueError, RuntimeError) as error:
        return _error(str(error))

    print(f"posterior fusion: {ds.name}, {args.clients} clients ({args.partition}"
          f"{f', alpha {args.alpha}' if args.partition == 'dirichlet' else ''}), fraction {args.fraction}, "
          f"{args.rounds} rounds x {args.local_epochs} local epochs, {args.arch}, prior {args.prior}, "
          f"weights {args.weights}, ECE with {args.ece_bins} bins, seed {args.seed}")
    result = run_fusion_experiment(ds, parts, config, progress=not args.no_progress)
    rows = result.summary_rows()
    for row in rows:
        if row["method"] == FEDAVG:
            row["mean_sigma"] = float("nan")  # printed as "-": FedAvg has no posterior
    print(format_table(rows))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "func"}
        write_json(args.json, {"command": "fuse", "arguments": settings, "dataset": ds.name, **result.to_dict()})
    if args.plot:
        plot_rounds(result, args.plot, title=f"{ds.name}, {args.clients} clients ({args.partition})")
    return 0


def plot_rounds(result, path, title: str = "") -> None:
    """A PNG with one panel per metric (accuracy, NLL, ECE, Brier, mean posterior sigma) over the rounds, one line
    per method (FedAvg dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.4))
    for method, history in result.histories.items():
        rounds = history.metric("round")
        for ax, metric in zip(axes, PLOTTED):
            if metric in history.rounds[0]:
                ax.plot(rounds, history.metric(metric), marker="o", ms=3, label=method,
                        linestyle="--" if method == FEDAVG else "-", color="k" if method == FEDAVG else None)
    for ax, metric in zip(axes, PLOTTED):
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(metric.replace("_", " "))
    axes[-1].set_yscale("log")
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _error(message: str) -> int:
    print(f"bnpfed fuse: error: {message}", file=sys.stderr)
    return 2

"""``bnpfed pfnm``: the PFNM experiments of Yurochkin et al. (2019) on one machine.

Examples::

    bnpfed pfnm                                                    # bundled digits, J = 10, one round
    bnpfed pfnm --dataset mnist --data-dir DIR --clients 10 --partition hetero --alpha 0.5 --hidden 100 \\
        --rounds 1 --seed 0 --json out.json --plot out.png
    bnpfed pfnm --clients 5,10,20 --plot by_j.png                  # accuracy and global size against J
    bnpfed pfnm --width-sweep --plot width.png                     # accuracy against global width
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, fields

from bnpfed.commands._args import dataset_name, floats, positive_ints
from bnpfed.data import DATASET_NAMES, NPZ_PREFIX, load_dataset
from bnpfed.federated.pfnm import METHODS, PFNMSettings, run_pfnm_experiment, width_sweep
from bnpfed.report import format_table, write_json

COLUMNS = ["method", "accuracy", "hidden", "parameters", "rounds", "seconds", "note"]


def add_parser(sub):
    d = PFNMSettings()
    p = sub.add_parser(
        "pfnm",
        help="PFNM federated experiment: local models, ensemble, FedAvg, k-means, PFNM (one round or more)",
        description="J clients train MLPs on their partitions; the server matches them into one global network "
        "(PFNM, Yurochkin et al. 2019) and compares it with the local models, their uniform ensemble, FedAvg and "
        "k-means. Defaults are the reference code's training settings.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--dataset", type=dataset_name, default="digits",
                   help=f"{', '.join(DATASET_NAMES)} or {NPZ_PREFIX}PATH (x_train, y_train, x_test, y_test)")
    g.add_argument("--data-dir", help="torchvision root for mnist / fashion-mnist / cifar10")
    g.add_argument("--download", action="store_true", help="let torchvision download missing files")
    g.add_argument("--standardize", action="store_true",
                   help="standardise pixels (default: keep them in [0, 1] as the reference does)")
    g.add_argument("--clients", type=positive_ints, default=(d.clients,), help="J, or a list such as 5,10,20")
    g.add_argument("--partition", choices=["homogeneous", "homo", "hetero", "dirichlet"], default="homogeneous",
                   help="homogeneous (IID) or heterogeneous label-Dirichlet(alpha)")
    g.add_argument("--alpha", type=float, default=d.alpha, help="Dirichlet concentration")
    g.add_argument("--min-size", type=int, default=d.min_size, help="minimum examples per client (Dirichlet)")
    g = p.add_argument_group("local training")
    g.add_argument("--hidden", type=positive_ints, default=d.hidden, help="hidden widths, e.g. 100 or 100,100")
    g.add_argument("--epochs", type=int, default=d.epochs)
    g.add_argument("--batch-size", type=int, default=d.batch_size)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="L2 strength")
    g.add_argument("--shared-init", action="store_true", help="all clients start from one initialisation")
    g = p.add_argument_group("matching")
    g.add_argument("--sigma2", type=float, default=d.sigma2, help="noise variance")
    g.add_argument("--sigma0-2", type=float, default=d.sigma0_2, help="prior variance")
    g.add_argument("--gamma0", type=float, default=d.gamma0, help="IBP mass")
    g.add_argument("--constants", choices=["bnpfed", "reference"], default=d.constants,
                   help="bnpfed: popularity factor 2, no caps; reference: the published code's constants")
    g.add_argument("--objective", choices=["map", "marginal"], default=d.objective)
    g.add_argument("--direction", choices=["bottom-up", "top-down"], default=d.direction,
                   help="layer order (top-down is the published one)")
    g.add_argument("--sweeps", type=int, default=d.sweeps)
    g.add_argument("--select", choices=["none", "federated", "pooled-train"], default=d.select,
                   help="choose sigma2 / sigma0_2 / gamma0 from the grids by the clients' held-out splits "
                   "(federated) or by pooled training accuracy (the reference's way)")
    g.add_argument("--grid-sigma2", type=floats, default=d.grid_sigma2)
    g.add_argument("--grid-sigma0-2", type=floats, default=d.grid_sigma0_2)
    g.add_argument("--grid-gamma0", type=floats, default=d.grid_gamma0)
    g.add_argument("--holdout", type=float, default=d.holdout, help="held-out share per client (federated)")
    g = p.add_argument_group("communication")
    g.add_argument("--rounds", type=int, default=d.rounds, help="PFNM communication rounds (and FedAvg's)")
    g.add_argument("--round-epochs", type=int, default=d.round_epochs, help="local epochs per later round")
    g.add_argument("--lr-decay", type=float, default=d.lr_decay, help="learning-rate factor per round")
    g = p.add_argument_group("output")
    g.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    g.add_argument("--width-sweep", action="store_true",
                   help="instead: accuracy against global width, sweeping --sweep-sigma2 x --sweep-gamma0 under "
                   "both sets of constants")
    g.add_argument("--sweep-sigma2", type=floats, default=(0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6, 2.0))
    g.add_argument("--sweep-gamma0", type=floats, default=(1e-3, 1.0))
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--json", metavar="PATH", help="write all results as JSON")
    g.add_argument("--plot", metavar="PATH", help="write a PNG: accuracy and global size per round, per J, or "
                   "against width")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads; the clients' small MLPs train fastest on one (and do not fight over cores)")
    p.set_defaults(func=run)


def settings_from_args(args, clients: int) -> PFNMSettings:
    partition = "homogeneous" if args.partition in ("homogeneous", "homo") else "dirichlet"
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    values = dict(clients=clients, hidden=tuple(args.hidden), partition=partition, alpha=args.alpha,
                  min_size=args.min_size, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                  weight_decay=args.weight_decay, shared_init=args.shared_init, sigma2=args.sigma2,
                  sigma0_2=args.sigma0_2, gamma0=args.gamma0, constants=args.constants, objective=args.objective,
                  direction=args.direction, sweeps=args.sweeps, rounds=args.rounds, round_epochs=args.round_epochs,
                  lr_decay=args.lr_decay, select=args.select, grid_sigma2=args.grid_sigma2,
                  grid_sigma0_2=args.grid_sigma0_2, grid_gamma0=args.grid_gamma0, holdout=args.holdout,
                  methods=methods, seed=args.seed)
    assert set(values) == {f.name for f in fields(PFNMSettings)}
    return PFNMSettings(**values)


def run(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    ds = load_dataset(args.dataset, data_dir=args.data_dir, download=args.download, standardize=args.standardize)
    progress = not args.no_progress
    if args.width_sweep:
        settings = settings_from_args(args, args.clients[0])
        points = width_sweep(ds, settings, sigma2=args.sweep_sigma2, gamma0=args.sweep_gamma0, progress=progress)
        print(f"accuracy against global width: {ds.name}, J={settings.clients}, {settings.partition}, "
              f"hidden {list(settings.hidden)}, seed {settings.seed}")
        print(format_table(points, ["constants", "sigma2", "gamma0", "hidden", "accuracy", "seconds"]))
        if args.json:
            write_json(args.json, {"command": "pfnm --width-sweep", "dataset": ds.name,
                                   "settings": asdict(settings), "points": points})
        if args.plot:
            _plot_width(points, args.plot)
        return 0
    runs = []
    for J in args.clients:
        settings = settings_from_args(args, J)
        result = run_pfnm_experiment(ds, settings, progress=progress)
        runs.append(result)
        print(f"\n{ds.name}: J={J} clients, {settings.partition}"
              f"{f' (alpha {settings.alpha})' if settings.partition == 'dirichlet' else ''}, hidden "
              f"{list(settings.hidden)}, seed {settings.seed}; hyper-parameters selected by {result.selection['by']}:"
              f" sigma2={result.selection['sigma2']}, sigma0_2={result.selection['sigma0_2']}, "
              f"gamma0={result.selection['gamma0']}")
        print(format_table([asdict(r) for r in result.rows], COLUMNS))
    if args.json:
        write_json(args.json, {"command": "pfnm", "dataset": ds.name, "runs": [r.as_dict() for r in runs]})
    if args.plot:
        if len(runs) > 1:
            _plot_by_clients(runs, args.plot)
        else:
            _plot_rounds(runs[0], args.plot)
    return 0


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_rounds(run_, path: str) -> None:
    plt = _figure()
    fig, (ax_acc, ax_size) = plt.subplots(1, 2, figsize=(10, 4))
    for method, hist in run_.history.items():
        rounds = [h["round"] for h in hist]
        ax_acc.plot(rounds, [h["accuracy"] for h in hist], marker="o", label=method)
        ax_size.plot(rounds, [sum(h["hidden"]) for h in hist], marker="o", label=method)
    for row in run_.rows:
        if row.method in ("ensemble", "local (mean)"):
            ax_acc.axhline(row.accuracy, ls="--", lw=1, color="grey" if row.method == "ensemble" else "silver",
                           label=row.method)
    if not run_.history:  # one round: a bar per method
        names = [r.method for r in run_.rows]
        ax_acc.barh(names, [r.accuracy for r in run_.rows])
        ax_size.barh(names, [sum(r.hidden) for r in run_.rows])
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_acc, ax_size):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.set(xlabel="communication round", ylabel="test accuracy")
    ax_size.set(xlabel="communication round", ylabel="global hidden size (sum over layers)")
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_by_clients(runs, path: str) -> None:
    plt = _figure()
    fig, (ax_acc, ax_size) = plt.subplots(1, 2, figsize=(10, 4))
    Js = [r.settings.clients for r in runs]
    for method in [row.method for row in runs[0].rows]:
        ax_acc.plot(Js, [r.row(method).accuracy for r in runs], marker="o", label=method)
        ax_size.plot(Js, [sum(r.row(method).hidden) for r in runs], marker="o", label=method)
    ax_acc.set(xlabel="number of clients J", ylabel="test accuracy")
    ax_size.set(xlabel="number of clients J", ylabel="global hidden size", yscale="log")
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_width(points, path: str) -> None:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted({p["constants"] for p in points}):
        mine = sorted((p["width"], p["accuracy"]) for p in points if p["constants"] == name)
        ax.plot(*zip(*mine), marker="o", ls="", label=f"{name} constants")
        front, best = [], -1.0
        for w, a in mine:  # the accuracy-width Pareto front
            if a > best:
                front.append((w, a))
                best = a
        ax.step(*zip(*front), where="post", alpha=0.6)
    ax.set(xlabel="global hidden size", ylabel="test accuracy", title="PFNM: accuracy against global width")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

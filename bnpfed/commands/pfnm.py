"""``bnpfed pfnm``: the PFNM experiments of Yurochkin et al. (2019) on one machine, through
:func:`bnpfed.federated.methods.run_experiment` and :func:`~bnpfed.federated.methods.width_sweep`.

Examples::

    bnpfed pfnm                                                    # bundled digits, J = 10, one round
    bnpfed pfnm --dataset mnist --data-dir DIR --clients 10 --partition dirichlet --alpha 0.5 --hidden 100 \\
        --json out.json --plot out.png
    bnpfed pfnm --rounds 3 --plot rounds.png                       # adds pfnm-rounds: PFNM over 3 rounds
    bnpfed pfnm --clients 5,10,20 --plot by_j.png                  # accuracy and global width against J
    bnpfed pfnm --width-sweep --plot width.png                     # accuracy against global width
    bnpfed pfnm --arch lenet --epochs 5 --layerwise-retrain 2      # LeNet on digits, adds fedma (layer-wise)
    bnpfed pfnm --dataset cifar10 --data-dir DIR --arch simple-cnn-bn --partition dirichlet --rounds 10
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import torch

from bnpfed.commands import _args, _options
from bnpfed.commands._args import HelpFormatter, UsageError, fail, flag_message, warn
from bnpfed.federated import methods
from bnpfed.federated import initial_network
from bnpfed.federated import (PFNM_NETWORK, PFNM_TRAINING, ExperimentConfig, FusionConfig, NetworkConfig,
                              PartitionConfig, PFNMConfig, TrainingConfig, config_dict)
from bnpfed.matching import derive_spec
from bnpfed.report import (command_record, command_results, format_table, line_styles, pyplot, save_figure,
                           write_json)
from bnpfed.validation import check_positives

PROG = "bnpfed pfnm"
#: The methods run unless --methods says otherwise (``pfnm-rounds`` too when --rounds > 1; ``fedma``, and
#: ``fedma-rounds`` when --rounds > 1, with --layerwise-retrain).
DEFAULT_METHODS = ("local", "ensemble", "fedavg-oneshot", "fedavg", "kmeans", "pfnm")
COLUMNS = ["method", "accuracy", "nll", "hidden", "parameters", "rounds", "server_seconds", "note"]
#: --width-sweep's grid: chosen to take the global width on the bundled digits from about one client's to about J
#: clients' (a larger sigma2 merges more; gamma0 sets how readily new units open).
SWEEP_SIGMA2 = (0.01, 0.02, 0.03, 0.04, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7)
SWEEP_GAMMA0 = (1e-3, 1.0)
WIDTH_LABEL = "global width (hidden neurons, all layers)"
#: What the size panels show for a convolutional network: a unit there is a channel or a neuron, and a channel of
#: conv2 carries fc1's 25 spatial columns, so widths hide where the parameters are
PARAMETERS_LABEL = "global parameters"


def _size_of(item, by: str, row=None) -> int:
    """A row's (or one round's, ``item`` a history dict of ``row``) global width or parameter count."""
    if isinstance(item, dict):
        return int(item.get("parameters", row.parameters)) if by == "parameters" else sum(item.get("hidden",
                                                                                                  row.hidden))
    return int(item.parameters) if by == "parameters" else sum(item.hidden)
SERVER_SECONDS = ("server_seconds: the server's aggregation time (matching, k-means or averaging) summed over the "
                  "rounds; local training and evaluation are not included.")


def add_parser(sub):
    p = sub.add_parser(
        "pfnm",
        help="PFNM federated experiment: local models, ensemble, FedAvg, k-means, PFNM, FedMA (one round or more)",
        description=_args.paragraphs(
            "J clients train networks (MLPs, LeNet, FedMA's simple CNN with or without batch norm) on their "
            "partitions; the server matches their units into one global network (PFNM, Yurochkin et al. 2019), "
            "compared with the local models, their ensemble, FedAvg, k-means at PFNM's widths and, with "
            "--layerwise-retrain, FedMA (Wang et al. 2020). The training defaults are the PFNM reference code's."),
        epilog=_args.examples(__doc__, SERVER_SECONDS), formatter_class=HelpFormatter, usage="%(prog)s [options]")
    _args.add_help_all(p)
    _args.add_data_arguments(p, standardize=False,
                             standardize_help="standardise inputs with the train split's mean and standard deviation;"
                             " --no-standardize keeps pixels in [0, 1], as the PFNM reference code does")
    g = p.add_argument_group("clients and partition")
    g.add_argument("--clients", type=_args.ints, default=(PartitionConfig().clients,), metavar="J[,J...]",
                   help="the number of clients J, or a list such as 5,10,20 (one experiment each, and a plot against "
                   "J)")
    _options.add_config_options(p, PartitionConfig, PartitionConfig(), group=g, exclude=("clients",))
    _options.add_config_options(p, NetworkConfig, PFNM_NETWORK, title="network", helps={"shared_init": (
        "every client starts from one initialisation (PFNM does not need it; default: each from its own)")})
    _options.add_config_options(p, TrainingConfig, PFNM_TRAINING, title="local training",
                                description="defaults: the PFNM reference code's", helps={"device": DEVICE_HELP},
                                defaults={"amsgrad": "on with --optimizer adam, off with sgd"})
    _options.add_config_options(p, PFNMConfig, PFNMConfig(), title="matching",
                                description="the PFNM server: Beta-Bernoulli process matching of the units",
                                exclude=("matcher_device",), helps={"fraction": FRACTION_HELP})
    e = ExperimentConfig()
    _options.add_config_options(
        p, ExperimentConfig, e, title="experiment", exclude=("predictive_samples",),
        helps={"methods": "the methods to run, one row each: names, or specs name:key=value such as "
               "pfnm:heads=pooled, fusion:rule=gaa, match:rule=eaa. The methods: "
               f"{', '.join(methods.available_methods())}; bnpfed.federated.method_options lists a method's options",
               "rounds": "communication rounds of the multi-round methods (fedavg, pfnm-rounds, fedma-rounds); not "
               "with --width-sweep, which matches the first round's local models"},
        defaults={"methods": f"{','.join(DEFAULT_METHODS)}, and pfnm-rounds with --rounds > 1, fedma (and "
                             "fedma-rounds) with --layerwise-retrain",
                  "rounds": f"{e.rounds}"})
    g = p.add_argument_group("width sweep", "instead of the comparison: accuracy against global width")
    g.add_argument("--width-sweep", action="store_true",
                   help="train the local models once and match them with every --sweep-sigma2 x --sweep-gamma0, "
                   "under both sets of constants")
    _args.hidden(g.add_argument(
        "--sweep-sigma2", type=_args.floats, metavar="S,S,...",
        help=f"sigma2 values of the sweep (default: {','.join(map(str, SWEEP_SIGMA2))}, from about one client's "
        "width to about J clients' on digits)"))
    _args.hidden(g.add_argument("--sweep-gamma0", type=_args.floats, metavar="G,G,...",
                                   help=f"gamma0 values of the sweep (default: {','.join(map(str, SWEEP_GAMMA0))})"))
    g = _args.add_output_arguments(p, threads=1, json_help="write the flags, settings, versions and results as JSON",
                                   plot_help="write a figure (PNG): accuracy and global width per method, per round "
                                   "(--rounds > 1), against J (several --clients) or against width (--width-sweep)")
    g.add_argument("--save-global", metavar="DIR",
                   help="write every global network a method built to DIR/<method>.pt (DIR/J<J>/ with several "
                   "--clients), each readable by bnpfed.load_global and bnpfed evaluate")
    _options.add_experimental_option(p, PFNMConfig.EXPERIMENTAL, old=("starts", "stop", "inactive"))
    p.set_defaults(func=run)


#: ``--device``'s help here: the clients' device and the matcher's.
DEVICE_HELP = ("where the clients train and the server's matcher computes its cross products: cpu or cuda[:N]. On cpu "
               "the matcher takes its numpy path; on a CUDA device torch sees, the networks come back to the CPU, "
               "where the scores and the assignment problems stay (numbers differ from the CPU's in the last digits)")
#: ``--fraction``'s help here: PFNM's client sampling and FedAvg's.
FRACTION_HELP = "the share of the clients sampled each round, in (0, 1] (PFNM's rounds and FedAvg's)"


# ------------------------------------------------------------------------------------------------ run


def prepare(args) -> dict:
    """Every config of the run, the data loaded and checked, the partitions checked against it: everything that
    can fail on a bad argument or input file, before anything trains (a ``ValueError`` or
    :class:`~bnpfed.commands._args.UsageError` naming the field or flag)."""
    _args.check_threads(args.threads)
    _args.check_output_path(args.json, "--json")
    _args.check_output_path(args.plot, "--plot", plot=True)
    if len(set(args.clients)) != len(args.clients):
        raise UsageError(f"--clients: expected each J at most once, got {','.join(map(str, args.clients))}")
    if args.width_sweep and len(args.clients) > 1:
        raise UsageError(f"--clients: expected one J with --width-sweep, got {','.join(map(str, args.clients))}")
    if args.save_global is not None:
        if args.width_sweep:
            raise UsageError("--save-global: expected only without --width-sweep (the sweep keeps no network)")
        _args.check_save_global(args.save_global)
    for name in ("max_width", "max_params", "select", "rounds"):
        if args.width_sweep and getattr(args, name) is not None:
            raise UsageError(f"--{name.replace('_', '-')}: expected only without --width-sweep (the sweep matches the "
                             f"first round's local models with every sigma2 and gamma0 and shows the widths they "
                             f"give), got --{name.replace('_', '-')} {getattr(args, name)}")
    for name, default in (("sweep_sigma2", SWEEP_SIGMA2), ("sweep_gamma0", SWEEP_GAMMA0)):
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif not args.width_sweep:
            raise UsageError(f"--{name.replace('_', '-')}: expected only with --width-sweep (the values it sweeps)")
    partitions = [_options.config_from_args(PartitionConfig, args, PartitionConfig(), clients=J) for J in args.clients]
    network = _options.network_config(args, PFNM_NETWORK)
    training = _options.training_config(args, PFNM_TRAINING)
    experimental = _options.experimental_from_args(args, PROG)
    pfnm = _options.config_from_args(
        PFNMConfig, args, PFNMConfig(), experimental=experimental,
        matcher_device=None if torch.device(training.device).type == "cpu" else training.device)
    fusion = FusionConfig(fraction=pfnm.fraction)  # FedAvg's client sampling
    with _args.notices(PROG):   # a method name of bnpfed 0.1 (pfnm-pooled) says its spec
        config = _options.config_from_args(ExperimentConfig, args, ExperimentConfig(), seed=args.seed)
    if args.methods is None:
        chosen = DEFAULT_METHODS + (("pfnm-rounds",) if config.rounds > 1 else ())
        if pfnm.layerwise_retrain:
            chosen += ("fedma",) + (("fedma-rounds",) if config.rounds > 1 else ())
        config = replace(config, methods=chosen)
    methods.check_methods(config, dict(pfnm=pfnm, fusion=fusion, partition=partitions[0], network=network,
                                       training=training, config=config))
    if config.select == "operating-point" and pfnm.fixed:
        raise UsageError("--select operating-point: expected empirical Bayes (it scales the estimated sigma2), got "
                         + ("--constants reference" if pfnm.constants == "reference" else "--hyperparameters fixed"))
    if config.select == "operating-point" and pfnm.sigma2 is not None:
        raise UsageError(f"--sigma2: expected it left to the estimate with --select operating-point (which scales "
                         f"the estimate), got {args.sigma2}")
    if args.width_sweep:
        check_positives(args.sweep_sigma2, "sweep_sigma2")
        check_positives(args.sweep_gamma0, "sweep_gamma0")
    dataset = _args.load_data(args, standardize=args.standardize)
    for partition in partitions:
        _args.check_partition(partition, dataset, config.seed)
    training.check_inputs(dataset.input_shape)
    net = initial_network(network, dataset.input_shape, dataset.num_classes, seed=config.seed, client=0)
    _check_per_group(pfnm, derive_spec(net, dataset.input_shape))
    return dict(dataset=dataset, partitions=partitions, network=network, training=training, pfnm=pfnm, fusion=fusion,
                config=config)


def _check_per_group(pfnm: PFNMConfig, spec) -> None:
    """--sigma2 / --sigma0-2 / --gamma0 / --max-width with several values: one per matched group (hidden layer or
    conv channels), checked before anything trains."""
    names = [g.name for g in spec.groups]
    for name in ("sigma2", "sigma0_2", "gamma0", "max_width"):
        values = getattr(pfnm, name)
        if isinstance(values, tuple) and len(values) != len(names):
            raise UsageError(f"--{name.replace('_', '-')}: expected one value or one per matched group ({len(names)}: "
                             f"{', '.join(names)}), got {len(values)}")


def run(args) -> int:
    try:
        plan = prepare(args)
    except UsageError as error:
        return fail(PROG, str(error))
    except ValueError as error:
        return fail(PROG, flag_message(error))
    dataset, partitions = plan.pop("dataset"), plan.pop("partitions")
    progress = not args.no_progress
    settings = {"partition": config_dict(partitions[0]), **{k: config_dict(v) for k, v in plan.items()}}
    settings["partition"]["clients"] = list(args.clients) if len(args.clients) > 1 else args.clients[0]
    try:
        with _args.torch_threads(args.threads):
            if args.width_sweep:
                # the reference constants match top-down, which only an MLP can be
                constants = ("bnpfed", "reference") if plan["network"].arch == "mlp" else ("bnpfed",)
                points = methods.width_sweep(dataset, sigma2=args.sweep_sigma2, gamma0=args.sweep_gamma0,
                                             constants=constants, progress=progress, partition=partitions[0],
                                             **_without(plan, "fusion"))
            else:
                results = []
                for partition in partitions:
                    result = methods.run_experiment(dataset, partition=partition, progress=progress,
                                                    log=_args.round_log(progress), **plan)
                    results.append(result)
                    _print_result(dataset.name, partition, plan, result)
    except _args.TRAINING_ERRORS as error:
        return fail(PROG, _args.training_failure(error), 1)
    except KeyboardInterrupt:
        return fail(PROG, "interrupted", 130)
    if args.width_sweep:
        _print_sweep(dataset.name, partitions[0], plan, points)
        payload = command_results([{"rows": points}])
    else:
        print(f"\n{SERVER_SECONDS}")
        payload = command_results([r.as_dict() for r in results])
    if args.json:
        write_json(args.json, command_record("pfnm", args, settings, payload))
        print(f"wrote results to {args.json}")
    if args.save_global is not None:
        for partition, result in zip(partitions, results):
            folder = Path(args.save_global) / (f"J{partition.clients}" if len(partitions) > 1 else "")
            _args.save_globals(folder, result.global_models)
    if args.plot:
        title = _title(dataset.name, partitions, plan)
        by = "width" if plan["network"].arch == "mlp" else "parameters"
        if args.width_sweep:
            one = initial_network(plan["network"], dataset.input_shape, dataset.num_classes, seed=0)
            _plot_width(points, args.plot, title, sum(methods.network_widths(one, dataset.input_shape)),
                        partitions[0].clients)
        elif len(results) > 1:
            _plot_by_clients(results, [p.clients for p in partitions], args.plot, title, by)
        elif plan["config"].rounds > 1 and any(len(r.history) > 1 for r in results[0].rows):
            _plot_rounds(results[0], args.plot, title, by)
        else:
            _plot_one_round(results[0], args.plot, title, by)
        print(f"wrote plot to {args.plot}")
    return 0


def _without(plan: dict, *names) -> dict:
    return {k: v for k, v in plan.items() if k not in names}


def _describe(name: str, partition, plan: dict) -> str:
    alpha = f" (alpha {partition.alpha:g})" if partition.partition == "dirichlet" else ""
    epochs = _args.plural(plan["training"].epochs, "local epoch")
    return (f"{name}: J = {partition.clients} clients, {partition.partition} partition{alpha}, "
            f"{_arch(plan['network'])}, {epochs}, seed {plan['config'].seed}")


def _arch(network: NetworkConfig) -> str:
    return f"MLP hidden {list(network.hidden)}" if network.arch == "mlp" else network.arch


def _hyper(config: PFNMConfig) -> str:
    def shown(v):
        if v is None:
            return "1" if config.fixed else "estimated"
        return ",".join("estimated" if x is None else f"{x:g}" for x in v) if isinstance(v, tuple) else f"{v:g}"

    objective = config.objective or ("map" if config.fixed else "marginal")
    mode = "fixed" if config.fixed else "empirical Bayes"
    weights = config.global_weights or ("posterior-mean" if config.fixed else "average")
    return (f"{mode}: sigma2 {shown(config.sigma2)}, sigma0_2 {shown(config.sigma0_2)}, gamma0 "
            f"{shown(config.gamma0)}, {config.constants} constants, {objective} objective, {config.direction}, "
            f"{weights} global weights")


def _layer_table(rows) -> list[dict]:
    """The PFNM and FedMA rows' hyper-parameters per hidden layer or conv channels (estimated or fixed), one table
    row per (method, layer)."""
    out = []
    for row in rows:
        for layer, h in enumerate(row.hyperparameters):
            out.append(dict(method=row.method, layer=layer + 1, sigma2=h["sigma2"], sigma0_2=h["sigma0_2"],
                            sigma2_out=h.get("sigma2_scaled", float("nan")),
                            sigma0_2_out=h.get("sigma0_2_scaled", float("nan")), gamma0=h["gamma0"],
                            mu0_mean=sum(h["mu0"]) / len(h["mu0"]) if h["mu0"] else float("nan"),
                            estimated=",".join(h["estimated"]) or "none", sweeps=h["sweeps"],
                            converged=h["converged"]))
    return out


def _print_result(name: str, partition, plan: dict, result) -> None:
    print(f"\n{_describe(name, partition, plan)}")
    selection = result.selection
    if selection is not None:
        if selection.by == "none":
            print(f"PFNM hyper-parameters: {_hyper(selection.config)}")
        elif selection.by == "operating-point":
            chosen = next(c for c in selection.curve if c["chosen"])
            print(f"PFNM operating point (the narrowest global network within {plan['config'].tolerance:g} paired "
                  f"standard error(s) of the best accuracy on the clients' held-out splits): sigma2 "
                  f"{chosen['factor']:g} x the estimate, held-out accuracy {selection.score:.4f}; "
                  f"{_hyper(selection.config)}")
            print(format_table(selection.curve, [c for c in ("factor", "hidden", "parameters", "validation", "se",
                                                             "test", "chosen") if c in selection.curve[0]]))
        else:
            where = ("the clients' held-out splits" if selection.by == "federated"
                     else "the pooled training data")
            print(f"PFNM hyper-parameters (selected on {where}, accuracy {selection.score:.4f}): "
                  f"{_hyper(selection.config)}")
            print(format_table(selection.curve, [c for c in ("sigma2", "sigma0_2", "gamma0", "hidden", "validation",
                                                             "test") if c in selection.curve[0]]))
    print(format_table([asdict(r) for r in result.rows], COLUMNS))
    layers = _layer_table(result.rows)
    if layers:
        print("PFNM hyper-parameters per hidden layer (conv channels count as a layer; the final match's; "
              "sigma2_out / sigma0_2_out: the pair of the class-share-weighted output coordinates of the last hidden "
              "layer; mu0_mean: the mean of the atoms' prior mean over the layer's coordinates):")
        print(format_table(layers))
    for message in result.warnings:
        warn(message)


def _print_sweep(name: str, partition, plan: dict, points) -> None:
    print(f"accuracy against global width: {_describe(name, partition, plan)}")
    print(format_table(points, ["constants", "sigma2", "gamma0", "hidden", "accuracy", "seconds"]))
    print("seconds: the wall time of the matching alone; the reference constants match top-down, as the published "
          "code does")


def _title(name: str, partitions, plan: dict) -> str:
    p = partitions[0]
    clients = ", ".join(str(q.clients) for q in partitions)
    alpha = f" (alpha {p.alpha:g})" if p.partition == "dirichlet" else ""
    return f"{name}: J = {clients} clients, {p.partition} partition{alpha}, {_arch(plan['network'])}"


# ------------------------------------------------------------------------------------------------ plots


def _integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _size_ticks(axis, by: str) -> None:
    """Integer ticks on a size axis; parameter counts as 50k, 1.2M (five ticks at most), so the labels never run
    into each other."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    if by != "parameters":
        _integer_ticks(axis)
        return
    axis.set_major_locator(MaxNLocator(nbins=5, integer=True))

    def compact(value, _):
        for scale, suffix in ((1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:.3g}{suffix}"
        return f"{value:.0f}"

    axis.set_major_formatter(FuncFormatter(compact))


def _legend_right(fig, axes) -> None:
    handles, labels = {}, []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    if labels:
        fig.legend([handles[label] for label in labels], labels, loc="center left", bbox_to_anchor=(1.0, 0.5),
                   fontsize=9, frameon=False)


def _plot_one_round(result, path: str, title: str, by: str = "width") -> None:
    """One round: a bar per method, test accuracy on the left, global width (``by="parameters"``: parameter count,
    the convolutional networks' measure) on the right."""
    plt = pyplot()
    rows = result.rows
    names = [r.method for r in rows]
    colors = {n: style["color"] for n, style in line_styles(names).items()}
    fig, (ax_acc, ax_width) = plt.subplots(1, 2, figsize=(11, 1.6 + 0.42 * len(rows)), sharey=True)
    y = list(range(len(rows)))
    accuracies = [r.accuracy for r in rows]
    widths = [_size_of(r, by) for r in rows]
    ax_acc.barh(y, accuracies, color=[colors[n] for n in names])
    ax_width.barh(y, widths, color=[colors[n] for n in names])
    for i, (a, w) in enumerate(zip(accuracies, widths)):
        ax_acc.text(a, i, f" {a:.3f}", va="center", fontsize=8)
        ax_width.text(w, i, f" {w:,}", va="center", fontsize=8)
    ax_acc.set_yticks(y, names)
    ax_acc.invert_yaxis()
    ax_acc.set(xlim=(0, 1.12), xlabel="test accuracy")
    ax_width.set(xlim=(0, 1.2 * max(widths + [1])), xlabel=WIDTH_LABEL if by == "width" else PARAMETERS_LABEL)
    _size_ticks(ax_width.xaxis, by)
    fig.suptitle(f"{title}, one round")
    fig.tight_layout()
    save_figure(fig, path)


def _plot_rounds(result, path: str, title: str, by: str = "width") -> None:
    """Several rounds: accuracy and global width per round of the multi-round methods; the one-shot methods as
    horizontal lines."""
    plt = pyplot()
    rows = [r for r in result.rows if r.method not in ("local-min", "local-max")]
    styles = line_styles([r.method for r in rows])
    colors = {name: style["color"] for name, style in styles.items()}
    fig, (ax_acc, ax_width) = plt.subplots(1, 2, figsize=(11, 4.2))
    last = max(len(r.history) for r in rows)
    for r in rows:
        if len(r.history) > 1:
            rounds = [h["round"] for h in r.history]
            hidden = [_size_of(h, by, r) for h in r.history]
            style = {**styles[r.method], "linestyle": "-"}
            ax_acc.plot(rounds, [h["accuracy"] for h in r.history], label=r.method, **style)
            ax_width.plot(rounds, hidden, label=r.method, **style)
        else:
            one_shot = r.rounds == 1 and "oneshot" not in r.method
            label = f"{r.method} (one shot)" if one_shot else r.method
            ax_acc.axhline(r.accuracy, ls="--", lw=1.2, color=colors[r.method], label=label)
            ax_width.axhline(_size_of(r, by), ls="--", lw=1.2, color=colors[r.method], label=label)
    for ax in (ax_acc, ax_width):
        ax.set_xlabel("communication round")
        ax.set_xlim(0.8, last + 0.2)
        _integer_ticks(ax.xaxis)
    _size_ticks(ax_width.yaxis, by)
    ax_acc.set_ylabel("test accuracy")
    ax_width.set_ylabel(WIDTH_LABEL if by == "width" else PARAMETERS_LABEL)
    ax_width.set_ylim(bottom=0)
    fig.suptitle(f"{title}, {last} rounds")
    fig.tight_layout()
    _legend_right(fig, [ax_acc, ax_width])
    save_figure(fig, path)


def _plot_by_clients(results, clients, path: str, title: str, by: str = "width") -> None:
    """Several J: accuracy and global width against J, one line per method (the local models' range shaded)."""
    plt = pyplot()
    names = [r.method for r in results[0].rows if r.method not in ("local-min", "local-max")]
    styles = line_styles(names)
    fig, (ax_acc, ax_width) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        found = [(J, res.row(name)) for J, res in zip(clients, results) if name in {r.method for r in res.rows}]
        js = [J for J, _ in found]
        ax_acc.plot(js, [r.accuracy for _, r in found], label=name, **styles[name])
        ax_width.plot(js, [_size_of(r, by) for _, r in found], label=name, **styles[name])
    if all({"local-min", "local-max"} <= {r.method for r in res.rows} for res in results):
        ax_acc.fill_between(clients, [res.row("local-min").accuracy for res in results],
                            [res.row("local-max").accuracy for res in results], color="0.5",
                            alpha=0.15, label="local models: min to max")
    for ax in (ax_acc, ax_width):
        ax.set_xlabel("number of clients J")
        ax.set_xticks(clients)
    ax_acc.set_ylabel("test accuracy")
    ax_width.set_ylabel(WIDTH_LABEL if by == "width" else PARAMETERS_LABEL)
    ax_width.set_ylim(bottom=0)
    _size_ticks(ax_width.yaxis, by)
    fig.suptitle(title)
    fig.tight_layout()
    _legend_right(fig, [ax_acc, ax_width])
    save_figure(fig, path)


def _nice_ticks(low: float, high: float) -> list[int]:
    """Integer ticks 1, 2, 3, 5, 7 x 10^k between ``low`` and ``high`` (a log axis)."""
    ticks = [m * 10 ** k for k in range(0, 8) for m in (1, 2, 3, 5, 7)]
    return [t for t in ticks if low * 0.9 <= t <= high * 1.1] or [int(low), int(high)]


def _plot_width(points, path: str, title: str, local_width: int, clients: int) -> None:
    """The width sweep: test accuracy against global width, one marker per gamma0 and a colour per set of
    constants, each set's Pareto front (the best accuracy at that width or less) as a step line."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    constants = list(dict.fromkeys(p["constants"] for p in points))
    gammas = list(dict.fromkeys(p["gamma0"] for p in points))
    colors = {n: style["color"] for n, style in line_styles(constants).items()}
    markers = "o^sDvP*X"
    for name in constants:
        for k, g in enumerate(gammas):
            mine = [p for p in points if p["constants"] == name and p["gamma0"] == g]
            ax.scatter([p["width"] for p in mine], [p["accuracy"] for p in mine], color=colors[name],
                       marker=markers[k % len(markers)], s=30, alpha=0.8, label=f"{name} constants, gamma0 {g:g}")
        mine = sorted((p["width"], -p["accuracy"]) for p in points if p["constants"] == name)
        front, best = [], -1.0
        for w, a in mine:
            if -a > best:
                best = -a
                front.append((w, best))
        front.append((max(w for w, _ in mine), best))
        ax.step(*zip(*front), where="post", color=colors[name], alpha=0.7, label=f"{name} constants: Pareto front")
    ax.axvline(local_width, ls=":", color="0.6", zorder=0, label=f"one client's width ({local_width})")
    ax.axvline(clients * local_width, ls="--", color="0.6", zorder=0,
               label=f"J clients' width ({clients * local_width}, the ensemble)")
    ax.set_xscale("log")
    widths = [p["width"] for p in points] + [local_width, clients * local_width]
    ax.set_xticks(_nice_ticks(min(widths), max(widths)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel=f"{WIDTH_LABEL}, log scale", ylabel="test accuracy",
           title=f"{title}\naccuracy against global width (sigma2 and gamma0 swept)")
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    save_figure(fig, path)

"""``bnpfed fuse``: federated variational Bayesian networks fused by the rules of Ozer et al. (2022), against FedAvg,
through :func:`bnpfed.federated.methods.run_experiment` (``fusion:rule=R`` and ``match:rule=R`` rows, one per rule and
kind of output layer). Its flags are the fields of the configs (``--help`` the usual ones, ``--help-all`` every one).

Examples::

    bnpfed fuse                                                    # digits, 10 IID clients, 5 rounds, every rule
    bnpfed fuse --rule eaa,conflation --partition dirichlet --fraction 0.5 --rounds 8 --plot fuse.png
    bnpfed fuse --paper --dataset fashion-mnist --data-dir DIR --rounds 12 --lr 1e-3 --batch-size 64 --epochs 1
    bnpfed fuse --align match --rounds 1 --epochs 10                # match units of independently initialised clients
    bnpfed fuse --align match --dataset mnist --data-dir DIR --ood fashion-mnist --ood-data-dir DIR2
    bnpfed fuse --align match --rounds 1 --baselines kl-fusion,weight-matching,ot-fusion   # the literature's
    bnpfed fuse --align match --rule eaa,gaa --heads both          # rows match-eaa, match-eaa-pooled, match-gaa, ...
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict

import torch

from bnpfed.combine import available_rules
from bnpfed.matching import ATOM_POSTERIOR, PVI, check_network_matching, derive_spec, matched_rules
from bnpfed.commands import _args, _options
from bnpfed.commands._args import HelpFormatter, UsageError, fail, flag_message, warn
import bnpfed.federated as federated   # called through the face at run time (tests stand in for run_experiment)
from bnpfed.federated import initial_network
from bnpfed.federated import (CNN_LR, FUSION_ARCHITECTURES, FUSION_TRAINING, PAPER_MIN_VARIANCE, BayesianConfig,
                              ExperimentConfig, FusionConfig, MatchedFusionFederation, NetworkConfig, PartitionConfig,
                              PFNMConfig, TrainingConfig, available_methods, config_dict, training_for)
from bnpfed.report import (command_record, command_results, format_table, line_styles, pyplot, save_figure,
                           with_intervals, write_json)
from bnpfed.validation import check_choice

PROG = "bnpfed fuse"
FEDAVG = "fedavg"
COLUMNS = ["method", "accuracy", "accuracy_95", "nll", "ece", "ece_floor", "ece15", "ece_debiased", "brier",
           "mean_sigma", "rounds", "server_seconds"]
#: ``--align match``'s table: the metrics that line up across runs (issue "matching Bayesian neurons").
MATCH_COLUMNS = ["method", "accuracy", "accuracy_95", "nll", "ece", "ece_floor", "ece15", "ece_debiased", "brier",
                 "width", "parameters", "rounds", "server_seconds"]
OOD_COLUMNS = ["auroc_max_prob", "auroc_entropy"]
#: A regression's table (``--dataset diabetes``): the posterior predictive's RMSE, NLL, and its central 90 % interval.
REGRESSION_COLUMNS = ["method", "rmse", "nll", "coverage", "interval_width", "mean_sigma", "rounds", "server_seconds"]
#: ``--heads``: the matched rows' output layers chosen by the clients' class shares, fused, pooled, or both rows.
HEADS_CHOICES = ("auto", "fused", "pooled", "both")
#: The one-shot fusion baselines --baselines adds (--align match).
BASELINES = ("kl-fusion", *federated.ALIGNMENT_METHODS)
#: Metrics the plot shows, one panel each.
#: The command's own defaults, where they differ from the configs': five rounds, ECE with 100 bins (the paper's).
ROUNDS, ECE_BINS = 5, 100
#: What --paper changes (Ozer et al.'s published code): pixels in [0, 1], their LeNet-5, the clamp of log sigma^2 at
#: -8 as a variance floor. The rest of their setting is already the default (see --help).
PAPER = {"standardize": False, "arch": "lenet-paper", "min_variance": PAPER_MIN_VARIANCE}
NOT_PAPER = {"standardize": True, "arch": NetworkConfig().arch, "min_variance": FusionConfig().min_variance}
SERVER_SECONDS = ("server_seconds: the server's aggregation time (fusion or averaging) summed over the rounds; local "
                  "training and evaluation are not included. mean_sigma: the mean posterior standard deviation of the "
                  "Bayesian weights (- for FedAvg, which has none). ece_floor: the ECE a perfectly calibrated model "
                  "with the same confidences would show on this test split (an ece near it is as calibrated as the "
                  "split can tell).")
#: The legend of a regression's table.
REGRESSION_LEGEND = ("rmse: of the posterior predictive's mean; nll: its mean negative log density at the test "
                     "targets; coverage: the share of test targets inside its central 90 % interval (0.9 when "
                     "calibrated); "
                     "interval_width: that interval's mean width (in the targets' units, standardised unless "
                     "--no-standardize); server_seconds: the server's fusion time summed over the rounds.")
#: What the table's calibration and interval columns are (printed under it).
INTERVALS_NOTE = ("ece15: the ECE with 15 bins; ece_debiased: Kumar et al.'s debiased L2 calibration error (15 "
                  "equal-mass bins), the test split's noise taken out; accuracy_95: a 95 % bootstrap interval over the "
                  "test examples (--json: every metric's).")


def add_parser(sub):
    bayes, fusion = BayesianConfig(), FusionConfig()
    p = sub.add_parser(
        "fuse",
        help="federated Bayesian networks fused by each posterior fusion rule, against FedAvg",
        description=_args.paragraphs(
            "J clients train mean-field Gaussian Bayesian networks with SVI; every round the server fuses their "
            "posteriors with each rule of Ozer et al. (2022), weight by weight or (--align match) after matching "
            "their hidden units. FedAvg on the same network is the baseline. Prints each method's test accuracy, "
            "NLL, ECE, Brier score and mean posterior sigma."),
        epilog=_args.examples(__doc__, SERVER_SECONDS), formatter_class=HelpFormatter, usage="%(prog)s [options]")
    _args.add_help_all(p)
    _args.add_data_arguments(p, standardize=None,
                             standardize_help="standardise inputs with the train split's mean and standard deviation "
                             "(default), or keep pixels in [0, 1] (--no-standardize; the default with --paper)")
    _options.add_config_options(p, PartitionConfig, PartitionConfig(), title="clients and partition")
    _options.add_config_options(
        p, NetworkConfig, NetworkConfig(), title="network", exclude=("shared_init",),
        helps={"arch": "mlp (ReLU MLP of --hidden), lenet (LeNet-5, conv1 padded by 2), lenet-paper (LeNet-5 as Ozer "
                       "et al.'s code has it) or simple-cnn (FedMA's); networks with batch norm are not fused (their "
                       "running statistics are no posterior)",
               "init": "the shared initial network's initialisation: torch (PyTorch's) or reference (PFNM's)"},
        defaults={"arch": "mlp; lenet-paper with --paper"},
        metavars={"arch": "{" + ",".join(FUSION_ARCHITECTURES) + "}"})
    _options.add_config_options(p, BayesianConfig, bayes, title="Bayesian clients",
                                description="a mean-field Gaussian posterior per Bayesian weight, fitted by SVI")
    g = _options.add_config_options(p, TrainingConfig, FUSION_TRAINING, title="local training",
                                    description=f"the Bayesian clients' SVI and FedAvg's clients alike; the CNNs at "
                                    f"--lr {CNN_LR:g}",
                                    hide=("round_epochs", "device"), helps={"device": (
                                        "cpu only: the Bayesian clients' SVI runs on the CPU (the flag is here so "
                                        "that every command takes the same settings)")},
                                    defaults={"lr": f"{FUSION_TRAINING.lr:g}, {CNN_LR:g} for a CNN"})
    g.add_argument("--local-epochs", dest="epochs", help=argparse.SUPPRESS)   # bnpfed 0.1's name of --epochs
    g = p.add_argument_group("fusion (the server)")
    g.add_argument("--rule", type=_rules, default="all", metavar="all|R,R,...",
                   help=f"the fusion rules to compare, one row each: all, or a list of {', '.join(available_rules())}; "
                   f"with --align match also {ATOM_POSTERIOR} (the matching model's own posterior of each unit) and "
                   f"{PVI} (partitioned variational inference)")
    g.add_argument("--heads", choices=HEADS_CHOICES, default="auto",
                   help="--align match: the output layer of the rows match-RULE and pfnm: auto (pooled when the "
                   "clients' class shares differ, else fused), fused, pooled (the clients' own posterior output "
                   "layers pooled with their class shares in every draw: rows match-RULE-pooled, pfnm-pooled) or both")
    _options.add_config_options(
        p, FusionConfig, fusion, group=g, exclude=("rule", "heads"),
        helps={"align": "none: fuse weight i of every client with weight i of the others (the rows named by the "
                        "rules), from one shared initialisation. match: the clients start from their own "
                        "initialisations, the server matches their hidden units and fuses each global unit's members "
                        "with each rule (rows match-RULE), beside the rows ensemble, pfnm, fedavg and every rule "
                        "without alignment",
               "own_init": "weight-wise rows: each client starts from its own initialisation instead of a shared one"},
        defaults={"min_variance": f"{fusion.min_variance:g}; exp(-8) = {PAPER_MIN_VARIANCE:.4g} with --paper",
                  "own_init": "off with --align none, on with --align match"})
    g.add_argument("--no-fedavg", action="store_true", help="skip the FedAvg baseline (none with --program)")
    g.add_argument("--baselines", type=_args.names, metavar="M[,M...]",
                   help="--align match: also these fusion baselines, one shot: kl-fusion (Claici et al. 2020), "
                   "weight-matching (Git Re-Basin), ot-fusion, ot-fusion-sinkhorn (Singh & Jaggi 2020)")
    g = _options.add_config_options(p, ExperimentConfig, ExperimentConfig(rounds=ROUNDS, ece_bins=ECE_BINS),
                                     title="experiment", only=("rounds", "predictive_samples", "ece_bins"),
                                     helps={"ece_bins": "equal-width bins of the expected calibration error (the "
                                                        "paper's 100)"})
    g.add_argument("--samples", dest="predictive_samples", help=argparse.SUPPRESS)   # 0.1's --predictive-samples
    g.add_argument("--ood", type=_args.dataset_name, metavar="NAME",
                   help="another dataset whose test images are out-of-distribution inputs: adds the AUROC of telling "
                   "them apart by the maximum probability and by the predictive entropy")
    _args.hidden(g.add_argument("--ood-data-dir", metavar="DIR",
                                   help="torchvision's root folder of the --ood dataset (default: --data-dir)"))
    g.add_argument("--paper", action="store_true",
                   help="the setting of Ozer et al.'s published code: --no-standardize, --arch lenet-paper, "
                   "--min-variance exp(-8); flags given explicitly win")
    g = _args.add_output_arguments(p, threads=None,
                                   json_help="write the flags, settings, versions and every method's per-round "
                                   "metrics as JSON",
                                   plot_help="write a figure (PNG) of the metrics per round, one panel each, one line "
                                   "per method")
    g.add_argument("--save-global", metavar="DIR",
                   help="write every global model a method built to DIR/<method>.pt, each readable by "
                   "bnpfed.load_global and bnpfed evaluate")
    reads = tuple(dict.fromkeys(FusionConfig.EXPERIMENTAL + BayesianConfig.EXPERIMENTAL))
    _options.add_experimental_option(p, reads, old=("starts", "stop", "later_rounds", "pvi_damping", "round_prior"))
    p.set_defaults(func=run)


def _rules(value: str) -> tuple[str, ...]:
    """argparse type of ``--rule``: ``all`` or a comma-separated list (checked against the registry later)."""
    return tuple(available_rules()) if value.strip() == "all" else _args.names(value)


# ------------------------------------------------------------------------------------------------ run


def prepare(args) -> dict:
    """Every config of the run, the data loaded and checked, the partition checked against it: everything that can
    fail on a bad argument or input file, before anything trains."""
    for key, value in (PAPER if args.paper else NOT_PAPER).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    _args.check_threads(args.threads)
    _args.check_output_path(args.json, "--json")
    _args.check_output_path(args.plot, "--plot", plot=True)
    _args.check_save_global(args.save_global)
    partition = _options.config_from_args(PartitionConfig, args, PartitionConfig())
    network = _options.network_config(args, NetworkConfig())
    check_choice(network.arch, FUSION_ARCHITECTURES, "arch")
    training = _options.training_config(args, training_for(network.arch, FUSION_TRAINING))
    if torch.device(training.device).type != "cpu":
        raise UsageError(f"--device: expected cpu for posterior fusion (the Bayesian clients' SVI runs on the CPU "
                         f"only), got {training.device}")
    experimental = _options.experimental_from_args(args, PROG)
    experimental.check_read_by(args._experimental_reads, PROG)
    bayesian = _options.config_from_args(BayesianConfig, args, BayesianConfig(),
                                         experimental=experimental.only(BayesianConfig.EXPERIMENTAL))
    bayesian.check_training(training)
    if bayesian.program is not None and args.save_global is not None:
        raise UsageError(f"--save-global: writes a global network (bnpfed.load_global); a Pyro program's global "
                         f"posterior is no network, expected it left out with --program {bayesian.program}")
    for rule in args.rule:
        check_choice(rule, matched_rules(), "rule")
    values = _options.given(FusionConfig, args)
    align = values.get("align", "none")
    match = align == "match"
    for rule in args.rule:
        if rule in (ATOM_POSTERIOR, PVI) and not match:
            raise UsageError(f"--rule {rule}: expected only with --align match (a fusion of matched units), got "
                             f"--align {align}")
    if len(set(args.rule)) != len(args.rule):
        raise ValueError(f"rule: expected each rule at most once, got {','.join(args.rule)}")
    if bayesian.client != "variational" and not match:
        raise UsageError(f"--client {bayesian.client}: expected only with --align match (Laplace clients serve "
                         f"matched fusion), got --align {align}")
    for name in ("tau2", "matcher_device"):
        if name in values and not match:
            raise UsageError(f"--{name.replace('_', '-')}: expected only with --align match, got --align {align}")
    for name in ("starts", "stop"):
        if name in experimental.set_fields() and not match:
            raise UsageError(f"--experimental: {name} is matched fusion's (its matcher's); expected it only with "
                             f"--align match, got --align {align}")
    if args.heads not in ("auto", "fused") and not match:
        raise UsageError(f"--heads: expected only with --align match, got --align {align}")
    if values.get("temperature", 1) != 1 and not match:
        raise UsageError(f"--temperature: the predictive temperature of the match-RULE rows; expected it only with "
                         f"--align match, got --align {align}")
    if values.get("temperature", 1) != 1 and args.heads == "pooled":
        raise UsageError("--temperature: the fused output layer's (match-RULE rows); with --heads pooled every row "
                         "pools its heads, whose temperature is --pool-temperature; expected --heads fused or both")
    if values.get("pool_temperature", 1) != 1 and args.heads == "fused":
        raise UsageError("--pool-temperature: the temperature of pooled heads; expected it only with --heads pooled "
                         "or both, got --heads fused")
    _args.check_ood_flags(args)
    if experimental.round_prior is not None and PVI in args.rule:
        raise UsageError(f"--experimental: round-prior: --rule {PVI} trains every client against its cavity; "
                         f"expected it unset with that rule, got round-prior={experimental.round_prior}")
    if experimental.pvi_damping is not None and PVI not in args.rule:
        raise UsageError(f"--experimental: pvi-damping: expected only with --rule {PVI}, got --rule "
                         f"{','.join(args.rule)}")
    if experimental.later_rounds == "fixed" and PVI in args.rule:
        raise UsageError(f"--experimental: later-rounds=fixed: --rule {PVI} keeps each client's factor in its own "
                         f"units; expected rematch with it")
    if PVI in args.rule and values.get("fraction", 1) != 1:
        raise UsageError(f"--fraction: --rule {PVI} keeps every client's factor from round to round, so every "
                         f"client takes part in every round; expected 1, got {values['fraction']}")
    fusion = _options.config_from_args(FusionConfig, args, FusionConfig(), rule=args.rule[0],
                                       heads="auto" if args.heads == "auto" else "fused",   # the rows' specs say
                                       own_init=match if args.own_init is None else args.own_init,
                                       experimental=experimental.only(FusionConfig.EXPERIMENTAL))
    if bayesian.program is not None:
        federated.check_program_fusion(network, fusion)   # the network's flags and --align match, before training
    if args.baselines is not None:
        if not match:
            raise UsageError(f"--baselines: expected only with --align match, got --align {align}")
        for name in args.baselines:   # the built-in baselines, or a method a plugin registered
            if name not in BASELINES and name not in available_methods():
                raise UsageError(f"--baselines: expected names among {', '.join(BASELINES)} or a method a --plugin "
                                 f"registered, got {name!r}")
    # FedAvg's baseline trains a network: a program's rows are the fusion rules (as a regression's, said in --help-all)
    fedavg = () if args.no_fedavg or bayesian.program is not None else (FEDAVG,)
    rounds = _options.given(ExperimentConfig, args).get("rounds", ROUNDS)
    if match:
        # weight-wise fusion from the own initialisations trains variational clients from the global posterior
        # after round 1, so Laplace clients have the matched rows only (said in --client's help)
        weight_wise = (tuple(f"fusion:rule={r}" for r in args.rule if r not in (ATOM_POSTERIOR, PVI))
                       if bayesian.client == "variational" else ())
        kinds = {"auto": ("",), "fused": ("",), "pooled": (":heads=pooled",),
                 "both": ("", ":heads=pooled")}[args.heads]
        pfnm = (("pfnm",) + (("pfnm:heads=pooled",) if args.heads in ("pooled", "both") else ()) if rounds == 1
                else ("pfnm-rounds",))
        names = ("ensemble-bayesian",) + pfnm + fedavg + weight_wise + tuple(
            f"match:rule={rule}{kind}" for rule in args.rule for kind in kinds) + tuple(args.baselines or ())
    else:
        names = tuple(f"fusion:rule={rule}" for rule in args.rule) + fedavg
    config = _options.config_from_args(ExperimentConfig, args, ExperimentConfig(rounds=ROUNDS, ece_bins=ECE_BINS),
                                       methods=names, seed=args.seed)
    # the pfnm-pooled row beside the matched pooled rows pools at the same temperature (under auto: pfnm's own)
    pooled_pfnm = "pfnm:heads=pooled" in names or args.heads == "auto"
    pfnm = PFNMConfig(heads="auto" if args.heads == "auto" else "fused",
                      pool_temperature=fusion.pool_temperature if pooled_pfnm else 1.0)
    federated.check_methods(config, dict(partition=partition, network=network, training=training, bayesian=bayesian,
                                       fusion=fusion, pfnm=pfnm, config=config))
    dataset, ood = _args.load_data_and_ood(args, standardize=args.standardize)
    if dataset.task == "regression":
        if match:
            raise UsageError(f"--align match: matches the units of classifiers; --dataset {dataset.name} is a "
                             "regression, fused weight by weight: expected --align none")
        if FEDAVG in names:
            raise UsageError(f"--dataset {dataset.name}: a regression, whose rows are the posterior fusion rules; "
                             "FedAvg's baseline classifies: pass --no-fedavg")
        if ood is not None:
            raise UsageError(f"--ood: scores a classifier's confidence; --dataset {dataset.name} is a regression")
    bayesian.check_task(dataset.task)
    _args.check_partition(partition, dataset, config.seed)
    training.check_inputs(dataset.input_shape)
    net = initial_network(network, dataset.input_shape, dataset.num_classes, seed=config.seed)
    if match:
        MatchedFusionFederation.check_network(network)
        spec = derive_spec(net, dataset.input_shape)
        fusion.check_groups(spec.group_names)
        check_network_matching(spec, net.state_dict(), partition.clients,   # before anything trains
                               name="--hidden" if network.arch == "mlp" else "--arch",
                               change="lower --hidden (the clients' widths) or --clients, or run on a machine with "
                                      "more memory")
    return dict(dataset=dataset, partition=partition, network=network, training=training, bayesian=bayesian,
                fusion=fusion, pfnm=pfnm, config=config, ood=ood)


def run(args) -> int:
    try:
        plan = prepare(args)
    except UsageError as error:
        return fail(PROG, str(error))
    except ValueError as error:
        return fail(PROG, flag_message(error, aliases={"methods": "--rule"}))
    dataset = plan.pop("dataset")
    ood = plan.pop("ood")
    settings = {k: config_dict(v) for k, v in plan.items()}
    settings["ood"] = args.ood
    print(_describe(dataset.name, plan))
    progress = not args.no_progress
    try:
        with _args.torch_threads(args.threads):
            result = federated.run_experiment(dataset, progress=progress, log=_args.round_log(progress), ood=ood,
                                            **plan)
    except _args.TRAINING_ERRORS as error:
        start = (f"--init-scale {plan['bayesian'].init_scale:g} (the guide's initial posterior sd: the first weights "
                 f"are drawn at that scale; default {BayesianConfig().init_scale:g}) and --init "
                 f"{plan['network'].init}")
        return fail(PROG, _args.training_failure(error, start), 1)
    except KeyboardInterrupt:
        return fail(PROG, "interrupted", 130)
    for row in result.rows:
        if row.method == "pfnm-rounds":  # one name per method across runs (one shot or with rounds)
            row.method = "pfnm"
    for comparison in result.comparisons:
        if comparison["method"] == "pfnm-rounds":
            comparison["method"] = "pfnm"
    kept = {("pfnm" if m == "pfnm-rounds" else m): v for m, v in result.global_models.items()}
    columns = (REGRESSION_COLUMNS if dataset.task == "regression" else MATCH_COLUMNS if args.align == "match"
               else COLUMNS)
    if ood is not None:
        columns = columns[:columns.index("brier") + 1] + OOD_COLUMNS + columns[columns.index("brier") + 1:]
    print(format_table(with_intervals([asdict(r) for r in result.rows]), columns))
    if dataset.task == "regression":
        print(REGRESSION_LEGEND)
    else:
        _args.print_comparisons(result.comparisons, len(result.test_labels))
        print(SERVER_SECONDS)
        print(INTERVALS_NOTE)
    for message in result.warnings:
        warn(message)
    if args.json:
        write_json(args.json, command_record("fuse", args, settings, command_results([result.as_dict()])))
        print(f"wrote results to {args.json}")
    if args.save_global is not None:
        _args.save_globals(args.save_global, kept)
    if args.plot:
        plot_rounds(result, args.plot, title=_title(dataset.name, plan))
        print(f"wrote plot to {args.plot}")
    return 0


def _partition(partition) -> str:
    alpha = f" (alpha {partition.alpha:g})" if partition.partition == "dirichlet" else ""
    return f"{partition.partition} partition{alpha}"


def _describe(name: str, plan: dict) -> str:
    partition, network, training = plan["partition"], plan["network"], plan["training"]
    bayesian, fusion, config = plan["bayesian"], plan["fusion"], plan["config"]
    arch = _arch(network) if bayesian.program is None else f"Pyro program {bayesian.program}, no FedAvg row"
    later = "" if training.round_epochs is None else f" (later rounds {training.round_epochs})"
    schedule = f"{_args.plural(config.rounds, 'round')} x {_args.plural(training.epochs, 'local epoch')}{later}"
    align = (" matched (hidden units of independently initialised clients)" if fusion.align == "match"
             else " weight by weight" + (" from each client's own initialisation" if fusion.own_init else ""))
    return (f"posterior fusion{align}: {name}, J = {partition.clients} clients, {_partition(partition)}, fraction "
            f"{fusion.fraction:g}, {schedule}, {arch}, prior "
            f"{'its own' if bayesian.program else f'{bayesian.prior} N(0, {bayesian.prior_scale:g}^2)'}, "
            f"weights {fusion.weights}, min variance {fusion.min_variance:.3g}, ECE with {config.ece_bins} bins, "
            f"seed {config.seed}")


def _arch(network, program=None) -> str:
    if program is not None:
        return f"Pyro program {program}"
    return f"MLP hidden {list(network.hidden)}" if network.arch == "mlp" else network.arch


def _title(name: str, plan: dict) -> str:
    return (f"posterior fusion on {name}: J = {plan['partition'].clients} clients, {_partition(plan['partition'])}, "
            f"{_arch(plan['network'], plan['bayesian'].program)}, {_args.plural(plan['config'].rounds, 'round')}")


#: What each panel shows, by metric.
PANEL_TITLES = {"accuracy": "test accuracy", "nll": "negative log-likelihood", "ece": "expected calibration error",
                "ece15": "ECE, 15 bins", "ece_debiased": "debiased L2 calibration error", "brier": "Brier score",
                "mean_sigma": "mean posterior sigma",
                "auroc_max_prob": "OOD AUROC (max probability)", "auroc_entropy": "OOD AUROC (entropy)"}


def _value(value):
    """A metric's value, None when it was not measured (None or NaN: FedAvg's mean sigma, AUROC without --ood)."""
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


#: Two methods' points closer than this share of a panel's range, on every panel and round, draw as one
OVERLAP = 0.005


def _same_as(rows, metrics) -> dict[str, str]:
    """Method -> the earlier method whose points it covers on every panel and round (closer than :data:`OVERLAP` of
    the panel's range: EAA and log-variance averaging often agree to the third digit), so that the legend can say
    that one line hides the other."""
    def values(row):
        return [[_value(h.get(m)) for h in row.history] or [_value(getattr(row, m, None))] for m in metrics]

    table = {row.method: values(row) for row in rows}
    spans = []
    for k in range(len(metrics)):
        seen = [v for vals in table.values() for v in vals[k] if v is not None]
        spans.append(max(seen) - min(seen) if seen else 0.0)

    def covers(a, b) -> bool:
        for k, span in enumerate(spans):
            if len(a[k]) != len(b[k]):
                return False
            for x, y in zip(a[k], b[k]):
                if (x is None) != (y is None) or (x is not None and abs(x - y) > OVERLAP * span):
                    return False
        return True

    same, kept = {}, []
    for row in rows:
        other = next((name for name in kept if covers(table[name], table[row.method])), None)
        if other is None:
            kept.append(row.method)
        else:
            same[row.method] = other
    return same


def _interval_bar(ax, row, metric: str, value: float, at: float, color, horizontal: bool) -> None:
    """The row's 95 % bootstrap interval of ``metric`` (its final model's) as an error bar at ``value``, across the
    panel (``horizontal``: the one-round panels, methods on the vertical axis) or up it at round ``at``."""
    interval = (row.intervals or {}).get(metric)
    if not interval:
        return
    err = [[max(value - interval[0], 0.0)], [max(interval[1] - value, 0.0)]]
    ax.errorbar([value] if horizontal else [at], [at] if horizontal else [value], xerr=err if horizontal else None,
                yerr=None if horizontal else err, fmt="none", ecolor=color, elinewidth=1.2, capsize=3)


def plot_rounds(result, path, title: str = "") -> None:
    """A grid of panels, one per metric (accuracy, NLL, ECE, ECE with 15 bins, the debiased calibration error,
    Brier, mean posterior sigma, and the OOD AUROCs when measured), the legend in a panel of its own. Over several
    rounds: one line per multi-round method (FedAvg in black), the one-shot methods (the ensemble, PFNM) as dashed
    horizontal lines. One round: a dot per method on each panel, methods on the vertical axis (no round axis to speak
    of). The final model's 95 % bootstrap interval is an error bar (:func:`_interval_bar`). A method whose points
    cover an earlier one's (:func:`_same_as`) says so in the legend."""
    plt = pyplot()
    rows = list(result.rows)
    metrics = [m for m in PANEL_TITLES if any(_value(getattr(r, m, None)) is not None for r in rows)]
    cols = 3
    n_panels = len(metrics) + 1
    nrows = -(-n_panels // cols)
    last = max(len(r.history) for r in rows)
    one_round = last <= 1
    height = (1.3 + 0.32 * len(rows)) if one_round else 3.2
    fig, axes = plt.subplots(nrows, cols, figsize=(12.5, height * nrows + 0.6), squeeze=False)
    panels, spare = list(axes.flat[:len(metrics)]), list(axes.flat[len(metrics):])
    legend_ax = spare[0]
    for ax in spare[1:]:
        ax.axis("off")
    styles = line_styles([r.method for r in rows])
    same = _same_as(rows, metrics)
    labels = {r.method: r.method + (f" (on {same[r.method]}'s points)" if r.method in same else "")
              for r in rows}
    for ax, metric in zip(panels, metrics):
        ax.set_title(PANEL_TITLES[metric], fontsize=10)
        if one_round:
            y = list(range(len(rows)))
            for i, r in enumerate(rows):
                value = _value(getattr(r, metric, None))
                if value is not None:
                    style = styles[r.method]
                    ax.plot([value], [i], linestyle="none", marker=style["marker"], color=style["color"],
                            markerfacecolor=style["markerfacecolor"], ms=7, label=labels[r.method])
                    _interval_bar(ax, r, metric, value, i, style["color"], horizontal=True)
                    ax.text(value, i, f"  {value:.3g}", va="center", fontsize=7)
            ax.set_yticks(y, [r.method for r in rows], fontsize=8)
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.margins(x=0.25)
            ax.grid(axis="x", alpha=0.3)
        else:
            for k, r in enumerate(rows):
                if len(r.history) > 1:
                    rounds = [h["round"] for h in r.history]
                    values = [_value(h.get(metric)) for h in r.history]
                    if all(v is not None for v in values):
                        ax.plot(rounds, values, label=labels[r.method], **styles[r.method])
                        dodge = 0.05 * (k - (len(rows) - 1) / 2)   # the methods' bars side by side
                        _interval_bar(ax, r, metric, values[-1], rounds[-1] + dodge, styles[r.method]["color"],
                                      horizontal=False)
                elif _value(getattr(r, metric, None)) is not None:
                    ax.axhline(getattr(r, metric), ls="--", lw=1.2, color=styles[r.method]["color"],
                               label=f"{labels[r.method]} (one shot)")
            ax.set_xlabel("communication round")
            ax.set_xlim(0.8, last + 0.2)
            ax.set_xticks(range(1, last + 1))
        if metric == "mean_sigma" and not one_round:  # (one round: a linear axis, each dot labelled)
            ax.set_yscale("log")
            ax.set_title(PANEL_TITLES[metric] + " (log scale)", fontsize=10)
    handles, names = {}, []
    for ax in panels:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                names.append(label)
    legend_ax.axis("off")
    if names and not one_round:
        legend_ax.legend([handles[n] for n in names], names, loc="center", title="method", frameon=False)
    elif same:  # one round: the methods are on every panel's axis; the legend only says which repeat which
        legend_ax.text(0.5, 0.5, "\n".join(f"{m}: the same values as {o}" for m, o in same.items()), ha="center",
                       va="center", fontsize=9, transform=legend_ax.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)

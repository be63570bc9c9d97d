"""``bnpfed fuse``: federated variational Bayesian networks fused by the rules of Ozer et al. (2022), against FedAvg,
through :func:`bnpfed.federated.methods.run_experiment` (every fusion rule is a method there).

Examples::

    bnpfed fuse                                                    # digits, 10 IID clients, 5 rounds, every rule
    bnpfed fuse --rule eaa,conflation --partition dirichlet --fraction 0.5 --rounds 8 --plot fuse.png
    bnpfed fuse --paper --dataset fashion-mnist --data-dir DIR --rounds 12 --lr 1e-3 --batch-size 64 --epochs 1
    bnpfed fuse --align match --rounds 1 --epochs 10                # match units of independently initialised clients
    bnpfed fuse --align match --dataset mnist --data-dir DIR --ood fashion-mnist --ood-data-dir DIR2
    bnpfed fuse --align match --rounds 1 --baselines kl-fusion,weight-matching,ot-fusion   # the literature's
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict

import torch

from bnpfed.combine import available_rules
from bnpfed.matching import STARTS, STOPS
from bnpfed.matching import ATOM_POSTERIOR, MATCH_ON, PVI, matched_rules
from bnpfed.commands import _args
from bnpfed.commands._args import HelpFormatter, UsageError, fail, flag_message, warn
from bnpfed.federated import methods
from bnpfed.federated import initial_network
from bnpfed.federated import (CLIENT_KINDS, CLIENT_WEIGHTS, FUSION_TRAINING, INITIALISATIONS, LAPLACE_PRIORS,
                              PAPER_MIN_VARIANCE, PRIOR_VARIANCES, PVI_DAMPING, ROUND_PRIORS, LATER_ROUNDS,
                              BayesianConfig, FusionConfig, NetworkConfig, PFNMConfig, config_dict)
from bnpfed.federated import ExperimentConfig
from bnpfed.federated import FUSION_ARCHITECTURES
from bnpfed.federated import MatchedFusionFederation
from bnpfed.models import available_likelihoods, available_priors
from bnpfed.report import (command_record, command_results, format_table, line_styles, pyplot, save_figure,
                           write_json)
from bnpfed.validation import check_choice

PROG = "bnpfed fuse"
FEDAVG = "fedavg"
COLUMNS = ["method", "accuracy", "nll", "ece", "ece_floor", "brier", "mean_sigma", "rounds", "server_seconds"]
#: ``--align match``'s table: the metrics that line up across runs (issue "matching Bayesian neurons").
MATCH_COLUMNS = ["method", "accuracy", "nll", "ece", "ece_floor", "ece15", "brier", "width", "parameters", "rounds",
                 "server_seconds"]
OOD_COLUMNS = ["auroc_max_prob", "auroc_entropy"]
MATCH_PREFIX = methods.MATCH_PREFIX
POOLED_SUFFIX = methods.POOLED_SUFFIX
#: ``--heads``: the matched rows' output layers fused, pooled, or both rows.
HEADS_CHOICES = ("fused", "pooled", "both")
#: The one-shot fusion baselines --baselines adds (--align match).
BASELINES = ("kl-fusion", *methods.ALIGNMENT_METHODS)
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


def add_parser(sub):
    bayes, fusion, network = BayesianConfig(), FusionConfig(), NetworkConfig()
    p = sub.add_parser(
        "fuse",
        help="federated Bayesian networks fused by each posterior fusion rule, against FedAvg",
        description=_args.paragraphs(
            "Partition a dataset among J clients, train mean-field Gaussian Bayesian networks on them with SVI, and "
            "fuse their posteriors on the server every round with each rule of Ozer et al. (2022) (eaa, gaa, "
            "log_variance, pooling, conflation); deterministic parameters are averaged with the same client "
            "weights. FedAvg on the same network is the baseline. Prints each method's final test accuracy, NLL, "
            "ECE, Brier score and mean posterior sigma."),
        epilog=_args.examples(__doc__, SERVER_SECONDS),
        formatter_class=HelpFormatter,
    )
    _args.add_data_arguments(p, standardize=None,
                             standardize_help="standardise inputs with the train split's mean and standard deviation "
                             "(default), or keep pixels in [0, 1] (--no-standardize; the default with --paper)")
    _args.add_partition_arguments(p, many_clients=False, clients_help="number of clients J")
    g = p.add_argument_group("network")
    g.add_argument("--arch", choices=FUSION_ARCHITECTURES,
                   help="mlp (ReLU MLP of --hidden), lenet (LeNet-5, conv1 padded by 2), lenet-paper (LeNet-5 as "
                   "Ozer et al.'s code has it) or simple-cnn (FedMA's); networks with batch norm are not fused "
                   f"(their running statistics are no posterior) (default: {network.arch}; lenet-paper with --paper)")
    g.add_argument("--hidden", type=_args.ints, metavar="H[,H...]",
                   help=f"hidden widths of the MLP (--arch mlp only; default: {','.join(map(str, network.hidden))})")
    g.add_argument("--init", choices=INITIALISATIONS, default=network.init,
                   help="initialisation of the shared initial network: torch (PyTorch's) or reference (PFNM's)")
    g = p.add_argument_group("Bayesian clients", "a mean-field Gaussian posterior per Bayesian weight, fitted by SVI")
    g.add_argument("--prior", choices=available_priors(), default=bayes.prior,
                   help="which parameters are Bayesian, with a N(0, prior_scale^2) prior: linear-weights (the fully "
                   "connected weight matrices, as in the paper) or all; or a prior a --plugin registered")
    g.add_argument("--likelihood", choices=available_likelihoods(), default=bayes.likelihood,
                   help="the clients' observation model: categorical (classification), or a classification "
                   "likelihood a --plugin registered")
    g.add_argument("--prior-scale", type=float, metavar="SCALE", default=bayes.prior_scale,
                   help="the prior's standard deviation")
    g.add_argument("--init-scale", type=float, metavar="SCALE", default=bayes.init_scale,
                   help="the posterior's initial standard deviation")
    g.add_argument("--prior-variance", choices=PRIOR_VARIANCES, default=bayes.prior_variance,
                   help="fixed (prior-scale^2, the paper's) or empirical-bayes (each client's own type-II maximum-"
                   "likelihood variance per weight matrix, re-estimated every step, starting at prior-scale^2)")
    g.add_argument("--kl-weight", type=float, metavar="LAMBDA", default=bayes.kl_weight,
                   help="weight of the KL term in the clients' loss: 1 is the ELBO, < 1 a tempered (cold) posterior "
                   "that counts each example 1/LAMBDA times")
    g.add_argument("--scale-lr-factor", type=float, metavar="F", default=bayes.scale_lr_factor,
                   help="the posterior scales learn at F times --lr (1: one rate, as recorded; 10 reaches the "
                   "variational optimum)")
    g.add_argument("--round-prior", choices=ROUND_PRIORS,
                   help="a client's prior in the rounds after the first: prior (the configured one; the global "
                   "posterior, or its slice, only where SVI starts: each round fuses posteriors that hold each "
                   "client's data once) or posterior (the global posterior or its slice as the prior too: posterior "
                   "as prior, which counts a client's data once more every round) (default: prior; not with --rule "
                   f"{PVI}, whose clients train against their cavities)")
    g.add_argument("--client", choices=CLIENT_KINDS, default=bayes.client,
                   help="variational (SVI on the ELBO) or laplace: each client trains its network as a PFNM client "
                   "does and takes its diagonal Laplace posterior, prior precision per weight matrix by the marginal "
                   "likelihood (laplace-torch); with --align match only (its table then has the matched rows, "
                   "not weight-wise fusion from the own initialisations), without the SVI flags above")
    g.add_argument("--laplace-prior", choices=LAPLACE_PRIORS, default=bayes.laplace_prior,
                   help="--client laplace: each weight matrix's prior precision, marglik (its evidence maximiser) or "
                   "held-out (those scaled by the factor whose linearised predictive gives a held-out tenth of the "
                   "client's data the lowest NLL; the network trains on the rest)")
    g.add_argument("--local-reparameterization", action=argparse.BooleanOptionalAction,
                   default=bayes.local_reparameterization,
                   help="sample pre-activations rather than weights (the local reparameterisation trick, as in the "
                   "paper)")
    _args.add_training_arguments(p, FUSION_TRAINING, epochs_aliases=("--local-epochs",),
                                 what="the Bayesian clients' SVI and FedAvg's clients alike",
                                 device="cpu only: the Bayesian clients' SVI runs on the CPU (another device is an "
                                        "error; the flag is here so that every command takes the same settings)")
    g = p.add_argument_group("fusion (the server)")
    g.add_argument("--rule", type=_rules, default="all", metavar="all|R,R,...",
                   help=f"fusion rules to compare: all, or a comma-separated list of {', '.join(available_rules())}; "
                   f"with --align match also {ATOM_POSTERIOR} (the matching model's own posterior of each unit) and "
                   f"{PVI} (partitioned variational inference: the prior times the clients' factors; in later rounds "
                   "each client trains against its cavity, so its data is not counted twice)")
    g.add_argument("--no-fedavg", action="store_true", help="skip the FedAvg baseline")
    g.add_argument("--weights", choices=CLIENT_WEIGHTS, default=fusion.weights,
                   help="client weights b_k: size (proportional to the client's examples, the paper's) or uniform")
    g.add_argument("--pooling-samples", type=int, metavar="N", default=fusion.pooling_samples,
                   help="N of the pooling rule (client k contributes floor(b_k N) draws), >= 2")
    g.add_argument("--min-variance", type=float, metavar="V",
                   help=f"floor on every fused variance, >= 0 (0: none) (default: {fusion.min_variance:g}; exp(-8) = "
                   f"{PAPER_MIN_VARIANCE:.4g} with --paper, the published clamp of log sigma^2)")
    g.add_argument("--align", choices=("none", "match"), default="none",
                   help="none: fuse weight i of every client with weight i of the others (the rows named by the "
                   "rules); meaningful only when the clients start from one shared initialisation, the default "
                   "(--own-init gives the one-shot baseline without one, far below matched fusion). match: the "
                   "clients start from their own initialisations, the server matches their hidden units "
                   "(heteroscedastic Beta-Bernoulli model, empirical Bayes) and fuses each global unit's members "
                   "with each rule (rows match-RULE), beside the rows ensemble (mean of the Bayesian clients' "
                   "predictive distributions), pfnm (deterministic clients, the same schedule), fedavg and every "
                   "rule without alignment")
    g.add_argument("--own-init", action=argparse.BooleanOptionalAction, default=None,
                   help="weight-wise rows: start each client from its own initialisation instead of a shared one "
                   "(default: off with --align none, on with --align match)")
    g.add_argument("--pvi-damping", type=float, metavar="RHO",
                   help=f"--rule {PVI}: each client's factor moves RHO of the way to its new value each round, in "
                   f"(0, 1] (default: {PVI_DAMPING})")
    g.add_argument("--match-on", choices=("auto",) + MATCH_ON, default=fusion.match_on,
                   help="--align match: what the assignment is computed from: posteriors (the heteroscedastic "
                   "model), means (PFNM's model on the posterior means, each client's units dead on its data left "
                   "out first) or auto (means for --client laplace, whose post-hoc variances are mostly the prior's, "
                   "posteriors for variational clients); the posteriors are fused along it either way")
    g.add_argument("--later-rounds", choices=("auto",) + LATER_ROUNDS, default=fusion.later_rounds,
                   help="--align match: the rounds after the first: rematch (each client from its slice of the "
                   "global posterior, the units matched again), fixed (every client from the whole global "
                   "posterior, fused unit by unit with the assignment fixed: round 1's matched network as the shared "
                   f"start; not with --rule {PVI}) or auto (default: rematch for --rule {PVI}, fixed otherwise)")
    g.add_argument("--heads", choices=HEADS_CHOICES, default="fused",
                   help="--align match: the global network's output layer: fused (default; each rule fuses the "
                   "clients' output layers, rows match-RULE), pooled (the clients' own posterior output layers, "
                   "log-probabilities pooled with their class shares inside every weight draw: rows "
                   "match-RULE-pooled, and pfnm-pooled beside pfnm one shot) or both; J output layers instead of "
                   "one, better under label skew (benchmarks/README.md)")
    g.add_argument("--pool-temperature", type=_args.pool_temperature, metavar="T|fit",
                   default=fusion.pool_temperature, help="--heads pooled or both: " + _args.POOL_TEMPERATURE_HELP)
    g.add_argument("--temperature", type=_args.pool_temperature, metavar="T|fit", default=fusion.temperature,
                   help="--align match: the temperature of the match-RULE rows' posterior predictive (the fused output "
                   "layer; softmax(logits / T) in every draw): a number > 0 (default 1) or fit (every matched client "
                   "scores the predictive on its own training data at 61 temperatures from 0.05 to 5, the least "
                   "summed negative log-likelihood wins; the fused posterior is under-confident, "
                   "benchmarks/README.md)"),
    g.add_argument("--starts", choices=STARTS, default=fusion.starts,
                   help="--align match: where the matcher's empirical Bayes starts: the even split (default), from "
                   "the small-noise start as well with the likelier kept (both), or the small-noise start only")
    g.add_argument("--stop", choices=STOPS, default=fusion.stop,
                   help="--align match: when the matcher's empirical-Bayes sweeps stop: once a sweep moved at most "
                   "2 percent of the units and no estimate by more than 1 percent (result, default), or when "
                   "nothing changes (fixed-point)")
    g.add_argument("--matcher-device", metavar="DEVICE",
                   help="--align match: where the server's matcher computes its cross products: cuda[:N] when torch "
                   "sees one, or cpu (torch there); default: its numpy path on the CPU (the clients train on the CPU "
                   "either way)")
    g.add_argument("--tau2", type=float, metavar="V",
                   help="--align match: the extra variance between two clients' copies of a unit, > 0 (default: "
                   "estimated per layer)")
    g.add_argument("--baselines", type=_args.names, metavar="M[,M...]",
                   help="--align match: also these fusion baselines, one shot: kl-fusion (KL-fusion of the Bayesian "
                   "clients, Claici et al. 2020), weight-matching (Git Re-Basin), ot-fusion, ot-fusion-sinkhorn "
                   "(Singh & Jaggi 2020; these three from the deterministic clients the pfnm row trains)")
    g.add_argument("--fraction", type=float, metavar="F", default=fusion.fraction,
                   help="share of the clients sampled each round, in (0, 1] (max(1, floor(fraction * J)) clients)")
    e = ExperimentConfig()
    g = p.add_argument_group("experiment")
    g.add_argument("--rounds", type=int, metavar="T", default=ROUNDS, help="communication rounds")
    g.add_argument("--predictive-samples", "--samples", dest="predictive_samples", type=int, metavar="S",
                   default=e.predictive_samples, help="weight draws S of the posterior predictive")
    g.add_argument("--ece-bins", type=int, metavar="BINS", default=ECE_BINS,
                   help="bins of the expected calibration error (the paper's 100)")
    g.add_argument("--ood", type=_args.dataset_name, metavar="NAME",
                   help="another dataset (same names as --dataset) whose test images, labels ignored, are "
                   "out-of-distribution inputs: adds auroc_max_prob and auroc_entropy, the AUROC of telling in- from "
                   "out-of-distribution inputs by the maximum predicted probability and by the predictive entropy "
                   "(both sets standardised with the training split's constants)")
    g.add_argument("--ood-data-dir", metavar="DIR",
                   help="torchvision's root folder of the --ood dataset (default: --data-dir)")
    g.add_argument("--paper", action="store_true",
                   help="the setting of Ozer et al.'s published code: pixels in [0, 1] (--no-standardize), their "
                   "LeNet-5 (--arch lenet-paper), fused variances floored at exp(-8) (--min-variance); the defaults "
                   "already follow the paper's N(0, 1) prior on the linear weights, local reparameterisation, b_k by "
                   "size and ECE with 100 bins. Flags given explicitly win")
    g = _args.add_output_arguments(p, threads=None,
                                   json_help="write the flags, settings, versions and every method's per-round "
                                   "metrics as JSON",
                                   plot_help="write a figure (PNG) of the metrics per round, one panel each, one line "
                                   "per method")
    g.add_argument("--save-global", metavar="DIR",
                   help="write every global model a method built to DIR/<method>.pt: the fused Bayesian networks "
                   "(each rule, match-RULE: posterior, prior and posterior-mean network; match-RULE-pooled: the fused "
                   "body with the clients' posterior heads, a PooledPosterior) and the deterministic ones "
                   "(fedavg, pfnm), each readable by bnpfed.load_global (a BayesianClient or a network) and bnpfed "
                   "evaluate")
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
    partition = _args.partition_config(args, args.clients)
    network = NetworkConfig(arch=args.arch, hidden=_args.hidden_widths(args, NetworkConfig().hidden), init=args.init)
    training = _args.training_config(args, FUSION_TRAINING)
    if torch.device(training.device).type != "cpu":
        raise UsageError(f"--device: expected cpu for posterior fusion (the Bayesian clients' SVI runs on the CPU "
                         f"only), got {training.device}")
    bayesian = BayesianConfig(prior=args.prior, prior_scale=args.prior_scale, init_scale=args.init_scale,
                              prior_variance=args.prior_variance, kl_weight=args.kl_weight,
                              scale_lr_factor=args.scale_lr_factor, client=args.client,
                              local_reparameterization=args.local_reparameterization, round_prior=args.round_prior,
                              laplace_prior=args.laplace_prior, likelihood=args.likelihood)
    bayesian.check_training(training)
    for rule in args.rule:
        check_choice(rule, matched_rules(), "rule")
        if rule in (ATOM_POSTERIOR, PVI) and args.align != "match":
            raise UsageError(f"--rule {rule}: expected only with --align match (a fusion of matched units), got "
                             f"--align {args.align}")
    if len(set(args.rule)) != len(args.rule):
        raise ValueError(f"rule: expected each rule at most once, got {','.join(args.rule)}")
    match = args.align == "match"
    if args.client != "variational" and not match:
        raise UsageError(f"--client {args.client}: expected only with --align match (Laplace clients serve matched "
                         f"fusion), got --align {args.align}")
    if args.tau2 is not None and not match:
        raise UsageError(f"--tau2: expected only with --align match, got --align {args.align}")
    if args.match_on != "auto" and not match:
        raise UsageError(f"--match-on: expected only with --align match, got --align {args.align}")
    if args.heads != "fused" and not match:
        raise UsageError(f"--heads: expected only with --align match, got --align {args.align}")
    if args.temperature != 1 and not match:
        raise UsageError(f"--temperature: the predictive temperature of the match-RULE rows; expected it only with "
                         f"--align match, got --align {args.align}")
    if args.temperature != 1 and args.heads == "pooled":
        raise UsageError("--temperature: the fused output layer's (match-RULE rows); with --heads pooled every row "
                         "pools its heads, whose temperature is --pool-temperature; expected --heads fused or both")
    if args.pool_temperature != 1 and args.heads == "fused":
        raise UsageError("--pool-temperature: the temperature of pooled heads; expected it only with --heads pooled "
                         "or both, got --heads fused")
    if args.starts != "even-split" and not match:
        raise UsageError(f"--starts: expected only with --align match, got --align {args.align}")
    if args.later_rounds != "auto" and not match:
        raise UsageError(f"--later-rounds: expected only with --align match, got --align {args.align}")
    if args.later_rounds == "fixed" and PVI in args.rule:
        raise UsageError(f"--later-rounds fixed: --rule {PVI} keeps each client's factor in its own units; expected "
                         f"rematch with it")
    if args.stop != "result" and not match:
        raise UsageError(f"--stop: expected only with --align match, got --align {args.align}")
    if args.matcher_device is not None and not match:
        raise UsageError(f"--matcher-device: expected only with --align match, got --align {args.align}")
    _args.check_ood_flags(args)
    if args.round_prior is not None and PVI in args.rule:
        raise UsageError(f"--round-prior: --rule {PVI} trains every client against its cavity; expected it unset "
                         f"with that rule, got --round-prior {args.round_prior}")
    if args.pvi_damping is not None and PVI not in args.rule:
        raise UsageError(f"--pvi-damping: expected only with --rule {PVI}, got --rule {','.join(args.rule)}")
    if PVI in args.rule and args.fraction != 1:
        raise UsageError(f"--fraction: --rule {PVI} keeps every client's factor from round to round, so every "
                         f"client takes part in every round; expected 1, got {args.fraction}")
    own_init = match if args.own_init is None else args.own_init
    fusion = FusionConfig(rule=args.rule[0], weights=args.weights, pooling_samples=args.pooling_samples,
                          min_variance=args.min_variance, fraction=args.fraction, align=args.align, tau2=args.tau2,
                          own_init=own_init, pvi_damping=args.pvi_damping, match_on=args.match_on,
                          starts=args.starts, stop=args.stop, matcher_device=args.matcher_device,
                          later_rounds=args.later_rounds, pool_temperature=args.pool_temperature,
                          temperature=args.temperature)
    if args.baselines is not None:
        if not match:
            raise UsageError(f"--baselines: expected only with --align match, got --align {args.align}")
        for name in args.baselines:   # the built-in baselines, or a method a plugin registered
            if name not in BASELINES and methods.registered_runner(name) is None:
                raise UsageError(f"--baselines: expected names among {', '.join(BASELINES)} or a method a --plugin "
                                 f"registered, got {name!r}")
    fedavg = () if args.no_fedavg else (FEDAVG,)
    if match:
        # weight-wise fusion from the own initialisations trains variational clients from the global posterior
        # after round 1, so Laplace clients have the matched rows only (said in --client's help)
        weight_wise = (tuple(r for r in args.rule if r not in (ATOM_POSTERIOR, PVI)) if args.client == "variational"
                       else ())
        suffixes = {"fused": ("",), "pooled": (POOLED_SUFFIX,), "both": ("", POOLED_SUFFIX)}[args.heads]
        pfnm = (("pfnm",) + (("pfnm-pooled",) if args.heads != "fused" else ()) if args.rounds == 1
                else ("pfnm-rounds",))
        names = ("ensemble-bayesian",) + pfnm + fedavg + weight_wise + tuple(
            MATCH_PREFIX + rule + suffix for rule in args.rule for suffix in suffixes) + tuple(args.baselines or ())
    else:
        names = args.rule + fedavg
    config = ExperimentConfig(methods=names, rounds=args.rounds, seed=args.seed, ece_bins=args.ece_bins,
                              predictive_samples=args.predictive_samples)
    dataset, ood = _args.load_data_and_ood(args, standardize=args.standardize)
    _args.check_partition(partition, dataset, config.seed)
    training.check_inputs(dataset.input_shape)
    initial_network(network, dataset.input_shape, dataset.num_classes, seed=config.seed)
    if match:
        MatchedFusionFederation.check_network(network)
    # the pfnm-pooled row beside the matched pooled rows pools at the same temperature
    pfnm = PFNMConfig(pool_temperature=args.pool_temperature if "pfnm-pooled" in names else 1.0)
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
            result = methods.run_experiment(dataset, progress=progress, log=_args.round_log(progress), ood=ood,
                                            **plan)
    except _args.TRAINING_ERRORS as error:
        start = (f"--init-scale {args.init_scale:g} (the guide's initial posterior sd: the first weights are drawn at "
                 f"that scale; default {BayesianConfig().init_scale:g}) and --init {args.init}")
        return fail(PROG, _args.training_failure(error, start), 1)
    except KeyboardInterrupt:
        return fail(PROG, "interrupted", 130)
    for row in result.rows:
        if row.method == "pfnm-rounds":  # one name per method across runs (one shot or with rounds)
            row.method = "pfnm"
    kept = {("pfnm" if m == "pfnm-rounds" else m): v for m, v in result.global_models.items()}
    columns = MATCH_COLUMNS if args.align == "match" else COLUMNS
    if ood is not None:
        columns = columns[:columns.index("brier") + 1] + OOD_COLUMNS + columns[columns.index("brier") + 1:]
    print(format_table([asdict(r) for r in result.rows], columns))
    print(SERVER_SECONDS)
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
    arch = _arch(network)
    later = "" if training.round_epochs is None else f" (later rounds {training.round_epochs})"
    schedule = f"{_args.plural(config.rounds, 'round')} x {_args.plural(training.epochs, 'local epoch')}{later}"
    align = (" matched (hidden units of independently initialised clients)" if fusion.align == "match"
             else " weight by weight" + (" from each client's own initialisation" if fusion.own_init else ""))
    return (f"posterior fusion{align}: {name}, J = {partition.clients} clients, {_partition(partition)}, fraction "
            f"{fusion.fraction:g}, {schedule}, {arch}, prior {bayesian.prior} N(0, {bayesian.prior_scale:g}^2), "
            f"weights {fusion.weights}, min variance {fusion.min_variance:.3g}, ECE with {config.ece_bins} bins, "
            f"seed {config.seed}")


def _arch(network) -> str:
    return f"MLP hidden {list(network.hidden)}" if network.arch == "mlp" else network.arch


def _title(name: str, plan: dict) -> str:
    return (f"posterior fusion on {name}: J = {plan['partition'].clients} clients, {_partition(plan['partition'])}, "
            f"{_arch(plan['network'])}, {_args.plural(plan['config'].rounds, 'round')}")


#: What each panel shows, by metric.
PANEL_TITLES = {"accuracy": "test accuracy", "nll": "negative log-likelihood", "ece": "expected calibration error",
                "brier": "Brier score", "mean_sigma": "mean posterior sigma",
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


def plot_rounds(result, path, title: str = "") -> None:
    """A grid of panels, one per metric (accuracy, NLL, ECE, Brier, mean posterior sigma, and the OOD AUROCs when
    measured), the legend in a panel of its own. Over several rounds: one line per multi-round method (FedAvg in
    black), the one-shot methods (the ensemble, PFNM) as dashed horizontal lines. One round: a dot per method on
    each panel, methods on the vertical axis (no round axis to speak of). A method whose points cover an earlier
    one's (:func:`_same_as`) says so in the legend."""
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
                    ax.text(value, i, f"  {value:.3g}", va="center", fontsize=7)
            ax.set_yticks(y, [r.method for r in rows], fontsize=8)
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.margins(x=0.25)
            ax.grid(axis="x", alpha=0.3)
        else:
            for r in rows:
                if len(r.history) > 1:
                    rounds = [h["round"] for h in r.history]
                    values = [_value(h.get(metric)) for h in r.history]
                    if all(v is not None for v in values):
                        ax.plot(rounds, values, label=labels[r.method], **styles[r.method])
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

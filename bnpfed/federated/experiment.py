"""The experiment harness: :class:`ExperimentConfig` (which methods, rounds, seed, how PFNM's hyper-parameters are
chosen) and :class:`Experiment`, one experiment's data, partition and configs and what several of its methods share
(the clients' local models, their Bayesian clients, PFNM's selection), which :mod:`bnpfed.federated.methods`' runners
take. Both are also importable from :mod:`bnpfed.federated.methods`.

Usage::

    >>> from bnpfed.data import load_dataset
    >>> from bnpfed.federated.config import NetworkConfig, PartitionConfig, TrainingConfig
    >>> ds = load_dataset("digits", standardize=False)
    >>> experiment = Experiment(ds, partition=PartitionConfig(clients=3), network=NetworkConfig(hidden=(20,)),
    ...                         training=TrainingConfig(epochs=1), config=ExperimentConfig(methods=("pfnm",)))
    >>> len(experiment.local_models()), experiment.num_clients
    (3, 3)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from bnpfed.data import Dataset
from bnpfed.federated.clients import fit_bayesian, initial_network, posterior_client, train_network, unit_activity_step
from bnpfed.federated.config import (BayesianConfig, FusionConfig, NetworkConfig, PFNMConfig, PartitionConfig,
                                     TrainingConfig, check_pool_temperature_applies, config_dict)
from bnpfed.federated.fusion import check_program_fusion
from bnpfed.federated.federation import EVAL_CHUNK, Federation, reestimate_statistics
from bnpfed.federated.operating_point import NOISE_FACTORS, check_noise_to_scale, select_operating_point
from bnpfed.federated.partition import class_counts, holdout_split
from bnpfed.federated.registry import (MethodSpec, available_methods, method_options, method_spec,
                                      resolve_options, row_name)
from bnpfed.federated.results import MethodResult, Selection
from bnpfed.federated.selection import select_hyperparameters
from bnpfed.federated.server import clients_per_round, pfnm_step, with_statistics
from bnpfed.matching import batch_norm_order
from bnpfed.matching import SpecMatch, derive_spec
from bnpfed.metrics import (INTERVAL_METRICS, bootstrap_intervals, chance_accuracy, chance_warning,
                            classification_report, debiased_calibration_error, ece_noise_floor,
                            expected_calibration_error, ood_auroc, paired_bootstrap)
from bnpfed.report import plural
from bnpfed.seeding import Stream, derive_seed
from bnpfed.schema import documented, option
from bnpfed.validation import check_choice, check_fraction, check_int, check_positives

__all__ = ["Experiment", "ExperimentConfig", "HELD_OUT", "Report", "SELECTIONS", "check_methods", "network_widths"]


#: How PFNM's hyper-parameters are chosen (:attr:`ExperimentConfig.select`); those that hold each client's
#: ``holdout`` out of its training data.
SELECTIONS = ("none", "federated", "pooled-train", "operating-point")
HELD_OUT = ("federated", "operating-point")


def _selection_help() -> str:
    return ('how PFNM\'s sigma2 / sigma0_2 / gamma0 are chosen. ``"none"``: as given (estimated where not given); '
            '``"federated"`` (a grid of fixed values, the best one-shot accuracy on the clients\' held-out splits), '
            '``"pooled-train"`` (that grid on all clients\' pooled training data, as the reference code does; a '
            'federation does not have it) or ``"operating-point"`` (empirical Bayes, then the estimated sigma2 scaled '
            'by each of ``noise_factors``, and the narrowest global network within ``tolerance`` paired standard '
            'errors of the best on the clients\' held-out splits: :mod:`bnpfed.federated.operating_point`).')


@documented
@dataclass(frozen=True)
class ExperimentConfig:
    """The experiment around the federations (not sent to Flower, whose run has ``rounds`` and ``seed`` of its own)."""

    methods: tuple[str, ...] = option(("local", "ensemble", "fedavg", "pfnm"), metavar="M,M,...", key=False,
                                      choices=available_methods, help=(
        'the methods to run, in this order, each a name or a spec ``name:key=value`` whose options the registry '
        'lists (:mod:`bnpfed.federated.registry`): e.g. ``pfnm``, ``pfnm:heads=pooled``, ``fusion:rule=gaa``, '
        '``match:rule=conflation:heads=pooled``; one row each (a few methods give several).'))
    rounds: int = option(1, metavar="T", key=False, help="communication rounds of the multi-round methods, >= 1.")
    seed: int = option(0, metavar="SEED", cli=False, key=False, help=(
        'the one seed every random step derives from (:mod:`bnpfed.seeding`), >= 0.'))
    select: str = option("none", choices=SELECTIONS, key=False, help=_selection_help())
    grid_sigma2: tuple[float, ...] = option((0.05, 0.1, 0.3, 1.0), metavar="S,S,...", shown=False, key=False, help=(
        'the candidates of sigma2 under ``select="federated"`` or ``"pooled-train"`` only.'))
    grid_sigma0_2: tuple[float, ...] = option((1.0,), metavar="S,S,...", shown=False, key=False, help=(
        'the candidates of sigma0_2, as ``grid_sigma2``.'))
    grid_gamma0: tuple[float, ...] = option((1e-3, 1.0), metavar="G,G,...", shown=False, key=False, help=(
        'the candidates of gamma0, as ``grid_sigma2``.'))
    noise_factors: tuple[float, ...] = option(NOISE_FACTORS, metavar="F,F,...", shown=False, key=False, help=(
        'the factors of the estimated sigma2 under ``select="operating-point"`` only, each > 0 and none 1 (the '
        'estimate itself is always a candidate).'))
    tolerance: float = option(1.0, metavar="SE", shown=False, key=False, help=(
        'the standard errors of ``select="operating-point"``\'s rule, >= 0 (0: the most accurate candidate); with '
        'it only.'))
    holdout: float = option(0.1, metavar="F", shown=False, key=False, help=(
        'the share of each client\'s data held out for ``select="federated"`` or ``"operating-point"``, in (0, 1); '
        'with those only (the clients then train on the rest).'))
    ece_bins: int = option(15, metavar="BINS", shown=False, key=False, help=(
        'equal-width bins of the expected calibration error.'))
    predictive_samples: int = option(10, metavar="S", shown=False, key=False, help=(
        'weight draws S of a Bayesian posterior predictive.'))

    def __post_init__(self):
        methods = self.methods
        if isinstance(methods, str) or not isinstance(methods, (tuple, list)) or not methods:
            raise ValueError(f"methods: expected a non-empty sequence of method names or specs from "
                             f"{available_methods()}, got {methods!r}")
        specs = tuple(str(method_spec(m)) for m in methods)
        object.__setattr__(self, "methods", specs)
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods: expected each method at most once, got {list(self.methods)}")
        check_int(self.rounds, "rounds", low=1)
        check_int(self.seed, "seed", low=0)
        check_choice(self.select, SELECTIONS, "select")
        for name in ("grid_sigma2", "grid_sigma0_2", "grid_gamma0", "noise_factors"):
            object.__setattr__(self, name, check_positives(getattr(self, name), name))
        if any(f == 1.0 for f in self.noise_factors) or len(set(self.noise_factors)) != len(self.noise_factors):
            raise ValueError(f"noise_factors: expected distinct factors other than 1 (the estimate itself is always "
                             f"a candidate), got {list(self.noise_factors)}")
        if not (isinstance(self.tolerance, (int, float)) and not isinstance(self.tolerance, bool)
                and math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(f"tolerance: expected a number of standard errors >= 0, got {self.tolerance!r}")
        check_fraction(self.holdout, "holdout", allow_one=False)
        defaults = {f.name: f.default for f in fields(self)}
        applies = {"grid_sigma2": ("federated", "pooled-train"), "grid_sigma0_2": ("federated", "pooled-train"),
                   "grid_gamma0": ("federated", "pooled-train"), "noise_factors": ("operating-point",),
                   "tolerance": ("operating-point",), "holdout": ("federated", "operating-point")}
        for name, modes in applies.items():
            if self.select not in modes and getattr(self, name) != defaults[name]:
                raise ValueError(f"{name}: applies with select in {list(modes)} only, got {getattr(self, name)!r} "
                                 f"with select={self.select!r}")
        check_int(self.ece_bins, "ece_bins", low=1)
        check_int(self.predictive_samples, "predictive_samples", low=1)


def check_methods(config: ExperimentConfig, configs: Mapping[str, Any]) -> list[MethodSpec]:
    """``config.methods`` as specs, checked against the other configs of the experiment (``configs``: ``{"pfnm":
    PFNMConfig, "fusion": FusionConfig, ...}``, each method's options resolved from them): no two specs give one row
    (``pfnm`` with ``heads="pooled"`` configured and ``pfnm:heads=pooled``), a pool temperature other than 1 only
    where some row pools its heads, the fused predictive's temperature only where a matched row fuses them. What
    :class:`Experiment` checks before anything runs, and a command before it loads its data."""
    pfnm, fusion = configs["pfnm"], configs["fusion"]
    specs = [method_spec(m) for m in config.methods]
    rows: dict[str, str] = {}
    for spec in specs:   # two specs that give one row (pfnm with heads="pooled" configured, pfnm:heads=pooled)
        row = row_name(spec, configs)
        if row is not None and row in rows:
            raise ValueError(f"methods: {rows[row]!r} and {str(spec)!r} both give the row {row!r}; expected one of "
                             f"them")
        if row is not None:
            rows[row] = str(spec)

    def heads(kind: str, reads: str) -> bool:   # some method's output layer of this kind, from this config
        return any(value == kind and method_options(spec.name)[key].reads == reads
                   for spec in specs for key, value in resolve_options(spec, configs).items() if key == "heads")

    check_pool_temperature_applies(pfnm, pfnm.heads == "pooled" or heads("pooled", "pfnm"))
    check_pool_temperature_applies(fusion, fusion.heads == "pooled" or heads("pooled", "fusion"))
    if fusion.temperature != 1 and not (heads("fused", "fusion") or heads("auto", "fusion")):   # auto: then fused
        raise ValueError(f"fusion.temperature: the predictive temperature of matched fusion's fused output layer; "
                         f"expected 1 without a match row of fused heads among the methods, got "
                         f"{fusion.temperature!r}")
    return specs


# ------------------------------------------------------------------------------------------------ the experiment


class Report(dict):
    """A row's metrics (a dict, as :meth:`Experiment.report` gives them) and, as the attribute ``probs``, the ``(N,
    C)`` test probabilities they were computed from (None where not at hand): what
    :meth:`MethodResult.from_metrics <bnpfed.federated.results.MethodResult.from_metrics>` keeps for the row's
    intervals. Not a key, so that ``MethodResult(name, **report)`` still takes the metrics alone."""

    probs: Optional[torch.Tensor] = None


class Experiment:
    """One experiment's data, partition and configs, and what several of its methods share.

    The partition is drawn once (``partition.split(labels, seed)``); with ``select="federated"`` or
    ``"operating-point"`` each client then holds out ``holdout`` of its examples. The clients' local models (round 1
    of training, from their own initialisations or from the shared one) are trained on first use and kept for the
    other methods, as are PFNM's selected hyper-parameters. Nothing else is kept between calls.

    :param Dataset dataset: the data.
    :param progress: show a progress bar of client trainings (tqdm, on stderr). Default False.
    :param log: called with a line of text after each round of a multi-round method, if given.
    :param ood: optional out-of-distribution inputs (another dataset's test images, preprocessed as this one's):
        every row then gets ``auroc_max_prob`` and ``auroc_entropy``.
    """

    def __init__(self, dataset: Dataset, *, partition: Optional[PartitionConfig] = None,
                 network: Optional[NetworkConfig] = None, training: Optional[TrainingConfig] = None,
                 pfnm: Optional[PFNMConfig] = None, fusion: Optional[FusionConfig] = None,
                 bayesian: Optional[BayesianConfig] = None, config: Optional[ExperimentConfig] = None,
                 progress: bool = False, log: Optional[Callable[[str], None]] = None,
                 ood: Optional[torch.Tensor] = None):
        if not isinstance(dataset, Dataset):
            raise ValueError(f"dataset: expected a bnpfed.data.Dataset, got {type(dataset).__name__}")
        partition = PartitionConfig() if partition is None else partition
        network = NetworkConfig() if network is None else network
        training = TrainingConfig() if training is None else training
        pfnm = PFNMConfig() if pfnm is None else pfnm
        fusion = FusionConfig() if fusion is None else fusion
        bayesian = BayesianConfig() if bayesian is None else bayesian
        config = ExperimentConfig() if config is None else config
        for name, value, kind in (("partition", partition, PartitionConfig), ("network", network, NetworkConfig),
                                  ("training", training, TrainingConfig), ("pfnm", pfnm, PFNMConfig),
                                  ("fusion", fusion, FusionConfig), ("bayesian", bayesian, BayesianConfig),
                                  ("config", config, ExperimentConfig)):
            if not isinstance(value, kind):
                raise ValueError(f"{name}: expected a {kind.__name__}, got {type(value).__name__}")
        if ood is not None:
            ood = torch.as_tensor(ood)
            if tuple(ood.shape[1:]) != tuple(dataset.input_shape) or not ood.is_floating_point() or not len(ood):
                shape = ", ".join(map(str, dataset.input_shape))
                raise ValueError(f"ood: expected out-of-distribution inputs of shape (N, {shape}) (the dataset's input "
                                 f"shape), got {tuple(ood.shape)} {ood.dtype}")
        if config.select == "operating-point":
            check_noise_to_scale(pfnm)
        configs = {"partition": partition, "network": network, "training": training, "pfnm": pfnm,
                   "fusion": fusion, "bayesian": bayesian, "config": config}
        self.specs = check_methods(config, configs)
        self.configs = configs
        training.check_inputs(dataset.input_shape)
        bayesian.check_task(dataset.task)
        if dataset.task == "regression":
            others = [spec for spec in config.methods if method_spec(spec).name != "fusion"]
            if others:
                raise ValueError(f"methods: {dataset.name!r} is a regression, which runs weight-wise posterior "
                                 f"fusion only (fusion:rule=RULE); expected no others, got {others}")
        if bayesian.program is not None:
            others = [spec for spec in config.methods if method_spec(spec).name != "fusion"]
            if others:
                raise ValueError(f"methods: a Pyro program's clients (bayesian.program) run weight-wise posterior "
                                 f"fusion only (fusion:rule=RULE; the other methods train networks); expected no "
                                 f"others, got {others}")
            check_program_fusion(network, fusion)
        self.ood = ood
        self.dataset, self.partition, self.network, self.training = dataset, partition, network, training
        self.bayesian, self.config = bayesian, config
        self.seed = config.seed
        self.input_shape = tuple(dataset.input_shape)
        labels = dataset.y_train.numpy()
        parts = partition.split(labels, self.seed)
        if config.select in HELD_OUT:
            self.parts, self.validation_parts = holdout_split(parts, config.holdout, self.seed)
        else:
            self.parts, self.validation_parts = parts, [np.zeros(0, dtype=np.int64) for _ in parts]
        # a regression has one "class": every client's examples
        self.class_counts = (class_counts(labels, self.parts, dataset.num_classes) if dataset.task == "classification"
                             else np.array([[len(p)] for p in self.parts], dtype=np.int64))
        # heads="auto" chosen by the clients' class shares; the methods' options still read the configs as given
        # (self.configs: pfnm:heads=auto's row is "pfnm" whichever output layer it gets), and resolve "auto" here
        self.pfnm, self.fusion = pfnm.with_heads(self.class_counts), fusion.with_heads(self.class_counts)
        self.client_data = [(dataset.x_train[torch.as_tensor(i)], dataset.y_train[torch.as_tensor(i)])
                            for i in self.parts]
        self.warnings: list[str] = []
        #: method -> the global network it built and what describes it (:meth:`keep`)
        self.global_models: dict[str, dict] = {}
        self.log = log
        self._progress = progress
        self._bar = None  # the progress bar, made by the first phase
        self._local: dict[bool, list[nn.Module]] = {}
        self._selection: Optional[Selection] = None
        self._bayesian: Optional[list] = None
        self._activity: Optional[list] = None

    @property
    def num_clients(self) -> int:
        return len(self.parts)

    def pfnm_heads(self, heads: str) -> str:
        """A PFNM or FedMA method's ``heads`` option with ``"auto"`` resolved as the experiment's PFNM config resolves
        it (:meth:`~bnpfed.federated.config.PFNMConfig.with_heads`)."""
        return replace(self.configs["pfnm"], heads=heads).with_heads(self.class_counts).heads

    def match_heads(self, heads: str) -> str:
        """A matched-fusion method's ``heads`` option with ``"auto"`` resolved for ``align="match"``
        (:meth:`~bnpfed.federated.config.FusionConfig.with_heads`)."""
        return replace(self.configs["fusion"], align="match", heads=heads).with_heads(self.class_counts).heads

    def settings(self) -> dict:
        """Every config as plain values (``heads="auto"`` as the clients' class shares resolved it)."""
        return {name: config_dict(getattr(self, name)) for name in
                ("partition", "network", "training", "pfnm", "fusion", "bayesian", "config")}

    def phase(self, what: str, total: int, epochs: int) -> None:
        """Start the progress bar's next phase: ``total`` client fits of ``epochs`` local epochs each (a total, so
        tqdm shows the rate and the time left)."""
        desc = f"{what} ({plural(epochs, 'epoch')} per fit)"
        if self._bar is None:
            self._bar = tqdm(desc=desc, total=total, unit="client fit", disable=not self._progress, leave=False)
        else:
            self._bar.reset(total=total)
            self._bar.set_description_str(desc, refresh=False)
            self._bar.set_postfix_str("")

    def tick(self, what: str) -> None:
        """One client training done (the progress bar; ``what`` its postfix, e.g. the client)."""
        self._bar.set_postfix_str(what, refresh=False)
        self._bar.update()
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def keep(self, method: str, net, match=None, predictive: Optional[dict] = None) -> None:
        """Record the global model ``method`` built, a network or a Bayesian client (and the match it came from, if
        any: a :class:`~bnpfed.matching.permutation.SpecMatch` or a
        :class:`~bnpfed.matching.posteriors.PosteriorMatch`): what ``bnpfed pfnm --save-global`` and
        ``bnpfed fuse --save-global`` write (:func:`bnpfed.saved.save_global`)."""
        kept = {"network": net, "inputs": self.dataset.preprocessing()}
        if predictive is not None:  # a Bayesian network's draws, {"samples": S, "seed": s}, as the row scored it
            kept["predictive"] = predictive
        if match is not None:
            kept.update(spec=match.spec, widths=match.widths, hyperparameters=match.hyperparameters,
                        class_shares=match.class_shares)
        self.global_models[method] = kept

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def convergence_check(self, what: str, clients: Sequence) -> None:
        """Warn when some of ``clients`` ' last fits had not converged (their ``converged_`` False: the last epochs
        still lowered -ELBO/n beyond their Monte Carlo spread; :meth:`~bnpfed.clients.BayesianClient.fit`). A
        client with no verdict (not a variational client, not fitted, or a fit of one epoch) is not counted."""
        judged = [c.converged_ for c in clients if getattr(c, "converged_", None) is not None]
        unconverged = sum(not verdict for verdict in judged)
        if unconverged:
            self.warn(f"{what}: {unconverged} of {len(judged)} variational clients' last local fits had not "
                      f"converged (-ELBO/n still falling beyond its Monte Carlo spread): their posteriors are not at "
                      f"the ELBO's optimum; train more local epochs (TrainingConfig.epochs, round_epochs: --epochs, "
                      f"--round-epochs) or raise the learning rate")

    def chance_check(self, method: str, accuracy: float) -> None:
        """Warn when ``accuracy`` is at or below chance (:func:`~bnpfed.metrics.chance_warning`: the largest class
        share of the test split, plus 0.02); a regression has none."""
        if self.dataset.task == "regression":
            return
        message = chance_warning(method, accuracy, chance_accuracy(torch.bincount(self.dataset.y_test)))
        if message is not None:
            self.warn(message)

    def report(self, probs: torch.Tensor, ood_probs: Optional[torch.Tensor] = None) -> "Report":
        """Accuracy, NLL, ECE (``ece_bins``), ECE with 15 bins (``ece15``), the debiased L2 calibration error
        (``ece_debiased``: :func:`~bnpfed.metrics.debiased_calibration_error`, with 2 test examples or more), the
        ECE's noise floor (``ece_floor``: :func:`~bnpfed.metrics.ece_noise_floor`, ``ece_bins``) and Brier score of
        test-set probabilities, as a :class:`Report` that carries the probabilities themselves (``probs``, not a
        key: a row keeps them for its intervals, :meth:`intervals`); with ``ood_probs`` (the same predictor on the
        out-of-distribution images) also ``auroc_max_prob`` and ``auroc_entropy`` (:func:`~bnpfed.metrics.ood_auroc`).
        """
        out = Report(classification_report(probs, self.dataset.y_test, n_bins=self.config.ece_bins))
        out["ece15"] = expected_calibration_error(probs, self.dataset.y_test, 15)
        if len(probs) >= 2:
            out["ece_debiased"] = debiased_calibration_error(probs, self.dataset.y_test)
        out["ece_floor"] = ece_noise_floor(probs, self.config.ece_bins)
        if ood_probs is not None:
            out.update(ood_auroc(probs, ood_probs))
        out.probs = probs
        return out

    def intervals(self, probs: torch.Tensor) -> dict[str, list[float]]:
        """95 % percentile bootstrap intervals of every metric of :data:`~bnpfed.metrics.INTERVAL_METRICS` (``ece``
        with ``ece_bins``) over the test examples, ``{metric: [low, high]}``: :func:`~bnpfed.metrics.
        bootstrap_intervals` with the seed ``derive_seed(seed, Stream.BOOTSTRAP)``, so every row of the experiment is
        resampled alike. ``ece_debiased`` needs 2 test examples or more (left out below)."""
        metrics = INTERVAL_METRICS if len(probs) >= 2 else tuple(m for m in INTERVAL_METRICS if m != "ece_debiased")
        found = bootstrap_intervals(probs, self.dataset.y_test, metrics=metrics, ece_bins=self.config.ece_bins,
                                    seed=derive_seed(self.seed, Stream.BOOTSTRAP))
        return {m: list(v) for m, v in found.items()}

    def paired(self, probs_a: torch.Tensor, probs_b: torch.Tensor) -> dict[str, dict[str, float]]:
        """Two predictors' metrics on the test split, ``a - b``, each with a paired 95 % bootstrap interval
        (:func:`~bnpfed.metrics.paired_bootstrap`, resampled as :meth:`intervals` resamples)."""
        metrics = INTERVAL_METRICS if len(probs_a) >= 2 else tuple(m for m in INTERVAL_METRICS if m != "ece_debiased")
        return paired_bootstrap(probs_a, probs_b, self.dataset.y_test, metrics=metrics, ece_bins=self.config.ece_bins,
                                seed=derive_seed(self.seed, Stream.BOOTSTRAP))

    def predictions(self, predict: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``predict`` (inputs -> class probabilities) on the test split and, when there is one, on the
        out-of-distribution images, in chunks of :data:`~bnpfed.federated.federation.EVAL_CHUNK`."""
        def run(x):
            return torch.cat([predict(x[i:i + EVAL_CHUNK]) for i in range(0, len(x), EVAL_CHUNK)])
        return run(self.dataset.x_test), (None if self.ood is None else run(self.ood))

    @torch.no_grad()
    def evaluate_network(self, net: nn.Module) -> dict[str, float]:
        net = net.eval()
        return self.report(*self.predictions(lambda x: net(x).softmax(-1)))

    def reestimate(self, target):
        """A global network's batch-norm running statistics re-estimated from every client's training inputs (the
        client step :func:`~bnpfed.federated.clients.batch_norm_moments_step`, the server step
        :func:`~bnpfed.federated.server.batch_norm_step`), written into ``target`` (a
        :class:`~bnpfed.matching.permutation.SpecMatch` or a network); nothing happens without batch norm. Returns
        ``target``."""
        net = target.network() if isinstance(target, SpecMatch) else target
        layers = batch_norm_order(net, self.dataset.input_shape)
        if not layers:
            return target
        state = net.state_dict()

        def network_of(k, statistics):
            net.load_state_dict(with_statistics(state, statistics))
            return net

        statistics = reestimate_statistics(layers, [x for x, _ in self.client_data], self.training.batch_size,
                                           network_of)
        if isinstance(target, SpecMatch):
            target.state = with_statistics(target.state, statistics)
        else:
            net.load_state_dict(with_statistics(state, statistics))
        return target

    def local_models(self, shared: Optional[bool] = None) -> list[nn.Module]:
        """The clients' networks after round 1's local training, each from its own initialisation (``shared``
        False; default ``network.shared_init``) or all from the shared one; trained on first use."""
        shared = self.network.shared_init if shared is None else bool(shared)
        if shared not in self._local:
            network = replace(self.network, shared_init=shared)
            models = []
            self.phase("local models" + (" (shared init)" if shared else ""), len(self.client_data),
                       self.training.epochs)
            for j, (x, y) in enumerate(self.client_data):
                net = initial_network(network, self.dataset.input_shape, self.dataset.num_classes, seed=self.seed,
                                      client=j)
                models.append(train_network(net, x, y, self.training, seed=self.seed, round=1, client=j))
                self.tick(f"client {j + 1}")
            self._local[shared] = models
        return self._local[shared]

    def trained_local_models(self) -> list[nn.Module]:
        """The clients' local models of ``network.shared_init`` if a method has trained them (:meth:`local_models`),
        else an empty list: what the experiment's result reports without training them."""
        return self._local.get(self.network.shared_init, [])

    @property
    def selected(self) -> Optional[Selection]:
        """PFNM's hyper-parameters as chosen, if a method has chosen them (:meth:`selection`), else None."""
        return self._selection

    def activity(self) -> Optional[list[dict]]:
        """Each client's report on the units of its local model (:func:`~bnpfed.federated.clients.
        unit_activity_step`), when PFNM drops inactive units (``pfnm.inactive``): under ``"drop"`` on every example
        the client holds, its training inputs and, where it holds some out (``config.select`` ``"federated"`` or
        ``"operating-point"``), its held-out inputs too, so that a unit is left out only if it is inactive on
        inputs it was not trained on as well; under ``"drop-train"`` on its training inputs alone."""
        if self.pfnm.inactive == "keep":
            return None
        if self._activity is None:
            reports = []
            for net, (x, _), held in zip(self.local_models(), self.client_data, self.validation_parts):
                if self.pfnm.inactive == "drop" and len(held):   # a unit's activity: its largest over both
                    x = torch.cat([x, self.dataset.x_train[torch.as_tensor(held)]])
                reports.append(unit_activity_step(net, x, self.input_shape, self.training.batch_size))
            self._activity = reports
        return self._activity

    def bayesian_clients(self) -> list:
        """The clients' variational Bayesian networks after round 1's local SVI, each from its own initialisation
        (what matched posterior fusion starts from; the Bayesian ensemble averages their predictive distributions);
        trained on first use."""
        if self._bayesian is None:
            network = replace(self.network, shared_init=False)
            clients = []
            self.phase("Bayesian clients", len(self.client_data), self.training.epochs)
            for j, (x, y) in enumerate(self.client_data):
                net = initial_network(network, self.dataset.input_shape, self.dataset.num_classes, seed=self.seed,
                                      client=j)
                client = posterior_client(net, self.bayesian)
                fit_bayesian(client, x, y, self.training, seed=self.seed, round=1, index=j,
                             scale_lr_factor=self.bayesian.scale_lr_factor)
                clients.append(client)
                self.tick(f"client {j + 1}")
            self._bayesian = clients
            self.convergence_check("the Bayesian clients (round 1)", clients)
        return self._bayesian

    def one_shot_match(self, config: PFNMConfig) -> SpecMatch:
        """PFNM's one-shot match of the local models under ``config`` (their activity reports as it says), its
        batch-norm statistics re-estimated (:meth:`reestimate`)."""
        return self.reestimate(pfnm_step(self.local_models(), self.class_counts, config, seed=self.seed, round=1,
                                         input_shape=self.input_shape, activity=self.activity()))

    def selection(self) -> Selection:
        """PFNM's hyper-parameters, chosen as ``config.select`` says on the local models (once)."""
        if self._selection is None:
            if self.config.select == "none":
                self._selection = Selection(self.pfnm, "none", match=self.one_shot_match(self.pfnm))
            elif self.config.select == "operating-point":
                validation = [(self.dataset.x_train[torch.as_tensor(i)], self.dataset.y_train[torch.as_tensor(i)])
                              for i in self.validation_parts]
                self._selection = select_operating_point(
                    self.local_models(), self.class_counts, validation, self.pfnm,
                    noise_factors=self.config.noise_factors, tolerance=self.config.tolerance, seed=self.seed,
                    test=(self.dataset.x_test, self.dataset.y_test), input_shape=self.input_shape,
                    reestimate=self.reestimate, activity=self.activity(), batch_size=EVAL_CHUNK)
            else:
                if self.config.select == "federated":
                    parts = self.validation_parts
                else:
                    parts = [np.concatenate(self.parts)]
                validation = [(self.dataset.x_train[torch.as_tensor(i)], self.dataset.y_train[torch.as_tensor(i)])
                              for i in parts]
                self._selection = select_hyperparameters(
                    self.local_models(), self.class_counts, validation, self.pfnm,
                    grid_sigma2=self.config.grid_sigma2, grid_sigma0_2=self.config.grid_sigma0_2,
                    grid_gamma0=self.config.grid_gamma0, seed=self.seed, by=self.config.select,
                    test=(self.dataset.x_test, self.dataset.y_test), input_shape=self.input_shape,
                    reestimate=self.reestimate, activity=self.activity())
        return self._selection

    def federation_row(self, federation: Federation, rounds: int, note: str = "") -> MethodResult:
        """Run ``federation`` for ``rounds`` rounds and make its row (final metrics, per-round history)."""
        per_round = clients_per_round(federation.num_clients, federation.fraction)
        later = self.training.epochs if self.training.round_epochs is None else self.training.round_epochs
        self.phase(f"{federation.method}: {plural(rounds, 'round')} x {plural(per_round, 'client')}",
                   rounds * per_round, later if rounds > 1 else self.training.epochs)
        for _ in range(rounds):
            record = federation.run_round()
            self._bar.set_postfix_str(f"round {record.round}/{rounds}", refresh=False)
            self._bar.update(len(record.sampled))
            self._bar.refresh()
            if self.log is not None:
                shown = {k: v for k, v in record.metrics.items() if k in ("accuracy", "hidden", "mean_sigma")}
                self.log(f"{federation.method} round {record.round}: "
                         + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in shown.items()))
        self.convergence_check(federation.method, getattr(federation, "clients", ()))
        history = [dict(r.metrics) for r in federation.history]
        final = Report(history[-1])
        final.probs = federation.test_probs
        if self.ood is not None:
            probs, ood_probs = self.predictions(federation.predict_proba)
            final.update(ood_auroc(probs, ood_probs))
        return MethodResult.from_metrics(federation.method, final, hidden=list(final.get("hidden", [])),
                                         parameters=int(final.get("parameters", 0)), rounds=len(history),
                                         server_seconds=float(sum(h["server_seconds"] for h in history)),
                                         mean_sigma=float(final.get("mean_sigma", math.nan)), history=history,
                                         hyperparameters=list(final.get("hyperparameters", [])), note=note)


def network_widths(net: nn.Module, input_shape) -> list[int]:
    """The widths of a network's hidden permutations in the order of its permutation spec: an MLP's hidden layers,
    a CNN's conv channels then its hidden units (what a row's ``hidden`` lists).

    >>> from bnpfed.models import LeNet
    >>> network_widths(LeNet(image_size=8), (1, 8, 8))
    [6, 16, 120, 84]
    """
    spec = derive_spec(net, input_shape)
    state = net.state_dict()
    return [int(state[g.axes[0].param].shape[g.axes[0].dim] // g.axes[0].block) for g in spec.groups]

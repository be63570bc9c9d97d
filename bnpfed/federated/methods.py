"""Comparison methods of a federated experiment, as a registry: one small runner per method, like the fusion rules
of :mod:`bnpfed.combine`.

A runner takes the :class:`Experiment` (the data, its partition, the configs, and what several methods share:
the clients' local models, PFNM's selected hyper-parameters) and returns one or more :class:`MethodResult` rows.
Adding a method is one function and one :func:`register_method` line; every fusion rule registered with
:func:`bnpfed.combine.register_rule` is a method too (posterior fusion with that rule).

Built-in methods (Yurochkin et al. 2019, section 4; Wang et al. 2020; Ozer et al. 2022), for any
:class:`~bnpfed.federated.config.NetworkConfig` architecture (MLP, LeNet, FedMA's simple CNN with or without batch
norm; a global network's batch-norm statistics are re-estimated from the clients' data after every average or
match):

* ``local``: the clients' own networks (rows ``local-mean``, ``local-min``, ``local-max``);
* ``ensemble``: the uniform average of their predicted probabilities (J times the parameters);
* ``fedavg-oneshot``: one FedAvg average of the local networks, each from its own initialisation unless
  ``network.shared_init`` (near chance without a shared initialisation: the point of the baseline);
* ``fedavg``: FedAvg from a shared initialisation over ``rounds`` rounds (one round: the one-shot baseline with a
  shared initialisation);
* ``kmeans``: k-means over the pooled units of every group (layer, conv channels), at PFNM's global widths;
* ``pfnm``: PFNM in one communication round, hyper-parameters chosen by ``select``;
* ``pfnm-pooled``: the same match, its global network's output layer replaced by the clients' own output layers
  pooled log-linearly with class-share weights (:mod:`bnpfed.inference.pooled_heads`: what PFNM's averaged output
  layer loses under label skew; the same predictions as ``pfnm`` when every class's shares are equal); under a
  ``max_params`` budget a match that prices the J output layers;
* ``pfnm-rounds``: PFNM with ``rounds`` communication rounds;
* ``fedma``: FedMA's layer-wise scheme in one round (Wang et al., ICLR 2020): match a layer, freeze it, let the
  clients retrain the layers above for ``pfnm.layerwise_retrain`` epochs (the schedule's epochs of a later round
  when 0), match the next layer, ...;
* ``fedma-pooled``: ``fedma`` with the clients' own output layers (as they retrained them before the last group was
  matched) pooled log-linearly with class-share weights, as ``pfnm-pooled`` (its budget split holding them);
* ``fedma-rounds``: FedMA with ``rounds`` communication rounds (each client starting a round from its slice);
* each fusion rule (``eaa``, ``gaa``, ``log_variance``, ``pooling``, ``conflation``): variational Bayesian clients
  whose posteriors the server fuses with that rule weight by weight, ``rounds`` rounds (from one shared
  initialisation, or each from its own with ``fusion.own_init``);
* ``match-<rule>`` for each rule: Bayesian clients from their own initialisations whose hidden units the server
  matches (heteroscedastic Beta-Bernoulli model) before fusing each global unit's members with the rule, ``rounds``
  rounds (:class:`~bnpfed.federated.matched_fusion.MatchedFusionFederation`);
* ``match-<rule>-pooled`` for each rule: the same, with the clients' own posterior output layers pooled log-linearly
  with class-share weights in place of the fused output layer (``FusionConfig(heads="pooled")``, which makes
  ``match-<rule>`` pooled too,
  :class:`~bnpfed.inference.PooledPosterior`), as ``pfnm-pooled`` does for PFNM;
* ``ensemble-bayesian`` (its row is named ``ensemble``): the mean of those Bayesian clients' predictive
  distributions after round 1.
* the fusion baselines of the literature since, one shot from the local networks
  (:func:`~bnpfed.federated.baselines.aligned_average`): ``weight-matching`` (Git Re-Basin, Ainsworth et al., ICLR
  2023), ``ot-fusion`` and ``ot-fusion-sinkhorn`` (Singh & Jaggi, NeurIPS 2020; exact and entropic plans); and from
  the Bayesian clients ``kl-fusion`` (Claici et al., ICML 2020; :mod:`bnpfed.inference.kl_fusion`).

Usage::

    >>> from bnpfed.data import load_dataset
    >>> from bnpfed.federated.config import NetworkConfig, PartitionConfig, TrainingConfig
    >>> ds = load_dataset("digits", standardize=False)
    >>> result = run_experiment(ds, partition=PartitionConfig(clients=3), network=NetworkConfig(hidden=(20,)),
    ...                         training=TrainingConfig(epochs=2),
    ...                         config=ExperimentConfig(methods=("local", "ensemble", "pfnm")))
    >>> [row.method for row in result.rows]
    ['local-mean', 'local-min', 'local-max', 'ensemble', 'pfnm']
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from bnpfed.combine import available_rules
from bnpfed.data import Dataset
from bnpfed.federated.baselines import (aligned_average, ensemble_proba, fedavg_network, kmeans_networks,
                                       reference_client)
from bnpfed.federated.clients import (fit_bayesian, initial_network, posterior_client, train_network,
                                      unit_activity_step)
from bnpfed.federated.config import (EB_DEFAULTS, BayesianConfig, FusionConfig, NetworkConfig, PFNMConfig,
                                     PartitionConfig, TrainingConfig, check_pool_temperature_applies, config_dict,
                                     holdout_split)
from bnpfed.federated.federation import EVAL_CHUNK, Federation, reestimate_statistics
from bnpfed.federated.fusion import FedAvgFederation, FusionFederation
from bnpfed.federated.matched_fusion import MatchedFusionFederation, bayesian_from_match
from bnpfed.federated.operating_point import NOISE_FACTORS, check_noise_to_scale, select_operating_point
from bnpfed.federated.partition import class_counts
from bnpfed.federated.pfnm import PFNMFederation, temper_pool
from bnpfed.federated.results import ExperimentResult, MethodResult, Selection
from bnpfed.federated.selection import select_hyperparameters
from bnpfed.federated.server import clients_per_round, match_hyperparameters, pfnm_step, with_statistics
from bnpfed.inference.batch_norm import batch_norm_order
from bnpfed.inference.kl_fusion import kl_fusion
from bnpfed.inference.permutation import SpecMatch, derive_spec
from bnpfed.inference.posterior_matching import matched_rules
from bnpfed.inference.pooled_heads import pooled_network
from bnpfed.metrics import (classification_report, count_parameters, ece_noise_floor, expected_calibration_error,
                            ood_auroc)
from bnpfed.report import plural
from bnpfed.seeding import Stream, derive_seed
from bnpfed.validation import check_choice, check_fraction, check_int, check_positives

__all__ = [
    "Experiment",
    "ExperimentConfig",
    "ExperimentResult",
    "MethodResult",
    "Selection",
    "available_methods",
    "register_method",
    "network_widths",
    "run_experiment",
    "run_method",
    "select_hyperparameters",
    "width_sweep",
]

#: ``runner(experiment) -> MethodResult | list[MethodResult]``
Runner = Callable[["Experiment"], "MethodResult | list[MethodResult]"]

_METHODS: dict[str, Runner] = {}


def register_method(name: str, runner: Runner, *, overwrite: bool = False) -> Runner:
    """Make ``runner`` available as the method ``name`` (in :class:`ExperimentConfig`'s
    ``methods`` and the commands' ``--methods``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if not callable(runner):
        raise ValueError(f"runner: expected a callable runner(experiment), got {type(runner).__name__}")
    if (name in _METHODS or name in available_rules()) and not overwrite:
        raise ValueError(f"name: expected a method name not registered yet, got {name!r}, which is (as a method "
                         "or a fusion rule); pass overwrite=True to replace it")
    _METHODS[name] = runner
    return runner


#: Prefix of the matched posterior fusion methods: ``match-<rule>`` for every fusion rule.
MATCH_PREFIX = "match-"
#: Suffix of matched posterior fusion with the clients' own output layers pooled: ``match-<rule>-pooled``.
POOLED_SUFFIX = "-pooled"


def available_methods() -> list[str]:
    """Every method name: the registered runners, then one per fusion rule of :mod:`bnpfed.combine` (weight-wise
    fusion), then ``match-<rule>`` per rule of matched fusion (those rules and ``atom-posterior``, the matching
    model's own posterior of each atom), then ``match-<rule>-pooled`` per rule (its output layers pooled)."""
    rules = [rule for rule in available_rules() if rule not in _METHODS]
    matched = [MATCH_PREFIX + rule + suffix for suffix in ("", POOLED_SUFFIX) for rule in matched_rules()]
    return list(_METHODS) + rules + [name for name in matched if name not in _METHODS]


def _runner(name: str) -> Runner:
    if name in _METHODS:
        return _METHODS[name]
    if name in available_rules():
        return lambda experiment: _fusion(experiment, name)
    if isinstance(name, str) and name.startswith(MATCH_PREFIX):
        rule = name[len(MATCH_PREFIX):]
        if rule in matched_rules():
            return lambda experiment: _matched_fusion(experiment, rule)
        if rule.endswith(POOLED_SUFFIX) and rule[:-len(POOLED_SUFFIX)] in matched_rules():
            return lambda experiment: _matched_fusion(experiment, rule[:-len(POOLED_SUFFIX)], pooled=True)
    raise ValueError(f"methods: expected names from {available_methods()}, got {name!r}")


# ------------------------------------------------------------------------------------------------ the harness's config

#: How PFNM's hyper-parameters are chosen (:attr:`ExperimentConfig.select`); those that hold each client's
#: ``holdout`` out of its training data.
SELECTIONS = ("none", "federated", "pooled-train", "operating-point")
HELD_OUT = ("federated", "operating-point")


@dataclass(frozen=True)
class ExperimentConfig:
    """The experiment around the federations (not sent to Flower).

    :param tuple methods: names from :func:`bnpfed.federated.methods.available_methods`, run in this order.
    :param int rounds: communication rounds of the multi-round methods, >= 1. Default 1.
    :param int seed: the one seed every random step derives from (:mod:`bnpfed.seeding`), >= 0. Default 0.
    :param str select: how PFNM's sigma2 / sigma0_2 / gamma0 are chosen: ``"none"`` (as given), ``"federated"``
        (a grid of fixed values, the best on the clients' held-out splits), ``"pooled-train"`` (that grid on all
        clients' pooled training data, as the reference code does; a federation does not have it) or
        ``"operating-point"`` (empirical Bayes, then the estimated sigma2 scaled by each of ``noise_factors``; the
        narrowest global network within ``tolerance`` paired standard errors of the best on the clients' held-out
        splits: :mod:`bnpfed.federated.operating_point`). Default ``"none"``.
    :param tuple grid_sigma2: candidates of ``"federated"`` and ``"pooled-train"`` (and ``grid_sigma0_2``,
        ``grid_gamma0``); only with those.
    :param tuple noise_factors: the factors of the estimated sigma2 under ``"operating-point"`` (each > 0, none 1:
        the estimate itself is always a candidate); only with it.
    :param float tolerance: the standard errors of ``"operating-point"``'s rule, >= 0; only with it. Default 1.
    :param float holdout: share of each client's data held out for ``select="federated"`` or
        ``"operating-point"``, in (0, 1); only with those (the clients then train on the rest).
    :param int ece_bins: equal-width bins of the expected calibration error. Default 15.
    :param int predictive_samples: weight draws S of a Bayesian posterior predictive. Default 10.
    """

    methods: tuple[str, ...] = ("local", "ensemble", "fedavg", "pfnm")
    rounds: int = 1
    seed: int = 0
    select: str = "none"
    grid_sigma2: tuple[float, ...] = (0.05, 0.1, 0.3, 1.0)
    grid_sigma0_2: tuple[float, ...] = (1.0,)
    grid_gamma0: tuple[float, ...] = (1e-3, 1.0)
    noise_factors: tuple[float, ...] = NOISE_FACTORS
    tolerance: float = 1.0
    holdout: float = 0.1
    ece_bins: int = 15
    predictive_samples: int = 10

    def __post_init__(self):
        methods = self.methods
        if isinstance(methods, str) or not isinstance(methods, (tuple, list)) or not methods:
            raise ValueError(f"methods: expected a non-empty sequence of names from {available_methods()}, got "
                             f"{methods!r}")
        object.__setattr__(self, "methods", tuple(methods))
        for m in self.methods:
            check_choice(m, available_methods(), "methods")
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


# ------------------------------------------------------------------------------------------------ the experiment


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
        pooled = [m for m in config.methods if isinstance(m, str) and m.endswith(POOLED_SUFFIX)]
        for m in pooled:   # with pooled heads configured, m and m-pooled would be two rows of the same name
            base = m[:-len(POOLED_SUFFIX)]
            heads = fusion.heads if base.startswith(MATCH_PREFIX) else pfnm.heads
            if base in config.methods and heads == "pooled" and base in ("pfnm", "fedma") + tuple(
                    MATCH_PREFIX + r for r in matched_rules()):
                raise ValueError(f"methods: with heads='pooled' configured, {base!r} already gives the row {m!r}; "
                                 f"expected one of {base!r} and {m!r}")
        check_pool_temperature_applies(pfnm, pfnm.heads == "pooled" or any(not m.startswith(MATCH_PREFIX)
                                                                           for m in pooled))
        check_pool_temperature_applies(fusion, fusion.heads == "pooled" or any(m.startswith(MATCH_PREFIX)
                                                                               for m in pooled))
        fused_matched = [m for m in config.methods if isinstance(m, str) and m.startswith(MATCH_PREFIX)
                         and not m.endswith(POOLED_SUFFIX)]
        if fusion.temperature != 1 and not fused_matched:
            raise ValueError(f"fusion.temperature: the predictive temperature of matched fusion's fused output layer; "
                             f"expected 1 without a match-<rule> row among the methods, got {fusion.temperature!r}")
        training.check_inputs(dataset.input_shape)
        self.ood = ood
        self.dataset, self.partition, self.network, self.training = dataset, partition, network, training
        self.pfnm, self.fusion, self.bayesian, self.config = pfnm, fusion, bayesian, config
        self.seed = config.seed
        self.input_shape = tuple(dataset.input_shape)
        labels = dataset.y_train.numpy()
        parts = partition.split(labels, self.seed)
        if config.select in HELD_OUT:
            self.parts, self.validation_parts = holdout_split(parts, config.holdout, self.seed)
        else:
            self.parts, self.validation_parts = parts, [np.zeros(0, dtype=np.int64) for _ in parts]
        self.class_counts = class_counts(labels, self.parts, dataset.num_classes)
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

    def settings(self) -> dict:
        """Every config as plain values."""
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
        any: a :class:`~bnpfed.inference.permutation.SpecMatch` or a
        :class:`~bnpfed.inference.posterior_matching.PosteriorMatch`): what ``bnpfed pfnm --save-global`` and
        ``bnpfed fuse --save-global`` write (:func:`bnpfed.saved.save_global`)."""
        kept = {"network": net}
        if predictive is not None:  # a Bayesian network's draws, {"samples": S, "seed": s}, as the row scored it
            kept["predictive"] = predictive
        if match is not None:
            kept.update(spec=match.spec, widths=match.widths, hyperparameters=match.hyperparameters,
                        class_shares=match.class_shares)
        self.global_models[method] = kept

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def chance_check(self, method: str, accuracy: float) -> None:
        """Warn when ``accuracy`` is at or below chance (the largest class share of the test split, plus 0.02)."""
        chance = float(torch.bincount(self.dataset.y_test).max()) / len(self.dataset.y_test)
        if not accuracy > chance + 0.02:
            self.warn(f"{method}: test accuracy {accuracy:.3f} is at chance ({chance:.3f}, the largest class's "
                      "share): training diverged or did not learn (check the learning rate, too large or too small, "
                      "the epochs and the data)")

    def report(self, probs: torch.Tensor, ood_probs: Optional[torch.Tensor] = None) -> dict[str, float]:
        """Accuracy, NLL, ECE (``ece_bins``), ECE with 15 bins (``ece15``), the ECE's noise floor (``ece_floor``:
        :func:`~bnpfed.metrics.ece_noise_floor`, ``ece_bins``) and Brier score of test-set probabilities;
        with ``ood_probs`` (the same predictor on the out-of-distribution images) also ``auroc_max_prob`` and
        ``auroc_entropy`` (:func:`~bnpfed.metrics.ood_auroc`)."""
        out = classification_report(probs, self.dataset.y_test, n_bins=self.config.ece_bins)
        out["ece15"] = expected_calibration_error(probs, self.dataset.y_test, 15)
        out["ece_floor"] = ece_noise_floor(probs, self.config.ece_bins)
        if ood_probs is not None:
            out.update(ood_auroc(probs, ood_probs))
        return out

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
        :class:`~bnpfed.inference.permutation.SpecMatch` or a network); nothing happens without batch norm. Returns
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

    def activity(self) -> Optional[list[dict]]:
        """Each client's report on the units of its local model (:func:`~bnpfed.federated.clients.
        unit_activity_step` on its own training inputs), when PFNM drops inactive units (``pfnm.inactive``)."""
        if self.pfnm.inactive != "drop":
            return None
        if self._activity is None:
            self._activity = [unit_activity_step(net, x, self.input_shape, self.training.batch_size)
                              for net, (x, _) in zip(self.local_models(), self.client_data)]
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
        history = [dict(r.metrics) for r in federation.history]
        final = dict(history[-1])
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


# ------------------------------------------------------------------------------------------------ runners


def _local(experiment: Experiment) -> list[MethodResult]:
    models = experiment.local_models()
    reports = [experiment.evaluate_network(net) for net in models]
    accuracies = [r["accuracy"] for r in reports]
    experiment.chance_check("local models", float(np.mean(accuracies)))
    width, params = network_widths(models[0], experiment.input_shape), count_parameters(models[0])
    rows = []
    for name, pick in (("local-mean", None), ("local-min", int(np.argmin(accuracies))),
                       ("local-max", int(np.argmax(accuracies)))):
        metrics = ({k: float(np.mean([r[k] for r in reports])) for k in reports[0]} if pick is None
                   else reports[pick])
        rows.append(MethodResult.from_metrics(name, metrics, hidden=width, parameters=params, rounds=0,
                                              note="mean over clients" if pick is None else f"client {pick}"))
    return rows


def _ensemble(experiment: Experiment) -> MethodResult:
    models = experiment.local_models()
    metrics = experiment.report(*experiment.predictions(lambda x: ensemble_proba(models, x)))
    widths = network_widths(models[0], experiment.input_shape)
    return MethodResult.from_metrics("ensemble", metrics, hidden=[h * len(models) for h in widths],
                                     parameters=count_parameters(models[0]) * len(models),
                                     note="uniform average of the clients' softmax")


def _fedavg_oneshot(experiment: Experiment) -> MethodResult:
    models = experiment.local_models()
    t0 = time.perf_counter()
    net = fedavg_network(models, [len(p) for p in experiment.parts])
    seconds = time.perf_counter() - t0
    experiment.reestimate(net)
    experiment.keep("fedavg-oneshot", net)
    shared = experiment.network.shared_init
    return MethodResult.from_metrics("fedavg-oneshot", experiment.evaluate_network(net),
                                     hidden=network_widths(net, experiment.input_shape),
                                     parameters=count_parameters(net), server_seconds=seconds,
                                     note="shared init" if shared else "each client from its own init")


def _fedavg(experiment: Experiment) -> MethodResult:
    federation = FedAvgFederation(experiment.dataset, experiment.parts, network=experiment.network,
                              training=experiment.training, seed=experiment.seed, weights=experiment.fusion.weights,
                              fraction=experiment.fusion.fraction, ece_bins=experiment.config.ece_bins)
    row = experiment.federation_row(federation, experiment.config.rounds, note="shared init")
    net = federation.global_model.net
    experiment.keep("fedavg", net)
    row.hidden, row.parameters = network_widths(net, experiment.input_shape), count_parameters(net)
    return row


def _pfnm(experiment: Experiment) -> MethodResult:
    if experiment.pfnm.heads == "pooled":   # the config asks for the pooled output layer: that row
        return _pfnm_pooled(experiment)
    selection = experiment.selection()
    match = selection.match
    net = match.network()
    experiment.keep("pfnm", net, match)
    if selection.by == "none":
        how = "hyper-parameters given" if selection.config.fixed else "hyper-parameters by empirical Bayes"
    elif selection.by == "operating-point":
        factor = next(c["factor"] for c in selection.curve if c["chosen"])
        how = (f"empirical Bayes with sigma2 {factor:g} x its estimate (the operating point on the clients' held-out "
               f"splits)")
    else:
        how = f"hyper-parameters by {selection.by}"
    return MethodResult.from_metrics("pfnm", experiment.evaluate_network(net), hidden=match.hidden_sizes,
                                     parameters=count_parameters(net), server_seconds=match.seconds,
                                     hyperparameters=match_hyperparameters(match),
                                     note=f"one shot; {how}{_limits(match)}")


def _limits(match) -> str:
    """What meeting the size limits took, for a row's note (empty when none bound)."""
    return "".join(f"; {s.what} = {s.limit} met ({s.own} -> {s.size})" for s in
                   getattr(match, "size_searches", {}).values() if s.binding)


_POOLED_NOTE = "the clients' own output layers pooled log-linearly with class-share weights"


def _pooled_row(experiment: Experiment, name: str, net: nn.Module, match: SpecMatch, note: str,
                **extra) -> MethodResult:
    """The row of ``net``, ``match``'s global body with the clients' own output layers pooled
    (:mod:`bnpfed.inference.pooled_heads`) at ``pfnm.pool_temperature`` (``"fit"``: every client scores it on its
    training data), kept under ``name``."""
    temperature = temper_pool(net, experiment.pfnm.pool_temperature, experiment.client_data)
    if temperature != 1:
        note += f", at temperature {temperature:.3g}"
    experiment.keep(name, net, match)
    return MethodResult.from_metrics(name, experiment.evaluate_network(net), hidden=match.hidden_sizes,
                                     parameters=count_parameters(net), server_seconds=match.seconds,
                                     hyperparameters=match_hyperparameters(match), note=note, **extra)


def _pfnm_pooled(experiment: Experiment) -> MethodResult:
    selection = experiment.selection()
    match, note = selection.match, f"one shot; pfnm's global body, {_POOLED_NOTE}"
    config = replace(selection.config, layerwise_retrain=0)   # pfnm_step's: PFNM's whole-network budget
    if config.heads == "fused" and config.parameter_limit is not None:
        # pfnm's match priced one output layer: this row carries J, so its budget is met by a match that prices them
        match = experiment.one_shot_match(replace(config, heads="pooled"))
        note = f"one shot; pfnm matched with its J output layers priced in max_params, {_POOLED_NOTE}"
    return _pooled_row(experiment, "pfnm-pooled", pooled_network(match, experiment.local_models()), match,
                       note=note + _limits(match))


def _pfnm_federation(experiment: Experiment, layerwise_retrain: int, heads: Optional[str] = None) -> PFNMFederation:
    """PFNM's (``layerwise_retrain`` 0) or FedMA's federation at the selected config, its output layer ``heads``
    (default: the config's)."""
    config = replace(experiment.selection().config, layerwise_retrain=layerwise_retrain,
                     heads=heads or experiment.selection().config.heads)
    if config.heads == "fused":   # its temperature is for the pooled rows (pfnm-pooled, fedma-pooled)
        config = replace(config, pool_temperature=1.0)
    return PFNMFederation(experiment.dataset, experiment.parts, network=experiment.network,
                          training=experiment.training, pfnm=config, seed=experiment.seed,
                          ece_bins=experiment.config.ece_bins,
                          initial_models=experiment.local_models() if config.fraction >= 1 else None)


def _pfnm_rounds(experiment: Experiment) -> MethodResult:
    federation = _pfnm_federation(experiment, 0)
    start = "warm" if federation.pfnm.warm_start else "cold"
    pooled = f"; {_POOLED_NOTE}" if federation.pfnm.heads == "pooled" else ""
    row = experiment.federation_row(federation, experiment.config.rounds, note=f"{start}-started matching{pooled}")
    experiment.keep(federation.method, federation.global_network(), federation.match)
    return row


def fedma_epochs(experiment: Experiment) -> int:
    """FedMA's retraining epochs after each matched layer: ``pfnm.layerwise_retrain``, or when that is 0 the local
    epochs of a later round of the training schedule."""
    return experiment.pfnm.layerwise_retrain or experiment.training.schedule(2).epochs


def _fedma_federation(experiment: Experiment, rounds: int, name: str, heads: Optional[str] = None
                      ) -> tuple[PFNMFederation, MethodResult]:
    """FedMA's federation run for ``rounds`` rounds under ``name`` (``name-pooled`` when ``heads``, default
    ``pfnm.heads``, pools the output layers: its budget then holds the J output layers), and its row."""
    epochs = fedma_epochs(experiment)
    federation = _pfnm_federation(experiment, epochs, heads)
    pooled = federation.pfnm.heads == "pooled"
    federation.method = name + ("-pooled" if pooled and not name.endswith("-pooled") else "")
    row = experiment.federation_row(federation, rounds, note=f"layer-wise, {epochs} retraining epoch(s) a layer"
                                                           + (f"; {_POOLED_NOTE}" if pooled else ""))
    row.hyperparameters = match_hyperparameters(federation.match)
    return federation, row


def _fedma(experiment: Experiment, rounds: int, name: str) -> MethodResult:
    federation, row = _fedma_federation(experiment, rounds, name)
    experiment.keep(federation.method, federation.global_network(), federation.match)
    return row


def _fedma_pooled(experiment: Experiment) -> MethodResult:
    """FedMA's federation with its output layer pooled (its budget split holding the J heads); the row is the
    federation's own pooled network at ``pfnm.pool_temperature``."""
    federation, row = _fedma_federation(experiment, 1, "fedma-pooled", heads="pooled")
    temperature = federation.history[-1].metrics["pool_temperature"]
    if temperature != 1:
        row.note += f", at temperature {temperature:.3g}"
    experiment.keep("fedma-pooled", federation.global_network(), federation.match)
    return row


#: The alignment baselines (:func:`~bnpfed.federated.baselines.aligned_average`) and their papers.
ALIGNMENT_METHODS = {"weight-matching": "Git Re-Basin weight matching (Ainsworth et al. 2023)",
                     "ot-fusion": "OT fusion, exact plan (Singh & Jaggi 2020)",
                     "ot-fusion-sinkhorn": "OT fusion, Sinkhorn plan (Singh & Jaggi 2020)"}


def _aligned(experiment: Experiment, method: str) -> MethodResult:
    models = experiment.local_models()
    sizes = [len(p) for p in experiment.parts]
    t0 = time.perf_counter()
    net = aligned_average(models, sizes, method=method, input_shape=experiment.input_shape, seed=experiment.seed)
    seconds = time.perf_counter() - t0
    experiment.reestimate(net)
    experiment.keep(method, net)
    return MethodResult.from_metrics(method, experiment.evaluate_network(net),
                                     hidden=network_widths(net, experiment.input_shape),
                                     parameters=count_parameters(net), server_seconds=seconds,
                                     note=f"{ALIGNMENT_METHODS[method]}: aligned to client {reference_client(sizes)} "
                                          "(most examples), averaged by size")


def _kmeans(experiment: Experiment) -> MethodResult:
    widths = experiment.selection().match.hidden_sizes
    match = kmeans_networks(experiment.local_models(), experiment.class_counts, widths, seed=experiment.seed,
                            input_shape=experiment.input_shape)
    match = experiment.reestimate(match)
    net = match.network()
    experiment.keep("kmeans", net, match)
    return MethodResult.from_metrics("kmeans", experiment.evaluate_network(net), hidden=match.hidden_sizes,
                                     parameters=count_parameters(net), server_seconds=match.seconds,
                                     note="at PFNM's width")


def _predictive(federation) -> dict:
    """The draws a Bayesian federation's last evaluation used (its ``predict_proba``)."""
    return {"samples": federation.predictive_samples,
            "seed": derive_seed(federation.seed, Stream.PREDICT, federation.round)}


def _fusion(experiment: Experiment, rule: str) -> MethodResult:
    federation = FusionFederation(experiment.dataset, experiment.parts, network=experiment.network,
                                  training=experiment.training, bayesian=experiment.bayesian,
                                  fusion=replace(experiment.fusion, rule=rule, temperature=1.0),
                                  seed=experiment.seed,
                                  ece_bins=experiment.config.ece_bins,
                                  predictive_samples=experiment.config.predictive_samples,
                                  initial_clients=experiment.bayesian_clients() if experiment.fusion.own_init
                                  and experiment.fusion.fraction >= 1 else None)
    row = experiment.federation_row(federation, experiment.config.rounds,
                                    note="posterior fusion" + (", own inits" if experiment.fusion.own_init else ""))
    experiment.keep(rule, federation.global_model, predictive=_predictive(federation))
    row.parameters = sum(g.loc.numel() for g in federation.global_posterior.values()) + sum(
        p.numel() for p in federation.global_deterministic.values())
    plain = initial_network(experiment.network, experiment.input_shape, experiment.dataset.num_classes,
                            seed=experiment.seed)   # the Bayesian network's plain twin, of the same widths
    row.hidden = network_widths(plain, experiment.input_shape)
    return row


def _bayesian_ensemble(experiment: Experiment) -> MethodResult:
    clients = experiment.bayesian_clients()

    def predict(x):
        return torch.stack([c.predict_proba(x, num_samples=experiment.config.predictive_samples,
                                            seed=derive_seed(experiment.seed, Stream.PREDICT, 1, j))
                            for j, c in enumerate(clients)]).mean(0)

    metrics = experiment.report(*experiment.predictions(predict))
    plain = initial_network(experiment.network, experiment.input_shape, experiment.dataset.num_classes,
                            seed=experiment.seed)
    return MethodResult.from_metrics("ensemble", metrics, hidden=[w * len(clients) for w in network_widths(
        plain, experiment.input_shape)], parameters=count_parameters(plain) * len(clients), rounds=1,
        note="mean of the Bayesian clients' predictive distributions")


def _matched_fusion(experiment: Experiment, rule: str, pooled: bool = False) -> MethodResult:
    heads = "pooled" if pooled else experiment.fusion.heads   # match-<rule>-pooled, or the config's heads
    federation = MatchedFusionFederation(experiment.dataset, experiment.parts, network=experiment.network,
                                         training=experiment.training, bayesian=experiment.bayesian,
                                         fusion=replace(experiment.fusion, rule=rule, align="match", heads=heads,
                                                        pool_temperature=experiment.fusion.pool_temperature
                                                        if heads == "pooled" else 1.0,
                                                        temperature=experiment.fusion.temperature
                                                        if heads == "fused" else 1.0),
                                         seed=experiment.seed, ece_bins=experiment.config.ece_bins,
                                         predictive_samples=experiment.config.predictive_samples,
                                         initial_clients=experiment.bayesian_clients())
    pooled = heads == "pooled"   # a fused body with the J clients' posterior heads (a PooledPosterior)
    row = experiment.federation_row(federation, experiment.config.rounds, note="matched posterior fusion" + (
        f"; {_POOLED_NOTE}, inside every draw" if pooled else ""))
    experiment.keep(federation.method, federation.pooled if pooled else federation.global_model, federation.match,
                    predictive=_predictive(federation))
    return row


def _kl_fusion(experiment: Experiment) -> MethodResult:
    clients = experiment.bayesian_clients()
    sizes = [len(p) for p in experiment.parts]
    t0 = time.perf_counter()
    match = kl_fusion(clients, experiment.class_counts, sizes=sizes, input_shape=experiment.input_shape,
                      seed=derive_seed(experiment.seed, Stream.MATCH, 1))
    seconds = time.perf_counter() - t0
    client = bayesian_from_match(match, experiment.bayesian)
    draws = {"samples": experiment.config.predictive_samples, "seed": derive_seed(experiment.seed, Stream.PREDICT, 1)}
    experiment.keep("kl-fusion", client, match, predictive=draws)

    def predict(x):
        return client.predict_proba(x, num_samples=draws["samples"], seed=draws["seed"])

    metrics = experiment.report(*experiment.predictions(predict))
    net = match.network()
    return MethodResult.from_metrics("kl-fusion", metrics, hidden=list(match.widths.values()),
                                     parameters=count_parameters(net), server_seconds=seconds, rounds=1,
                                     note=f"KL-fusion (Claici et al. 2020), components from client "
                                          f"{reference_client(sizes)}, at the clients' width")


for _name, _fn in (("local", _local), ("ensemble", _ensemble), ("ensemble-bayesian", _bayesian_ensemble),
                   ("fedavg-oneshot", _fedavg_oneshot),
                   ("fedavg", _fedavg), ("kmeans", _kmeans), ("pfnm", _pfnm), ("pfnm-pooled", _pfnm_pooled),
                   ("pfnm-rounds", _pfnm_rounds),
                   ("fedma", lambda e: _fedma(e, 1, "fedma")), ("fedma-pooled", _fedma_pooled),
                   *((m, functools.partial(_aligned, method=m)) for m in ALIGNMENT_METHODS),
                   ("kl-fusion", _kl_fusion),
                   ("fedma-rounds", lambda e: _fedma(e, e.config.rounds, "fedma-rounds"))):
    register_method(_name, _fn)


# ------------------------------------------------------------------------------------------------ entry points


def run_method(experiment: "Experiment", method: str) -> list[MethodResult]:
    """The rows of one method on ``experiment`` (its local models trained on first use and kept for the next
    method): what :func:`run_experiment` does per method, for a caller that records each method as it ends."""
    out = _runner(method)(experiment)
    rows = out if isinstance(out, list) else [out]
    for row in rows:
        row.width = int(sum(row.hidden))
        # every global model is checked against chance (the local rows are checked once, by their mean: one client
        # of a skewed partition may well sit at chance; one-shot FedAvg of clients from their own initialisations
        # is at chance by construction, its note says so)
        expected = row.method == "fedavg-oneshot" and not experiment.network.shared_init
        if not row.method.startswith("local") and not expected:
            experiment.chance_check(row.method, row.accuracy)
    return rows


def run_experiment(dataset: Dataset, *, progress: bool = False, log: Optional[Callable[[str], None]] = None,
                   ood: Optional[torch.Tensor] = None, **configs) -> ExperimentResult:
    """Run ``config.methods`` (an :class:`ExperimentConfig`) on ``dataset``, one after the
    other, and collect their rows.

    :param ood: optional out-of-distribution inputs (rows then carry ``auroc_max_prob``, ``auroc_entropy``).
    :param configs: the configs of :class:`Experiment` (``partition``, ``network``, ``training``, ``pfnm``,
        ``fusion``, ``bayesian``, ``config``); each defaults to its dataclass's defaults.
    """
    experiment = Experiment(dataset, progress=progress, log=log, ood=ood, **configs)
    rows: list[MethodResult] = []
    try:
        for method in experiment.config.methods:
            rows.extend(run_method(experiment, method))
    finally:
        experiment.close()
    local = experiment._local.get(experiment.network.shared_init, [])
    accuracies = [experiment.evaluate_network(n)["accuracy"] for n in local]
    return ExperimentResult(settings=experiment.settings(), rows=rows, client_sizes=[len(p) for p in experiment.parts],
                            local_accuracies=accuracies, selection=experiment._selection,
                            warnings=experiment.warnings, local_models=local, class_counts=experiment.class_counts,
                            global_models=experiment.global_models)


def width_sweep(dataset: Dataset, *, sigma2: Sequence[float], gamma0: Sequence[float],
                constants: Sequence[str] = ("bnpfed", "reference"), progress: bool = False, **configs) -> list[dict]:
    """Accuracy against global width: the clients' local models trained once, then matched with every
    (sigma2, gamma0) under each set of constants (the reference constants with the reference's top-down order).

    :returns: one dict per point: constants, sigma2, gamma0, hidden, width (sum of hidden sizes), accuracy, seconds.
    """
    experiment = Experiment(dataset, progress=progress, **configs)
    models = experiment.local_models()
    experiment.close()
    points = []
    grid = list(itertools.product(constants, sigma2, gamma0))
    for name, s2, g in tqdm(grid, desc="matching", disable=not progress, leave=False):
        candidate = replace(experiment.pfnm, hyperparameters="fixed", constants=name, sigma2=s2, gamma0=g,
                            direction="top-down" if name == "reference" else experiment.pfnm.direction,
                            **EB_DEFAULTS)
        match = experiment.reestimate(pfnm_step(models, experiment.class_counts, candidate, seed=experiment.seed,
                                                round=1, input_shape=experiment.input_shape,
                                                activity=experiment.activity()))
        points.append(dict(constants=name, sigma2=s2, gamma0=g, hidden=match.hidden_sizes,
                           width=sum(match.hidden_sizes),
                           accuracy=experiment.evaluate_network(match.network())["accuracy"],
                           seconds=match.seconds))
    return points

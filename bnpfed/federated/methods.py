"""Comparison methods of a federated experiment, as a registry: one small runner per method, like the fusion rules
of :mod:`bnpfed.combine`.

A runner takes the :class:`Experiment` (the data, its partition, the configs, and what several methods share:
the clients' local models, PFNM's selected hyper-parameters) and returns one or more :class:`MethodResult` rows.
Adding a method is one function and one :func:`register_method` line (with the options it takes); every fusion rule
registered with :func:`bnpfed.combine.register_rule` is an option of ``fusion`` and ``match`` too. A method's options
are written ``name:key=value`` (:mod:`bnpfed.federated.registry`); those left out take the configs' values.

Built-in methods (Yurochkin et al. 2019, section 4; Wang et al. 2020; Ozer et al. 2022), for any
:class:`~bnpfed.federated.config.NetworkConfig` architecture (MLP, LeNet, FedMA's simple CNN with or without batch
norm; a global network's batch-norm statistics are re-estimated from the clients' data after every average or
match):

* ``local``: the clients' own networks (rows ``local-mean``, ``local-min``, ``local-max``);
* ``ensemble``: the uniform average of their predicted probabilities (J times the parameters);
* ``fedavg-oneshot``: one FedAvg average of the local networks, each from its own initialisation (near chance: the
  point of the baseline); ``fedavg-oneshot:init=shared`` (row ``fedavg-oneshot-shared``): one round of FedAvg from a
  shared initialisation, the simplest strong one-shot baseline (the default ``init`` follows
  ``network.shared_init``);
* ``fedavg``: FedAvg from a shared initialisation over ``rounds`` rounds (one round: the one-shot baseline with a
  shared initialisation);
* ``kmeans``: k-means over the pooled units of every group (layer, conv channels), at PFNM's global widths;
* ``pfnm``: PFNM in one communication round, hyper-parameters chosen by ``select``; ``pfnm:heads=pooled`` (row
  ``pfnm-pooled``): the same match, its global network's output layer replaced by the clients' own output layers
  pooled log-linearly with class-share weights (:mod:`bnpfed.matching.pooled_heads`: what PFNM's averaged output
  layer loses under label skew; the same predictions as ``pfnm`` when every class's shares are equal); under a
  ``max_params`` budget a match that prices the J output layers;
* ``pfnm-rounds``: PFNM with ``rounds`` communication rounds (``heads`` as ``pfnm``'s);
* ``fedma``: FedMA's layer-wise scheme in one round (Wang et al., ICLR 2020): match a layer, freeze it, let the
  clients retrain the layers above for ``pfnm.layerwise_retrain`` epochs (the schedule's epochs of a later round
  when 0), match the next layer, ...; ``fedma:heads=pooled``: with the clients' own output layers (as they retrained
  them before the last group was matched) pooled, as ``pfnm``'s, its budget split holding them;
* ``fedma-rounds``: FedMA with ``rounds`` communication rounds (each client starting a round from its slice);
* ``fusion:rule=R`` for each fusion rule R (``eaa``, ``gaa``, ``log_variance``, ``pooling``, ``conflation``, or a
  registered one; rows named by the rule): variational Bayesian clients whose posteriors the server fuses with that
  rule weight by weight, ``rounds`` rounds (from one shared initialisation, or each from its own with
  ``fusion.own_init``);
* ``match:rule=R`` for each rule of matched fusion (rows ``match-R``): Bayesian clients from their own
  initialisations whose hidden units the server matches (heteroscedastic Beta-Bernoulli model) before fusing each
  global unit's members with the rule, ``rounds`` rounds (:class:`~bnpfed.federated.matched_fusion.
  MatchedFusionFederation`); ``match:rule=R:heads=pooled`` (rows ``match-R-pooled``): the clients' own posterior
  output layers pooled log-linearly with class-share weights in place of the fused output layer
  (:class:`~bnpfed.matching.PooledPosterior`), as ``pfnm:heads=pooled`` does for PFNM;
* ``ensemble-bayesian`` (its row is named ``ensemble``): the mean of those Bayesian clients' predictive
  distributions after round 1.
* the fusion baselines of the literature since, one shot from the local networks
  (:func:`~bnpfed.baselines.averaging.aligned_average`): ``weight-matching`` (Git Re-Basin, Ainsworth et al., ICLR
  2023), ``ot-fusion`` and ``ot-fusion-sinkhorn`` (Singh & Jaggi, NeurIPS 2020; exact and entropic plans); and from
  the Bayesian clients ``kl-fusion`` (Claici et al., ICML 2020; :mod:`bnpfed.baselines.kl_fusion`).

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
import time
from dataclasses import replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from bnpfed.combine import available_rules
from bnpfed.data import Dataset
from bnpfed.baselines import aligned_average, ensemble_proba, fedavg_network, kmeans_networks, reference_client
from bnpfed.federated.clients import initial_network
from bnpfed.federated.config import EB_DEFAULTS, HEADS
from bnpfed.federated.experiment import (HELD_OUT, SELECTIONS, Experiment, ExperimentConfig, check_methods,
                                         network_widths)
from bnpfed.federated.fusion import FedAvgFederation, FusionFederation
from bnpfed.federated.matched_fusion import MatchedFusionFederation, bayesian_from_match
from bnpfed.federated.pfnm import PFNMFederation, temper_pool
from bnpfed.federated.registry import (MATCH_PREFIX, POOLED_SUFFIX, MethodOption, MethodSpec, Runner,
                                       available_methods, method_options, method_spec, register_method, runner_of,
                                       unregister_method)
from bnpfed.federated.results import ExperimentResult, MethodResult, Selection
from bnpfed.federated.selection import select_hyperparameters
from bnpfed.federated.server import match_hyperparameters, pfnm_step
from bnpfed.baselines import kl_fusion
from bnpfed.matching import SpecMatch
from bnpfed.matching import matched_rules
from bnpfed.matching import pooled_network
from bnpfed.metrics import count_parameters
from bnpfed.seeding import Stream, derive_seed

__all__ = [   # with the names that moved to experiment.py and registry.py, which keep working from here
    "HELD_OUT",
    "MATCH_PREFIX",
    "MethodOption",
    "MethodSpec",
    "POOLED_SUFFIX",
    "Runner",
    "SELECTIONS",
    "Experiment",
    "ExperimentConfig",
    "ExperimentResult",
    "MethodResult",
    "Selection",
    "available_methods",
    "check_methods",
    "method_options",
    "method_spec",
    "register_method",
    "unregister_method",
    "network_widths",
    "COMPARED_WITH",
    "comparisons",
    "run_experiment",
    "run_method",
    "select_hyperparameters",
    "width_sweep",
]


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


def _fedavg_oneshot(experiment: Experiment, init: str) -> MethodResult:
    shared = init == "shared"
    models = experiment.local_models(shared=shared)
    t0 = time.perf_counter()
    net = fedavg_network(models, [len(p) for p in experiment.parts])
    seconds = time.perf_counter() - t0
    experiment.reestimate(net)
    name = _fedavg_oneshot_label({"init": init})
    experiment.keep(name, net)
    return MethodResult.from_metrics(name, experiment.evaluate_network(net),
                                     hidden=network_widths(net, experiment.input_shape),
                                     parameters=count_parameters(net), server_seconds=seconds,
                                     note="one round from a shared init" if shared else "each client from its own init")


def _fedavg_oneshot_label(options: dict) -> str:
    """``fedavg-oneshot`` (the clients from their own initialisations), ``fedavg-oneshot-shared`` (from one)."""
    return "fedavg-oneshot" + ("-shared" if options["init"] == "shared" else "")


def _fedavg(experiment: Experiment) -> MethodResult:
    federation = FedAvgFederation(experiment.dataset, experiment.parts, network=experiment.network,
                              training=experiment.training, seed=experiment.seed, weights=experiment.fusion.weights,
                              fraction=experiment.fusion.fraction, ece_bins=experiment.config.ece_bins)
    row = experiment.federation_row(federation, experiment.config.rounds, note="shared init")
    net = federation.global_model.net
    experiment.keep("fedavg", net)
    row.hidden, row.parameters = network_widths(net, experiment.input_shape), count_parameters(net)
    return row


def _pfnm(experiment: Experiment, heads: str) -> MethodResult:
    if experiment.pfnm_heads(heads) == "pooled":   # the pooled output layer: that row (named "pfnm" under "auto")
        return _pfnm_pooled(experiment, "pfnm" if heads == "auto" else "pfnm-pooled")
    selection = experiment.selection()
    match = selection.match
    if selection.config.heads == "pooled" and selection.config.parameter_limit is not None:
        # the selection's match priced J output layers (the config's heads): this row carries one
        match = experiment.one_shot_match(replace(selection.config, heads="fused", layerwise_retrain=0))
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
#: What a row's note adds when heads="auto" pooled its output layers.
_AUTO_NOTE = " (heads auto: the clients' class shares differ)"


def _pooled_row(experiment: Experiment, name: str, net: nn.Module, match: SpecMatch, note: str,
                **extra) -> MethodResult:
    """The row of ``net``, ``match``'s global body with the clients' own output layers pooled
    (:mod:`bnpfed.matching.pooled_heads`) at ``pfnm.pool_temperature`` (``"fit"``: every client scores it on its
    training data), kept under ``name``."""
    temperature = temper_pool(net, experiment.pfnm.pool_temperature, experiment.client_data)
    if temperature != 1:
        note += f", at temperature {temperature:.3g}"
    experiment.keep(name, net, match)
    return MethodResult.from_metrics(name, experiment.evaluate_network(net), hidden=match.hidden_sizes,
                                     parameters=count_parameters(net), server_seconds=match.seconds,
                                     hyperparameters=match_hyperparameters(match), note=note, **extra)


def _pfnm_pooled(experiment: Experiment, name: str) -> MethodResult:
    selection = experiment.selection()
    auto = _AUTO_NOTE if name == "pfnm" else ""
    match, note = selection.match, f"one shot; pfnm's global body, {_POOLED_NOTE}{auto}"
    config = replace(selection.config, layerwise_retrain=0)   # pfnm_step's: PFNM's whole-network budget
    if config.heads == "fused" and config.parameter_limit is not None:
        # pfnm's match priced one output layer: this row carries J, so its budget is met by a match that prices them
        match = experiment.one_shot_match(replace(config, heads="pooled"))
        note = f"one shot; pfnm matched with its J output layers priced in max_params, {_POOLED_NOTE}{auto}"
    return _pooled_row(experiment, name, pooled_network(match, experiment.local_models()), match,
                       note=note + _limits(match))


def _pfnm_federation(experiment: Experiment, layerwise_retrain: int, heads: Optional[str] = None) -> PFNMFederation:
    """PFNM's (``layerwise_retrain`` 0) or FedMA's federation at the selected config, its output layer ``heads``
    (default: the config's; ``"auto"`` resolved by the clients' class shares)."""
    config = replace(experiment.selection().config, layerwise_retrain=layerwise_retrain,
                     heads=experiment.pfnm_heads(heads) if heads else experiment.selection().config.heads)
    if config.heads == "fused":   # its temperature is for the pooled rows (pfnm-pooled, fedma-pooled)
        config = replace(config, pool_temperature=1.0)
    return PFNMFederation(experiment.dataset, experiment.parts, network=experiment.network,
                          training=experiment.training, pfnm=config, seed=experiment.seed,
                          ece_bins=experiment.config.ece_bins,
                          initial_models=experiment.local_models() if config.fraction >= 1 else None)


def _pfnm_rounds(experiment: Experiment, heads: str) -> MethodResult:
    federation = _pfnm_federation(experiment, 0, heads)
    if heads == "auto":   # the row's name is the spec's, whichever output layer "auto" chose
        federation.method = "pfnm-rounds"
    start = "warm" if federation.pfnm.warm_start else "cold"
    pooled = f"; {_POOLED_NOTE}" + (_AUTO_NOTE if heads == "auto" else "") if federation.pfnm.heads == "pooled" else ""
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
    auto = heads == "auto"   # the row's name is the spec's, whichever output layer "auto" chose
    federation.method = name + ("-pooled" if pooled and not auto and not name.endswith("-pooled") else "")
    row = experiment.federation_row(federation, rounds, note=f"layer-wise, {epochs} retraining epoch(s) a layer"
                                    + (f"; {_POOLED_NOTE}" + (_AUTO_NOTE if auto else "") if pooled else ""))
    row.hyperparameters = match_hyperparameters(federation.match)
    return federation, row


def _fedma(experiment: Experiment, rounds: int, name: str, heads: str) -> MethodResult:
    """FedMA's federation for ``rounds`` rounds, its output layer ``heads`` (pooled: the federation's own pooled
    network at ``pfnm.pool_temperature``, its budget split holding the J heads)."""
    federation, row = _fedma_federation(experiment, rounds, name, heads)
    if federation.pfnm.heads == "pooled":
        temperature = federation.history[-1].metrics["pool_temperature"]
        if temperature != 1:
            row.note += f", at temperature {temperature:.3g}"
    experiment.keep(federation.method, federation.global_network(), federation.match)
    return row


#: The alignment baselines (:func:`~bnpfed.baselines.averaging.aligned_average`) and their papers.
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
    if experiment.bayesian.program is None:   # a program has no network whose widths a row could give
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


def _matched_fusion(experiment: Experiment, rule: str, heads: str) -> MethodResult:
    auto, heads = heads == "auto", experiment.match_heads(heads)
    given = experiment.configs["fusion"]
    federation = MatchedFusionFederation(experiment.dataset, experiment.parts, network=experiment.network,
                                         training=experiment.training, bayesian=experiment.bayesian,
                                         fusion=replace(experiment.fusion, rule=rule, align="match", heads=heads,
                                                        pool_temperature=given.pool_temperature
                                                        if heads == "pooled" else 1.0,
                                                        temperature=given.temperature if heads == "fused" else 1.0),
                                         seed=experiment.seed, ece_bins=experiment.config.ece_bins,
                                         predictive_samples=experiment.config.predictive_samples,
                                         initial_clients=experiment.bayesian_clients())
    pooled = heads == "pooled"   # a fused body with the J clients' posterior heads (a PooledPosterior)
    if auto:   # the row's name is the spec's, whichever output layer "auto" chose
        federation.method = f"match-{rule}"
    row = experiment.federation_row(federation, experiment.config.rounds, note="matched posterior fusion" + (
        f"; {_POOLED_NOTE}, inside every draw" + (_AUTO_NOTE if auto else "") if pooled else ""))
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


#: The option ``heads`` of PFNM's and FedMA's methods (its default: ``pfnm.heads``), and of matched fusion (its
#: default: ``fusion.heads``).
_PFNM_HEADS = MethodOption(HEADS, "pfnm", "the global network's output layer: fused, the clients' own pooled, or "
                                          "auto (pooled when the clients' class shares differ)")
_MATCH_HEADS = MethodOption(HEADS, "fusion", "the global posterior's output layer: fused, the clients' own pooled, or "
                                             "auto (pooled when the clients' class shares differ)")


def _suffix(options: dict) -> str:
    """A row's name says ``-pooled`` when the spec asks for pooled heads (``"auto"``: the name of the spec alone)."""
    return "-pooled" if options["heads"] == "pooled" else ""


for _name, _fn in (("local", _local), ("ensemble", _ensemble), ("ensemble-bayesian", _bayesian_ensemble),
                   ("fedavg", _fedavg), ("kmeans", _kmeans)):
    register_method(_name, _fn)
register_method("fedavg-oneshot", _fedavg_oneshot, label=_fedavg_oneshot_label, options={"init": MethodOption(
    ("own", "shared"), None, "the clients' initialisations before their one round: each its own, or one shared",
    default=lambda configs: "shared" if configs["network"].shared_init else "own")})
register_method("pfnm", _pfnm, options={"heads": _PFNM_HEADS}, label=lambda o: "pfnm" + _suffix(o))
register_method("pfnm-rounds", _pfnm_rounds, options={"heads": _PFNM_HEADS},
                label=lambda o: "pfnm-rounds" + _suffix(o))
register_method("fedma", lambda e, heads: _fedma(e, 1, "fedma", heads), options={"heads": _PFNM_HEADS},
                label=lambda o: "fedma" + _suffix(o))
register_method("fedma-rounds", lambda e, heads: _fedma(e, e.config.rounds, "fedma-rounds", heads),
                options={"heads": _PFNM_HEADS}, label=lambda o: "fedma-rounds" + _suffix(o))
for _name in ALIGNMENT_METHODS:
    register_method(_name, functools.partial(_aligned, method=_name))
register_method("kl-fusion", _kl_fusion)
register_method("fusion", _fusion, label=lambda o: o["rule"], options={"rule": MethodOption(
    available_rules, "fusion", "the fusion rule, weight by weight (bnpfed.combine)")})
register_method("match", _matched_fusion, label=lambda o: f"match-{o['rule']}" + _suffix(o), options={
    "rule": MethodOption(matched_rules, "fusion", "the rule that fuses each global unit's members"),
    "heads": _MATCH_HEADS})


# ------------------------------------------------------------------------------------------------ entry points


def run_method(experiment: "Experiment", method: str) -> list[MethodResult]:
    """The rows of one method on ``experiment`` (its local models trained on first use and kept for the next
    method): what :func:`run_experiment` does per method, for a caller that records each method as it ends."""
    out = runner_of(method_spec(method), experiment.configs)(experiment)
    rows = out if isinstance(out, list) else [out]
    for row in rows:
        row.width = int(sum(row.hidden))
        if row.test_probs is not None and not row.intervals:
            row.intervals = experiment.intervals(row.test_probs)
        # every global model is checked against chance (the local rows are checked once, by their mean: one client
        # of a skewed partition may well sit at chance; one-shot FedAvg of clients from their own initialisations
        # is at chance by construction, its note says so)
        expected = row.method == "fedavg-oneshot"
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
    local = experiment.trained_local_models()
    accuracies = [experiment.evaluate_network(n)["accuracy"] for n in local]
    return ExperimentResult(settings=experiment.settings(), rows=rows, client_sizes=[len(p) for p in experiment.parts],
                            local_accuracies=accuracies, selection=experiment.selected,
                            warnings=experiment.warnings, local_models=local, class_counts=experiment.class_counts,
                            global_models=experiment.global_models, comparisons=comparisons(experiment, rows),
                            test_labels=experiment.dataset.y_test)


#: The rows every other row is compared with, paired on the test examples (:func:`comparisons`), the first one run:
#: the clients' ensemble, the target one-shot fusion is judged against (J times the parameters, one round), else
#: FedAvg, the baseline of the methods with communication.
COMPARED_WITH = ("ensemble", "fedavg")


def comparisons(experiment: Experiment, rows: Sequence[MethodResult]) -> list[dict]:
    """Every row of one global model minus the reference row (the first of :data:`COMPARED_WITH` that ran), paired
    on the same test examples (:meth:`Experiment.paired`): ``[{"method": ..., "against": "ensemble", "accuracy":
    {"difference", "low", "high"}, "nll": ..., ...}]``; empty without a reference row."""
    kept = {r.method: r for r in rows if r.test_probs is not None}
    against = next((name for name in COMPARED_WITH if name in kept), None)
    if against is None:
        return []
    reference = kept[against]
    return [{"method": row.method, "against": against, **experiment.paired(row.test_probs, reference.test_probs)}
            for row in rows if row is not reference and row.test_probs is not None]


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
                            experimental=replace(experiment.pfnm.experimental, **EB_DEFAULTS))
        match = experiment.reestimate(pfnm_step(models, experiment.class_counts, candidate, seed=experiment.seed,
                                                round=1, input_shape=experiment.input_shape,
                                                activity=experiment.activity()))
        points.append(dict(constants=name, sigma2=s2, gamma0=g, hidden=match.hidden_sizes,
                           width=sum(match.hidden_sizes),
                           accuracy=experiment.evaluate_network(match.network())["accuracy"],
                           seconds=match.seconds))
    return points

"""The Flower ServerApp: reads the run config (its ``plugins`` first), asks the SuperNodes for their partitions,
builds :class:`~bnpfed.flower.strategies.PFNMStrategy`, :class:`~bnpfed.flower.strategies.PosteriorFusionStrategy`,
(for ``method = "fusion"`` with ``align = "match"``) :class:`~bnpfed.flower.strategies.MatchedFusionStrategy`,
:class:`~bnpfed.flower.strategies.FedAvgStrategy` or, for a registered federated method,
:class:`~bnpfed.flower.method_strategy.MethodStrategy`, runs its rounds and writes what came out.

The run config (``[tool.flwr.app.config]`` of the app, then ``flwr run --run-config``) is one flat namespace of the
configs of :mod:`bnpfed.federated.config` plus the run's own keys (:mod:`bnpfed.flower.config`); every key and value
is checked before anything is sent. With every client answering, the global model is the in-process run's
(:class:`~bnpfed.federated.pfnm.PFNMFederation`, :class:`~bnpfed.federated.fusion.FusionFederation`,
:class:`~bnpfed.federated.matched_fusion.MatchedFusionFederation` with the same configs and seed), bit for bit,
whatever ``fraction`` is.

Usage (``grid`` is a Flower ``Grid``: the SuperLink's, a simulation's, or a
:class:`~bnpfed.flower.local.LocalGrid`)::

    >>> from bnpfed.flower.client import app as client_app
    >>> from bnpfed.flower.local import LocalGrid
    >>> result = run_federation(LocalGrid(client_app, num_nodes=3),
    ...                         {"method": "pfnm", "rounds": 2, "hidden": "16", "epochs": 1, "round-epochs": 1})
    >>> [r["clients"] for r in result.history], [r["hidden"] for r in result.history]
    ([[0, 1, 2], [0, 1, 2]], [[29], [29]])
    >>> 0.5 < result.history[-1]["accuracy"] <= 1       # the clients' test shards: the whole test split
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from bnpfed.data import dataset_task
from bnpfed.federated import federated_method, initial_network
from bnpfed.federated import client_from_slice, tempered
from bnpfed.flower.client_steps import initial_global_model
from bnpfed.flower.config import FlowerSettings, config_key, parse_run_config
from bnpfed.flower.secure import SecureFusionStrategy, SecureMatchedFusionStrategy, client_at_widths
from bnpfed.flower.method_strategy import MethodStrategy
from bnpfed.flower.records import (from_array_record, matched_posterior_from_arrays, posterior_from_arrays,
                                   state_to_record, split_heads, split_temperature, tensors_from_arrays)
from bnpfed.flower.strategies import (LOGGER, FedAvgStrategy, MatchedFusionStrategy, PFNMStrategy,
                                      PosteriorFusionStrategy)
from bnpfed.matching import check_network_matching, derive_spec, network_from_state
from bnpfed.matching import PooledPosterior, attach_heads
from bnpfed.metrics import chance_warning
from bnpfed.report import command_record, command_results, write_json
from bnpfed.saved import save_global
from bnpfed.seeding import Stream, derive_seed

__all__ = ["FederationResult", "app", "global_model", "make_server_app", "run_federation", "run_warnings"]


@dataclass
class FederationResult:
    """What a Flower run produced.

    :param str method: ``"pfnm"`` or ``"fusion"``.
    :param FlowerSettings settings: every config of the run (``partition.clients`` is the SuperNodes' J).
    :param dict arrays: the final global model's arrays, ``{name: ndarray}`` in the layout of
        :mod:`bnpfed.flower.records` (PFNM: the global network's ``state_dict``).
    :param list history: one dict per round (:attr:`~bnpfed.flower.strategies.PFNMStrategy.history`).
    :param list warnings: what the run should say, as the commands do: a global model whose accuracy on the
        clients' test shards sits at chance (:func:`~bnpfed.metrics.chance_warning`).
    """

    method: str
    settings: FlowerSettings
    arrays: dict[str, np.ndarray] = field(repr=False)
    history: list[dict]
    warnings: list[str] = field(default_factory=list)

    def results(self) -> dict:
        """JSON-ready ``results`` of :func:`~bnpfed.report.command_record` (arrays left out): one run whose one row
        is the method after its last round, and every round's record."""
        rounds = [{"run": 0, "method": self.method, **r} for r in self.history]
        final = {"method": self.method, **(self.history[-1] if self.history else {})}
        return command_results([{"method": self.method, "rows": [final], "warnings": list(self.warnings)}], rounds)


def run_federation(grid: Grid, config: Mapping[str, Any]) -> FederationResult:
    """Run the method ``config`` asks for on ``grid`` and return the result; see :mod:`bnpfed.flower.config` for
    the keys. The SuperNodes are asked for their partitions first (at most ``node-timeout`` seconds).

    :raises ValueError: on an unknown key or a bad value (naming it), before anything is sent; ``augment`` that
        does not apply to the SuperNodes' data (crops of inputs that are not images), once they have reported its
        shape and before any training.
    :raises RuntimeError: when the run cannot go on (too few SuperNodes, too few usable replies).
    """
    settings = parse_run_config(config)
    run = settings.run
    common = dict(seed=run.seed, fraction_evaluate=run.fraction_evaluate, min_nodes=run.min_nodes,
                  min_replies=run.min_replies, node_timeout=run.node_timeout, query_timeout=run.round_timeout,
                  client_config=settings.client_record())
    matched = run.method == "fusion" and settings.fusion.align == "match"
    if run.federated:   # a registered federated method: the one generic strategy
        strategy = MethodStrategy(run.method, settings.fusion, network=settings.network, **common)
    elif run.method == "pfnm":
        strategy = PFNMStrategy(settings.pfnm, network=settings.network, **common)
    elif run.method == "fedavg":
        strategy = FedAvgStrategy(settings.fusion, network=settings.network, **common)
    elif settings.secure.secure_aggregation and matched:   # round 1 matched in the clear, then under SecAgg+
        strategy = SecureMatchedFusionStrategy(settings.fusion, settings.secure, network=settings.network,
                                               bayesian=settings.bayesian, **common)
    elif settings.secure.secure_aggregation:
        strategy = SecureFusionStrategy(settings.fusion, settings.secure, **common)
    elif matched:
        strategy = MatchedFusionStrategy(settings.fusion, network=settings.network, bayesian=settings.bayesian,
                                         **common)
    else:
        strategy = PosteriorFusionStrategy(settings.fusion, **common)
    identity = strategy.connect(grid)
    settings.training.check_inputs(identity.input_shape)   # augment: images only, known once the nodes report
    if run.method == "pfnm" or matched:   # a value per matched group: as many as the network has, before training
        template = initial_network(settings.network, identity.input_shape, identity.num_classes, seed=run.seed)
        groups = derive_spec(template, identity.input_shape).group_names
        try:
            (settings.pfnm if run.method == "pfnm" else settings.fusion).check_groups(groups)
        except ValueError as error:
            name, _, rest = str(error).partition(":")
            raise ValueError(config_key(name) + ":" + rest) from None
        check_network_matching(derive_spec(template, identity.input_shape), template.state_dict(),
                               identity.num_partitions, name="hidden" if settings.network.arch == "mlp" else "arch",
                               change="lower hidden (the clients' widths), or run the server on a machine with more "
                                      "memory")
    settings = settings.with_clients(identity.num_partitions)
    if run.federated:   # the method's initial global state, from the shared initial network
        initial = strategy.initial_arrays()
    elif run.method == "pfnm" or matched:  # each client starts round 1 from its own initialisation
        initial = ArrayRecord()
    elif run.method == "fedavg":  # the shared initial network
        initial = state_to_record(initial_network(settings.network, identity.input_shape, identity.num_classes,
                                                  seed=run.seed).state_dict())
    else:
        initial = initial_global_model(settings.network, settings.bayesian, identity.input_shape,
                                       identity.num_classes, seed=run.seed, task=dataset_task(run.dataset))
    LOGGER.info("bnpfed %s: %d round(s), dataset %s, %d clients", run.method, run.rounds, run.dataset,
                identity.num_partitions)
    outcome = strategy.start(grid, initial, num_rounds=run.rounds, timeout=run.round_timeout)
    result = FederationResult(method=run.method, settings=settings, arrays=from_array_record(outcome.arrays),
                              history=strategy.history, warnings=run_warnings(run.method, strategy.history))
    for message in result.warnings:
        LOGGER.warning("%s", message)
    if run.output_dir:
        out = Path(run.output_dir)
        write_json(out / f"{run.method}-summary.json",
                   command_record("flower run", config, settings.as_dict(), result.results()))
        np.savez(out / f"{run.method}-global.npz", **result.arrays)
        if settings.bayesian.program is not None:
            LOGGER.warning("%s", f"program: a Pyro program's global posterior is saved as its arrays only "
                                 f"({run.method}-global.npz; the .pt file of bnpfed.load_global holds networks)")
            return result
        method, model = global_model(settings, identity.input_shape, identity.num_classes, result.arrays)
        deterministic = run.method in ("pfnm", "fedavg") or run.federated
        predictive = None if deterministic else {   # the clients' draws of the last evaluation
            "samples": run.predictive_samples, "seed": derive_seed(run.seed, Stream.PREDICT, run.rounds)}
        save_global(out / f"{run.method}-global.pt", model, method=method, predictive=predictive,
                    notes=[f"Flower run, {run.rounds} round(s)"], inputs=identity.preprocessing(run.dataset))
    return result


def run_warnings(method: str, history: Sequence[Mapping[str, Any]]) -> list[str]:
    """What a run says, as the commands do (:func:`~bnpfed.metrics.chance_warning`): the global model after the last
    evaluated round at chance on the clients' test shards (their labels' largest class share, which they report)."""
    last = next((r for r in reversed(history) if "accuracy" in r and "chance" in r), None)
    if last is None:
        return []
    message = chance_warning(method, float(last["accuracy"]), float(last["chance"]))
    return [] if message is None else [message]


def global_model(settings: FlowerSettings, input_shape, num_classes: int, arrays: Mapping[str, np.ndarray]):
    """``(method, model)``: the global model of a run's final arrays, as the in-process federation holds it: PFNM's
    network, or posterior fusion's Bayesian client (weight-wise: of the shared initial network; matched: at the
    matched widths), for :func:`bnpfed.saved.save_global` (``bnpfed.load_global``, ``bnpfed evaluate``)."""
    run = settings.run
    template = initial_network(settings.network, input_shape, num_classes, seed=run.seed)
    if run.federated:
        return run.method, federated_method(run.method).global_network(tensors_from_arrays(arrays), template)
    if run.method in ("pfnm", "fedavg"):
        arrays, heads = split_heads(arrays)   # PFNM with pooled heads: they replace the output layer
        net = network_from_state(template, {k: torch.as_tensor(v) for k, v in arrays.items()})
        if heads is None:
            return run.method, net
        (weight,) = derive_spec(template, input_shape).params_of_kind("output_weight")
        return f"{run.method}-pooled", attach_heads(net, weight.rpartition(".")[0], heads["weight"], heads["bias"],
                                                    heads["pool_weights"], float(heads["temperature"]))
    if settings.fusion.align == "match" and not settings.secure.secure_aggregation:
        arrays, heads = split_heads(arrays)   # matched fusion with pooled heads: the clients' posterior heads
        arrays, temperature = split_temperature(arrays)   # or the fused predictive's temperature
        spec = derive_spec(template, input_shape)
        locs, variances = matched_posterior_from_arrays(arrays, spec, template.state_dict())
        if heads is not None:
            (weight,) = spec.params_of_kind("output_weight")
            return (f"match-{settings.fusion.rule}-pooled",
                    PooledPosterior.of_heads(template, locs, variances, weight.rpartition(".")[0], heads))
        client = client_from_slice(template, locs, variances, settings.bayesian, as_prior=False)
        return f"match-{settings.fusion.rule}", client if temperature is None else tempered(client, temperature)
    # weight-wise layout, at the widths of the global (a matched network's after SecAgg+'s matching round)
    posterior, deterministic = posterior_from_arrays(arrays, {k: v.shape for k, v in arrays.items()})
    method = f"match-{settings.fusion.rule}" if settings.fusion.align == "match" else settings.fusion.rule
    return method, client_at_widths(template, posterior, deterministic, settings.bayesian)


def make_server_app(defaults: Optional[Mapping[str, Any]] = None,
                    on_result: Optional[Callable[[FederationResult], None]] = None,
                    on_error: Optional[Callable[[Exception], None]] = None) -> ServerApp:
    """A ``ServerApp`` whose ``main`` calls :func:`run_federation` with ``defaults`` overridden by the run config
    (under ``run_simulation`` the run config is empty, so ``defaults`` is how a script sets things), then
    ``on_result(result)`` if given. With ``on_error``, a run that cannot go on (``RuntimeError``: too few SuperNodes
    in time, too few usable replies) or a bad run config (``ValueError``) is handed to it instead of raised, so that
    a caller can say it in one line rather than under Flower's traceback."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            result = run_federation(grid, {**(defaults or {}), **context.run_config})
        except (RuntimeError, ValueError) as error:
            if on_error is None:
                raise
            on_error(error)
            return
        if on_result is not None:
            on_result(result)

    return server_app


#: The ServerApp a SuperLink runs (``bnpfed.flower.server:app``).
app = make_server_app()

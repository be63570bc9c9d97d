"""Federated methods by name, and the in-process federation that runs any of them round by round.

:func:`register_federated_method` makes a :class:`~bnpfed.federated.protocol.FederatedMethod` available under a name:

* in process, :class:`MethodFederation` (``method="<name>"``) runs it with :class:`~bnpfed.federated.federation.
  Federation`'s round loop: client sampling, seeding, evaluation of the global network on the test split;
* :func:`~bnpfed.federated.run_experiment` and the commands' ``--methods`` take the name (it is registered as an
  experiment method, :func:`~bnpfed.federated.register_method`): one row, ``rounds`` rounds from the shared
  initialisation, clients sampled and weighted as FedAvg's (``FusionConfig.fraction``, ``FusionConfig.weights``);
* on Flower, ``method = "<name>"`` in the run config (with ``plugins = "<module>"`` when a plugin registers it) runs
  it with one generic strategy (:class:`bnpfed.flower.method_strategy.MethodStrategy`); the global model is the
  in-process one, bit for bit.

Usage::

    >>> from bnpfed.data import load_dataset
    >>> from bnpfed.federated import NetworkConfig, PartitionConfig, TrainingConfig, train_network
    >>> from bnpfed.federated.protocol import ClientUpdate, FederatedMethod, ServerUpdate
    >>> class Averaging(FederatedMethod):         # FedAvg, as a method of the protocol
    ...     def client_step(self, task):
    ...         net = train_network(task.network, task.x, task.y, task.training, seed=task.seed,
    ...                             round=task.round, client=task.client)
    ...         return ClientUpdate(dict(net.state_dict()))
    ...     def server_step(self, task):
    ...         return ServerUpdate({k: sum(b * u[k] for b, u in zip(task.weights, task.updates)) for k in task.state})
    >>> _ = register_federated_method("averaging", Averaging())
    >>> ds = load_dataset("digits")
    >>> parts = PartitionConfig(clients=3).split(ds.y_train.numpy(), seed=0)
    >>> federation = MethodFederation(ds, parts, method="averaging", network=NetworkConfig(hidden=(16,)),
    ...                               training=TrainingConfig(epochs=1), seed=0)
    >>> record = federation.run_round()
    >>> record.sampled, record.metrics["accuracy"] > 0.5
    ([0, 1, 2], True)
    >>> _ = unregister_federated_method("averaging")
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import Tensor, nn

from bnpfed.data import Dataset
from bnpfed.federated.clients import initial_network
from bnpfed.federated.config import CLIENT_WEIGHTS, NetworkConfig, TrainingConfig
from bnpfed.federated.experiment import network_widths
from bnpfed.federated.federation import Federation
from bnpfed.federated.protocol import (FederatedMethod, client_metrics, client_step, initial_global_state,
                                       server_step)
from bnpfed.federated.registry import register_method, unregister_method
from bnpfed.federated.results import MethodResult
from bnpfed.federated.server import client_weights
from bnpfed.metrics import count_parameters
from bnpfed.validation import check_choice

__all__ = ["MethodFederation", "available_federated_methods", "federated_method", "register_federated_method",
           "unregister_federated_method"]

_FEDERATED: dict[str, FederatedMethod] = {}


def register_federated_method(name: str, method: FederatedMethod, *, overwrite: bool = False) -> FederatedMethod:
    """Make ``method`` the federated method ``name``: :class:`MethodFederation`'s ``method``, a method of
    :func:`~bnpfed.federated.run_experiment` and the commands' ``--methods``, and Flower's ``method`` key.

    :param str name: its name (no commas, no spaces at its ends; not a method or fusion rule's name already).
    :param FederatedMethod method: the method (an instance).
    :param bool overwrite: replace what is registered under ``name``; default False raises instead.
    :returns: ``method``.
    """
    if not isinstance(name, str) or not name.strip() or name != name.strip() or "," in name:
        raise ValueError(f"name: expected a non-empty method name without commas or spaces at its ends, got {name!r}")
    if not isinstance(method, FederatedMethod):
        raise ValueError(f"method: expected a bnpfed.federated.FederatedMethod (an instance), got "
                         f"{type(method).__name__}")
    register_method(name, lambda experiment: _row(experiment, name), overwrite=overwrite)
    _FEDERATED[name] = method
    return method


def unregister_federated_method(name: str) -> FederatedMethod:
    """Remove the federated method ``name`` (and its experiment method) and return it."""
    if name not in _FEDERATED:
        raise ValueError(f"name: expected a registered federated method, got {name!r} (registered: "
                         f"{available_federated_methods()})")
    unregister_method(name)
    return _FEDERATED.pop(name)


def available_federated_methods() -> list[str]:
    """The registered federated methods' names, in registration order."""
    return list(_FEDERATED)


def federated_method(name: str) -> FederatedMethod:
    """The federated method registered as ``name``.

    :raises ValueError: ``"method: expected one of [...], got ..."``.
    """
    if not isinstance(name, str) or name not in _FEDERATED:
        raise ValueError(f"method: expected a registered federated method, one of {available_federated_methods()} "
                         f"(a plugin registers more: --plugin MODULE, the run config's plugins), got {name!r}")
    return _FEDERATED[name]


class MethodFederation(Federation):
    """J clients and a server running a registered federated method (:mod:`bnpfed.federated.protocol`), round by
    round, from the shared initial network.

    :param Dataset dataset: train split (partitioned) and test split (evaluation).
    :param parts: J index arrays into ``dataset.y_train``.
    :param str method: a name of :func:`available_federated_methods`.
    :param NetworkConfig network: the architecture; its shared initialisation (``(seed, INIT)``) is the initial
        global network.
    :param TrainingConfig training: the clients' local training settings (the method says which it reads).
    :param int seed: the experiment's seed.
    :param str weights: the clients' weights ``b_k`` the server step gets, ``"size"`` or ``"uniform"``. Default
        ``"size"``.
    :param float fraction: share of the clients sampled per round. Default 1.
    :param int ece_bins: bins of the calibration error. Default 15.

    Attributes: ``federated`` (the :class:`~bnpfed.federated.protocol.FederatedMethod`), ``template`` (the shared
    initial network), ``global_state``, ``server_state``, ``client_states`` (client -> what it keeps), ``round``,
    ``history``.
    """

    def __init__(self, dataset: Dataset, parts: Sequence, *, method: str, network: NetworkConfig,
                 training: TrainingConfig, seed: int, weights: str = "size", fraction: float = 1.0,
                 ece_bins: int = 15):
        super().__init__(dataset, parts, seed=seed, fraction=fraction, ece_bins=ece_bins)
        self.federated = federated_method(method)
        self.method = method
        for label, value, kind in (("network", network, NetworkConfig), ("training", training, TrainingConfig)):
            if not isinstance(value, kind):
                raise ValueError(f"{label}: expected a {kind.__name__}, got {type(value).__name__}")
        training.check_inputs(dataset.input_shape)
        self.weights = check_choice(weights, CLIENT_WEIGHTS, "weights")
        self.training = training
        self.template = initial_network(network, dataset.input_shape, dataset.num_classes, seed=seed)
        self.global_state: dict[str, Tensor] = initial_global_state(self.federated, self.template)
        self.server_state: dict[str, Tensor] = {}
        self.client_states: dict[int, dict[str, Tensor]] = {}
        self._net = self.federated.global_network(self.global_state, self.template)

    def _round(self, round, sampled):
        updates, metrics = [], []
        for j in sampled:
            x, y = self.client_data[j]
            out = client_step(self.federated, self.template, self.global_state, x, y, self.training, seed=self.seed,
                              round=round, client=j, client_state=self.client_states.get(j))
            self.client_states[j] = out.client_state
            updates.append(out.update)
            metrics.append(out.metrics)
        sizes = [self.sizes[j] for j in sampled]
        weights = client_weights(sizes, self.weights)
        start = time.perf_counter()
        result = server_step(self.federated, self.global_state, self.server_state, updates, weights, sizes, sampled,
                             seed=self.seed, round=round)
        seconds = time.perf_counter() - start
        self.global_state, self.server_state = result.state, result.server_state
        self._net = self.federated.global_network(self.global_state, self.template)
        return weights, {**client_metrics(metrics), **result.metrics, "parameters": count_parameters(self._net),
                         "server_seconds": seconds}

    def global_network(self) -> nn.Module:
        """The global network after the last round."""
        return self._net

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        return self._net.eval()(x).softmax(-1)


def _row(experiment, name: str) -> MethodResult:
    """The experiment runner of the federated method ``name``: :class:`MethodFederation` for ``rounds`` rounds on
    the experiment's partition, clients sampled and weighted as FedAvg's."""
    federation = MethodFederation(experiment.dataset, experiment.parts, method=name, network=experiment.network,
                                  training=experiment.training, seed=experiment.seed,
                                  weights=experiment.fusion.weights, fraction=experiment.fusion.fraction,
                                  ece_bins=experiment.config.ece_bins)
    row = experiment.federation_row(federation, experiment.config.rounds,
                                    note=f"federated method {type(federation.federated).__name__}, shared init")
    net = federation.global_network()
    experiment.keep(name, net)
    row.hidden, row.parameters = network_widths(net, experiment.input_shape), count_parameters(net)
    return row

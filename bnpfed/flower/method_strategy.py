"""Any registered federated method (:mod:`bnpfed.federated.protocol`) as one Flower strategy: the rounds of
:class:`~bnpfed.federated.MethodFederation`, bit for bit.

Every round each sampled client gets the global state (an ``ArrayRecord``, entry by entry) and the method's name
(``federated-method`` in the message's config); the ClientApp runs the method's client step
(:func:`~bnpfed.federated.client_step`, :func:`bnpfed.flower.client_steps.train`), keeps what the step keeps in its
node's ``context.state``, and replies with the update, its example count and its metrics. The strategy checks every
reply at the boundary (the update's entries, shapes and dtypes as the method expects them, finite values; a bad one
is dropped with its reason) and runs the server step (:func:`~bnpfed.federated.server_step`) on the accepted ones in
partition order with their weights ``b_k`` (``FusionConfig.weights``); what the server step keeps stays in the
strategy between rounds. Evaluation: the clients score the global network (the method's
:meth:`~bnpfed.federated.FederatedMethod.global_network` of the state) on their test shards.

The run config: ``method = "<name>"`` (and ``plugins = "<module>"`` when a plugin registers it); the network, the
local training, ``fraction`` and ``weights`` are FedAvg's keys.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from bnpfed.federated import (FusionConfig, NetworkConfig, client_metrics, client_weights, federated_method,
                              initial_global_state, initial_network, server_step)
from bnpfed.flower.records import (METHOD_KEY, NodeIdentity, from_array_record, read_finite, tensors_from_arrays,
                                   to_array_record)
from bnpfed.flower.strategies import Accepted, _RoundStrategy
from bnpfed.metrics import count_parameters

__all__ = ["METHOD_KEY", "MethodStrategy"]


class MethodStrategy(_RoundStrategy):
    """A registered federated method as a Flower strategy.

    Usage (``grid`` is any Flower ``Grid``; :func:`bnpfed.flower.server.run_federation` builds this for ``method =
    "<name>"``)::

        strategy = MethodStrategy("fedpa", FusionConfig(), seed=0, network=NetworkConfig(hidden=(32,)))
        strategy.connect(grid)
        result = strategy.start(grid, strategy.initial_arrays(), num_rounds=3)

    :param str method: a registered federated method's name (:func:`~bnpfed.federated.available_federated_methods`).
    :param FusionConfig fusion: its ``fraction`` (the share of clients a round trains) and ``weights`` (the clients'
        weights ``b_k`` the server step gets).
    :param int seed: the experiment's seed (client sampling, the shared initial network, every step's stream).
    :param NetworkConfig network: the clients' architecture (default an MLP of ``NetworkConfig()``).
    :param kwargs: as for :class:`~bnpfed.flower.strategies.PFNMStrategy`.

    Attributes: ``federated`` (the method), ``global_state`` and ``server_state`` (after each round), ``history``.
    """

    task = METHOD_KEY

    def __init__(self, method: str, fusion: FusionConfig, *, seed: int, network: Optional[NetworkConfig] = None,
                 **kwargs: Any):
        self.federated = federated_method(method)
        if not isinstance(fusion, FusionConfig):
            raise ValueError(f"fusion: expected a FusionConfig, got {type(fusion).__name__}")
        network = NetworkConfig() if network is None else network
        if not isinstance(network, NetworkConfig):
            raise ValueError(f"network: expected a NetworkConfig, got {type(network).__name__}")
        client_config = {**dict(kwargs.pop("client_config", None) or {}), METHOD_KEY: method}
        super().__init__(seed=seed, fraction=fusion.fraction, client_config=client_config, **kwargs)
        self.method, self.fusion, self.network = method, fusion, network
        self.template = None
        self.global_state: Optional[dict] = None
        self.server_state: dict = {}

    def connect(self, grid: Grid) -> NodeIdentity:
        """As :meth:`~bnpfed.flower.strategies._RoundStrategy.connect`, then the shared initial network for the
        nodes' data (the template of the global network)."""
        identity = super().connect(grid)
        if self.template is None:
            self.template = initial_network(self.network, identity.input_shape, identity.num_classes, seed=self.seed)
        return identity

    def _train_content(self, server_round, j, arrays):
        if self.global_state is None:
            if len(arrays) == 0:
                raise ValueError("initial_arrays: expected the method's initial global state "
                                 "(bnpfed.flower.server.run_federation sends it), got no arrays")
            self.global_state = tensors_from_arrays(from_array_record(arrays), label="initial_arrays")
        return to_array_record(self.global_state)

    def _parse_train(self, reply):
        arrays, metrics, j, n = self._identity_and_count(reply)
        update = tensors_from_arrays(arrays, self.federated.expected_update(self.global_state), "update")
        own = {k: read_finite(metrics, k) for k in metrics if k != "num-examples"}
        return Accepted(j, n, update, own)

    def _aggregate(self, server_round, accepted):
        sizes = [a.num_examples for a in accepted]
        weights = client_weights(sizes, self.fusion.weights)
        start = time.perf_counter()
        result = server_step(self.federated, self.global_state, self.server_state, [a.payload for a in accepted],
                             weights, sizes, [a.partition_id for a in accepted], seed=self.seed, round=server_round)
        seconds = time.perf_counter() - start
        self.global_state, self.server_state = result.state, result.server_state
        net = self.federated.global_network(self.global_state, self.template)
        summary = {"weights": weights, **client_metrics([a.metrics for a in accepted]), **result.metrics,
                   "parameters": count_parameters(net), "server_seconds": seconds}
        return to_array_record(self.global_state), summary

    def initial_arrays(self) -> ArrayRecord:
        """The global state before round 1 (after :meth:`connect`), as ``Strategy.start`` takes it."""
        return to_array_record(initial_global_state(self.federated, self.template))

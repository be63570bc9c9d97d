"""PFNM, posterior fusion and matched posterior fusion as Flower strategies (the Message API of Flower 1.42).

A strategy has one method per phase of a round: ``configure_train`` (which clients, what each gets),
``aggregate_train`` (check the replies, then call the server step), ``configure_evaluate`` / ``aggregate_evaluate``
(clients score the global model on their test shards). ``Strategy.start(grid, initial_arrays, num_rounds,
timeout)`` runs the rounds. No server math lives here: :class:`PFNMStrategy` calls
:func:`~bnpfed.federated.server.pfnm_step` and :func:`~bnpfed.federated.server.client_start`,
:class:`PosteriorFusionStrategy` calls :func:`~bnpfed.federated.server.fuse_posteriors`,
:class:`MatchedFusionStrategy` (run config ``method = "fusion"`` with ``align = "match"``) calls
:func:`~bnpfed.federated.server.matched_fusion_step`, and all sample with
:func:`~bnpfed.federated.server.sample_clients` -- the functions :class:`~bnpfed.federated.pfnm.PFNMFederation`,
:class:`~bnpfed.federated.fusion.FusionFederation` and
:class:`~bnpfed.federated.matched_fusion.MatchedFusionFederation` call, with the same arguments, so the global models
are the same bit for bit.

Clients are *partitions*: client j is the SuperNode started with ``partition-id=j`` (a simulation numbers its
nodes). Flower's node ids are random, so before round 1 the strategy asks every node for its identity (a
``query`` message: partition id, number of partitions J, input shape, number of classes) and asks again whenever
nodes it does not know connect. A round samples partition ids, exactly as the in-process run samples client
indices, and sends each sampled partition's message to the node holding it; a sampled partition whose node is not
connected is missing.

Faults are handled at the boundary, per client:

* a reply that is an error (the ClientApp raised, the node went away), or whose content is malformed (wrong keys or
  shapes, NaN / inf, a variance <= 0, a bad count, another partition id than the one it was sent as; see
  :mod:`bnpfed.flower.records`) is dropped and logged with its reason on the ``flwr.bnpfed`` logger; the round goes
  on with the other clients;
* a client that does not answer within ``timeout`` seconds of ``Strategy.start`` is logged as missing and the round
  goes on without it (Flower's grid returns the replies it has at the deadline);
* SuperNodes are awaited for at most ``node_timeout`` seconds before round 1 (Flower's own sampling waits forever);
  a node whose identity disagrees with the others' (another J, input shape or class count, a partition id another
  node holds) is refused, with its reason logged;
* a round with fewer than ``min_replies`` usable replies stops the run with a ``RuntimeError`` that names every
  rejected and missing client.

Every round is recorded in :attr:`history`: the partitions sampled, those aggregated, the rejected ones with their
reasons, the missing ones, the method's own numbers (PFNM and matched fusion: the global hidden widths; fusion: the
client weights, the floored variances) and the evaluation.
"""

from __future__ import annotations

import logging
import math
import time
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from bnpfed.federated import bayesian_client
from bnpfed.federated import BayesianConfig, FusionConfig, NetworkConfig, PFNMConfig
from bnpfed.federated import pvi_factors, pvi_prior_variance
from bnpfed.federated import Architecture, HoldsRounds, MatchRounds
from bnpfed.federated import (average_states, batch_norm_steps, clients_per_round, fuse_posteriors, matched_fusion_step,
                              mean_sigma, pfnm_step, sample_clients, with_statistics)
from bnpfed.matching import width
from bnpfed.matching import client_posterior
from bnpfed.flower.records import (
    ARRAYS,
    CLIENT,
    CONFIG,
    ECE_BINS,
    METRICS,
    NodeIdentity,
    ReplyError,
    array_shapes,
    from_array_record,
    matched_posterior_from_arrays,
    matched_posterior_to_record,
    moments_from_arrays,
    posterior_from_arrays,
    posterior_to_record,
    read_activity,
    read_class_counts,
    read_count,
    read_finite,
    read_gaps,
    read_identity,
    read_partition_id,
    reply_parts,
    state_from_arrays,
    state_to_record,
    with_cavity,
    with_heads,
    with_temperature,
    POOL_NLL,
    TEST_CLASS_COUNTS,
)
from bnpfed.federated import FIT
from bnpfed.matching import TEMPERATURES, fit_temperature
from bnpfed.matching import PooledPosterior
from bnpfed.matching import pooled_heads_of
from bnpfed.metrics import chance_accuracy, ece_from_gaps
from bnpfed.seeding import Stream
from bnpfed.validation import check_fraction, check_int, check_positive

__all__ = ["LOGGER", "Accepted", "FedAvgStrategy", "MatchedFusionStrategy", "PFNMStrategy", "PosteriorFusionStrategy",
           "evaluation_clients", "unexpected_reply"]

#: The scores of a regression's evaluation reply, each a mean over the shard.
REGRESSION_SCORES = ("squared-error", "nll", "coverage", "interval-width")

#: Where rejections, missing clients and round summaries are logged: a child of Flower's logger, so the lines show
#: up in the ServerApp's console and in ``flwr log``.
LOGGER = logging.getLogger("flwr.bnpfed")


def evaluation_clients(num_clients: int, fraction: float, *, seed: int, round: int) -> list[int]:
    """The sorted clients that score the global model after round ``round``: all of them at ``fraction`` 1, none at
    0, else :func:`~bnpfed.federated.server.clients_per_round` of them drawn without replacement from the stream
    ``(seed, EVALUATION, round)`` (as :func:`~bnpfed.federated.server.sample_clients` draws from ``SAMPLING``).

    >>> evaluation_clients(10, 0.3, seed=0, round=1)      # round 1 trains sample_clients(...): [4, 8, 9]
    [1, 3, 6]
    """
    check_fraction(fraction, "fraction_evaluate", allow_zero=True)
    if fraction == 0:
        return []
    return sample_clients(num_clients, fraction, seed=seed, round=round, stream=Stream.EVALUATION)


def unexpected_reply(reply: Message, message_type: str, sent: Mapping[int, int], *, duplicate: bool) -> str:
    """Why a reply is ignored, in words: a second reply of a node, or one whose source is no node the round sent a
    message to (Flower's own error reply for a message it could not deliver carries no SuperNode's id: it is named
    with the nodes that were sent to, and its error)."""
    node = reply.metadata.src_node_id
    error = f" (error code {reply.error.code}: {reply.error.reason})" if reply.has_error() else ""
    if duplicate:
        return f"a second {message_type} reply from node {node} (partition {sent[node]}) ignored{error}"
    nodes = ", ".join(map(str, sorted(sent))) or "none"
    return (f"a {message_type} reply from node id {node}, to which this round sent no {message_type} message "
            f"(sent to nodes {nodes}), ignored{error}")


def _network(network: Optional[NetworkConfig]) -> NetworkConfig:
    """A strategy's ``network`` argument: the clients' architecture (default an MLP of ``NetworkConfig()``)."""
    network = NetworkConfig() if network is None else network
    if not isinstance(network, NetworkConfig):
        raise ValueError(f"network: expected a NetworkConfig, got {type(network).__name__}")
    return network


@dataclass
class Accepted:
    """One usable reply: which client sent it and what it carried, parsed (what a strategy's ``_parse_train``
    returns)."""

    partition_id: int
    num_examples: int
    payload: Any
    metrics: Mapping[str, Any]


class _RoundStrategy(Strategy):
    """What both strategies share: the node <-> partition map, partition sampling, per-client reply checking, the
    round record, client-side evaluation. Subclasses say what a client gets (``_train_content``) and what its reply
    must carry (``_parse_train``), and aggregate (``_aggregate``)."""

    task = ""

    def __init__(self, *, seed: int, fraction: float = 1.0, fraction_evaluate: float = 1.0, min_nodes: int = 0,
                 min_replies: int = 1, node_timeout: float = 120.0, query_timeout: float = 600.0,
                 client_config: Optional[Mapping[str, Any]] = None):
        self.seed = check_int(seed, "seed", low=0)
        self.fraction = check_fraction(fraction, "fraction")
        self.fraction_evaluate = check_fraction(fraction_evaluate, "fraction_evaluate", allow_zero=True)
        self.min_nodes = check_int(min_nodes, "min_nodes", low=0)
        self.min_replies = check_int(min_replies, "min_replies", low=1)
        self.node_timeout = check_positive(node_timeout, "node_timeout")
        self.query_timeout = check_positive(query_timeout, "query_timeout")
        self.client_config = dict(client_config or {})
        #: ``{partition id: node id}`` of the connected SuperNodes that answered the query.
        self.nodes: dict[int, int] = {}
        #: J, the input shape and the number of classes every node reported (None before :meth:`connect`).
        self.identity: Optional[NodeIdentity] = None
        #: ``{node id: reason}`` of the nodes refused (their identity disagreed, or they answered the query with an
        #: error); not asked again.
        self.refused: dict[int, str] = {}
        #: ``{node id: partition}`` of the nodes the SuperLink said are gone (an error reply ``NODE_UNAVAILABLE``:
        #: no heartbeat; -1 for one gone before it told its partition): no message is sent to them again (their
        #: partitions count as unconnected), so a round's evaluation does not wait out its timeout for a node its
        #: training already found gone.
        self.gone: dict[int, int] = {}
        #: One dict per finished round (see the module docstring).
        self.history: list[dict[str, Any]] = []
        self._sent: dict[tuple[int, str], dict[int, int]] = {}  # (round, type) -> {node: partition}
        self._pushed: dict[tuple[int, str], list[Message]] = {}  # (round, type) -> the messages sent
        self._unconnected: dict[tuple[int, str], list[int]] = {}  # (round, type) -> sampled partitions without node

    # ------------------------------------------------------------------------------------------------ nodes

    @property
    def num_partitions(self) -> int:
        if self.identity is None:
            raise RuntimeError("no SuperNode has told its partition yet: call connect(grid) first")
        return self.identity.num_partitions

    def _query(self, grid: Grid, nodes: Sequence[int]) -> None:
        """Ask ``nodes`` who they are; map those whose answer agrees with what is known."""
        config = ConfigRecord({**self.client_config, "task": self.task})
        messages = [Message(content=RecordDict({CONFIG: config}), dst_node_id=node, message_type=MessageType.QUERY,
                            group_id="query") for node in nodes]
        for reply in sorted(grid.send_and_receive(messages, timeout=self.query_timeout),
                            key=lambda m: self.sender(m, messages)):
            node = self.sender(reply, messages)
            try:
                if reply.has_error():
                    if reply.error.code == ErrorCode.NODE_UNAVAILABLE:
                        self.gone[node] = -1   # gone before it told its partition
                    raise ReplyError(f"error reply (code {reply.error.code}): {reply.error.reason}")
                identity = read_identity(reply)
                known = self.identity
                if known is not None:
                    for what, mine, theirs in (("num-partitions", known.num_partitions, identity.num_partitions),
                                               ("input-shape", known.input_shape, identity.input_shape),
                                               ("num-classes", known.num_classes, identity.num_classes),
                                               ("input-mean", known.mean, identity.mean),
                                               ("input-std", known.std, identity.std)):
                        if mine != theirs:
                            raise ReplyError(f"{what!r}: expected {mine}, that of the other nodes, got {theirs}")
                holder = self.nodes.get(identity.partition_id)
                if holder is not None and holder != node:
                    raise ReplyError(f"'partition-id': expected a partition no other node holds, got "
                                     f"{identity.partition_id}, held by node {holder} already")
            except ReplyError as error:
                self.refused[node] = str(error)
                LOGGER.warning("node %d refused: %s", node, error)
                continue
            if self.identity is None:
                self.identity = identity
            self.nodes[identity.partition_id] = node
        LOGGER.info("partitions of the connected nodes: %s", dict(sorted(self.nodes.items())))

    def refresh(self, grid: Grid) -> None:
        """Forget nodes that went away; ask the nodes that are new (or never answered) for their identity."""
        connected = set(grid.get_node_ids()) - set(self.gone)
        self.nodes = {j: n for j, n in self.nodes.items() if n in connected}
        new = sorted(connected - set(self.nodes.values()) - set(self.refused))
        if new:
            self._query(grid, new)

    def connect(self, grid: Grid) -> NodeIdentity:
        """Wait (at most ``node_timeout`` seconds) until ``min_nodes`` SuperNodes (0: all J) have told their
        partition; return what they hold in common (J, input shape, classes).

        :raises RuntimeError: if they do not connect in time.
        :raises ValueError: if ``min_nodes`` exceeds J, or ``min_replies`` the clients a round trains.
        """
        deadline = time.monotonic() + self.node_timeout
        while True:
            self.refresh(grid)
            if self.identity is not None:
                if self.min_nodes > self.num_partitions:
                    raise ValueError(f"min-nodes: expected at most the {self.num_partitions} partitions of the "
                                     f"SuperNodes (num-partitions), got {self.min_nodes}")
                per_round = clients_per_round(self.num_partitions, self.fraction)
                if self.min_replies > per_round:
                    raise ValueError(f"min-replies: expected at most the {per_round} clients a round trains "
                                     f"(fraction {self.fraction} of {self.num_partitions}), got {self.min_replies}")
                need = self.min_nodes or self.num_partitions
                if len(self.nodes) >= need:
                    return self.identity
            else:
                need = max(self.min_nodes, 1)
            if time.monotonic() >= deadline:
                raise RuntimeError(f"waited {self.node_timeout:.0f} s for {need} SuperNode(s) with a partition, "
                                   f"{len(self.nodes)} connected (partitions {sorted(self.nodes)}); start more "
                                   f"SuperNodes or lower min-nodes"
                                   + (f"; refused: {self.refused}" if self.refused else ""))
            LOGGER.info("waiting for SuperNodes: %d of %d with a partition", len(self.nodes), need)
            time.sleep(1.0)

    def _messages(self, server_round: int, message_type: str, partitions: Sequence[int],
                  content) -> list[Message]:
        """One message per partition in ``partitions`` that has a node (``content(j) -> (arrays, extra config)``);
        the others are recorded as unconnected."""
        sent, unconnected, messages = {}, [], []
        for j in partitions:
            node = self.nodes.get(j)
            if node is None:
                unconnected.append(j)
                continue
            arrays, extra = content(j)
            config = ConfigRecord({**self.client_config, **extra, "task": self.task, "server-round": server_round})
            messages.append(Message(content=RecordDict({ARRAYS: arrays, CONFIG: config}), dst_node_id=node,
                                    message_type=message_type, group_id=str(server_round)))
            sent[node] = j
        if unconnected:
            LOGGER.warning("round %d: partition(s) %s sampled for %s but no connected node holds them", server_round,
                           unconnected, message_type)
        self._sent[(server_round, message_type)] = sent
        self._pushed[(server_round, message_type)] = messages
        self._unconnected[(server_round, message_type)] = unconnected
        return messages

    def sender(self, reply: Message, messages: Iterable[Message]) -> int:
        """The node a reply speaks for: its sender, or, for the SuperLink's own error reply about a message it could
        not deliver (``NODE_UNAVAILABLE``: sent from the SuperLink, naming the message it answers), that message's
        destination (``messages``: those sent, their ids set by the grid when it pushed them)."""
        if reply.metadata.src_node_id != SUPERLINK_NODE_ID:
            return reply.metadata.src_node_id
        for message in messages:
            if message.metadata.message_id and message.metadata.message_id == reply.metadata.reply_to_message_id:
                return message.metadata.dst_node_id
        return reply.metadata.src_node_id

    # ------------------------------------------------------------------------------------------------ replies

    def _accept(self, server_round: int, replies: Iterable[Message], message_type: str, parse
                ) -> tuple[list[Accepted], dict[int, str], list[int]]:
        """Parse every reply; drop (and log) errors and malformed replies; log the clients that never answered.
        Returns the accepted replies sorted by partition id (the order of the in-process run), the rejected
        ``{partition: reason}`` and the missing partitions."""
        sent = self._sent.get((server_round, message_type), {})
        accepted: dict[int, Accepted] = {}
        rejected: dict[int, str] = {}
        pushed = self._pushed.get((server_round, message_type), [])
        for reply in replies:
            node = self.sender(reply, pushed)
            j = sent.get(node)
            if j is None or j in accepted or j in rejected:
                LOGGER.warning("round %d: %s", server_round, unexpected_reply(reply, message_type, sent,
                                                                             duplicate=j is not None))
                continue
            if reply.has_error():
                rejected[j] = f"error reply (code {reply.error.code}): {reply.error.reason}"
                if reply.error.code == ErrorCode.NODE_UNAVAILABLE:   # the SuperLink's word: no heartbeat from it
                    self.gone[node] = j
                    if self.nodes.get(j) == node:
                        del self.nodes[j]
                    LOGGER.warning("round %d: node %d (client %d) is gone (%s); no message is sent to it again",
                                   server_round, node, j, reply.error.reason)
            else:
                try:
                    item = parse(reply)
                    if item.partition_id != j:
                        raise ReplyError(f"'partition-id': expected {j}, the partition the message was sent to, "
                                         f"got {item.partition_id}")
                    accepted[j] = item
                    continue
                except ReplyError as error:
                    rejected[j] = str(error)
            LOGGER.warning("round %d: %s reply of client %d (node %d) rejected: %s", server_round, message_type, j,
                           node, rejected[j])
        silent = sorted(j for j in sent.values() if j not in accepted and j not in rejected)
        if silent:
            LOGGER.warning("round %d: no %s reply from client(s) %s before the deadline; going on without them",
                           server_round, message_type, silent)
        missing = sorted(self._unconnected.get((server_round, message_type), []) + silent)
        return [accepted[j] for j in sorted(accepted)], rejected, missing

    # ------------------------------------------------------------------------------------------------ training

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        """Sample this round's partitions (:func:`~bnpfed.federated.server.sample_clients`) and give each node
        holding one its training message (see the subclass)."""
        if self.identity is None:
            self.connect(grid)
        else:
            self.refresh(grid)
        self._grid = grid  # for a step within aggregate_train (PFNM's batch-norm moments)
        sampled = sample_clients(self.num_partitions, self.fraction, seed=self.seed, round=server_round)
        self._sampled = sampled
        LOGGER.info("round %d: training client(s) %s", server_round, sampled)
        extra = dict(config)
        return self._messages(server_round, MessageType.TRAIN, sampled,
                              lambda j: (self._train_content(server_round, j, arrays), extra))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """Check the replies, then aggregate the usable ones (see the subclass)."""
        start = time.perf_counter()
        accepted, rejected, missing = self._accept(server_round, replies, MessageType.TRAIN, self._parse_train)
        if len(accepted) < self.min_replies:
            raise RuntimeError(
                f"round {server_round}: {len(accepted)} usable replies, fewer than min-replies={self.min_replies}; "
                f"rejected: {rejected or 'none'}; missing (no reply before the deadline, or no node): "
                f"{missing or 'none'}")
        arrays, summary = self._aggregate(server_round, accepted)
        record = {"round": server_round, "sampled": list(self._sampled),
                  "clients": [a.partition_id for a in accepted], "num_examples": [a.num_examples for a in accepted],
                  "rejected": rejected, "missing": missing, **summary, "seconds": time.perf_counter() - start}
        self.history.append(record)
        LOGGER.info("round %d: aggregated client(s) %s%s", server_round, record["clients"],
                    "".join(f", {k} {v}" for k, v in summary.items()))
        metrics = MetricRecord({"num-clients": len(accepted), "num-examples": sum(a.num_examples for a in accepted)})
        for key, value in summary.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                metrics[key.replace("_", "-")] = value
            elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                metrics[key.replace("_", "-")] = [type(value[0])(v) for v in value]
        return arrays, metrics

    def _identity_and_count(self, reply: Message) -> tuple[Mapping, MetricRecord, int, int]:
        arrays, metrics, client = reply_parts(reply)
        return arrays, metrics, read_partition_id(client), read_count(metrics)

    @abstractmethod
    def _train_content(self, server_round: int, j: int, arrays: ArrayRecord) -> ArrayRecord:
        """The arrays client ``j`` starts its round from."""

    @abstractmethod
    def _parse_train(self, reply: Message) -> Accepted:
        """A training reply, checked and unpacked."""

    @abstractmethod
    def _aggregate(self, server_round: int, accepted: list[Accepted]) -> tuple[ArrayRecord, dict]:
        """The server step on the accepted replies: the new global arrays and the round's own numbers."""

    # ------------------------------------------------------------------------------------------------ evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                           ) -> Iterable[Message]:
        """Send the global model to the clients of :func:`evaluation_clients` (every one by default)."""
        if self.fraction_evaluate == 0 or len(arrays) == 0 or self.identity is None:
            return []
        self.refresh(grid)   # not the nodes that went away (nor those found gone in training): no wait for them
        chosen = evaluation_clients(self.num_partitions, self.fraction_evaluate, seed=self.seed, round=server_round)
        extra = dict(config)
        return self._messages(server_round, MessageType.EVALUATE, chosen, lambda j: (arrays, extra))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        """Example-weighted means of the clients' ``accuracy``, ``nll`` and ``brier`` on their test shards, and the
        ECE of their union with 100 and 15 bins (``ece``, ``ece15``) from the sums of their per-bin gaps: what the
        in-process federation reports on the whole test split. A regression's: the example-weighted means of the
        shards' squared error (its root: ``rmse``), ``nll``, ``coverage`` and ``interval_width``."""
        def parse(reply: Message) -> Accepted:
            content = reply.content
            missing = [key for key, kind in ((METRICS, content.metric_records), (CLIENT, content.config_records))
                       if key not in kind]
            if missing:
                raise ReplyError(f"evaluation reply: expected its {METRICS!r} and {CLIENT!r} records, got no "
                                 f"{' or '.join(map(repr, missing))} record")
            metrics = content.metric_records[METRICS]
            if "squared-error" in metrics:   # a regression's shard
                scores = {key: read_finite(metrics, key) for key in REGRESSION_SCORES}
                return Accepted(read_partition_id(content.config_records[CLIENT]), read_count(metrics), None, scores)
            scores = {key: read_finite(metrics, key) for key in ("accuracy", "nll", "brier")}
            if TEST_CLASS_COUNTS in metrics:   # the shard's labels per class (none from a client of bnpfed 0.2)
                scores[TEST_CLASS_COUNTS] = read_class_counts(metrics, self.identity.num_classes, TEST_CLASS_COUNTS)
            gaps = {bins: read_gaps(metrics, bins) for bins in ECE_BINS}
            return Accepted(read_partition_id(content.config_records[CLIENT]), read_count(metrics), gaps, scores)

        accepted, _, _ = self._accept(server_round, replies, MessageType.EVALUATE, parse)
        if not accepted:
            return None
        total = sum(a.num_examples for a in accepted)
        out = MetricRecord({"num-examples": total})
        if any(a.payload is None for a in accepted):
            if not all(a.payload is None for a in accepted):
                raise ReplyError("evaluation replies: expected one task's scores, got a regression's and a "
                                 "classification's")
            means = {key: float(sum(a.metrics[key] * a.num_examples for a in accepted) / total)
                     for key in REGRESSION_SCORES}
            scores = {"rmse": math.sqrt(means["squared-error"]), "nll": means["nll"], "coverage": means["coverage"],
                      "interval_width": means["interval-width"]}
            for key, value in scores.items():
                out[key] = value
            if self.history and self.history[-1]["round"] == server_round:
                self.history[-1].update(**scores, test_examples=total, evaluated=[a.partition_id for a in accepted])
            return out
        for key in ("accuracy", "nll", "brier"):
            out[key] = float(sum(a.metrics[key] * a.num_examples for a in accepted) / total)
        for bins, key in zip(ECE_BINS, ("ece", "ece15")):
            out[key] = ece_from_gaps(sum(a.payload[bins] for a in accepted), total)
        if self.history and self.history[-1]["round"] == server_round:
            self.history[-1].update(accuracy=out["accuracy"], nll=out["nll"], brier=out["brier"], ece=out["ece"],
                                    ece15=out["ece15"], test_examples=total,
                                    evaluated=[a.partition_id for a in accepted])
            if all(TEST_CLASS_COUNTS in a.metrics for a in accepted):   # the shards' chance accuracy together
                self.history[-1]["chance"] = chance_accuracy(sum(a.metrics[TEST_CLASS_COUNTS] for a in accepted))
        return out

    def reestimate_statistics(self, server_round: int, state: dict, clients: Sequence[int],
                              batch_norms: Sequence[str]) -> tuple[dict, list[int]]:
        """The batch-norm step, one batch norm at a time, front to back
        (:func:`~bnpfed.federated.server.batch_norm_steps`): for each, the ``clients``' moments of its inputs under
        the global network ``state`` carrying the statistics set so far (a ``query`` with its name), summed in
        partition order. Returns ``state`` with the running statistics set from them, and the partitions whose
        moments were used for every batch norm (none, and ``state``'s statistics stay, for a layer nobody answered
        and those after it)."""
        used = set(clients)

        def moments_of(layer: str, statistics: dict) -> list:
            record = state_to_record(with_statistics(state, statistics))
            channels = {layer: int(state[f"{layer}.running_mean"].shape[0])}

            def parse(reply: Message) -> Accepted:
                arrays, _, j, n = self._identity_and_count(reply)
                return Accepted(j, n, moments_from_arrays(arrays, channels), {})

            messages = self._messages(server_round, MessageType.QUERY, list(clients),
                                      lambda j: (record, {"step": "batch-norm-moments", "layer": layer}))
            replies = self._grid.send_and_receive(messages, timeout=self.query_timeout)
            accepted, rejected, missing = self._accept(server_round, replies, MessageType.QUERY, parse)
            if not accepted:
                LOGGER.warning("round %d: no client sent the moments of batch norm %s (rejected: %s, missing: %s); "
                               "it and the batch norms after it keep their statistics", server_round,
                               layer, rejected or "none", missing or "none")
            used.intersection_update(a.partition_id for a in accepted)
            return [a.payload for a in accepted]

        statistics = batch_norm_steps(list(batch_norms), moments_of)
        return with_statistics(state, statistics), (sorted(used) if statistics else [])

    def pool_temperature(self, server_round: int, value, record: ArrayRecord, heads: dict,
                         clients: Sequence[int]) -> float:
        """The pooled heads' temperature: ``value`` (a number), or with ``"fit"`` the one of least summed NLL over
        ``clients``' replies to a ``query`` (``step`` ``"pool-nll"``) carrying ``record`` with ``heads`` at
        temperature 1, summed in partition order (:func:`~bnpfed.matching.pooled_heads.fit_temperature`; 1 with a
        warning when nobody answers)."""
        if value != FIT:
            return float(value)
        probe = with_heads(ArrayRecord(dict(record.items())),
                           {**heads, "temperature": torch.tensor(1.0, dtype=torch.float64)})
        return self.fitted_temperature(server_round, probe, "pool-nll", clients, "the pooled heads")

    def fitted_temperature(self, server_round: int, probe: ArrayRecord, step: str, clients: Sequence[int],
                           what: str) -> float:
        """The temperature of least summed NLL over ``clients``' replies to a ``query`` (``step``: ``"pool-nll"``,
        ``"posterior-nll"``) carrying ``probe`` at temperature 1, summed in partition order
        (:func:`~bnpfed.matching.pooled_heads.fit_temperature`; 1 with a warning when nobody answers)."""
        def parse(reply: Message) -> Accepted:
            arrays, _, j, n = self._identity_and_count(reply)
            sums = arrays.get(POOL_NLL)
            if sums is None or sums.shape != tuple(TEMPERATURES.shape) or not np.isfinite(sums).all():
                raise ReplyError(f"{POOL_NLL!r}: expected {len(TEMPERATURES)} finite sums, got "
                                 f"{None if sums is None else sums.shape}")
            return Accepted(j, n, torch.from_numpy(np.asarray(sums, dtype=np.float64)), {})

        messages = self._messages(server_round, MessageType.QUERY, list(clients),
                                  lambda j: (probe, {"step": step}))
        replies = self._grid.send_and_receive(messages, timeout=self.query_timeout)
        accepted, rejected, missing = self._accept(server_round, replies, MessageType.QUERY, parse)
        if not accepted:
            LOGGER.warning("round %d: no client scored %s (rejected: %s, missing: %s); the temperature stays 1",
                           server_round, what, rejected or "none", missing or "none")
            return 1.0
        return fit_temperature([a.payload for a in sorted(accepted, key=lambda a: a.partition_id)])

    def summary(self) -> None:
        """Log the strategy's settings."""
        LOGGER.info("%s: fraction %.2f, fraction-evaluate %.2f, min-nodes %s, min-replies %d, node-timeout %.0f s, "
                    "seed %d", type(self).__name__, self.fraction, self.fraction_evaluate,
                    self.min_nodes or "all", self.min_replies, self.node_timeout, self.seed)


class _MatchingStrategy(HoldsRounds, _RoundStrategy):
    """What PFNM and matched fusion share: once the SuperNodes have told their input shape and classes, the clients'
    :class:`~bnpfed.federated.rounds.Architecture` (the template network and its permutation spec, as every client
    builds them) and the server's :class:`~bnpfed.federated.rounds.MatchRounds` (what each client was sent, the last
    match), which the in-process federations hold too."""

    network: NetworkConfig
    rounds: Optional[MatchRounds]
    whole_rounds = False   # every client from the whole global model after round 1 (MatchRounds' whole)

    def connect(self, grid: Grid) -> NodeIdentity:
        """As :meth:`_RoundStrategy.connect`, then the architecture for the nodes' data."""
        identity = super().connect(grid)
        if self.rounds is None:
            self.rounds = MatchRounds(Architecture.of(self.network, identity.input_shape, identity.num_classes,
                                                      seed=self.seed), whole=self.whole_rounds)
        return identity


class PFNMStrategy(_MatchingStrategy):
    """PFNM (Yurochkin et al. 2019) as a Flower strategy, one-shot (one round) or with communication rounds, for any
    architecture of :class:`~bnpfed.federated.config.NetworkConfig`; the rounds of
    :class:`~bnpfed.federated.pfnm.PFNMFederation`.

    Once the SuperNodes have told their input shape and classes, the strategy builds a network of the configured
    architecture and derives its permutation spec, as every client does: networks travel as ``state_dict`` s
    (:mod:`bnpfed.flower.records`) and are checked against it. Round 1: each sampled client trains its own network
    from its own initialisation (an empty ``ArrayRecord`` is sent) and replies with its state and its training
    examples per class. The server matches them (:func:`~bnpfed.federated.server.pfnm_step`, clients in partition
    order) into a global network whose widths the Beta-Bernoulli process decides. With batch norm, the server then
    sends the global network to the clients it matched (a ``query`` message, ``step`` ``"batch-norm-moments"``), each
    replies with the moments of its batch-norm inputs on its data, and the server re-estimates the running statistics
    from their sum (:func:`~bnpfed.federated.server.batch_norm_step`; clients that do not answer are left out, and
    with none the members' mean statistics stay). Round r > 1: each sampled client gets what
    :func:`~bnpfed.federated.server.client_start` gives it -- its slice of the global network if it was matched last
    round, the whole network otherwise -- retrains it, and the server matches again, warm-started from the global ids
    each client was sent (``PFNMConfig.warm_start``); the global widths can change from round to round.

    Usage (``grid`` is any Flower ``Grid``; :func:`bnpfed.flower.server.run_federation` builds this)::

        strategy = PFNMStrategy(PFNMConfig(sigma2=0.3), seed=0, network=NetworkConfig(arch="lenet"))
        strategy.connect(grid)
        result = strategy.start(grid, ArrayRecord(), num_rounds=2, timeout=600)
        strategy.match.widths, strategy.history

    :param PFNMConfig pfnm: matching hyper-parameters, warm start, the share of clients a round trains
        (``layerwise_retrain`` must be 0: FedMA's layer-wise scheme runs in process only).
    :param int seed: the experiment's seed (client sampling, the matcher's sweeps).
    :param NetworkConfig network: the clients' architecture (default an MLP of ``NetworkConfig()``).
    :param kwargs: ``fraction_evaluate`` (1), ``min_nodes`` (0: all J), ``min_replies`` (1), ``node_timeout``
        (120 s), ``query_timeout`` (600 s; also the deadline of the batch-norm step), ``client_config`` (sent to
        every client in every message).

    Attributes: ``match`` (the last :class:`~bnpfed.matching.permutation.SpecMatch`), ``matched`` (the clients
    it matched, in its order), ``spec`` and ``template`` (after :meth:`connect`), ``history``.
    """

    task = "pfnm"

    def __init__(self, pfnm: PFNMConfig, *, seed: int, network: Optional[NetworkConfig] = None, **kwargs: Any):
        if not isinstance(pfnm, PFNMConfig):
            raise ValueError(f"pfnm: expected a PFNMConfig, got {type(pfnm).__name__}")
        if pfnm.layerwise_retrain:
            raise ValueError(f"layerwise-retrain: expected 0 on Flower (FedMA's layer-wise scheme runs in process: "
                             f"bnpfed pfnm --layerwise-retrain), got {pfnm.layerwise_retrain}")
        network = _network(network)
        super().__init__(seed=seed, fraction=pfnm.fraction, **kwargs)
        self.pfnm, self.network = pfnm, network
        self.rounds: Optional[MatchRounds] = None

    def _train_content(self, server_round, j, arrays):
        start = self.rounds.start(j)   # None in round 1: the client starts from its own initialisation
        return ArrayRecord() if start is None else state_to_record(start)

    def _parse_train(self, reply):
        arrays, metrics, j, n = self._identity_and_count(reply)
        state = state_from_arrays(arrays, self.spec, self.template.state_dict(), widths=self.rounds.widths(j))
        counts = read_class_counts(metrics, self.identity.num_classes)
        activity = read_activity(metrics, self.spec.group_names) if self.pfnm.inactive != "keep" else None
        return Accepted(j, n, (state, counts, activity), metrics)

    def _aggregate(self, server_round, accepted):
        clients = [a.partition_id for a in accepted]
        activity = None if self.pfnm.inactive == "keep" else [a.payload[2] for a in accepted]
        counts = np.stack([a.payload[1] for a in accepted])
        # heads="auto": chosen once, by the class counts of round 1's clients (all of them in process)
        self.pfnm = self.pfnm.with_heads(counts)
        match = pfnm_step([a.payload[0] for a in accepted], counts, self.pfnm,
                          seed=self.seed, round=server_round, starts=self.rounds.warm_start(clients), spec=self.spec,
                          template=self.template, activity=activity)
        self.rounds.update(match, clients)
        seconds = match.seconds
        summary = {}
        if self.rounds.architecture.batch_norms:
            start = time.perf_counter()
            summary["statistics_from"] = self._reestimate(server_round)
            seconds += time.perf_counter() - start
        own = self.rounds.summary()   # the hyper-parameters estimated (empirical Bayes, the default) or fixed
        record = state_to_record(match.state)
        if self.pfnm.heads == "pooled":   # the matched clients' own output layers, in the match's order
            heads = pooled_heads_of(match, [a.payload[0] for a in accepted])
            t = self.pool_temperature(server_round, self.pfnm.pool_temperature, record, heads, clients)
            summary["pool_temperature"] = t
            record = with_heads(record, {**heads, "temperature": torch.tensor(t, dtype=torch.float64)})
        return record, {
            "hidden": own["hidden"], **{name: [h[name] for h in own["hyperparameters"]]
                                        for name in ("sigma2", "sigma0_2", "gamma0")},
            **summary, "server_seconds": seconds}

    def _reestimate(self, server_round: int) -> list[int]:
        """The batch-norm step of ``match.state`` (:meth:`_RoundStrategy.reestimate_statistics` from the clients it
        matched). Returns the partitions whose moments were used for every batch norm."""
        match = self.rounds.match
        state, used = self.reestimate_statistics(server_round, match.state, self.rounds.matched,
                                                 self.rounds.architecture.batch_norms)
        match.state = state
        return used


class PosteriorFusionStrategy(_RoundStrategy):
    """Posterior fusion of variational Bayesian clients (Ozer et al. 2022) as a Flower strategy; the rounds of
    :class:`~bnpfed.federated.fusion.FusionFederation`.

    Every round each sampled client gets the global model (the fused posterior ``loc/`` / ``variance/`` per
    Bayesian weight, the averaged deterministic parameters ``param/``), runs SVI on its data and replies with its
    posterior, its parameters and its example count ``n_k``. The server step is
    :func:`~bnpfed.federated.server.fuse_posteriors` (client weights, the rule, the pooling draws, the variance
    floor, the averaged deterministic parameters), on the clients in partition order.

    Usage (``initial`` is the global model before round 1, see
    :func:`bnpfed.flower.client_steps.initial_global_model`)::

        strategy = PosteriorFusionStrategy(FusionConfig(rule="pooling"), seed=0)
        strategy.connect(grid)
        result = strategy.start(grid, initial, num_rounds=5)

    :param FusionConfig fusion: the rule, client weights, pooling draws, variance floor, share of clients a round
        trains.
    :param int seed: the experiment's seed (client sampling, the pooling draws).
    :param kwargs: as for :class:`PFNMStrategy`.
    """

    task = "fusion"

    def __init__(self, fusion: FusionConfig, *, seed: int, **kwargs: Any):
        if not isinstance(fusion, FusionConfig):
            raise ValueError(f"fusion: expected a FusionConfig, got {type(fusion).__name__}")
        super().__init__(seed=seed, fraction=fusion.fraction, **kwargs)
        self.fusion = fusion
        self._expected: dict[str, tuple[int, ...]] = {}

    def _train_content(self, server_round, j, arrays):
        if len(arrays) == 0:
            raise ValueError("initial_arrays: expected the initial global model for posterior fusion "
                             "(bnpfed.flower.client_steps.initial_global_model), got no arrays")
        self._expected = array_shapes(arrays)
        return arrays

    def _parse_train(self, reply):
        arrays, metrics, j, n = self._identity_and_count(reply)
        posterior, params = posterior_from_arrays(arrays, self._expected)
        return Accepted(j, n, (posterior, params), {"train_loss": read_finite(metrics, "train-loss")})

    def _aggregate(self, server_round, accepted):
        step = fuse_posteriors([a.payload[0] for a in accepted], [a.payload[1] for a in accepted],
                               [a.num_examples for a in accepted], self.fusion, seed=self.seed, round=server_round)
        summary = {"weights": step.weights,
                   "train_loss": sum(a.metrics["train_loss"] for a in accepted) / len(accepted),
                   "mean_sigma": mean_sigma(g.variance for g in step.posterior.values()),
                   "min_variance": step.min_variance, "floored": step.floored,
                   "server_seconds": step.seconds}
        return posterior_to_record(step.posterior, step.deterministic), summary


class FedAvgStrategy(_RoundStrategy):
    """FedAvg (McMahan et al. 2017) as a Flower strategy; the rounds of
    :class:`~bnpfed.federated.fusion.FedAvgFederation`, bit for bit (the baseline of every comparison, deployed).

    Every round each sampled client gets the global network (a ``state_dict``: round 1 the shared initialisation),
    trains it with :func:`~bnpfed.federated.clients.train_network` and replies with its state and its example count
    ``n_k``. The server step is :func:`~bnpfed.federated.server.average_states` over the parameters (client weights
    ``FusionConfig.weights``, clients in partition order); with batch norm the running statistics are then
    re-estimated from the moments of the aggregated clients (:meth:`_RoundStrategy.reestimate_statistics`), as in
    process.

    :param FusionConfig fusion: its ``weights`` (``"size"`` or ``"uniform"``) and ``fraction`` (the share of clients a
        round trains).
    :param int seed: the experiment's seed (client sampling).
    :param NetworkConfig network: the clients' architecture (default an MLP of ``NetworkConfig()``).
    :param kwargs: as for :class:`PFNMStrategy`.
    """

    task = "fedavg"

    def __init__(self, fusion: FusionConfig, *, seed: int, network: Optional[NetworkConfig] = None, **kwargs: Any):
        if not isinstance(fusion, FusionConfig):
            raise ValueError(f"fusion: expected a FusionConfig, got {type(fusion).__name__}")
        network = _network(network)
        super().__init__(seed=seed, fraction=fusion.fraction, **kwargs)
        self.fusion, self.network = fusion, network
        self.architecture: Optional[Architecture] = None
        self.widths: dict[str, int] = {}   # the architecture's, which FedAvg keeps
        self.state: Optional[dict] = None

    def connect(self, grid: Grid) -> NodeIdentity:
        """As :meth:`_RoundStrategy.connect`, then the architecture for the nodes' data."""
        identity = super().connect(grid)
        if self.architecture is None:
            self.architecture = Architecture.of(self.network, identity.input_shape, identity.num_classes,
                                                seed=self.seed)
            template = self.architecture.template.state_dict()
            self.widths = {g.name: width(template, g, "template") for g in self.architecture.spec.groups}
        return identity

    def _train_content(self, server_round, j, arrays):
        if self.state is None:
            if len(arrays) == 0:
                raise ValueError("initial_arrays: expected the shared initial network for FedAvg "
                                 "(bnpfed.flower.server.run_federation sends it), got no arrays")
            self.state = state_from_arrays(from_array_record(arrays), self.architecture.spec,
                                           self.architecture.template.state_dict(), widths=self.widths)
        return state_to_record(self.state)

    def _parse_train(self, reply):
        arrays, metrics, j, n = self._identity_and_count(reply)
        state = state_from_arrays(arrays, self.architecture.spec, self.architecture.template.state_dict(),
                                  widths=self.widths)
        return Accepted(j, n, state, metrics)

    def _aggregate(self, server_round, accepted):
        start = time.perf_counter()
        names = [name for name, _ in self.architecture.template.named_parameters()]
        params, weights = average_states([{k: a.payload[k] for k in names} for a in accepted],
                                         [a.num_examples for a in accepted], self.fusion.weights)
        state = {**self.state, **{k: v.to(self.state[k].dtype) for k, v in params.items()}}
        seconds = time.perf_counter() - start
        summary = {"weights": weights}
        if self.architecture.batch_norms:
            state, used = self.reestimate_statistics(server_round, state, [a.partition_id for a in accepted],
                                                     self.architecture.batch_norms)
            summary["statistics_from"] = used
        self.state = state
        return state_to_record(state), {**summary, "server_seconds": seconds}


class MatchedFusionStrategy(_MatchingStrategy):
    """Matched posterior fusion as a Flower strategy (run config ``method = "fusion"``, ``align = "match"``); the
    rounds of :class:`~bnpfed.federated.matched_fusion.MatchedFusionFederation`.

    Round 1: each sampled client builds its own initial network from its partition id (an empty ``ArrayRecord``
    is sent), runs SVI and replies with its posterior (:func:`~bnpfed.flower.records.matched_posterior_to_record`
    of :func:`~bnpfed.matching.posteriors.client_posterior`), ``num-examples``, ``class-counts`` and
    ``train-loss``. The server matches the clients' hidden units and fuses every global unit's members
    (:func:`~bnpfed.federated.server.matched_fusion_step`, clients in partition order). Round r > 1: a client
    matched last round gets its slice of the global posterior (its start; its prior as the run's ``round-prior``
    says: the configured one by default, or the slice itself), any other client -- and with ``later-rounds``
    ``"fixed"`` (the default for every rule but PVI) every client -- the whole global posterior; the server
    remembers the global units it sent each client and warm-starts the matching from them (or, fixed, keeps them).
    The global widths can change every round (``history[r]["hidden"]``).
    Evaluation: the clients score the global Bayesian network (its posterior predictive, as fusion's) on their test
    shards; with ``fusion.heads = "pooled"`` the global record carries the round's clients' own posterior output
    layers beside it (:func:`~bnpfed.flower.records.with_heads` of the
    :class:`~bnpfed.matching.PooledPosterior` the in-process federation predicts with), and the clients score that.

    Usage (``grid`` is any Flower ``Grid``; :func:`bnpfed.flower.server.run_federation` builds this)::

        strategy = MatchedFusionStrategy(FusionConfig(rule="eaa", align="match"), seed=0,
                                         network=NetworkConfig(hidden=(16,)))
        strategy.connect(grid)
        result = strategy.start(grid, ArrayRecord(), num_rounds=2)
        strategy.match.widths, strategy.history

    :param FusionConfig fusion: the rule, member weights, ``tau2``, pooling draws, variance floor, share of clients
        a round trains; ``align`` must be ``"match"``.
    :param int seed: the experiment's seed (client sampling, the matcher's sweeps, the pooling draws).
    :param NetworkConfig network: the clients' network kind, without batch norm (default ``NetworkConfig()``;
        ``shared_init`` is ignored: each client starts from its own initialisation).
    :param BayesianConfig bayesian: the clients' prior (which parameters are Bayesian sites). Default
        ``BayesianConfig()``.
    :param kwargs: as for :class:`PFNMStrategy`.

    Attributes: ``match`` (the last :class:`~bnpfed.matching.posteriors.PosteriorMatch`), ``matched``
    (the clients it matched, in its order), ``spec`` and ``template`` (after :meth:`connect`), ``history``.
    """

    task = "matched-fusion"

    def __init__(self, fusion: FusionConfig, *, seed: int, network: Optional[NetworkConfig] = None,
                 bayesian: Optional[BayesianConfig] = None, **kwargs: Any):
        network = _network(network)
        bayesian = BayesianConfig() if bayesian is None else bayesian
        for name, value, kind in (("fusion", fusion, FusionConfig), ("network", network, NetworkConfig),
                                  ("bayesian", bayesian, BayesianConfig)):
            if not isinstance(value, kind):
                raise ValueError(f"{name}: expected a {kind.__name__}, got {type(value).__name__}")
        if fusion.align != "match":
            raise ValueError(f"align: MatchedFusionStrategy expected \"match\", got {fusion.align!r} (weight-wise "
                             f"fusion is PosteriorFusionStrategy)")
        if network.arch.endswith("-bn"):
            raise ValueError(f"arch: matched posterior fusion (align=\"match\") expected a network without batch "
                             f"norm (its running statistics are no posterior), got {network.arch!r}")
        super().__init__(seed=seed, fraction=fusion.fraction, **kwargs)
        self.fusion, self.bayesian = fusion, bayesian
        self.network = replace(network, shared_init=False)
        self.rounds: Optional[MatchRounds] = None
        self.pvi = pvi_factors(fusion, bayesian)   # rule "pvi": the clients' factors, kept on the server
        self.whole_rounds = fusion.rounds_after_first() == "fixed"
        fusion.client_prior(bayesian)   # raises if bayesian.round_prior does not apply to this fusion
        self.match_on = fusion.matches_on(bayesian.client)

    def connect(self, grid: Grid) -> NodeIdentity:
        """As :meth:`_MatchingStrategy.connect`, then the template's Bayesian sites (what every client builds
        too)."""
        identity = super().connect(grid)
        if not hasattr(self, "_sites"):
            locs, variances = client_posterior(bayesian_client(self.template, self.bayesian))
            self._order, self._sites = list(locs), list(variances)  # a client's (locs, variances), as it makes them
        if self.pvi is not None and self.pvi.prior_variance is None:   # a prior read on the clients' network
            self.pvi.prior_variance = pvi_prior_variance(self.bayesian, self.template)
        return identity

    def _train_content(self, server_round, j, arrays):
        start = self.rounds.start(j)   # None in round 1: the client starts from its own initialisation
        if start is None:
            return ArrayRecord()
        record = matched_posterior_to_record(*start)
        return record if self.pvi is None else with_cavity(record, self.pvi.cavity(j, start))

    def _parse_train(self, reply):
        arrays, metrics, j, n = self._identity_and_count(reply)
        locs, variances = matched_posterior_from_arrays(arrays, self.spec, self.template.state_dict(), self._sites,
                                                        widths=self.rounds.widths(j))
        counts = read_class_counts(metrics, self.identity.num_classes)
        posterior = ({k: locs[k] for k in self._order}, variances)
        activity = read_activity(metrics, self.spec.group_names) if self.match_on == "means" else None
        return Accepted(j, n, (posterior, counts, activity), {"train_loss": read_finite(metrics, "train-loss")})

    def _aggregate(self, server_round, accepted):
        clients = [a.partition_id for a in accepted]
        posteriors = [a.payload[0] for a in accepted]
        pvi = {} if self.pvi is None else self.pvi.step_arguments(clients, posteriors)
        counts = np.stack([a.payload[1] for a in accepted])
        # heads="auto": chosen once, by the class counts of round 1's clients (all of them in process)
        self.fusion = self.fusion.with_heads(counts)
        match = matched_fusion_step(posteriors, counts,
                                    [a.num_examples for a in accepted], self.fusion, seed=self.seed,
                                    round=server_round, starts=self.rounds.warm_start(clients), spec=self.spec,
                                    template=self.template, match_on=self.match_on,
                                    activity=None if self.match_on != "means" else [a.payload[2] for a in accepted],
                                    **pvi)
        self.rounds.update(match, clients)
        own = self.rounds.summary()
        summary = {"hidden": own["hidden"],
                   "train_loss": sum(a.metrics["train_loss"] for a in accepted) / len(accepted),
                   "mean_sigma": own["mean_sigma"], "hyperparameters": own["hyperparameters"],
                   "server_seconds": match.seconds}
        record = matched_posterior_to_record(match.locs, match.variances)
        if self.fusion.heads == "pooled":   # the clients' own heads, in the match's order
            pooled = PooledPosterior.of_match(match, posteriors)
            pooled.temperature = self.pool_temperature(server_round, self.fusion.pool_temperature, record,
                                                       pooled.heads(), clients)
            summary["pool_temperature"] = pooled.temperature
            record = with_heads(record, pooled.heads())
        elif self.fusion.temperature != 1:   # the fused predictive's temperature, given or fitted by the clients
            temperature = self.fusion.temperature
            if temperature == FIT:
                temperature = self.fitted_temperature(server_round, record, "posterior-nll", clients,
                                                      "the global posterior's predictive")
            summary["temperature"] = float(temperature)
            record = with_temperature(record, float(temperature))
        return record, summary

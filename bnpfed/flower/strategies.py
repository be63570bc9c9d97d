"""PFNM and posterior fusion as Flower strategies (the Message API of Flower 1.42).

A strategy has one method per phase of a round: ``configure_train`` (which nodes, what each gets),
``aggregate_train`` (check the replies, then call the library), ``configure_evaluate`` / ``aggregate_evaluate``
(the clients score the global model on their test shards). ``Strategy.start(grid, initial_arrays, num_rounds,
timeout)`` runs the rounds. No aggregation math lives here: :class:`PFNMStrategy` calls
:func:`bnpfed.inference.multilayer.match_networks`, :class:`PosteriorFusionStrategy` calls
:func:`bnpfed.combine.fuse_sites` and :func:`bnpfed.combine.average_deterministic` -- the functions the in-process
loops (:mod:`bnpfed.federated.pfnm`, :mod:`bnpfed.federated.fusion`) call.

Faults are handled at the boundary, per client:

* a reply that is an error (the ClientApp raised, the node went away), or whose content is malformed (wrong keys or
  shapes, NaN / inf, a variance <= 0, a bad count; see :mod:`bnpfed.flower.records`) is dropped and logged with
  its reason on the ``flwr.bnpfed`` logger; the round goes on with the other clients;
* a node that does not answer within ``timeout`` seconds of ``Strategy.start`` is logged as missing and the round
  goes on without it (Flower's grid returns the replies it has at the deadline);
* nodes are awaited for at most ``node_timeout`` seconds before a round (Flower's own sampling waits forever);
* a round with fewer than ``min_replies`` usable replies stops the run with a ``RuntimeError`` that lists every
  dropped and missing client.

Every round is recorded in :attr:`rounds`: the partition ids used, the rejected nodes with their reasons, the
missing nodes, and (PFNM) the global hidden sizes.
"""

from __future__ import annotations

from abc import abstractmethod

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from bnpfed.combine import available_rules, average_deterministic, fuse_sites
from bnpfed.federated.fusion import POOLING, derive_seed
from bnpfed.inference.multilayer import match_networks
from bnpfed.flower.records import (
    ARRAYS,
    CLIENT,
    CONFIG,
    METRICS,
    ReplyError,
    array_shapes,
    network_from_arrays,
    network_to_record,
    posterior_from_arrays,
    posterior_to_record,
    read_class_counts,
    read_count,
    read_finite,
    read_partition_id,
    reply_parts,
)

__all__ = ["PFNMStrategy", "PosteriorFusionStrategy", "LOGGER"]

#: Where rejections, missing nodes and round summaries are logged: a child of Flower's logger, so the lines show up
#: in the ServerApp's console and in ``flwr log``.
LOGGER = logging.getLogger("flwr.bnpfed")


@dataclass
class _Accepted:
    """One usable reply: who sent it and what it carried, parsed."""

    node_id: int
    partition_id: int
    num_examples: int
    payload: Any
    metrics: Mapping[str, Any]


class _RoundStrategy(Strategy):
    """What both strategies share: node sampling with a deadline, per-client reply checking, the round record,
    client-side evaluation. Subclasses say what a node gets (``_train_content``) and what a reply must carry
    (``_parse_train``), and aggregate (``_aggregate``)."""

    task = ""

    def __init__(self, *, fraction_train: float = 1.0, min_train_nodes: int = 2, min_available_nodes: int = 2,
                 min_replies: int = 1, node_timeout: float = 120.0, fraction_evaluate: float = 0.0,
                 min_evaluate_nodes: int = 1, client_config: Mapping[str, Any] | None = None, seed: int = 0):
        for name, value in (("fraction_train", fraction_train), ("fraction_evaluate", fraction_evaluate)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
        for name, value in (("min_train_nodes", min_train_nodes), ("min_available_nodes", min_available_nodes),
                            ("min_replies", min_replies), ("min_evaluate_nodes", min_evaluate_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not node_timeout > 0:
            raise ValueError(f"node_timeout: expected a positive number of seconds, got {node_timeout!r}")
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_nodes = min_train_nodes
        self.min_available_nodes = min_available_nodes
        self.min_evaluate_nodes = min_evaluate_nodes
        self.min_replies = min_replies
        self.node_timeout = float(node_timeout)
        self.client_config = dict(client_config or {})
        self.seed = seed
        #: One dict per finished round (see the module docstring).
        self.rounds: list[dict[str, Any]] = []
        self._sent: dict[tuple[int, str], list[int]] = {}

    # ------------------------------------------------------------------------------------------------ sampling

    def _sample(self, grid: Grid, server_round: int, fraction: float, min_nodes: int) -> list[int]:
        """Wait at most ``node_timeout`` s for ``max(min_available_nodes, min_nodes)`` nodes, then sample
        ``max(floor(fraction * connected), min_nodes)`` of them (sorted node ids, seeded by seed and round)."""
        need = max(self.min_available_nodes, min_nodes)
        deadline = time.monotonic() + self.node_timeout
        while len(nodes := sorted(grid.get_node_ids())) < need:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"round {server_round}: waited {self.node_timeout:.0f} s for {need} nodes, only "
                                   f"{len(nodes)} connected; start more SuperNodes or lower min-nodes")
            LOGGER.info("waiting for nodes: %d connected, %d needed", len(nodes), need)
            time.sleep(1.0)
        size = min(len(nodes), max(int(fraction * len(nodes)), min_nodes))
        if size == len(nodes):
            return nodes
        return sorted(random.Random(f"{self.seed}-{server_round}").sample(nodes, size))

    def _messages(self, server_round: int, nodes: list[int], message_type: str,
                  content: Callable[[int], tuple[ArrayRecord, dict]], config: ConfigRecord) -> list[Message]:
        self._sent[(server_round, message_type)] = nodes
        messages = []
        for node in nodes:
            arrays, extra = content(node)
            record = ConfigRecord({**self.client_config, **dict(config), **extra, "task": self.task,
                                   "server-round": server_round})
            messages.append(Message(content=RecordDict({ARRAYS: arrays, CONFIG: record}), dst_node_id=node,
                                    message_type=message_type, group_id=str(server_round)))
        return messages

    # ------------------------------------------------------------------------------------------------ replies

    def _accept(self, server_round: int, replies: Iterable[Message], message_type: str,
                parse: Callable[[Message], _Accepted]) -> tuple[list[_Accepted], dict[int, str], list[int]]:
        """Parse every reply; drop (and log) errors, malformed replies and duplicate partition ids; log the nodes
        that never answered. Returns the accepted replies sorted by partition id (the order of the in-process run),
        the rejected ``{node: reason}`` and the missing nodes."""
        accepted: list[_Accepted] = []
        rejected: dict[int, str] = {}
        answered = set()
        for reply in replies:
            node = reply.metadata.src_node_id
            answered.add(node)
            if reply.has_error():
                rejected[node] = f"error reply (code {reply.error.code}): {reply.error.reason}"
            else:
                try:
                    item = parse(reply)
                    if any(a.partition_id == item.partition_id for a in accepted):
                        raise ReplyError(f"partition-id {item.partition_id} already answered by another node")
                    accepted.append(item)
                    continue
                except ReplyError as error:
                    rejected[node] = str(error)
            LOGGER.warning("round %d: %s reply of node %d rejected: %s", server_round, message_type, node,
                           rejected[node])
        missing = [n for n in self._sent.get((server_round, message_type), []) if n not in answered]
        if missing:
            LOGGER.warning("round %d: no %s reply from node(s) %s before the deadline; going on without them",
                           server_round, message_type, missing)
        accepted.sort(key=lambda a: a.partition_id)
        return accepted, rejected, missing

    def _require(self, server_round: int, accepted, rejected, missing) -> None:
        if len(accepted) < self.min_replies:
            raise RuntimeError(
                f"round {server_round}: {len(accepted)} usable replies, fewer than min_replies={self.min_replies}; "
                f"rejected: {rejected or 'none'}; missing (no reply before the deadline): {missing or 'none'}")

    def _identity(self, reply: Message) -> tuple[Mapping, MetricRecord, int, int]:
        arrays, metrics, client = reply_parts(reply)
        return arrays, metrics, read_partition_id(client), read_count(metrics)

    # ------------------------------------------------------------------------------------------------ training

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        """Sample the nodes of this round and give each its training message (see the subclass)."""
        if self.fraction_train == 0:
            return []
        nodes = self._sample(grid, server_round, self.fraction_train, self.min_train_nodes)
        LOGGER.info("round %d: training on %d node(s)", server_round, len(nodes))
        return self._messages(server_round, nodes, MessageType.TRAIN,
                              lambda node: self._train_content(server_round, node, arrays), config)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check the replies, then aggregate the usable ones (see the subclass)."""
        start = time.perf_counter()
        accepted, rejected, missing = self._accept(server_round, replies, MessageType.TRAIN, self._parse_train)
        self._require(server_round, accepted, rejected, missing)
        arrays, summary = self._aggregate(server_round, accepted)
        record = {"round": server_round, "partition_ids": [a.partition_id for a in accepted],
                  "num_examples": [a.num_examples for a in accepted], "rejected": rejected, "missing": missing,
                  **summary, "seconds": time.perf_counter() - start}
        self.rounds.append(record)
        LOGGER.info("round %d: aggregated %d client(s) %s%s", server_round, len(accepted), record["partition_ids"],
                    "".join(f", {k} {v}" for k, v in summary.items()))
        metrics = MetricRecord({"num-clients": len(accepted), "num-examples": sum(a.num_examples for a in accepted)})
        for key, value in summary.items():
            metrics[key.replace("_", "-")] = value
        return arrays, metrics

    @abstractmethod
    def _train_content(self, server_round: int, node: int, arrays: ArrayRecord) -> tuple[ArrayRecord, dict]:
        """Implemented by each subclass."""

    @abstractmethod
    def _parse_train(self, reply: Message) -> _Accepted:
        """Implemented by each subclass."""

    @abstractmethod
    def _aggregate(self, server_round: int, accepted: list[_Accepted]) -> tuple[ArrayRecord, dict]:
        """Implemented by each subclass."""

    # ------------------------------------------------------------------------------------------------ evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                           ) -> Iterable[Message]:
        """Send the global model to a ``fraction_evaluate`` of the nodes (none by default)."""
        if self.fraction_evaluate == 0 or len(arrays) == 0:
            return []
        nodes = self._sample(grid, server_round, self.fraction_evaluate, self.min_evaluate_nodes)
        return self._messages(server_round, nodes, MessageType.EVALUATE, lambda node: (arrays, {}), config)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted means of the clients' ``accuracy`` and ``nll`` on their test shards."""
        def parse(reply: Message) -> _Accepted:
            content = reply.content
            if METRICS not in content.metric_records or CLIENT not in content.config_records:
                raise ReplyError("evaluation reply lacks its 'metrics' or 'client' record")
            metrics = content.metric_records[METRICS]
            scores = {key: read_finite(metrics, key) for key in ("accuracy", "nll")}
            return _Accepted(reply.metadata.src_node_id, read_partition_id(content.config_records[CLIENT]),
                             read_count(metrics), None, scores)

        accepted, _, _ = self._accept(server_round, replies, MessageType.EVALUATE, parse)
        if not accepted:
            return None
        total = sum(a.num_examples for a in accepted)
        out = MetricRecord({"num-examples": total})
        for key in ("accuracy", "nll"):
            out[key] = float(sum(a.metrics[key] * a.num_examples for a in accepted) / total)
        if self.rounds and self.rounds[-1]["round"] == server_round:
            self.rounds[-1].update(accuracy=out["accuracy"], nll=out["nll"])
        return out

    def summary(self) -> None:
        """Log the strategy's settings."""
        LOGGER.info("%s: fraction_train %.2f, fraction_evaluate %.2f, min_available_nodes %d, min_replies %d, "
                    "node_timeout %.0f s", type(self).__name__, self.fraction_train, self.fraction_evaluate,
                    self.min_available_nodes, self.min_replies, self.node_timeout)


class PFNMStrategy(_RoundStrategy):
    """PFNM (Yurochkin et al. 2019) as a Flower strategy, one-shot (one round) or with communication rounds.

    Round 1: every sampled client trains its own MLP from its own initialisation (an empty ``ArrayRecord`` is
    sent) and replies with its layers and its training examples per class. The server matches the layers
    (:func:`~bnpfed.inference.multilayer.match_networks`; clients in partition-id order) into a global network
    whose width is decided by the Beta-Bernoulli process, not fixed. Round r > 1: each client that was matched gets
    *its slice* of the global network (:meth:`NetworkMatch.client_slice`: the global neurons its own neurons were
    matched to), retrains it with the round's schedule, and the server re-matches, so the global width can change
    from round to round; a node that was not matched gets the whole global network.

    Usage::

        strategy = PFNMStrategy(sigma2=0.3, in_features=64, num_classes=10, min_available_nodes=3,
                                schedule=lambda r: asdict(local_schedule(settings, r)))
        result = strategy.start(grid, ArrayRecord(), num_rounds=2, timeout=600)
        strategy.match.hidden_sizes, strategy.rounds

    :param float sigma2: noise variance of the matching (one value, or one per hidden layer as a list).
    :param float sigma0_2: prior variance.
    :param float gamma0: IBP mass.
    :param dict match_kwargs: further keywords of ``match_networks`` (``objective``, ``direction``, ``sweeps``,
        ``seed``, the reference constants; e.g. ``PFNMSettings.matcher_kwargs()``).
    :param int in_features: input size every client's first layer must take; unchecked if None.
    :param int num_classes: output size every client's last layer must have; unchecked if None.
    :param schedule: ``round -> {"epochs", "lr", "seed"}``, the local training each client runs that round (sent as
        ``schedule-epochs``, ``schedule-lr``, ``schedule-seed``). Default: none sent (the client
        then follows ``local_schedule`` of the settings it was sent).
    :param kwargs: sampling, deadline and evaluation settings: ``fraction_train`` (1.0), ``min_train_nodes`` (2),
        ``min_available_nodes`` (2), ``min_replies`` (1), ``node_timeout`` (120 s), ``fraction_evaluate`` (0.0),
        ``min_evaluate_nodes`` (1), ``client_config`` (sent to every client in every message), ``seed`` (node
        sampling when ``fraction_train < 1``).

    Attributes: ``match`` (the last :class:`~bnpfed.inference.multilayer.NetworkMatch`), ``rounds``.
    """

    task = "pfnm"

    def __init__(self, *, sigma2=1.0, sigma0_2=1.0, gamma0=1.0, match_kwargs: Mapping[str, Any] | None = None,
                 in_features: int | None = None, num_classes: int | None = None,
                 schedule: Callable[[int], Mapping[str, Any]] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.sigma2, self.sigma0_2, self.gamma0 = sigma2, sigma0_2, gamma0
        self.match_kwargs = dict(match_kwargs or {})
        self.in_features, self.num_classes = in_features, num_classes
        self.schedule = schedule
        self.match = None
        self._slot: dict[int, int] = {}  # node -> its client index j in self.match
        self._widths: dict[int, list[int] | None] = {}  # node -> hidden widths it must answer with

    def _train_content(self, server_round, node, arrays):
        extra = {}
        if self.schedule is not None:
            s = self.schedule(server_round)
            extra = {"schedule-epochs": int(s["epochs"]), "schedule-lr": float(s["lr"]),
                     "schedule-seed": int(s["seed"])}
        if self.match is not None and node in self._slot:
            layers = self.match.client_slice(self._slot[node])
            self._widths[node] = [int(w.shape[0]) for w, _ in layers[:-1]]
            return network_to_record(layers), extra
        if len(arrays) == 0:  # round 1: the client starts from its own initialisation
            self._widths[node] = None
            return ArrayRecord(), extra
        shapes = array_shapes(arrays)  # a node that was not matched last round starts from the whole global network
        self._widths[node] = [shapes[f"{c}.weight"][0] for c in range(len(shapes) // 2 - 1)]
        return arrays, extra

    def _parse_train(self, reply):
        arrays, metrics, partition_id, n = self._identity(reply)
        layers = network_from_arrays(arrays, in_features=self.in_features, num_classes=self.num_classes,
                                     widths=self._widths.get(reply.metadata.src_node_id))
        counts = read_class_counts(metrics, self.num_classes if self.num_classes is not None else
                                   int(layers[-1][0].shape[0]))
        return _Accepted(reply.metadata.src_node_id, partition_id, n, (layers, counts), metrics)

    def _aggregate(self, server_round, accepted):
        if self.num_classes is None:  # without a declared class count the first client's sets it for the others
            outputs = {int(a.payload[0][-1][0].shape[0]) for a in accepted}
            if len(outputs) > 1:
                raise RuntimeError(f"round {server_round}: clients disagree on the number of classes {outputs}; "
                                   "set num_classes so that the odd ones are rejected")
        match = match_networks([a.payload[0] for a in accepted], np.stack([a.payload[1] for a in accepted]),
                               sigma2=self.sigma2, sigma0_2=self.sigma0_2, gamma0=self.gamma0, **self.match_kwargs)
        self.match = match
        self._slot = {a.node_id: j for j, a in enumerate(accepted)}
        return network_to_record(match.layers), {"hidden_sizes": match.hidden_sizes}


class PosteriorFusionStrategy(_RoundStrategy):
    """Posterior fusion of variational Bayesian clients (Ozer et al. 2022) as a Flower strategy.

    Every round each sampled client gets the global model (the fused posterior ``loc/`` / ``variance/`` per
    Bayesian weight, the averaged deterministic parameters ``param/``), runs SVI on its data and replies with its
    posterior and parameters and its example count ``n_k``. The server fuses the posteriors weight by weight with
    one rule of :mod:`bnpfed.combine` (:func:`~bnpfed.combine.fuse_sites`) under client weights ``b_k``
    (``"size"``: ``n_k / sum_j n_j``, ``"uniform"``: ``1 / m``) and averages the deterministic parameters with the
    same ``b_k`` (:func:`~bnpfed.combine.average_deterministic`), as :class:`bnpfed.federated.fusion.FusionFederation`
    does; the pooling rule draws from ``derive_seed(seed, POOLING, round)``, as there.

    Usage::

        strategy = PosteriorFusionStrategy("conflation", weights="size", seed=0, min_available_nodes=3)
        result = strategy.start(grid, posterior_to_record(initial_posterior, initial_params), num_rounds=5)

    :param str rule: a name from :func:`bnpfed.combine.available_rules`. Default ``"conflation"``.
    :param str weights: ``"size"`` (default) or ``"uniform"``.
    :param int pooling_samples: N of the pooling rule. Default 1000.
    :param int seed: the experiment's seed (pooling draws; node sampling when ``fraction_train < 1``).
    :param kwargs: sampling, deadline and evaluation settings, as for :class:`PFNMStrategy`.
    """

    task = "fusion"

    def __init__(self, rule: str = "conflation", *, weights: str = "size", pooling_samples: int = 1000,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if rule not in available_rules():
            raise ValueError(f"rule: expected one of {available_rules()}, got {rule!r}")
        if weights not in ("size", "uniform"):
            raise ValueError(f"weights: expected 'size' or 'uniform', got {weights!r}")
        self.rule, self.weights, self.pooling_samples = rule, weights, pooling_samples
        self._expected: dict[str, tuple[int, ...]] = {}

    def _train_content(self, server_round, node, arrays):
        if len(arrays) == 0:
            raise ValueError("posterior fusion needs the initial global model as initial_arrays "
                             "(see bnpfed.flower.client.initial_global_model)")
        self._expected = array_shapes(arrays)
        return arrays, {}

    def _parse_train(self, reply):
        arrays, metrics, partition_id, n = self._identity(reply)
        return _Accepted(reply.metadata.src_node_id, partition_id, n, posterior_from_arrays(arrays, self._expected),
                         metrics)

    def _aggregate(self, server_round, accepted):
        sizes = [a.num_examples for a in accepted]
        weights = [n / sum(sizes) for n in sizes] if self.weights == "size" else [1.0 / len(sizes)] * len(sizes)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, POOLING, server_round))
        fused = fuse_sites([a.payload[0] for a in accepted], self.rule, weights, num_samples=self.pooling_samples,
                           generator=generator)
        names = list(accepted[0].payload[1])
        params = {name: average_deterministic([a.payload[1][name] for a in accepted], weights) for name in names}
        record = posterior_to_record({site: (g.loc, g.variance) for site, g in fused.items()}, params)
        return record, {"weights": weights}


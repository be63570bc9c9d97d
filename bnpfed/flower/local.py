"""A Flower ``Grid`` that runs a ClientApp in this process: the whole message protocol of a strategy, without Ray,
SuperLink or SuperNodes. For tests and for stepping through a run in a debugger.

Every message is serialised to Flower's protobuf form and back on the way to the client and on the way back (so a
payload that would not survive the wire fails here too), handed to ``client_app(message, context)`` with one
persistent ``Context`` per node (``node_config`` has ``partition-id`` and ``num-partitions``, as a simulation's),
and an exception in the ClientApp becomes an error reply, as on a SuperNode. Nodes whose partitions are listed in
``silent`` take messages of ``silent_types`` and never answer them, as a SuperNode killed mid-run:
``send_and_receive`` then waits out its ``timeout`` and returns the replies it has.

Usage::

    >>> from bnpfed.flower.client import app
    >>> from bnpfed.flower.server import run_federation
    >>> grid = LocalGrid(app, num_nodes=3, partitions=[2, 0, 1])     # node i holds partition partitions[i]
    >>> result = run_federation(grid, {"method": "pfnm", "hidden": "8", "epochs": 1})
    >>> grid.calls[:3] == [(node, "query") for node in grid.node_ids]  # then (node, "train"), (node, "evaluate")
    True
"""

from __future__ import annotations

import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["LocalGrid"]


#: The reason of the SuperLink's error reply for a node without heartbeat (Flower's own words).
NODE_UNAVAILABLE = ("Error: Node Unavailable - The destination node failed to report a heartbeat within the expected "
                    "interval.")


def _over_the_wire(content: RecordDict) -> RecordDict:
    return recorddict_from_proto(recorddict_to_proto(content))


class LocalGrid(Grid):
    """A ``Grid`` over ``num_nodes`` in-process nodes that each run ``client_app``.

    :param client_app: a ``ClientApp`` or any callable ``(Message, Context) -> Message``.
    :param int num_nodes: number of nodes (and of partitions, ``num-partitions``).
    :param partitions: the ``partition-id`` of node i is ``partitions[i]``. Default ``range(num_nodes)``.
    :param dict run_config: the ``Context.run_config`` every node sees. Default empty.
    :param silent: partition ids whose nodes never reply to messages of ``silent_types``.
    :param silent_types: the message types silent nodes ignore. Default ``("train", "evaluate")``: they tell their
        partition, then go quiet (a SuperNode that dies after joining); add ``"query"`` for one that never answers.
    :param unavailable: partition ids whose nodes died after telling their partition: messages of ``silent_types``
        to them get the error reply the SuperLink gives for a node without heartbeat (``NODE_UNAVAILABLE``) at once.
    :param int run_id: the run id messages carry. Default 1.
    :param dict node_config: more node config every node sees (a SuperNode's ``--node-config``, e.g.
        ``{"data-dir": path}``). Default none.
    """

    def __init__(self, client_app: Callable[[Message, Context], Message], num_nodes: int, *,
                 partitions: Sequence[int] | None = None, run_config: Mapping[str, Any] | None = None,
                 silent: Iterable[int] = (), silent_types: Iterable[str] = ("train", "evaluate"), run_id: int = 1,
                 node_config: Mapping[str, Any] | None = None, unavailable: Iterable[int] = ()):
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes: expected an int >= 1, got {num_nodes!r}")
        partitions = list(range(num_nodes)) if partitions is None else [int(p) for p in partitions]
        if sorted(partitions) != list(range(num_nodes)):
            raise ValueError(f"partitions: expected a permutation of range({num_nodes}), got {partitions}")
        # Message() reads the sender's identity from here; a ServerApp process has it set by Flower
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = run_id, 1, SUPERLINK_NODE_ID
        self.client_app = client_app
        self._run = Run.create_empty(run_id)
        self.node_ids = [10_000 + 7 * i for i in range(num_nodes)]
        #: ``{partition id: node id}``.
        self.node_of = {j: node for j, node in zip(partitions, self.node_ids)}
        self.silent = {self.node_of[j] for j in silent}
        self.unavailable = {self.node_of[j] for j in unavailable}
        self.silent_types = set(silent_types)
        self.contexts = {
            node: Context(run_id=run_id, node_id=node, state=RecordDict(), run_config=dict(run_config or {}),
                          node_config={**dict(node_config or {}), "partition-id": j, "num-partitions": num_nodes})
            for j, node in self.node_of.items()}
        #: ``(node_id, message_type)`` of every message a ClientApp ran, in order.
        self.calls: list[tuple[int, str]] = []
        #: ``(node_id, message_type)`` of every message pushed (to any node, answered or not), in order.
        self.pushed: list[tuple[int, str]] = []
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Run the ClientApp of every destination now (unless silent); the replies wait for ``pull_messages``."""
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(msg.metadata.message_id)
            node = msg.metadata.dst_node_id
            if node not in self.contexts:
                raise ValueError(f"dst_node_id: expected one of the nodes {self.node_ids}, got {node}")
            self.pushed.append((node, msg.metadata.message_type))
            if node in self.unavailable and msg.metadata.message_type in self.silent_types:
                # the SuperLink's own reply, as Flower makes it: from the SuperLink, naming the message it answers
                reply = Message(Error(ErrorCode.NODE_UNAVAILABLE, NODE_UNAVAILABLE), reply_to=msg)
                reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
                self._replies[msg.metadata.message_id] = reply
                continue
            if node in self.silent and msg.metadata.message_type in self.silent_types:
                continue
            incoming = Message(_over_the_wire(msg.content), metadata=msg.metadata)
            self.calls.append((node, msg.metadata.message_type))
            try:
                reply = self.client_app(incoming, self.contexts[node])
                reply = (Message(reply.error, reply_to=msg) if reply.has_error()
                         else Message(_over_the_wire(reply.content), reply_to=msg))
            except Exception as error:  # a SuperNode turns a ClientApp exception into an error reply, so do we
                reason = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"
                reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)
            reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self._replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Push, then return the replies; if some never come (silent nodes), first wait out ``timeout`` seconds
        (forever if None, as Flower's grids do)."""
        ids = self.push_messages(messages)
        replies = self.pull_messages(ids)
        if len(replies) < len(ids):
            if timeout is None:
                raise RuntimeError("a silent node never replies and send_and_receive has no timeout: it would hang")
            time.sleep(timeout)
        return replies

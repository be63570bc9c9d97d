"""A federated method in one file: a client step, a server step and one registration.

A :class:`FederatedMethod` says what a client does with the global model in a round and what the server does with
the clients' replies; the loop around them (which clients a round samples, what each is sent, seeding, checking
replies, evaluation) is bnpfed's, written once: in process :class:`~bnpfed.federated.generic.MethodFederation`
runs it round by round, on Flower one generic strategy (:class:`bnpfed.flower.method_strategy.MethodStrategy`) and
the ClientApp run it by the method's registered name, and both call the two steps through :func:`client_step` and
:func:`server_step` here, so the global models are the same bit for bit.

A round ``t`` of a method:

1. the server samples ``max(1, floor(fraction * J))`` clients (:func:`~bnpfed.federated.server.sample_clients`);
2. each sampled client ``k`` gets the global state (a dict of tensors: the global network's ``state_dict``, plus any
   entries of the method's own) and runs :meth:`FederatedMethod.client_step` on a :class:`ClientTask` -- the global
   network (a copy it may train), its data, the training config, its random stream ``(seed, FIT, t, k)`` and what it
   kept from its last round -- returning a :class:`ClientUpdate`: the tensors it sends, the tensors it keeps, its
   metrics;
3. the server runs :meth:`FederatedMethod.server_step` on a :class:`ServerTask` -- the global state, what the server
   kept, the clients' updates in client order with their weights ``b_k`` (:func:`~bnpfed.federated.server.
   client_weights`) -- returning a :class:`ServerUpdate`: the new global state (same entries, shapes and dtypes),
   what the server keeps, its metrics;
4. the global network (:meth:`FederatedMethod.global_network` of the state) is evaluated.

Everything that travels or is kept is a ``dict[str, Tensor]``, so it crosses Flower's ``ArrayRecord`` unchanged;
every random draw comes from :meth:`ClientTask.generator` or :meth:`ServerTask.generator`, never from Torch's global
generator, so a run is the same in process and on Flower. Register a method with
:func:`~bnpfed.federated.register_federated_method`: it is then a method of
:func:`~bnpfed.federated.run_experiment` and of the commands' ``--methods``, and ``method = "<name>"`` on Flower.

Usage (FedAvg in a few lines; ``examples/fedpa.py`` is a method of the literature written this way)::

    >>> from bnpfed.federated import train_network
    >>> class Averaging(FederatedMethod):
    ...     def client_step(self, task):
    ...         net = train_network(task.network, task.x, task.y, task.training, seed=task.seed,
    ...                             round=task.round, client=task.client)
    ...         return ClientUpdate(dict(net.state_dict()))
    ...     def server_step(self, task):
    ...         return ServerUpdate({k: sum(b * u[k] for b, u in zip(task.weights, task.updates)) for k in task.state})
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from bnpfed.federated.config import TrainingConfig
from bnpfed.seeding import Stream, derive_seed, torch_generator

__all__ = ["ClientTask", "ClientUpdate", "FederatedMethod", "ServerTask", "ServerUpdate", "check_tensors",
           "client_metrics", "client_step", "initial_global_state", "server_step"]


@dataclass(frozen=True)
class ClientTask:
    """What a client's step of a round gets.

    :param nn.Module network: the global network (:meth:`FederatedMethod.global_network` of ``state``), a copy of
        its own the step may train.
    :param dict state: the global state the server sent (read it, do not change it).
    :param Tensor x: the client's training inputs ``(n_k, *input_shape)``.
    :param Tensor y: its labels ``(n_k,)``.
    :param TrainingConfig training: the local training settings (the method says which it reads; ``training.
        schedule(round)`` gives the round's epochs and learning rate).
    :param int seed: the experiment's seed.
    :param int round: the communication round, from 1.
    :param int client: the client's index j.
    :param dict client_state: what this client kept at the end of the last round it trained (empty before).
    """

    network: nn.Module
    state: Mapping[str, Tensor]
    x: Tensor
    y: Tensor
    training: TrainingConfig
    seed: int
    round: int
    client: int
    client_state: Mapping[str, Tensor] = field(default_factory=dict)

    @property
    def stream(self) -> int:
        """The seed of the client's random stream this round, ``derive_seed(seed, FIT, round, client)`` (what
        :func:`~bnpfed.federated.train_network` draws from)."""
        return derive_seed(self.seed, Stream.FIT, self.round, self.client)

    def generator(self) -> torch.Generator:
        """A fresh CPU generator on :attr:`stream`: the step's shuffles and draws."""
        return torch_generator(self.seed, Stream.FIT, self.round, self.client)


@dataclass
class ClientUpdate:
    """What a client's step returns.

    :param dict update: the tensors sent to the server: the keys, shapes and dtypes of
        :meth:`FederatedMethod.expected_update` (by default the global state's), finite.
    :param dict client_state: tensors the client keeps for the next round it trains (on Flower in the SuperNode's
        ``context.state``). Default none.
    :param dict metrics: numbers about the step (e.g. ``train_loss``); a round records each one's mean over its
        clients. Default none.
    """

    update: dict[str, Tensor]
    client_state: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerTask:
    """What the server's step of a round gets.

    :param dict state: the global state the clients were sent.
    :param dict server_state: what the server kept from the last round (empty before round 1's step).
    :param list updates: the clients' :attr:`ClientUpdate.update` s, in client order.
    :param list weights: their normalised weights ``b_k`` (``FusionConfig.weights``: by size or uniform).
    :param list sizes: their numbers of training examples ``n_k``.
    :param list clients: their indices.
    :param int round: the communication round.
    :param int seed: the experiment's seed.
    """

    state: Mapping[str, Tensor]
    server_state: Mapping[str, Tensor]
    updates: Sequence[Mapping[str, Tensor]]
    weights: Sequence[float]
    sizes: Sequence[int]
    clients: Sequence[int]
    round: int
    seed: int

    def generator(self) -> torch.Generator:
        """A fresh CPU generator on the stream ``(seed, SERVER, round)``: the step's own draws."""
        return torch_generator(self.seed, Stream.SERVER, self.round)


@dataclass
class ServerUpdate:
    """What the server's step returns.

    :param dict state: the new global state: the entries, shapes and dtypes of the state it was given, finite.
    :param dict server_state: tensors the server keeps for the next round. Default none.
    :param dict metrics: numbers about the step, recorded with the round. Default none.
    """

    state: dict[str, Tensor]
    server_state: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class FederatedMethod(ABC):
    """A federated method: :meth:`client_step` and :meth:`server_step`, and optionally how the global state starts
    (:meth:`initial_state`), which network it is (:meth:`global_network`) and what a client's update must look like
    (:meth:`expected_update`). A method object holds settings only (its constructor's arguments): what changes
    between rounds lives in the states the steps return, so one object serves any number of runs.

    Subclass it, then register an instance: ``register_federated_method("name", MyMethod(...))``
    (:func:`~bnpfed.federated.register_federated_method`); each setting of interest is its own registration
    (``"fedpa"``, ``"fedpa-rho0"``).
    """

    def initial_state(self, network: nn.Module) -> dict[str, Tensor]:
        """The global state before round 1, from the shared initial network (the configured architecture from the
        stream ``(seed, INIT)``, as FedAvg's). Default: its ``state_dict``. Called once per run, before any
        training: the place to refuse an architecture the method does not take."""
        return {k: v.detach().clone() for k, v in network.state_dict().items()}

    def global_network(self, state: Mapping[str, Tensor], template: nn.Module) -> nn.Module:
        """The global network of ``state``: a copy of ``template`` (the configured architecture) carrying its
        entries. Default: the entries of the template's ``state_dict`` (the state's other entries are the
        method's own)."""
        keys = list(template.state_dict())
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"state: expected the global network's entries {keys}, missing {missing}")
        net = copy.deepcopy(template)
        net.load_state_dict({k: state[k] for k in keys})
        return net.eval()

    def expected_update(self, state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """Tensors with the keys, shapes and dtypes every client's update must have (values unused). Default: the
        global state's."""
        return state

    @abstractmethod
    def client_step(self, task: ClientTask) -> ClientUpdate:
        """A client's round: its update from the global state and its data."""

    @abstractmethod
    def server_step(self, task: ServerTask) -> ServerUpdate:
        """The server's round: the new global state from the clients' updates."""


# ------------------------------------------------------------------------------------------------ the steps, run


def check_tensors(values: Any, like: Mapping[str, Tensor], label: str) -> dict[str, Tensor]:
    """``values`` as a ``{name: tensor}`` dict with exactly the keys of ``like``, each of its shape and dtype and,
    floating point, finite; detached, on the CPU.

    >>> check_tensors({"w": torch.ones(2)}, {"w": torch.zeros(3)}, "update")
    Traceback (most recent call last):
    ...
    ValueError: update['w']: expected shape (3,) and dtype torch.float32, got shape (2,) and dtype torch.float32

    :param values: what a step returned.
    :param like: ``{name: tensor}`` of the expected shapes and dtypes (values unused).
    :param str label: what ``values`` is, for the message.
    :raises ValueError: ``"<label>...: ..."`` naming the entry.
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"{label}: expected a dict of tensors, got {type(values).__name__}")
    missing, extra = [k for k in like if k not in values], [k for k in values if k not in like]
    if missing or extra:
        wrong = ([f"missing {missing}"] if missing else []) + ([f"extra {extra}"] if extra else [])
        raise ValueError(f"{label}: expected exactly the entries {list(like)}, got " + "; ".join(wrong))
    out = {}
    for key, ref in like.items():
        value = values[key]
        if not torch.is_tensor(value):
            raise ValueError(f"{label}[{key!r}]: expected a tensor, got {type(value).__name__}")
        if value.shape != ref.shape or value.dtype != ref.dtype:
            raise ValueError(f"{label}[{key!r}]: expected shape {tuple(ref.shape)} and dtype {ref.dtype}, got shape "
                             f"{tuple(value.shape)} and dtype {value.dtype}")
        value = value.detach().cpu()
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{label}[{key!r}]: expected finite values, got {int((~torch.isfinite(value)).sum())} "
                             f"NaN or infinite")
        out[key] = value
    return out


def _kept(values: Any, label: str) -> dict[str, Tensor]:
    """A state a step keeps: ``{name: tensor}``, any shapes, detached on the CPU."""
    if not isinstance(values, Mapping) or not all(isinstance(k, str) and torch.is_tensor(v)
                                                   for k, v in values.items()):
        raise ValueError(f"{label}: expected a dict of name -> tensor, got {values!r:.200}")
    return check_tensors(values, values, label)


def _metrics(values: Any, label: str) -> dict[str, float]:
    if not isinstance(values, Mapping):
        raise ValueError(f"{label}: expected a dict of name -> number, got {type(values).__name__}")
    out = {}
    for key, value in values.items():
        if not isinstance(key, str) or key == "num-examples":
            raise ValueError(f"{label}: expected metric names (strings other than 'num-examples'), got {key!r}")
        number = float(value.item() if torch.is_tensor(value) else value)
        if not math.isfinite(number):
            raise ValueError(f"{label}[{key!r}]: expected a finite number, got {value!r}")
        out[key] = number
    return out


def initial_global_state(method: FederatedMethod, template: nn.Module) -> dict[str, Tensor]:
    """``method`` 's global state before round 1 from the shared initial network ``template`` (checked: a dict of
    finite tensors whose global network can be built).

    :param FederatedMethod method: the method.
    :param nn.Module template: the shared initial network (a copy is handed to the method).
    """
    state = _kept(method.initial_state(copy.deepcopy(template)), "initial_state")
    method.global_network(state, template)
    return state


def client_step(method: FederatedMethod, template: nn.Module, state: Mapping[str, Tensor], x: Tensor, y: Tensor,
                training: TrainingConfig, *, seed: int, round: int, client: int,
                client_state: Optional[Mapping[str, Tensor]] = None) -> ClientUpdate:
    """Client ``client`` 's step of round ``round``, as the in-process federation and the Flower ClientApp both run
    it: :meth:`FederatedMethod.client_step` on the :class:`ClientTask` of ``state`` (its network built on
    ``template``) and the client's data, its returns checked (:func:`check_tensors` against
    :meth:`FederatedMethod.expected_update`).

    :param FederatedMethod method: the method.
    :param nn.Module template: the shared initial network (the architecture the global network is built on).
    :param dict state: the global state sent.
    :param Tensor x: the client's training inputs.
    :param Tensor y: its labels.
    :param TrainingConfig training: the local training settings.
    :param int seed: the experiment's seed.
    :param int round: the round, from 1.
    :param int client: the client's index.
    :param dict client_state: what the client kept from its last round (None: nothing yet).
    :raises ValueError: naming what the step returned wrong.
    """
    task = ClientTask(network=method.global_network(state, template).train(), state=state, x=x, y=y,
                      training=training, seed=seed, round=round, client=client,
                      client_state=dict(client_state or {}))
    out = method.client_step(task)
    name = type(method).__name__
    if not isinstance(out, ClientUpdate):
        raise ValueError(f"{name}.client_step: expected a ClientUpdate, got {type(out).__name__}")
    return ClientUpdate(check_tensors(out.update, method.expected_update(state), f"{name}.client_step update"),
                        _kept(out.client_state, f"{name}.client_step client_state"),
                        _metrics(out.metrics, f"{name}.client_step metrics"))


def server_step(method: FederatedMethod, state: Mapping[str, Tensor], server_state: Mapping[str, Tensor],
                updates: Sequence[Mapping[str, Tensor]], weights: Sequence[float], sizes: Sequence[int],
                clients: Sequence[int], *, seed: int, round: int) -> ServerUpdate:
    """The server's step of round ``round``, as the in-process federation and the Flower strategy both run it:
    :meth:`FederatedMethod.server_step` on the :class:`ServerTask`, its new state checked against ``state``'s
    entries, shapes and dtypes.

    :param FederatedMethod method: the method.
    :param dict state: the global state the clients were sent.
    :param dict server_state: what the server kept from the last round.
    :param list updates: the clients' updates, in client order.
    :param list weights: their normalised weights ``b_k``.
    :param list sizes: their numbers of training examples.
    :param list clients: their indices.
    :param int seed: the experiment's seed.
    :param int round: the round, from 1.
    :raises ValueError: naming what the step returned wrong.
    """
    if not (len(updates) == len(weights) == len(sizes) == len(clients)) or not updates:
        raise ValueError(f"updates, weights, sizes and clients: expected one entry per client, at least one, got "
                         f"{len(updates)}, {len(weights)}, {len(sizes)} and {len(clients)}")
    task = ServerTask(state=state, server_state=dict(server_state), updates=list(updates), weights=list(weights),
                      sizes=list(sizes), clients=list(clients), round=round, seed=seed)
    out = method.server_step(task)
    name = type(method).__name__
    if not isinstance(out, ServerUpdate):
        raise ValueError(f"{name}.server_step: expected a ServerUpdate, got {type(out).__name__}")
    return ServerUpdate(check_tensors(out.state, state, f"{name}.server_step state"),
                        _kept(out.server_state, f"{name}.server_step server_state"),
                        _metrics(out.metrics, f"{name}.server_step metrics"))


def client_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each metric's mean over the clients that reported it, in the order first seen (what a round records of its
    clients' :attr:`ClientUpdate.metrics`).

    :param metrics: per client, ``{name: number}``.

    >>> client_metrics([{"train_loss": 1.0}, {"train_loss": 2.0, "steps": 4}])
    {'train_loss': 1.5, 'steps': 4.0}
    """
    keys = list(dict.fromkeys(k for m in metrics for k in m))
    return {k: sum(m[k] for m in metrics if k in m) / sum(1 for m in metrics if k in m) for k in keys}

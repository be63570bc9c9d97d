"""The clients' steps, written once: what client j of a federation does, in process or as a Flower ClientApp.

* :func:`initial_network`: the network a client starts from (its own initialisation, or the shared one);
* :func:`train_network`: a deterministic client's local training in a round (PFNM's clients, FedAvg's);
* :func:`bayesian_client`: a variational Bayesian client of a network (posterior fusion's clients);
* :func:`fit_bayesian`: its local SVI in a round.

Every random step draws from a stream of :mod:`bnpfed.seeding`: client j's own initialisation from
``(seed, INIT, 0, j + 1)``, the shared one from ``(seed, INIT, 0, 0)``, its fit in round r from ``(seed, FIT, r, j)``.

Usage::

    >>> from bnpfed.federated.config import NetworkConfig, TrainingConfig
    >>> net = initial_network(NetworkConfig(hidden=(8,)), (1, 8, 8), 10, seed=0, client=3)
    >>> x, y = torch.randn(20, 1, 8, 8), torch.arange(20) % 10
    >>> trained = train_network(net, x, y, TrainingConfig(epochs=1), seed=0, round=1, client=3)
    >>> sum(p.numel() for p in trained.parameters())
    610
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from bnpfed.federated.config import BayesianConfig, NetworkConfig, TrainingConfig
from bnpfed.inference import BayesianClient, DeterministicClient
from bnpfed.models import LeNet, mlp, reference_init_
from bnpfed.seeding import Stream, derive_seed, seeded, torch_generator

__all__ = ["bayesian_client", "build_network", "fit_bayesian", "initial_network", "train_network"]


def build_network(network: NetworkConfig, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """The plain network of ``network.arch`` for inputs of ``input_shape`` (PyTorch's initialisation, from Torch's
    global generator: use :func:`initial_network` for a seeded one)."""
    input_shape = tuple(int(s) for s in input_shape)
    if network.arch == "mlp":
        return mlp(math.prod(input_shape), list(network.hidden), num_classes)
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ValueError(f"arch: {network.arch!r} needs square images, input shape (C, H, H); got {input_shape} "
                         "(use arch 'mlp' for flat data)")
    padding = 0 if network.arch == "lenet-paper" else 2
    return LeNet(in_channels=input_shape[0], image_size=input_shape[1], num_classes=num_classes,
                 conv1_padding=padding)


def initial_network(network: NetworkConfig, input_shape: Sequence[int], num_classes: int, *, seed: int,
                    client: Optional[int] = None) -> nn.Module:
    """Client ``client`` 's network before any training, or the shared initial network when ``client`` is None or
    ``network.shared_init`` holds: built from the stream ``(seed, INIT, 0, client + 1)`` (shared: ``(seed, INIT, 0,
    0)``) in ``network.init``'s initialisation."""
    key = 0 if client is None or network.shared_init else int(client) + 1
    stream = derive_seed(seed, Stream.INIT, 0, key)
    with seeded(stream):
        net = build_network(network, input_shape, num_classes)
    if network.init == "reference":
        reference_init_(net, generator=torch_generator(seed, Stream.INIT, 0, key))
    return net


def train_network(net: nn.Module, x: Tensor, y: Tensor, training: TrainingConfig, *, seed: int, round: int,
                  client: int) -> nn.Module:
    """Client ``client`` 's local step of round ``round`` on a deterministic network: a copy of ``net`` trained on
    ``(x, y)`` with ``training.schedule(round)``, drawing from ``(seed, FIT, round, client)``; returned in eval
    mode (``net`` is not changed)."""
    schedule = training.schedule(round)
    fitted = DeterministicClient(net).fit(x, y, epochs=schedule.epochs, batch_size=training.batch_size,
                                          lr=schedule.lr, seed=derive_seed(seed, Stream.FIT, round, client),
                                          amsgrad=training.amsgrad, weight_decay=training.weight_decay)
    return fitted.net.eval()


def bayesian_client(net: nn.Module, bayesian: BayesianConfig) -> BayesianClient:
    """A variational Bayesian client of (a copy of) ``net`` with ``bayesian``'s prior, initial posterior scale and
    local reparameterisation; the in-process federation and the Flower client app build their clients here."""
    return BayesianClient(net, bayesian.build_prior(), init_scale=bayesian.init_scale,
                          local_reparameterization=bayesian.local_reparameterization)


def fit_bayesian(client: BayesianClient, x: Tensor, y: Tensor, training: TrainingConfig, *, seed: int, round: int,
                 index: int) -> float:
    """Client ``index`` 's local SVI of round ``round``: ``training.schedule(round)`` epochs, drawing from ``(seed,
    FIT, round, index)``. Returns its last epoch's loss (negative ELBO per example)."""
    schedule = training.schedule(round)
    client.fit(x, y, epochs=schedule.epochs, batch_size=training.batch_size, lr=schedule.lr,
               seed=derive_seed(seed, Stream.FIT, round, index), amsgrad=training.amsgrad)
    return float(client.losses_[-1])

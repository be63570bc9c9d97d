"""PFNM as an in-process federation (Yurochkin et al. 2019, section 4): J clients train MLPs on their partitions;
the server matches their neurons into one global network, in one communication round or over several.

Round 1: every sampled client trains its own MLP from its own initialisation (or a shared one). The server matches
them (:func:`~bnpfed.federated.server.pfnm_step`) into a global network whose width the Beta-Bernoulli process
decides. Round r > 1: each sampled client starts from :func:`~bnpfed.federated.server.client_start` -- its slice of
the global network if it was matched last round, the whole global network otherwise -- retrains it with the
round's schedule, and the server matches again, warm-started from the assignment the slices came from
(``PFNMConfig.warm_start``), so the global width can change from round to round.

No math lives here: local training is :func:`~bnpfed.federated.clients.train_network`, matching is
:func:`~bnpfed.federated.server.pfnm_step`; the Flower strategy :class:`bnpfed.flower.strategies.PFNMStrategy`
calls the same functions.

Usage::

    >>> from bnpfed.data import load_dataset
    >>> from bnpfed.federated.config import NetworkConfig, PFNMConfig, PartitionConfig, TrainingConfig
    >>> ds = load_dataset("digits", standardize=False)
    >>> parts = PartitionConfig(clients=3).split(ds.y_train.numpy(), seed=0)
    >>> federation = PFNMFederation(ds, parts, network=NetworkConfig(hidden=(20,), init="reference"),
    ...                             training=TrainingConfig(epochs=5), pfnm=PFNMConfig(), seed=0)
    >>> record = federation.run_round()
    >>> record.metrics["accuracy"] > 0.8, federation.match.hidden_sizes[0] >= 20
    (True, True)
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from bnpfed.data import Dataset
from bnpfed.federated.clients import initial_network, train_network
from bnpfed.federated.config import NetworkConfig, PFNMConfig, TrainingConfig
from bnpfed.federated.federation import Federation
from bnpfed.federated.partition import class_counts
from bnpfed.federated.server import client_start, match_hyperparameters, pfnm_step
from bnpfed.inference.multilayer import NetworkMatch, linear_layers, network_from_layers
from bnpfed.metrics import count_parameters

__all__ = ["PFNMFederation"]


class PFNMFederation(Federation):
    """J MLP clients and a PFNM server, round by round.

    :param Dataset dataset: train split (partitioned) and test split (evaluation).
    :param parts: J index arrays into ``dataset.y_train``.
    :param NetworkConfig network: the clients' MLP (``arch="mlp"``; PFNM here matches fully connected networks).
    :param TrainingConfig training: local training and its per-round schedule.
    :param PFNMConfig pfnm: matching hyper-parameters, warm start, client sampling.
    :param int seed: the experiment's seed.
    :param int ece_bins: bins of the calibration error. Default 15.
    :param initial_models: optional, the J networks the clients hold after round 1's local training when they were
        trained already with these settings and seed (an experiment's local models): round 1 then reuses them.

    Attributes: ``match`` (the last :class:`~bnpfed.inference.multilayer.NetworkMatch`), ``matched`` (the
    clients it matched, in its order), ``class_counts`` ((J, C) training examples per class of each client).
    """

    method = "pfnm-rounds"

    def __init__(self, dataset: Dataset, parts: Sequence, *, network: NetworkConfig, training: TrainingConfig,
                 pfnm: PFNMConfig, seed: int, ece_bins: int = 15,
                 initial_models: Optional[Sequence[nn.Module]] = None):
        super().__init__(dataset, parts, seed=seed, fraction=pfnm.fraction, ece_bins=ece_bins)
        for name, value, kind in (("network", network, NetworkConfig), ("training", training, TrainingConfig),
                                  ("pfnm", pfnm, PFNMConfig)):
            if not isinstance(value, kind):
                raise ValueError(f"{name}: expected a {kind.__name__}, got {type(value).__name__}")
        if network.arch != "mlp":
            raise ValueError(f"network.arch: PFNM matches fully connected networks, expected 'mlp', got "
                             f"{network.arch!r}")
        if initial_models is not None and len(initial_models) != self.num_clients:
            raise ValueError(f"initial_models: expected one network per client ({self.num_clients}), got "
                             f"{len(initial_models)}")
        self.network, self.training, self.pfnm = network, training, pfnm
        self.initial_models = initial_models
        self.class_counts = class_counts(dataset.y_train.numpy(), [p.numpy() for p in self.parts],
                                         dataset.num_classes)
        self.match: Optional[NetworkMatch] = None
        self.matched: list[int] = []

    def _start(self, round: int, j: int) -> tuple[nn.Module, Optional[list[Tensor]]]:
        if round == 1:
            net = initial_network(self.network, self.dataset.input_shape, self.dataset.num_classes, seed=self.seed,
                                  client=j)
            return net, None
        layers, ids = client_start(self.match, self.matched.index(j) if j in self.matched else None)
        return network_from_layers(layers), ids

    def _round(self, round, sampled):
        nets, starts = [], []
        for j in sampled:
            x, y = self.client_data[j]
            if round == 1 and self.initial_models is not None:
                nets.append(self.initial_models[j])
                starts.append(None)
                continue
            start, ids = self._start(round, j)
            nets.append(train_network(start, x, y, self.training, seed=self.seed, round=round, client=j))
            starts.append(ids)
        t0 = time.perf_counter()
        self.match = pfnm_step([linear_layers(n) for n in nets], self.class_counts[sampled], self.pfnm,
                               seed=self.seed, round=round, starts=None if round == 1 else starts)
        seconds = time.perf_counter() - t0
        self.matched = list(sampled)
        self._net = self.match.network().eval()
        return [], {"hidden": self.match.hidden_sizes, "parameters": count_parameters(self._net),
                    "hyperparameters": match_hyperparameters(self.match), "server_seconds": seconds}

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        if self.match is None:
            raise ValueError("no round has run yet: the federation has no global network")
        return self._net(x).softmax(-1)

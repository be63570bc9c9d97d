"""Federated rounds of variational Bayesian clients fused on a server (Ozer et al. 2022), and the FedAvg baseline.

"How to Combine Variational Bayesian Networks in Federated Learning": each of J clients holds a mean-field
Gaussian posterior over the Bayesian weights of a shared architecture (in the paper only the fully connected
weight matrices; convolutions and biases stay deterministic). Round ``t = 1 .. T``:

1. the server samples ``m = max(1, floor(fraction * J))`` clients without replacement
   (:func:`~bnpfed.federated.server.sample_clients`);
2. each sampled client k takes the global model -- the fused posterior and the averaged deterministic parameters
   -- and runs SVI on its ``n_k`` examples for E local epochs (:func:`~bnpfed.federated.clients.fit_bayesian`)
   under the configured prior (from round 2 on with ``BayesianConfig(round_prior="posterior")``, under the global
   posterior as prior);
3. the server fuses the sampled clients' posteriors weight by weight with one rule of :mod:`bnpfed.combine`
   (``eaa``, ``gaa``, ``log_variance``, ``pooling``, ``conflation``) under client weights ``b_k`` (``"size"``:
   ``b_k = n_k / sum_{j sampled} n_j``; ``"uniform"``: ``b_k = 1 / m``), floors the fused variances at
   ``min_variance``, and averages the deterministic parameters with the same ``b_k``
   (:func:`~bnpfed.federated.server.fuse_posteriors`);
4. the global model is evaluated on the test set: accuracy, NLL, ECE, Brier score of the posterior predictive
   (the softmax averaged over S weight draws), the mean posterior standard deviation of the Bayesian weights, and
   how many fused variances sat at the floor.

The baseline is FedAvg (McMahan et al. 2017) on the same architecture, with the same initial network, partition,
sampled clients, client weights and local schedule: deterministic networks whose parameters are averaged
(:func:`~bnpfed.federated.server.average_states`).

No fusion math lives here: the server steps are :mod:`bnpfed.federated.server`'s, which the Flower strategy
:class:`bnpfed.flower.strategies.PosteriorFusionStrategy` calls too.

Randomness (:mod:`bnpfed.seeding`): the initial network from ``(seed, INIT)``, the clients of round t from
``(seed, SAMPLING, t)``, client k's fit in round t from ``(seed, FIT, t, k)``, the pooling rule's draws from
``(seed, POOLING, t)``, the predictive draws of the evaluation after round t from ``(seed, PREDICT, t)``. Every rule
and the baseline therefore start from the same network and see the same sampled clients; the same seed gives the
same results, and Torch's global random state is left untouched.

Defaults (why): the bundled digits data (J = 10 clients of about 135 examples, MLP 64-100-10), batch 32, E = 2 local
epochs a round (10 steps on a digits client) at ``lr=1e-2``, the paper's N(0, 1) prior and the ELBO. Since 0.2 the
guide's scales learn at ten times the means' rate (``BayesianConfig.scale_lr_factor``), so that a client's variances
are the ELBO's rather than the optimiser's: they reach the prior's size within a few hundred steps wherever the data
do not pin a weight down. GAA and conflation divide the fused
variance by about J a round and keep FedAvg's accuracy; EAA, log-variance averaging and pooling pass the clients'
width on, every round restarts the clients from a posterior about as wide as the prior, and on clients this small
their global model falls towards chance within five rounds (one rate for all, ``scale_lr_factor=1``, the behaviour
before 0.2, kept every scale near ``init_scale=1e-2`` and every rule near FedAvg). With larger clients, lower ``lr``
as the steps per round grow (the Fashion-MNIST benchmark, 94 steps of 64 examples per epoch, uses ``lr=1e-3``).
Local reparameterisation is on, as in the paper. The docs' benchmark pages on posterior fusion and on calibration
("Which default reaches the optimum") have the numbers.

Usage::

    >>> from bnpfed.data import load_dataset
    >>> from bnpfed.federated.config import BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig
    >>> from bnpfed.federated.config import TrainingConfig
    >>> ds = load_dataset("digits")
    >>> parts = PartitionConfig(clients=5).split(ds.y_train.numpy(), seed=0)
    >>> federation = FusionFederation(ds, parts, network=NetworkConfig(hidden=(32,)), training=TrainingConfig(),
    ...                               bayesian=BayesianConfig(), fusion=FusionConfig(rule="eaa"), seed=0)
    >>> record = federation.run_round()          # record.sampled, record.weights, record.metrics
    >>> sorted(federation.global_posterior)      # {site: GaussianPosterior(loc, variance)}
    ['1.weight', '3.weight']
"""

from __future__ import annotations

import math
import time
from dataclasses import fields
from typing import Optional, Sequence

import torch
from torch import Tensor

from bnpfed.data import Dataset
from bnpfed.federated.clients import (bayesian_client, fit_bayesian, initial_network, program_client,
                                     server_program_client, start_round_prior_, train_network)
from bnpfed.federated.config import BayesianConfig, FusionConfig, NetworkConfig, TrainingConfig
from bnpfed.federated.federation import Federation, reestimate_statistics
from bnpfed.federated.server import average_states, fuse_posteriors, mean_sigma, with_statistics
from bnpfed.clients import DeterministicClient
from bnpfed.matching import batch_norm_order
from bnpfed.posterior import GaussianPosterior
from bnpfed.seeding import Stream, derive_seed
from bnpfed.validation import check_int

__all__ = ["FUSION_ARCHITECTURES", "FedAvgFederation", "FusionFederation", "check_fusion_network",
           "check_program_fusion"]

#: The architectures of :class:`~bnpfed.federated.config.NetworkConfig` posterior fusion takes: those without batch
#: norm (a batch norm's running statistics are no posterior to fuse, and averaging them is not what the paper does).
FUSION_ARCHITECTURES = ("mlp", "lenet", "lenet-paper", "simple-cnn")


def check_fusion_network(network: NetworkConfig) -> NetworkConfig:
    """The one rule of every posterior fusion (weight-wise or matched, in process or on Flower): a network of
    :data:`FUSION_ARCHITECTURES`, or a ``ValueError`` naming ``arch``."""
    if network.arch not in FUSION_ARCHITECTURES:
        raise ValueError(f"arch: posterior fusion expected one of {list(FUSION_ARCHITECTURES)} (no batch norm: its "
                         f"running statistics are no posterior), got {network.arch!r}")
    return network


def check_program_fusion(network: NetworkConfig, fusion: FusionConfig) -> None:
    """The rules of posterior fusion with a user's Pyro program (``BayesianConfig.program``), in process or on
    Flower, before anything trains: the program is the network, so ``network`` keeps every default (``arch``,
    ``hidden``, ...); the fusion is weight-wise (``fusion.align="none"``: matching reads a network's layers) from one
    shared start (not ``fusion.own_init``: every client's guide starts at the program's initial values).

    :raises ValueError: naming the setting that does not apply.
    """
    for f in fields(network):
        if getattr(network, f.name) != f.default:
            raise ValueError(f"{f.name}: a setting of the network that a Pyro program replaces "
                             f"(bayesian.program); expected its default {f.default!r}, got "
                             f"{getattr(network, f.name)!r}")
    if fusion.align != "none":
        raise ValueError(f"align: matched fusion lines up a network's hidden units; a Pyro program's clients are "
                         f"fused site by site, expected 'none' with bayesian.program, got {fusion.align!r}")
    if fusion.own_init:
        raise ValueError("own_init: a Pyro program's clients all start from the program's initial values (its guide's "
                         "from seed 0, its own parameters from the shared stream); expected False with "
                         "bayesian.program")


def _check_configs(**configs) -> None:
    kinds = {"network": NetworkConfig, "training": TrainingConfig, "bayesian": BayesianConfig,
             "fusion": FusionConfig}
    for name, value in configs.items():
        if not isinstance(value, kinds[name]):
            raise ValueError(f"{name}: expected a {kinds[name].__name__}, got {type(value).__name__}")


class FusionFederation(Federation):
    """J variational Bayesian clients and a server that fuses their posteriors with one rule, round by round.

    :param Dataset dataset: train split (partitioned) and test split (evaluation).
    :param parts: J index arrays into ``dataset.y_train``, one per client.
    :param NetworkConfig network: the network every client shares (its initial weights from ``(seed, INIT)``; with
        ``fusion.own_init`` each client starts round 1 from its own, ``(seed, INIT, 0, j + 1)``: the one-shot
        baseline that fusing weight by weight without alignment is: a damped average of unaligned units).
    :param TrainingConfig training: the clients' local SVI schedule.
    :param BayesianConfig bayesian: prior, initial posterior scale, local reparameterisation; or a user's Pyro program
        (``bayesian.program``, a registered name or a factory): every client and the server's model are then the
        program (:func:`~bnpfed.federated.clients.program_client`), fused site by site, every latent site
        (hyper-parameters included) in its guide's unconstrained space; ``network`` keeps its defaults
        (:func:`check_program_fusion`). In the rounds after the first a program's client starts from the fused
        posterior and trains against the program's own prior (its sample statements), as a network's client trains
        against the configured prior under the default ``round_prior``.
    :param FusionConfig fusion: the rule, client weights, pooling draws, variance floor, client sampling.
    :param int seed: the experiment's seed.
    :param int ece_bins: bins of the calibration error. Default 15.
    :param int predictive_samples: weight draws S of the posterior predictive. Default 10.
    :param initial_clients: with ``fusion.own_init``, optionally the J clients after round 1's local SVI with these
        settings and seed (an experiment's Bayesian clients): round 1 then reuses them.

    Attributes: ``clients`` (J :class:`~bnpfed.clients.BayesianClient` s), ``global_model`` (the server's
    client, holding the global model, used for evaluation), ``global_posterior`` (``{site: GaussianPosterior}``),
    ``global_deterministic`` (the averaged deterministic parameters), ``round``, ``history``.
    """

    def __init__(self, dataset: Dataset, parts: Sequence, *, network: NetworkConfig, training: TrainingConfig,
                 bayesian: BayesianConfig, fusion: FusionConfig, seed: int, ece_bins: int = 15,
                 predictive_samples: int = 10, initial_clients: Optional[Sequence] = None):
        super().__init__(dataset, parts, seed=seed, fraction=fusion.fraction, ece_bins=ece_bins)
        if initial_clients is not None and (not fusion.own_init or len(initial_clients) != self.num_clients):
            raise ValueError(f"initial_clients: expected one client per partition ({self.num_clients}) trained from "
                             f"its own initialisation (fusion.own_init), got {len(initial_clients)}")
        self.initial_clients = initial_clients
        _check_configs(network=network, training=training, bayesian=bayesian, fusion=fusion)
        training.check_inputs(dataset.input_shape)
        bayesian.check_task(dataset.task)
        self.bayesian = bayesian
        if bayesian.client != "variational":
            raise ValueError(f"bayesian.client: weight-wise posterior fusion trains variational clients from the "
                             f"global posterior each round; Laplace clients serve matched fusion "
                             f"(MatchedFusionFederation, fusion.align='match'), got client={bayesian.client!r}")
        if bayesian.program is not None:
            check_program_fusion(network, fusion)
        else:
            check_fusion_network(network)
        if fusion.temperature != 1:
            raise ValueError(f"fusion.temperature: the predictive temperature of matched fusion's global posterior "
                             f"(MatchedFusionFederation); expected 1 for weight-wise fusion, got "
                             f"{fusion.temperature!r}")
        bayesian.check_training(training)
        fusion.client_prior(bayesian)   # raises if bayesian.round_prior does not apply to this fusion
        self.training, self.fusion = training, fusion
        self.method = fusion.rule
        self.predictive_samples = check_int(predictive_samples, "predictive_samples", low=1)
        self.shared_init = not fusion.own_init
        if bayesian.program is not None:   # a user's Pyro program: every client and the server call its factory
            self.global_model = server_program_client(bayesian, dataset.input_shape, dataset.task, seed=seed)
            self.clients = [program_client(bayesian, x, y, seed=seed) for x, y in self.client_data]
        else:
            net = initial_network(network, dataset.input_shape, dataset.num_classes, seed=seed)  # the shared one
            self.global_model = bayesian_client(net, bayesian)
            self.clients = [bayesian_client(net if self.shared_init else initial_network(
                network, dataset.input_shape, dataset.num_classes, seed=seed, client=j), bayesian)
                for j in range(self.num_clients)]
        self.global_posterior: dict[str, GaussianPosterior] = dict(self.global_model.posterior())
        self.global_deterministic: dict[str, Tensor] = self.global_model.deterministic_state()

    def _round(self, round, sampled):
        losses = []
        for k in sampled:
            if round == 1 and self.initial_clients is not None:  # trained already, with these settings and seed
                # a copy (later rounds train it further): its posterior and deterministic parameters
                self.clients[k].load_posterior(self.initial_clients[k].posterior())
                self.clients[k].load_deterministic(self.initial_clients[k].deterministic_state())
                continue
            client = self.clients[k]
            if self.shared_init or round > 1:  # without a shared one, round 1 starts from the client's own init
                client.load_posterior(self.global_posterior)
                client.load_deterministic(self.global_deterministic)
            start_round_prior_(client, self.bayesian, round)
            x, y = self.client_data[k]
            losses.append(fit_bayesian(client, x, y, self.training, seed=self.seed, round=round, index=k,
                                       scale_lr_factor=self.bayesian.scale_lr_factor))
        step = fuse_posteriors([self.clients[k].posterior() for k in sampled],
                               [self.clients[k].deterministic_state() for k in sampled],
                               [self.sizes[k] for k in sampled], self.fusion, seed=self.seed, round=round)
        self.global_posterior, self.global_deterministic = step.posterior, step.deterministic
        self.global_model.load_posterior(self.global_posterior)
        self.global_model.load_deterministic(self.global_deterministic)
        return step.weights, {"train_loss": sum(losses) / len(losses) if losses else math.nan,
                              "mean_sigma": mean_sigma(g.variance for g in self.global_posterior.values()),
                              "min_variance": step.min_variance, "floored": step.floored,
                              "server_seconds": step.seconds}

    tasks = ("classification", "regression")

    def predict_observations(self, x: Tensor) -> list:
        """A regression's posterior predictive: the observation distributions of ``predictive_samples`` draws from
        the global posterior, drawn from ``(seed, PREDICT, round)``."""
        return self.global_model.sample_observations(x, num_samples=self.predictive_samples,
                                                     seed=derive_seed(self.seed, Stream.PREDICT, self.round))

    def predict_proba(self, x: Tensor) -> Tensor:
        """The posterior predictive: softmax averaged over ``predictive_samples`` weight draws from the global
        posterior, drawn from ``(seed, PREDICT, round)``."""
        return self.global_model.predict_proba(x, num_samples=self.predictive_samples,
                                               seed=derive_seed(self.seed, Stream.PREDICT, self.round))


class FedAvgFederation(Federation):
    """FedAvg (McMahan et al. 2017): J deterministic clients of one network, starting every round from the average
    of the last round's, from a shared initialisation (``(seed, INIT)``). A network with batch norm gets its running
    statistics re-estimated after every average from the sampled clients' moments of the averaged network.

    :param NetworkConfig network: the network (its ``shared_init`` is implied).
    :param TrainingConfig training: local training.
    :param str weights: client weights ``b_k``, ``"size"`` or ``"uniform"``. Default ``"size"``.
    :param float fraction: share of the clients sampled per round. Default 1.

    Attributes: ``global_model`` (a :class:`~bnpfed.clients.DeterministicClient` holding the average),
    ``global_state``, ``round``, ``history``.
    """

    method = "fedavg"

    def __init__(self, dataset: Dataset, parts: Sequence, *, network: NetworkConfig, training: TrainingConfig,
                 seed: int, weights: str = "size", fraction: float = 1.0, ece_bins: int = 15):
        super().__init__(dataset, parts, seed=seed, fraction=fraction, ece_bins=ece_bins)
        _check_configs(network=network, training=training)
        training.check_inputs(dataset.input_shape)
        self.training, self.weights = training, weights
        net = initial_network(network, dataset.input_shape, dataset.num_classes, seed=seed)
        self.batch_norms = batch_norm_order(net, dataset.input_shape)
        self.global_model = DeterministicClient(net)
        self.global_state: dict[str, Tensor] = self.global_model.state()

    def _round(self, round, sampled):
        states = []
        for k in sampled:
            x, y = self.client_data[k]
            trained = train_network(self.global_model.net, x, y, self.training, seed=self.seed, round=round,
                                    client=k)
            states.append({name: p.detach() for name, p in trained.named_parameters()})
        t0 = time.perf_counter()
        self.global_state, weights = average_states(states, [self.sizes[k] for k in sampled], self.weights)
        self.global_model.load_state(self.global_state)
        seconds = time.perf_counter() - t0
        if self.batch_norms:
            # averaging moves the parameters, not a batch norm's running statistics: re-estimate them from the
            # sampled clients' moments of the averaged network (the client and server steps PFNM uses)
            net = self.global_model.net
            state = net.state_dict()

            def network_of(k, statistics):
                net.load_state_dict(with_statistics(state, statistics))
                return net

            statistics = reestimate_statistics(self.batch_norms, [self.client_data[k][0] for k in sampled],
                                               self.training.batch_size, network_of)
            net.load_state_dict(with_statistics(state, statistics))
        return weights, {"server_seconds": seconds}

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        return self.global_model.net.eval()(x).softmax(-1)

"""PFNM as an in-process federation (Yurochkin et al. 2019, section 4), for any network with a permutation spec (MLPs,
LeNet, FedMA's simple CNN with or without batch norm): J clients train their networks on their partitions; the
server matches their units (hidden neurons, conv channels) into one global network, in one communication round or
over several; optionally layer by layer with retraining in between, as FedMA does (Wang et al., ICLR 2020).

Round 1: every sampled client trains its own network from its own initialisation (or a shared one). The server
matches them (:func:`~bnpfed.federated.server.pfnm_step`, group by group of the spec, bottom-up) into a global
network whose widths the Beta-Bernoulli process decides. Round r > 1: each sampled client starts from
:func:`~bnpfed.federated.server.client_start` -- its slice of the global network if it was matched last round, the
whole global network otherwise -- retrains it with the round's schedule, and the server matches again,
warm-started from the assignment the slices came from (``PFNMConfig.warm_start``), so the global widths can change
from round to round.

Batch norm: after every match the global network's running statistics are re-estimated from the matched clients'
data (each computes :func:`~bnpfed.federated.clients.batch_norm_moments_step` of the global network, the server sums
them, :func:`~bnpfed.federated.server.batch_norm_step`); the members' mean statistics the match gives leave a merged
network near chance (see :mod:`bnpfed.matching.permutation`).

FedMA's layer-wise scheme (``PFNMConfig(layerwise_retrain=E)``, E >= 1): within a round, the server matches the
lowest group only (:func:`~bnpfed.federated.server.fedma_group_step`); every client takes the matched units
(:func:`~bnpfed.matching.permutation.align_to_group`: the global units of that layer, the next layer's input
columns re-indexed to them), its batch-norm statistics are re-estimated, the clients retrain everything above for E
epochs with the matched layers frozen (:func:`~bnpfed.federated.clients.train_network` with ``frozen``), and the
server matches the next group, up to the last hidden one (which carries the output layer). Then every client holds
the same network: the global one. Later rounds ("FedMA with communication") start each client from its slice of it,
as PFNM's do.

No math lives here: local training is :func:`~bnpfed.federated.clients.train_network`, matching is
:mod:`bnpfed.federated.server`'s; the Flower strategy :class:`bnpfed.flower.strategies.PFNMStrategy` calls the same
functions.

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

import torch
from torch import Tensor, nn

from bnpfed.data import Dataset
from bnpfed.federated.clients import initial_network, pool_nll_step, train_network, unit_activity_step
from bnpfed.federated.config import FIT, NetworkConfig, PFNMConfig, TrainingConfig, check_pool_temperature_applies
from bnpfed.federated.federation import Federation, reestimate_statistics
from bnpfed.federated.partition import class_counts
from bnpfed.federated.rounds import Architecture, HoldsRounds, MatchRounds
from bnpfed.federated.server import (drop_inactive, ensemble_parameters, fedma_group_step, fedma_width_limits,
                                     matched_parameters, pfnm_step, with_statistics)
from bnpfed.matching import SpecMatch, align_to_group
from bnpfed.matching import averaging_weights
from bnpfed.matching import fit_temperature, pooled_network, set_temperature
from bnpfed.metrics import count_parameters

__all__ = ["PFNMFederation", "temper_pool"]


def temper_pool(net: nn.Module, value, client_data: Sequence[tuple[Tensor, Tensor]]) -> float:
    """Set the temperature of ``net`` 's pooled heads to ``value`` (a number) or, with ``"fit"``, to
    :func:`~bnpfed.matching.pooled_heads.fit_temperature` of every client's
    :func:`~bnpfed.federated.clients.pool_nll_step` on its ``(x, y)`` of ``client_data``; return it."""
    if value == FIT:
        value = fit_temperature([pool_nll_step(net, x, y) for x, y in client_data])
    set_temperature(net, value)
    return float(value)


class PFNMFederation(HoldsRounds, Federation):
    """J clients of one network kind and a PFNM server, round by round (FedMA's layer-wise server with
    ``pfnm.layerwise_retrain``).

    :param Dataset dataset: train split (partitioned) and test split (evaluation).
    :param parts: J index arrays into ``dataset.y_train``.
    :param NetworkConfig network: the clients' network (any ``arch``; its permutation spec is derived once).
    :param TrainingConfig training: local training and its per-round schedule.
    :param PFNMConfig pfnm: matching hyper-parameters, warm start, client sampling, layer-wise retraining.
    :param int seed: the experiment's seed.
    :param int ece_bins: bins of the calibration error. Default 15.
    :param initial_models: optional, the J networks the clients hold after round 1's local training when they were
        trained already with these settings and seed (an experiment's local models): round 1 then reuses them.

    Attributes: ``rounds`` (the server's :class:`~bnpfed.federated.rounds.MatchRounds`: the last match, the clients
    it matched, what each client was sent), ``match`` and ``matched`` (the last
    :class:`~bnpfed.matching.permutation.SpecMatch` and its clients), ``class_counts`` ((J, C) training examples per
    class of each client), ``architecture`` (the clients' network kind: ``template``, ``spec``, ``batch_norms``),
    ``spec`` and ``template`` (its spec and template network).
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
        training.check_inputs(dataset.input_shape)
        if initial_models is not None and len(initial_models) != self.num_clients:
            raise ValueError(f"initial_models: expected one network per client ({self.num_clients}), got "
                             f"{len(initial_models)}")
        self.class_counts = class_counts(dataset.y_train.numpy(), [p.numpy() for p in self.parts],
                                         dataset.num_classes)
        pfnm = pfnm.with_heads(self.class_counts)   # heads="auto": pooled when the clients' class shares differ
        check_pool_temperature_applies(pfnm, pfnm.heads == "pooled")
        self.network, self.training, self.pfnm = network, training, pfnm
        if pfnm.layerwise_retrain:
            self.method = "fedma-rounds"
        if pfnm.heads == "pooled":
            self.method += "-pooled"
        self.initial_models = initial_models
        self.architecture = Architecture.of(network, dataset.input_shape, dataset.num_classes, seed=seed)
        self.rounds = MatchRounds(self.architecture)
        self.matched_states: Optional[list] = None   # the sampled clients' states the last round matched

    def _statistics(self, sampled: Sequence[int], layers: Sequence[str], states: Sequence[dict]) -> dict:
        """The batch-norm statistics of ``layers`` re-estimated from the sampled clients' data, each client's network
        carrying its state of ``states`` (one for all: the global network; one each: FedMA's aligned ones)."""
        def network_of(k, statistics):
            return self.architecture.network(with_statistics(states[k if len(states) > 1 else 0], statistics))

        return reestimate_statistics(layers, [self.client_data[j][0] for j in sampled], self.training.batch_size,
                                     network_of)

    def _round(self, round, sampled):
        nets = []
        for j in sampled:
            x, y = self.client_data[j]
            if round == 1 and self.initial_models is not None:
                self.rounds.start(j)
                nets.append(self.initial_models[j])
                continue
            start = self.rounds.start(j)
            net = (initial_network(self.network, self.dataset.input_shape, self.dataset.num_classes, seed=self.seed,
                                   client=j) if start is None else self.architecture.network(start))
            nets.append(train_network(net, x, y, self.training, seed=self.seed, round=round, client=j))
        states = [{k: v.detach() for k, v in n.state_dict().items()} for n in nets]
        starts = self.rounds.warm_start(sampled)
        activity = None
        if self.pfnm.inactive != "keep":   # each client's report on its units, on its own (training) data
            activity = [unit_activity_step(net, self.client_data[j][0], self.dataset.input_shape,
                                           self.training.batch_size) for net, j in zip(nets, sampled)]
        if self.pfnm.layerwise_retrain:
            ensemble = ensemble_parameters(self.template, len(sampled))
            if activity is not None:
                states, starts = drop_inactive(states, self.spec, activity, starts)
            match, seconds = self._layerwise(round, sampled, states, starts, ensemble)
        else:
            self.matched_states = states
            t0 = time.perf_counter()
            match = pfnm_step(states, self.class_counts[sampled], self.pfnm, seed=self.seed, round=round,
                              starts=starts, spec=self.spec, template=self.template, activity=activity)
            seconds = time.perf_counter() - t0
            if self.architecture.batch_norms:
                match.state = with_statistics(match.state, self._statistics(sampled, self.architecture.batch_norms,
                                                                            [match.state]))
        self.rounds.update(match, sampled)
        pooled = {}
        if self.pfnm.heads == "pooled":
            self._net = self.pooled_network()
            pooled["pool_temperature"] = self.pool_temperature_(sampled)
        else:
            self._net = match.network().eval()
        return [], {**self.rounds.summary(), "parameters": count_parameters(self._net), "server_seconds": seconds,
                    **pooled}

    def pool_temperature_(self, clients: Sequence[int]) -> float:
        """Set the pooled global network's temperature as ``pfnm.pool_temperature`` says (:func:`temper_pool`, the
        ``clients`` ' training data scoring it under ``"fit"``) and return it."""
        return temper_pool(self._net, self.pfnm.pool_temperature, [self.client_data[j] for j in clients])

    def _layerwise(self, round: int, sampled: list[int], states: list[dict], starts, ensemble: int
                   ) -> tuple[SpecMatch, float]:
        """FedMA's round: group by group, match (``max_params`` split into widths before each group by
        :func:`~bnpfed.federated.server.fedma_width_limits`, ``ensemble`` the clients' parameters together), align
        every client to it, re-estimate its batch norm, retrain the layers above (see the module docstring). A width
        no strength meets is kept as near as the matcher can under the default budget and in every round after the
        first (:meth:`~bnpfed.federated.config.PFNMConfig.best_effort_in`), refused otherwise."""
        spec, names = self.spec, self.spec.group_names
        output_group = spec.owner(spec.params_of_kind("output_weight")[0])
        counts = self.class_counts[sampled]
        matches, seconds = {}, 0.0
        best_effort = self.pfnm.best_effort_in(round)
        for c, group in enumerate(names):
            t0 = time.perf_counter()
            config = fedma_width_limits(self.pfnm, spec, self.template, states, ensemble,
                                        matched={g: m.size for g, m in matches.items()}, best_effort=best_effort)
            if group == output_group:
                self.matched_states = states   # the output layers as the clients retrained them last
            match = fedma_group_step(states, counts, config, spec=spec, group=group, seed=self.seed,
                                     round=round, starts=starts, best_effort=best_effort)
            states = [align_to_group(s, spec, match, k) for k, s in enumerate(states)]
            seconds += time.perf_counter() - t0
            matches[group] = match
            owned = {k.rpartition(".")[0] for k in spec.owned(group) if k in self.architecture.statistics}
            layers = [n for n in self.architecture.batch_norms if n in owned]
            if layers:
                statistics = self._statistics(sampled, layers, states)
                states = [with_statistics(s, statistics) for s in states]
            if c + 1 < len(names):
                frozen = matched_parameters(spec, names[:c + 1])
                states = [{k: v.detach() for k, v in train_network(
                    self.architecture.network(s), *self.client_data[j], self.training, seed=self.seed,
                    round=round, client=j, epochs=self.pfnm.layerwise_retrain, frozen=frozen,
                    step=c + 1).state_dict().items()} for s, j in zip(states, sampled)]
        last = matches[output_group]
        return SpecMatch(spec=spec, state=states[0], assignments={g: m.assignments for g, m in matches.items()},
                         layer_results={g: m.result for g, m in matches.items()}, template=self.template,
                         seconds=seconds, hyperparameters={g: m.hyperparameters for g, m in matches.items()},
                         class_shares=averaging_weights(torch.as_tensor(counts, dtype=torch.float64)),
                         output_bias_mu0=last.output_bias_mu0,
                         size_searches={g: m.size_search for g, m in matches.items() if m.size_search is not None}
                         ), seconds

    def pooled_network(self) -> nn.Module:
        """The last round's global network with the matched clients' own output layers in place of its averaged
        one, pooled log-linearly with class-share weights (:func:`~bnpfed.matching.pooled_network`; under FedMA's
        layer-wise scheme the output layers as the clients retrained them before the last group was matched)."""
        if self.match is None:
            raise ValueError("no round has run yet: the federation has no global network")
        return pooled_network(self.match, self.matched_states)

    def global_network(self) -> nn.Module:
        """The last round's global network as the federation predicts with it: the match's, or with
        ``pfnm.heads="pooled"`` :meth:`pooled_network`."""
        if self.match is None:
            raise ValueError("no round has run yet: the federation has no global network")
        return self._net

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        if self.match is None:
            raise ValueError("no round has run yet: the federation has no global network")
        return self._net(x).softmax(-1)

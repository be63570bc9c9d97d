"""Weight-wise posterior fusion under secure aggregation (SecAgg+) as a Flower strategy.

The rules EAA, GAA, log-variance averaging and conflation need only sums over clients of per-client statistics
(:mod:`bnpfed.combine.secure`), and Flower ships a protocol that computes such sums without showing the server any
one client's vector: SecAgg+ (Bell et al., CCS 2020), the server's ``SecAggPlusWorkflow`` and the clients'
``secaggplus_mod``. A round of :class:`SecureFusionStrategy` has two steps:

1. **train** (as :class:`~bnpfed.flower.strategies.PosteriorFusionStrategy`): each sampled client gets the global
   posterior, runs SVI, keeps its posterior to itself (the ClientApp's ``context.state``) and replies with its
   example count ``n_k`` and training loss only;
2. **secure sum**: the server computes the client weights ``b_k`` from the counts and runs SecAgg+ with the clients
   that answered: every client sends its statistics, centred and scaled at the global posterior it was sent
   (:func:`~bnpfed.combine.secure.sum_statistics` with its ``b_k`` and ``b_max``), masked; the server unmasks only
   their sum and fuses from it (:func:`~bnpfed.combine.secure.fuse_sums`). A client that drops out during the
   protocol is left out of the sum (SecAgg+ reconstructs its masks from its neighbours' shares) and the weights of
   the others are renormalised, so the global posterior is the rule over the clients that remained; with fewer
   clients left than the reconstruction threshold, the round fails with a message saying so.

What each party sees (the threat model of SecAgg+: an honest-but-curious server and clients, of which fewer than
the threshold collude). The server sees every client's example count (it weights the clients), its training loss,
and the sum over the round's clients of their quantised statistics: the fused posterior, nothing of one client's.
A client sees the global posterior and the other clients' public keys. An eavesdropper on the network sees, with TLS
on (``bnpfed flower --help``), nothing; without it, masked vectors that are uniformly random on their own, the
counts and the losses. The global posterior itself is public to every client (it is what they are sent), so what a
run releases is what any weight-wise fusion releases; secure aggregation removes the per-client posteriors from the
server's view, not the differences between successive global models (no differential privacy is added).

What the quantisation costs: each statistic must lie in ``[-c, c]`` (a client whose statistic would be clipped
fails its round instead, naming ``secagg-clipping-range``) and travels in two limbs of ``Q`` levels each
(:func:`~bnpfed.combine.secure.split_limbs`); the sums are off by less than ``K (2c / Q)^2 / 2c``
(:func:`~bnpfed.combine.secure.quantisation_bound`), in units of the global posterior's standard deviation
(locations) or of its variance (variances), plus float64 rounding. The measured effect on the fused moments is on
the docs' benchmark page on posterior fusion (secure aggregation).

Matching (PFNM, matched fusion) needs each client's units in the clear: the assignment is computed from them.
The compromise is to match once in the clear and then fuse aligned posteriors under secure aggregation, where the
assignment is fixed: :class:`SecureMatchedFusionStrategy` matches in round 1 and, from round 2, has every client
start from the whole matched global posterior (aligned with it by construction) and fuses weight by weight under
SecAgg+.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common.recorddict_compat import fitres_to_recorddict, recorddict_to_fitins
from flwr.server import ServerConfig, SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp import Grid

from bnpfed.federated import BayesianConfig, FusionConfig, NetworkConfig
from bnpfed.federated import bayesian_from_match, client_from_slice
from bnpfed.federated import client_weights, floor_variances, mean_sigma
from bnpfed.flower.config import SecureAggregationConfig
from bnpfed.flower.records import (NodeIdentity, array_shapes, from_array_record, posterior_from_arrays,
                                   posterior_to_record, read_finite)
from bnpfed.flower.strategies import LOGGER, Accepted, MatchedFusionStrategy, PosteriorFusionStrategy
from bnpfed.posterior import GaussianPosterior
from bnpfed.combine import (deterministic_from_sum, deterministic_statistic, fuse_sums, join_limbs, quantisation_bound,
                            quantization_range, split_limbs, statistic_names, sum_statistics)

__all__ = ["POSTERIOR_STATE", "REFERENCE_STATE", "SecureFusionStrategy", "SecureMatchedFusionStrategy",
           "client_at_widths", "client_statistics", "keep_for_secure_sum", "secure_fit", "statistic_keys"]

#: Where a client keeps, between the two steps of a round, its posterior and the global posterior it was sent
#: (``context.state.array_records``; they never leave the client).
POSTERIOR_STATE, REFERENCE_STATE = "bnpfed-secure-posterior", "bnpfed-secure-reference"
#: SecAgg+'s modulus, a power of two: masked vectors are summed modulo it.
MODULUS = 1 << 32


def statistic_keys(global_keys: Sequence[str], rule: str) -> list[str]:
    """The order in which client and server lay the statistics out: for each Bayesian site of the global model
    (``loc/<site>`` keys, sorted) its two statistics ``<statistic>/<site>``, then each deterministic parameter
    ``param/<name>`` (sorted)."""
    names = statistic_names(rule)
    sites = sorted(k.partition("/")[2] for k in global_keys if k.startswith("loc/"))
    params = sorted(k for k in global_keys if k.startswith("param/"))
    return [f"{name}/{site}" for site in sites for name in names] + params


def client_statistics(posterior: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], rule: str, *,
                      weight: float, max_weight: float, clipping_range: float, quantization_range: int
                      ) -> list[np.ndarray]:
    """A client's vector for the secure sum (float64): for every statistic of :func:`statistic_keys`, in that
    order, its two limbs (:func:`~bnpfed.combine.secure.split_limbs`). A deterministic parameter's statistic
    ``b_k (theta_k - theta_g)`` travels unscaled.

    :param posterior: its arrays as :func:`~bnpfed.flower.records.posterior_to_record` lays them out.
    :param reference: the global model it was sent, in the same layout.
    :raises ValueError: if a statistic falls outside ``[-clipping_range, clipping_range]`` (SecAgg+ would clip
        it), naming ``secagg-clipping-range``, the statistic and the range it needs.
    """
    out = []
    as64 = {k: torch.as_tensor(np.asarray(v), dtype=torch.float64) for k, v in posterior.items()}
    ref64 = {k: torch.as_tensor(np.asarray(v), dtype=torch.float64) for k, v in reference.items()}
    for key in statistic_keys(list(reference), rule):
        kind, _, site = key.partition("/")
        if kind == "param":
            value = deterministic_statistic(as64[key], ref64[key], weight=weight)
        else:
            value = sum_statistics(rule, as64[f"loc/{site}"], as64[f"variance/{site}"], ref64[f"loc/{site}"],
                                   ref64[f"variance/{site}"], weight=weight, max_weight=max_weight)[kind]
        largest = float(value.abs().max()) if value.numel() else 0.0
        if not largest <= clipping_range:
            raise ValueError(f"secagg-clipping-range: expected at least {largest:.4g} to hold statistic {key!r} of "
                             f"this client (secure aggregation would clip it), got {clipping_range}")
        out.extend(limb.numpy() for limb in split_limbs(value, clipping_range, quantization_range))
    return out


def _reason(failure: Exception) -> str:
    """A failed SecAgg+ reply in one line: its error's reason (a traceback's first line) and code."""
    error = failure.args[0] if failure.args else failure
    reason = getattr(error, "reason", None)
    if reason is None:
        return str(failure).splitlines()[0] if str(failure) else type(failure).__name__
    return f"{reason.splitlines()[0] if reason else 'no reason'} (error code {getattr(error, 'code', '?')})"


class _SecureRound:
    """The legacy strategy ``SecAggPlusWorkflow`` drives for one round: ``configure_fit`` gives each client its
    weight, ``aggregate_fit`` receives the unmasked mean of the clients' vectors (and the failures)."""

    def __init__(self, grid, run_id: int, nodes: Mapping[int, int], config: Mapping[int, dict]):
        self.grid, self.run_id, self.nodes, self.config = grid, run_id, nodes, config
        self.results: Optional[list] = None
        self.failures: list = []

    def configure_fit(self, server_round, parameters, client_manager):
        return [(GridClientProxy(self.nodes[j], self.grid, self.run_id),
                 FitIns(Parameters(tensors=[], tensor_type="numpy.ndarray"), dict(self.config[j])))
                for j in sorted(self.config)]

    def aggregate_fit(self, server_round, results, failures):
        self.results, self.failures = list(results), list(failures)
        return None, {}


class SecureFusionStrategy(PosteriorFusionStrategy):
    """Weight-wise posterior fusion (EAA, GAA, log-variance averaging, conflation) under SecAgg+ (module docstring):
    the rounds of :class:`~bnpfed.flower.strategies.PosteriorFusionStrategy` with the server seeing only sums.

    With every client in the sum the global posterior equals the plain run's within the quantisation bound
    (``history[r]["quantisation_bound"]``, in units of the global posterior's standard deviations and variances).

    :param FusionConfig fusion: as for :class:`~bnpfed.flower.strategies.PosteriorFusionStrategy` (a rule of
        :data:`~bnpfed.combine.secure.SECURE_RULES`).
    :param SecureAggregationConfig secure: the clipping range, the shares and the reconstruction threshold.
    :param kwargs: as for :class:`~bnpfed.flower.strategies.PosteriorFusionStrategy`.
    """

    task = "secure-fusion"

    def __init__(self, fusion: FusionConfig, secure: Optional[SecureAggregationConfig] = None, *, seed: int,
                 **kwargs: Any):
        super().__init__(fusion, seed=seed, **kwargs)
        secure = SecureAggregationConfig(secure_aggregation=True) if secure is None else secure
        if not isinstance(secure, SecureAggregationConfig):
            raise ValueError(f"secure: expected a SecureAggregationConfig, got {type(secure).__name__}")
        statistic_names(fusion.rule)   # a rule of sums, or a ValueError naming the rule
        self.secure = secure
        self._reference: ArrayRecord = ArrayRecord()   # the global model this round sent

    def _train_content(self, server_round, j, arrays):
        self._reference = arrays
        return super()._train_content(server_round, j, arrays)

    def _parse_train(self, reply):
        _, metrics, j, n = self._identity_and_count(reply)
        return Accepted(j, n, None, {"train_loss": read_finite(metrics, "train-loss")})

    def _aggregate(self, server_round, accepted):
        start = time.perf_counter()
        if len(accepted) < 2:
            raise RuntimeError(f"round {server_round}: secure aggregation needs at least 2 clients, got "
                               f"{len(accepted)} usable training replies")
        weights = dict(zip([a.partition_id for a in accepted],
                           client_weights([a.num_examples for a in accepted], self.fusion.weights)))
        levels = quantization_range(len(accepted))
        summed, failures, sums = self._secure_sums(server_round, weights, levels)
        b_max = max(weights.values())
        posterior, deterministic = self._fused(sums, self.fusion.rule, sum(weights[j] for j in summed),
                                               b_max / max(weights[j] for j in summed))
        posterior, floored, smallest = floor_variances(posterior, self.fusion.min_variance)
        summary = {"weights": [weights[j] for j in sorted(weights)], "secure_clients": summed,
                   "secure_failures": failures,
                   "quantisation_bound": quantisation_bound(self.secure.secagg_clipping_range, levels, len(summed)),
                   "train_loss": sum(a.metrics["train_loss"] for a in accepted) / len(accepted),
                   "mean_sigma": mean_sigma(g.variance for g in posterior.values()),
                   "min_variance": smallest, "floored": floored, "server_seconds": time.perf_counter() - start}
        return posterior_to_record(posterior, deterministic), summary

    def _secure_sums(self, server_round: int, weights: Mapping[int, float], levels: int
                     ) -> tuple[list[int], list[str], dict[str, torch.Tensor]]:
        """Run SecAgg+ over the clients of ``weights`` (each told its weight, the largest, the rule, the range and
        the levels); return the partitions whose vectors are in the sum, the failures (one line each) and
        ``{statistic key: sum}``.

        :raises RuntimeError: when the protocol halts (fewer clients left than its threshold)."""
        c = self.secure.secagg_clipping_range
        config = {j: {"weight": w, "max-weight": max(weights.values()), "rule": self.fusion.rule, "task": self.task,
                      "clipping-range": c, "levels": levels, "server-round": server_round}
                  for j, w in weights.items()}
        legacy = _SecureRound(self._grid, self._grid.run.run_id, self.nodes, config)
        context = LegacyContext(Context(run_id=self._grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                                        run_config={}),
                                config=ServerConfig(num_rounds=server_round), strategy=legacy,
                                client_manager=SimpleClientManager())
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round})
        context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        workflow = SecAggPlusWorkflow(num_shares=float(self.secure.secagg_shares),
                                      reconstruction_threshold=float(self.secure.secagg_threshold), max_weight=1.0,
                                      clipping_range=float(c), quantization_range=levels, modulus_range=MODULUS,
                                      timeout=self.query_timeout)
        state = WorkflowState()   # the workflow's __call__, stage by stage, to read its failures when it halts
        for stage in (workflow.setup_stage, workflow.share_keys_stage, workflow.collect_masked_vectors_stage,
                      workflow.unmask_stage):
            if not stage(self._grid, context, state):
                break
        failures = list(dict.fromkeys(_reason(f) for f in state.failures))   # the workflow records some twice
        for reason in failures:
            LOGGER.warning("round %d: secure aggregation: a client left the protocol: %s", server_round, reason)
        if not legacy.results:
            raise RuntimeError(f"round {server_round}: secure aggregation halted: fewer clients remained than its "
                               f"reconstruction threshold (secagg-threshold={self.secure.secagg_threshold} of "
                               f"secagg-shares={self.secure.secagg_shares} of the {len(weights)} clients); "
                               f"failures: {failures or 'none'}")
        node_partition = {node: j for j, node in self.nodes.items()}
        summed = sorted(node_partition[proxy.node_id] for proxy, _ in legacy.results)
        mean = parameters_to_ndarrays(legacy.results[0][1].parameters)   # SecAgg+ divides by the clients summed
        keys = statistic_keys(list(self._reference.keys()), self.fusion.rule)
        if len(mean) != 2 * len(keys):
            raise RuntimeError(f"round {server_round}: secure aggregation returned {len(mean)} arrays, expected "
                               f"two limbs of each of {len(keys)} statistics")
        limbs = [torch.as_tensor(a, dtype=torch.float64) * len(summed) for a in mean]
        return summed, failures, {key: join_limbs(limbs[2 * i], limbs[2 * i + 1], c, levels)
                                  for i, key in enumerate(keys)}

    def _fused(self, sums: Mapping[str, torch.Tensor], rule: str, total: float, ratio: float
               ) -> tuple[dict[str, GaussianPosterior], dict[str, torch.Tensor]]:
        """The global posterior and deterministic parameters from the sums, in the reference's dtypes."""
        arrays = from_array_record(self._reference)
        reference, _ = posterior_from_arrays(arrays, array_shapes(self._reference))
        ref = {k: torch.as_tensor(np.asarray(v)) for k, v in arrays.items()}
        names = statistic_names(rule)
        posterior, deterministic = {}, {}
        for site, (loc, variance) in reference.items():
            fused = fuse_sums(rule, {n: sums[f"{n}/{site}"] for n in names}, loc.double(), variance.double(),
                              weight_total=total, max_weight_ratio=ratio)
            posterior[site] = GaussianPosterior(fused.loc.to(loc.dtype), fused.variance.to(variance.dtype))
        for key in (k for k in ref if k.startswith("param/")):
            value = deterministic_from_sum(sums[key], ref[key].double(), weight_total=total)
            deterministic[key.partition("/")[2]] = value.to(ref[key].dtype)
        return posterior, deterministic


class SecureMatchedFusionStrategy(SecureFusionStrategy):
    """Matched posterior fusion's documented compromise with secure aggregation (run config ``method = "fusion"``,
    ``align = "match"``, ``secure-aggregation = true``): round 1 is a round of
    :class:`~bnpfed.flower.strategies.MatchedFusionStrategy` -- each client from its own initialisation, its units
    sent **in the clear** and matched by the server (matching cannot work on sums) -- and every later round is a
    round of :class:`SecureFusionStrategy` at the matched widths: each client starts from the whole matched global
    posterior (so every client's units are aligned with the global ones: the assignment is fixed), and the server
    sees only the sums of the secure rounds.

    :param FusionConfig fusion: as for :class:`~bnpfed.flower.strategies.MatchedFusionStrategy` (``align =
        "match"``, a rule of :data:`~bnpfed.combine.secure.SECURE_RULES`).
    :param SecureAggregationConfig secure: as for :class:`SecureFusionStrategy`.
    :param NetworkConfig network: the clients' network kind (without batch norm).
    :param BayesianConfig bayesian: the clients' prior.
    """

    def __init__(self, fusion: FusionConfig, secure: Optional[SecureAggregationConfig] = None, *, seed: int,
                 network: Optional[NetworkConfig] = None, bayesian: Optional[BayesianConfig] = None, **kwargs: Any):
        super().__init__(replace(fusion, align="none"), secure, seed=seed, **kwargs)
        self.matching = MatchedFusionStrategy(fusion, seed=seed, network=network, bayesian=bayesian, **kwargs)
        self.bayesian = self.matching.bayesian

    def connect(self, grid: Grid) -> NodeIdentity:
        """The matching round's strategy asks the SuperNodes for their partitions; this one takes its node map (and
        asks only nodes it does not know)."""
        identity = self.matching.connect(grid)
        self.identity, self.nodes, self.refused = identity, dict(self.matching.nodes), dict(self.matching.refused)
        self.gone = dict(self.matching.gone)
        return super().connect(grid)

    def configure_train(self, server_round, arrays, config, grid):
        if server_round == 1:
            if self.identity is None:
                self.connect(grid)
            return self.matching.configure_train(server_round, arrays, config, grid)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        if server_round > 1:
            return super().aggregate_train(server_round, replies)
        _, metrics = self.matching.aggregate_train(server_round, replies)
        self.history.append(self.matching.history[-1])
        client = bayesian_from_match(self.matching.match, self.bayesian)   # at the matched widths
        return posterior_to_record(client.posterior(), client.deterministic_state()), metrics

    def _aggregate(self, server_round, accepted):
        arrays, summary = super()._aggregate(server_round, accepted)
        return arrays, {"hidden": self.matching.history[0]["hidden"], **summary}   # matched in round 1, fixed since


def client_at_widths(template, posterior: Mapping[str, GaussianPosterior], deterministic: Mapping[str, torch.Tensor],
                     bayesian: BayesianConfig):
    """A Bayesian client of ``template``'s kind at the widths of ``(posterior, deterministic)`` (a weight-wise
    global model: the shared initial network's widths, or a matched network's), holding it; its prior
    ``bayesian``'s."""
    locs = {**{site: p.loc for site, p in posterior.items()}, **deterministic}
    return client_from_slice(template, locs, {site: p.variance for site, p in posterior.items()}, bayesian,
                             as_prior=False)


def secure_fit(msg: Message, context: Context) -> Message:
    """The client's part of the secure sum (what ``secaggplus_mod`` calls in its masked-vector stage): its
    statistics from the posterior and reference it kept in ``context.state`` after training, with the weights the
    server sent (``FitIns.config``); ``num_examples`` 1, so that SecAgg+ returns the plain mean of the vectors."""
    fitins = recorddict_to_fitins(msg.content, keep_input=True)
    config = fitins.config
    state = context.state.array_records
    if POSTERIOR_STATE not in state or REFERENCE_STATE not in state:
        raise ValueError("secure aggregation: this client holds no posterior of this round (it did not train)")
    vector = client_statistics(from_array_record(state[POSTERIOR_STATE]), from_array_record(state[REFERENCE_STATE]),
                               str(config["rule"]), weight=float(config["weight"]),
                               max_weight=float(config["max-weight"]),
                               clipping_range=float(config["clipping-range"]),
                               quantization_range=int(config["levels"]))
    res = FitRes(status=Status(code=Code.OK, message=""), parameters=ndarrays_to_parameters(vector), num_examples=1,
                 metrics={})
    return Message(content=fitres_to_recorddict(res, keep_input=False), reply_to=msg)


def keep_for_secure_sum(context: Context, posterior: Mapping[str, GaussianPosterior],
                        deterministic: Mapping[str, torch.Tensor], reference: ArrayRecord) -> None:
    """Keep a client's trained posterior and the global model it was sent in ``context.state`` for
    :func:`secure_fit`."""
    context.state.array_records[POSTERIOR_STATE] = posterior_to_record(posterior, deterministic)
    context.state.array_records[REFERENCE_STATE] = reference

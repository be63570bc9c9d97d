"""The server's steps, written once: pure functions that the in-process federations
(:mod:`bnpfed.federated.pfnm`, :mod:`bnpfed.federated.fusion`) and the Flower strategies
(:mod:`bnpfed.flower.strategies`) both call. With the same inputs they give the same outputs, bit for bit, so a
Flower run and an in-process run of the same settings give the same global models.

* :func:`sample_clients`: which of the J clients a round trains (``max(1, floor(fraction * J))`` of them, drawn
  without replacement from the stream ``(seed, SAMPLING, round)``);
* :func:`client_weights`: the normalised weights ``b_k`` of the clients of a round;
* :func:`fuse_posteriors`: posterior fusion (Ozer et al. 2022): every Bayesian site fused with one rule of
  :mod:`bnpfed.combine`, the deterministic parameters averaged with the same ``b_k``, variances floored at
  ``min_variance``;
* :func:`matched_fusion_step`: matched posterior fusion: the clients' Bayesian hidden units matched, each global unit's
  members' posteriors fused with one rule;
* :func:`average_states`: FedAvg's step, every parameter averaged with ``b_k``;
* :func:`pfnm_step`: PFNM (Yurochkin et al. 2019): match the clients' networks (any architecture with a permutation
  spec: MLPs, LeNet, FedMA's simple CNN, ...) into a global one, warm-started from what each client started its
  round from;
* :func:`client_start`: what a client starts its next round from: its slice of the global network, or the whole
  network if it was not matched;
* :func:`batch_norm_step`: the running statistics of a global network's batch norms from the clients' moments of
  its batch-norm inputs on their data (REPAIR's reset, federated), after every match or average;
* :func:`fedma_group_step` and :func:`matched_parameters`: FedMA's layer-wise scheme (Wang et al. 2020), one group at
  a time, the clients retraining what lies above the matched groups in between.

Usage::

    >>> sample_clients(10, 0.3, seed=0, round=1)       # the clients of round 1 when 30 % train each round
    [4, 8, 9]
    >>> client_weights([100, 300], "size")
    [0.25, 0.75]
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from bnpfed.combine import average_deterministic, fuse_sites
from bnpfed.federated.config import CLIENT_WEIGHTS, FusionConfig, PFNMConfig
from bnpfed.matching import drop_units, kept_per_client
from bnpfed.matching import width
from bnpfed.matching import (BatchNormMoments, GroupMatch, PermutationSpec, SpecMatch, batch_norm_statistics,
                             match_by_spec, match_group)
from bnpfed.matching import MIN_VARIANCE, PVI, match_posteriors
from bnpfed.matching import SizeLimitError, minimum_widths, proportional_widths
from bnpfed.metrics import count_parameters
from bnpfed.posterior import GaussianPosterior
from bnpfed.seeding import Stream, derive_seed, numpy_rng, torch_generator
from bnpfed.validation import check_choice, check_fraction, check_int

__all__ = [
    "FusionStep",
    "average_states",
    "batch_norm_step",
    "batch_norm_steps",
    "client_start",
    "client_weights",
    "clients_per_round",
    "drop_inactive",
    "ensemble_parameters",
    "fedma_width_limits",
    "fedma_group_step",
    "floor_variances",
    "fuse_posteriors",
    "match_hyperparameters",
    "mean_sigma",
    "matched_client_start",
    "matched_fusion_step",
    "matched_parameters",
    "pfnm_step",
    "sample_clients",
    "with_statistics",
]


def clients_per_round(num_clients: int, fraction: float) -> int:
    """``max(1, floor(fraction * J))``: how many clients a round samples (a rounding slack of 1e-9 keeps
    ``0.3 * 10`` at 3)."""
    check_int(num_clients, "num_clients", low=1)
    check_fraction(fraction, "fraction")
    return max(1, int(math.floor(fraction * num_clients + 1e-9)))


def sample_clients(num_clients: int, fraction: float, *, seed: int, round: int,
                   stream: Stream = Stream.SAMPLING) -> list[int]:
    """The sorted client indices a round trains: all of them when ``fraction`` gives J, else
    :func:`clients_per_round` drawn without replacement by ``numpy_rng(seed, stream, round)`` (``SAMPLING``; Flower's
    client-side evaluation draws its clients from ``EVALUATION``)."""
    m = clients_per_round(num_clients, fraction)
    if m == num_clients:
        return list(range(num_clients))
    rng = numpy_rng(seed, stream, round)
    return sorted(int(k) for k in rng.choice(num_clients, m, replace=False))


def client_weights(sizes: Sequence[int], scheme: str) -> list[float]:
    """Normalised client weights ``b_k``: ``n_k / sum_j n_j`` over the given clients (``"size"``) or ``1 / m``
    (``"uniform"``)."""
    check_choice(scheme, CLIENT_WEIGHTS, "weights")
    sizes = [check_int(n, f"sizes[{k}]", low=0) for k, n in enumerate(sizes)]
    if not sizes:
        raise ValueError("sizes: expected at least one client, got none")
    if scheme == "uniform":
        return [1.0 / len(sizes)] * len(sizes)
    total = sum(sizes)
    if total <= 0:
        raise ValueError(f"sizes: expected a positive total number of examples, got {sizes}")
    return [n / total for n in sizes]


@dataclass
class FusionStep:
    """What :func:`fuse_posteriors` returns.

    :param dict posterior: ``{site: GaussianPosterior}``, the fused global posterior.
    :param dict deterministic: ``{name: tensor}``, the averaged deterministic parameters.
    :param list weights: the clients' normalised weights ``b_k``.
    :param int floored: how many fused variances were raised to ``min_variance``.
    :param float min_variance: the smallest fused variance after the floor.
    :param float seconds: wall time of the step.
    """

    posterior: dict[str, GaussianPosterior]
    deterministic: dict[str, Tensor]
    weights: list[float]
    floored: int = 0
    min_variance: float = math.nan
    seconds: float = 0.0


def floor_variances(fused: Mapping[str, GaussianPosterior], min_variance: float
                    ) -> tuple[dict[str, GaussianPosterior], int, float]:
    """``(fused, floored, smallest)``: every fused variance below ``min_variance`` raised to it (none when it is
    0), how many were, and the smallest variance after the floor."""
    out, floored, smallest = dict(fused), 0, math.inf
    for site, (loc, variance) in fused.items():
        if min_variance > 0:
            floored += int((variance < min_variance).sum())
            variance = variance.clamp_min(min_variance)
            out[site] = GaussianPosterior(loc, variance)
        smallest = min(smallest, float(variance.min()))
    return out, floored, smallest


def fuse_posteriors(posteriors: Sequence[Mapping[str, GaussianPosterior]],
                    deterministic: Sequence[Mapping[str, Tensor]], sizes: Sequence[int], config: FusionConfig, *,
                    seed: int, round: int) -> FusionStep:
    """Posterior fusion's server step for the clients of one round, in a fixed order (client index).

    Every Bayesian site is fused with ``config.rule`` under the weights ``b_k = client_weights(sizes,
    config.weights)`` (the pooling rule draws from ``torch_generator(seed, POOLING, round)``); every fused variance
    below ``config.min_variance`` is raised to it (and counted); the deterministic parameters are averaged with the
    same ``b_k``.

    :param posteriors: per client, ``{site: (loc, variance)}``, the same sites and shapes.
    :param deterministic: per client, ``{name: tensor}`` (may be empty dicts).
    :param sizes: per client, its number of training examples ``n_k``.
    """
    start = time.perf_counter()
    if not isinstance(config, FusionConfig):
        raise ValueError(f"config: expected a FusionConfig, got {type(config).__name__}")
    if len(posteriors) != len(sizes) or len(deterministic) != len(sizes):
        raise ValueError(f"posteriors, deterministic and sizes: expected one entry per client each, got "
                         f"{len(posteriors)}, {len(deterministic)} and {len(sizes)}")
    weights = client_weights(sizes, config.weights)
    fused = fuse_sites(list(posteriors), config.rule, weights, num_samples=config.pooling_samples,
                       generator=torch_generator(seed, Stream.POOLING, round))
    fused, floored, smallest = floor_variances(fused, config.min_variance)
    names = list(deterministic[0]) if deterministic else []
    for k, state in enumerate(deterministic):
        if list(state) != names:
            raise ValueError(f"deterministic[{k}]: expected the parameters {names}, got {list(state)}")
    params = {name: average_deterministic([s[name] for s in deterministic], weights) for name in names}
    return FusionStep(posterior=fused, deterministic=params, weights=weights, floored=floored,
                      min_variance=smallest, seconds=time.perf_counter() - start)


def matched_fusion_step(clients: Sequence, class_counts, sizes: Sequence[int], config: FusionConfig, *, seed: int,
                        round: int, starts: Optional[Sequence[Optional[Mapping[str, Tensor]]]] = None,
                        spec: Optional[PermutationSpec] = None, template: Optional[nn.Module] = None,
                        input_shape: Optional[Sequence[int]] = None, factors: Optional[Sequence] = None,
                        prior_variance: float = 1.0, match_on: str = "posteriors",
                        activity: Optional[Sequence[Mapping[str, Tensor]]] = None):
    """Matched posterior fusion's server step (``config.align == "match"``): the clients' hidden units matched group
    by group under the heteroscedastic Beta-Bernoulli model, every global unit's members fused with ``config.rule``
    (:func:`~bnpfed.matching.posteriors.match_posteriors`).

    Member weights are the clients' example counts (``config.weights="size"``) or equal (``"uniform"``); the output
    coordinates use the class shares. Fused variances are floored at ``config.min_variance`` (at
    :data:`~bnpfed.matching.posteriors.MIN_VARIANCE` when that is 0). The sweeps and the pooling draws derive
    from ``derive_seed(seed, MATCH, round)``.

    :param clients: per client, its ``(locs, variances)``
        (:func:`~bnpfed.matching.posteriors.client_posterior`).
    :param class_counts: ``(J, C)`` training examples per class of each client.
    :param sizes: per client, ``n_k``.
    :param starts: None in round 1; later, per client, the global ids of its units per group it started the round
        from (the warm start of the matching; with ``config.later_rounds="fixed"`` the assignment itself).
    :param factors: ``config.rule == "pvi"``: per client its approximate-likelihood factor (None: each posterior
        over the prior, round 1); ``prior_variance`` the clients' prior variance.
    :param str match_on: what the assignment is computed from, ``config.matches_on(client kind)``: ``"posteriors"``
        or ``"means"`` (then ``activity``, per client its :func:`~bnpfed.federated.clients.unit_activity_step` of its
        posterior-mean network, leaves its dead units out).
    :returns: :class:`~bnpfed.matching.posteriors.PosteriorMatch`.
    """
    if not isinstance(config, FusionConfig):
        raise ValueError(f"config: expected a FusionConfig, got {type(config).__name__}")
    if len(clients) != len(sizes):
        raise ValueError(f"clients and sizes: expected one entry per client each, got {len(clients)} and {len(sizes)}")
    weights = client_weights(sizes, config.weights)
    init = None
    if starts is not None and all(s is not None for s in starts):
        init = {g: [s[g] for s in starts] for g in starts[0]}
    # later_rounds="fixed": the assignment stays what each client was sent (no sweep); the estimates are still made
    sweeps = 0 if config.rounds_after_first() == "fixed" and init is not None else None
    pvi = {"factors": factors, "prior_variance": prior_variance} if config.rule == PVI else {}
    return match_posteriors(list(clients), class_counts, spec, rule=config.rule, sizes=weights, **pvi,
                            input_shape=input_shape, template=template, tau2=config.tau2, sweeps=sweeps,
                            seed=derive_seed(seed, Stream.MATCH, round), warm_start=init,
                            num_samples=config.pooling_samples, min_variance=config.min_variance or MIN_VARIANCE,
                            stop=config.stop, starts=config.starts, match_on=match_on, activity=activity,
                            device=config.matcher_device)


def matched_client_start(match, k: Optional[int]) -> tuple[dict, dict, dict]:
    """What a client starts a round of matched posterior fusion from: ``(locs, variances, ids)``, as
    :meth:`~bnpfed.matching.posteriors.PosteriorMatch.client_start` gives them (its slice of the global
    posterior if it was the ``k``-th client matched last round, else the whole posterior)."""
    (locs, variances), ids = match.client_start(k)
    return locs, variances, ids


def average_states(states: Sequence[Mapping[str, Tensor]], sizes: Sequence[int], scheme: str = "size"
                   ) -> tuple[dict[str, Tensor], list[float]]:
    """FedAvg's server step: every parameter averaged with the weights ``client_weights(sizes, scheme)``.
    Returns the averaged state and the weights."""
    weights = client_weights(sizes, scheme)
    if len(states) != len(weights):
        raise ValueError(f"states: expected one state per client ({len(weights)}), got {len(states)}")
    names = list(states[0])
    for k, state in enumerate(states):
        if list(state) != names:
            raise ValueError(f"states[{k}]: expected the parameters {names}, got {list(state)}")
    return {name: average_deterministic([s[name] for s in states], weights) for name in names}, weights


def _warm_start(config: PFNMConfig, starts, J: int) -> Optional[dict[str, list[Tensor]]]:
    if not config.warm_start or starts is None:
        return None
    if len(starts) != J or any(s is None for s in starts):
        raise ValueError(f"starts: expected the start of each of the {J} clients, got {starts!r}")
    return {g: [start[g] for start in starts] for g in starts[0]}


def drop_inactive(states: Sequence[Mapping[str, Tensor]], spec: PermutationSpec,
                  activity: Sequence[Mapping[str, Tensor]],
                  starts: Optional[Sequence[Optional[Mapping[str, Tensor]]]] = None) -> tuple[list, Optional[list]]:
    """The clients' ``state_dict`` s without the units they report inactive (:mod:`bnpfed.matching.activity`), and
    their ``starts`` (global ids per group, as :func:`pfnm_step` takes them) restricted to the units kept: what
    FedMA's layer-wise matching starts from (:func:`pfnm_step` does the same inside
    :func:`~bnpfed.matching.match_by_spec`)."""
    kept = kept_per_client(activity, spec, [{g.name: width(s, g, f"states[{j}]") for g in spec.groups}
                                            for j, s in enumerate(states)])
    states = [drop_units(s, spec, k) for s, k in zip(states, kept)]
    if starts is not None:
        starts = [None if st is None else {g: torch.as_tensor(ids)[k[g]] for g, ids in st.items()}
                  for st, k in zip(starts, kept)]
    return states, starts


def ensemble_parameters(template: nn.Module, num_clients: int) -> int:
    """A budget of ``max_params="ensemble"`` over rounds: ``num_clients`` networks at the template's size (the
    clients' own networks together, what the global network replaces), not the slices of a global network they hold
    from round 2 on, whose size would shrink the budget round by round."""
    return num_clients * count_parameters(template)


def pfnm_step(client_nets: Sequence, class_counts, config: PFNMConfig, *, seed: int, round: int,
              starts: Optional[Sequence[Optional[Mapping[str, Tensor]]]] = None,
              spec: Optional[PermutationSpec] = None, template: Optional[nn.Module] = None,
              input_shape: Optional[Sequence[int]] = None,
              activity: Optional[Sequence[Mapping[str, Tensor]]] = None) -> SpecMatch:
    """PFNM's server step: match the clients' networks (in the given order) into one global network, group by group
    of the permutation spec (:func:`~bnpfed.matching.permutation.match_by_spec`; for an MLP the hidden layers),
    with ``config``'s hyper-parameters (estimated per group by default), bottom-up or, with
    ``config.direction="top-down"`` (the published order), top-down.

    :param client_nets: per client, its network (``nn.Module``) or its ``state_dict`` (then pass ``spec`` and
        ``template``).
    :param class_counts: ``(J, C)`` training examples per class of each client.
    :param PFNMConfig config: the matching hyper-parameters and options.
    :param int seed: the experiment's seed; group c's sweeps draw from ``derive_seed(seed, MATCH, round) + c``.
    :param int round: the 1-based round.
    :param starts: None in round 1 (every client from its own initialisation); in a later round, per client, the
        global ids of its units per group (``{group: ids}``) that :func:`client_start` gave it. With
        ``config.warm_start`` the matching starts from that assignment (the previous round's, as the published code
        does) instead of a greedy pass; without it every round re-matches from scratch.
    :param spec: the networks' :class:`~bnpfed.matching.permutation.PermutationSpec` (default: derived from
        ``template``, or client 0's network, and ``input_shape``).
    :param template: a network of the clients' kind the global one is built from (default client 0's).
    :param input_shape: the shape of one input, to derive the spec of a convolutional network.
    :param activity: per client, its report on its units (:func:`~bnpfed.federated.clients.unit_activity_step`);
        with ``config.inactive`` ``"drop"`` or ``"drop-train"`` the units inactive on the data the report was read on
        are left out before matching (``SpecMatch.kept_units``), with ``"keep"`` the reports are not used. None:
        every unit is matched.
    :returns: :class:`~bnpfed.matching.permutation.SpecMatch` (``state``, ``assignments``, ``widths``,
        ``network()``, ``client_slice(j)``).

    ``max_params="ensemble"`` with a ``template`` is the clients at the template's size together (their own
    networks'), in every round: from round 2 on they hold slices of the global network, and a budget of the slices'
    size would shrink it round by round. This is PFNM's whole-network step whatever ``config.layerwise_retrain``
    says (an experiment's one-shot PFNM shares its config with FedMA's rounds): the default ``max_params="auto"``
    is then the model's own size, not FedMA's ensemble budget (:attr:`PFNMConfig.parameter_limit`). The limits apply
    from round ``config.limit_from_round`` on (:meth:`PFNMConfig.in_round`); in every round after the first
    (:meth:`PFNMConfig.best_effort_in`) a ``max_params`` the matcher cannot meet keeps the smallest match found
    (``size_searches["parameters"]`` says ``met=False``) instead of failing the federation mid-way; in round 1 it
    is refused (:class:`~bnpfed.matching.size.SizeLimitError`).
    """
    if config.layerwise_retrain:
        config = replace(config, layerwise_retrain=0)
    config = config.with_heads(class_counts)   # heads="auto": pooled (its J heads priced) when the shares differ
    init = _warm_start(config, starts, len(client_nets))
    later = config.best_effort_in(round)   # a limit met as far as the matcher can (after round 1)
    config = config.in_round(round)
    if config.parameter_limit == "ensemble" and template is not None:
        config = replace(config, max_params=ensemble_parameters(template, len(client_nets)))
    kwargs = dict(config.matcher_kwargs(), **({"best_effort": True} if later and config.parameter_limit else {}))
    return match_by_spec(list(client_nets), class_counts, spec, input_shape=input_shape, template=template,
                         seed=derive_seed(seed, Stream.MATCH, round), warm_start=init,
                         activity=activity if config.inactive != "keep" else None, **kwargs)


def match_hyperparameters(match) -> list[dict]:
    """Per group (hidden layer, conv channels), the hyper-parameters a match used (estimated or fixed) as plain
    values for tables and JSON: every variance and ``gamma0`` by the matcher's names (PFNM's ``sigma2``,
    ``sigma0_2``, ``gamma0`` and, when it has them, the ``_scaled`` pair of the class-share-weighted output
    coordinates; matched fusion's ``tau2``, ``sigma0_2``, ``gamma0`` and its ``_point`` / ``_scaled`` pairs), ``mu0``
    (a list, one per coordinate of the group's unit vectors), ``estimated`` (the names estimated), ``converged``,
    ``sweeps`` (sweeps run after the first assignment) and ``notes`` (the estimator's fallbacks, if any). Empty for a
    matcher without hyper-parameters (k-means). ``match``: a :class:`~bnpfed.matching.permutation.SpecMatch` or a
    :class:`~bnpfed.matching.posteriors.PosteriorMatch`."""
    out = []
    for result in match.layer_results.values():
        h = getattr(result, "hyperparameters", None)
        if not h:
            continue
        layer = {k: float(v) for k, v in h.items() if k != "mu0" and v is not None}
        mu0 = h.get("mu0")
        layer["mu0"] = [float(v) for v in torch.as_tensor(mu0).reshape(-1)] if mu0 is not None else None
        layer.update(estimated=list(getattr(result, "estimated", ())),
                     converged=bool(getattr(result, "converged", True)),
                     sweeps=int(getattr(result, "sweeps_run", len(result.objective) - 1)),
                     notes=list(getattr(result, "notes", [])))
        out.append(layer)
    return out


def mean_sigma(variances) -> float:
    """The mean posterior standard deviation over every weight of the given variance tensors (the Bayesian sites of
    a global posterior; with a hierarchical prior its hyper-parameters too, a few entries in the unconstrained space
    among the weights')."""
    variances = [torch.as_tensor(v).reshape(-1) for v in variances]
    if not variances:
        raise ValueError("variances: expected the posterior variances of at least one site, got none")
    return float(torch.cat(variances).double().sqrt().mean())


def client_start(match, j: Optional[int]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """What a client starts its next round from (a ``state_dict``), and the global ids of its units per group:
    :meth:`~bnpfed.matching.permutation.SpecMatch.client_start` (its slice of the global network if it was matched,
    ``j`` its position among the matched clients, else, ``j`` None, the whole global network)."""
    return match.client_start(j)


# ------------------------------------------------------------------------------------------------ batch norm


def batch_norm_step(moments: Sequence[Mapping[str, BatchNormMoments]]) -> dict[str, Tensor]:
    """The server's step of re-estimating a global network's batch-norm statistics after a match or an average
    (REPAIR's reset, Jordan et al. 2023, federated): the clients' moments of every batch norm's inputs
    (:func:`~bnpfed.federated.clients.batch_norm_moments_step`, computed on the same global network) summed in the
    given order, then the running mean and unbiased variance. Returns ``{"<bn>.running_mean": ..., "<bn>.running_var":
    ...}`` (float64), to be written with :func:`with_statistics`.

    :raises ValueError: if the clients' moments are not of the same batch norms.
    """
    if not moments:
        raise ValueError("moments: expected the batch-norm moments of at least one client, got none")
    names = list(moments[0])
    pooled = {}
    for k, m in enumerate(moments):
        if list(m) != names:
            raise ValueError(f"moments[{k}]: expected the batch norms {names}, got {list(m)}")
        for name, value in m.items():
            pooled[name] = pooled[name] + value if name in pooled else value
    out = {}
    for name, (mean, var) in batch_norm_statistics(pooled).items():
        out[f"{name}.running_mean"], out[f"{name}.running_var"] = mean, var
    return out


def batch_norm_steps(layers: Sequence[str], moments_of: Callable[[str, dict[str, Tensor]], Sequence]
                     ) -> dict[str, Tensor]:
    """REPAIR's reset one batch norm at a time, front to back (:func:`~bnpfed.matching.batch_norm.batch_norm_order`):
    for each of ``layers``, ``moments_of(layer, statistics)`` gives the clients' moments of that layer's inputs under
    the global network carrying ``statistics`` (those set so far), and :func:`batch_norm_step` pools them. Returns the
    statistics of every layer set, for :func:`with_statistics`; it stops at the first layer no client sent moments for
    (the later layers' inputs depend on it)."""
    statistics: dict[str, Tensor] = {}
    for layer in layers:
        moments = moments_of(layer, dict(statistics))
        if not moments:
            break
        statistics.update(batch_norm_step(moments))
    return statistics


def with_statistics(state: Mapping[str, Tensor], statistics: Mapping[str, Tensor],
                    keys: Optional[Sequence[str]] = None) -> dict[str, Tensor]:
    """``state`` with the running statistics of :func:`batch_norm_step` written in (those in ``keys`` only, if
    given), each in the dtype of the entry it replaces."""
    out = dict(state)
    for key, value in statistics.items():
        if keys is not None and key not in keys:
            continue
        if key not in out:
            raise ValueError(f"statistics: expected entries of the network's state, got {key!r}, which is not one")
        out[key] = value.to(out[key].dtype)
    return out


# ------------------------------------------------------------------------------------------------ FedMA


def fedma_group_step(client_states: Sequence[Mapping[str, Tensor]], class_counts, config: PFNMConfig, *,
                     spec: PermutationSpec, group: str, seed: int, round: int,
                     starts: Optional[Sequence[Optional[Mapping[str, Tensor]]]] = None,
                     best_effort: bool = False) -> GroupMatch:
    """FedMA's server step for one group (Wang et al. 2020): match group ``group`` of the clients' networks, whose
    groups before it are the matched ones already (every client holds them, unit for unit, after
    :func:`~bnpfed.matching.permutation.align_to_group`), with ``config``'s hyper-parameters for that group; its
    sweeps draw from ``derive_seed(seed, MATCH, round) + c`` (c its position in the spec), as in :func:`pfnm_step`.
    ``starts`` warm-starts it as in :func:`pfnm_step`; ``best_effort``: a width limit the matcher cannot meet gives
    the smallest match found, noted (:func:`~bnpfed.matching.fedma.match_group`)."""
    kwargs = config.matcher_kwargs()
    kwargs.pop("direction")   # FedMA matches bottom-up (PFNMConfig refuses layer-wise top-down)
    init = _warm_start(config, starts, len(client_states))
    c = spec.group_names.index(group)
    return match_group(list(client_states), spec, group, class_counts,
                       seed=derive_seed(seed, Stream.MATCH, round) + c,
                       init_assignments=None if init is None else init[group], best_effort=best_effort, **kwargs)


def fedma_width_limits(config: PFNMConfig, spec: PermutationSpec, template: nn.Module,
                       client_states: Sequence[Mapping[str, Tensor]], ensemble: int,
                       matched: Optional[Mapping[str, int]] = None, *,
                       best_effort: Optional[bool] = None) -> PFNMConfig:
    """The config FedMA's next group step runs with: ``config.max_params`` turned into a ``max_width`` per group (FedMA
    matches one group at a time, before the widths above it are known): ``floor(k m_g)``, ``m_g`` the most units one
    client holds in group g, at the largest k whose network fits the budget with the groups already ``matched`` at
    their global widths (:func:`~bnpfed.matching.size.proportional_widths`; called before each group, so the budget
    the groups below left unused goes to the ones above), each the smaller of that and ``config.max_width``'s for the
    group. ``ensemble``: the clients' networks' parameters together (``max_params="ensemble"``, FedMA's default
    ``"auto"``). ``config`` itself when it has no limit (:attr:`~bnpfed.federated.config.PFNMConfig.parameter_limit`
    is None). With ``best_effort`` (default :attr:`~bnpfed.federated.config.PFNMConfig.best_effort_budget`: under
    ``"auto"``; FedMA's rounds after the first pass True, :meth:`~bnpfed.federated.config.PFNMConfig.best_effort_in`)
    the budget is met as far as the matcher can: when the groups below already took more than it allows, the groups
    above are limited to one client's width (and :func:`fedma_group_step` with ``best_effort`` keeps the smallest
    match it finds); without it such a budget is refused. With ``config.heads="pooled"`` the budget holds the J
    clients' output layers the pooled network carries."""
    if config.parameter_limit is None:
        return config
    names = spec.group_names
    limit = ensemble if config.parameter_limit == "ensemble" else int(config.parameter_limit)
    widths = [{g.name: width(s, g, f"client_states[{j}]") for g in spec.groups} for j, s in enumerate(client_states)]
    shapes = {k: tuple(v.shape) for k, v in client_states[0].items()}
    try:
        budget = proportional_widths(spec, shapes, [n for n, _ in template.named_parameters()], widths, limit,
                                     matched=matched, heads=len(client_states) if config.heads == "pooled" else 1)
    except SizeLimitError:
        if not (config.best_effort_budget if best_effort is None else best_effort):
            raise
        # FedMA's default budget, overdrawn by the groups below (best effort): the rest as small as one client's
        budget = {**minimum_widths(widths), **(matched or {})}
    given = config.max_width if isinstance(config.max_width, tuple) else (config.max_width,) * len(names)
    if len(given) != len(names):
        raise ValueError(f"max_width: expected one value or one per matched group ({len(names)}), got {len(given)}")
    caps = tuple(b if c is None else c if b is None else min(b, c)
                 for b, c in zip((None,) * len(names) if budget is None else (budget[g] for g in names), given))
    return replace(config, max_width=caps if any(c is not None for c in caps) else None, max_params=None)


def matched_parameters(spec: PermutationSpec, groups: Sequence[str]) -> list[str]:
    """The parameters (not the running statistics) that ``groups`` own: what FedMA freezes while the clients retrain
    the layers above them."""
    return [p for g in groups for p in spec.owned(g) if spec.kinds[p] not in ("running_mean", "running_var")]

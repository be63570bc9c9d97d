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
* :func:`average_states`: FedAvg's step, every parameter averaged with ``b_k``;
* :func:`pfnm_step`: PFNM (Yurochkin et al. 2019): match the clients' networks into a global one, warm-started from
  what each client started its round from;
* :func:`client_start`: what a client starts its next round from: its slice of the global network, or the whole
  network if it was not matched.

Usage::

    >>> sample_clients(10, 0.3, seed=0, round=1)       # the clients of round 1 when 30 % train each round
    [4, 8, 9]
    >>> client_weights([100, 300], "size")
    [0.25, 0.75]
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from bnpfed.combine import average_deterministic, fuse_sites
from bnpfed.federated.config import CLIENT_WEIGHTS, FusionConfig, PFNMConfig
from bnpfed.inference.multilayer import NetworkMatch, match_networks
from bnpfed.posterior import GaussianPosterior
from bnpfed.seeding import Stream, derive_seed, numpy_rng, torch_generator
from bnpfed.validation import check_choice, check_fraction, check_int

__all__ = [
    "FusionStep",
    "average_states",
    "client_start",
    "client_weights",
    "clients_per_round",
    "fuse_posteriors",
    "match_hyperparameters",
    "pfnm_step",
    "sample_clients",
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
    floored, smallest = 0, math.inf
    if config.min_variance > 0:
        for site, (loc, variance) in fused.items():
            low = variance < config.min_variance
            floored += int(low.sum())
            fused[site] = GaussianPosterior(loc, variance.clamp_min(config.min_variance))
    for loc, variance in fused.values():
        smallest = min(smallest, float(variance.min()))
    names = list(deterministic[0]) if deterministic else []
    for k, state in enumerate(deterministic):
        if list(state) != names:
            raise ValueError(f"deterministic[{k}]: expected the parameters {names}, got {list(state)}")
    params = {name: average_deterministic([s[name] for s in deterministic], weights) for name in names}
    return FusionStep(posterior=fused, deterministic=params, weights=weights, floored=floored,
                      min_variance=smallest, seconds=time.perf_counter() - start)


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


def pfnm_step(client_layers: Sequence, class_counts, config: PFNMConfig, *, seed: int, round: int,
              starts: Optional[Sequence[Optional[list[Tensor]]]] = None) -> NetworkMatch:
    """PFNM's server step: match the clients' networks (in the given order) into one global network.

    :param client_layers: per client, its ``(weight, bias)`` layers (or an ``nn.Module``).
    :param class_counts: ``(J, C)`` training examples per class of each client.
    :param PFNMConfig config: the matching hyper-parameters and options.
    :param int seed: the experiment's seed; layer c's sweeps draw from ``derive_seed(seed, MATCH, round, c)``.
    :param int round: the 1-based round.
    :param starts: None in round 1 (every client from its own initialisation); in a later round, per client, the
        global ids of its hidden neurons per layer that :func:`client_start` gave it. With ``config.warm_start``
        the matching starts from that assignment (the previous round's, as the published code does) instead of a
        greedy pass; without it every round re-matches from scratch.
    """
    init = None
    if config.warm_start and starts is not None:
        if len(starts) != len(client_layers) or any(s is None for s in starts):
            raise ValueError(f"starts: expected the start of each of the {len(client_layers)} clients, got {starts!r}")
        init = [[start[c] for start in starts] for c in range(len(starts[0]))]  # per layer, per client
    return match_networks(client_layers, class_counts, seed=derive_seed(seed, Stream.MATCH, round),
                          warm_start=init, **config.matcher_kwargs())


def match_hyperparameters(match: NetworkMatch) -> list[dict]:
    """Per hidden layer, the hyper-parameters a match used (estimated or fixed) as plain values for tables and JSON:
    ``sigma2``, ``sigma0_2``, ``gamma0``, ``mu0`` (a list, one per coordinate of the layer's neuron vectors), when the
    matcher has them ``sigma2_scaled`` / ``sigma0_2_scaled`` (the pair of the class-share-weighted output coordinates)
    and ``sigma2_per_client`` (a list), ``estimated`` (the names estimated), ``converged``, ``sweeps`` (sweeps run
    after the first assignment) and ``notes`` (the estimator's fallbacks, if any). Empty for a matcher without
    hyper-parameters (k-means)."""
    out = []
    for result in match.layer_results:
        h = getattr(result, "hyperparameters", None)
        if not h:
            continue
        mu0 = h.get("mu0")
        layer = dict(sigma2=float(h["sigma2"]), sigma0_2=float(h["sigma0_2"]), gamma0=float(h["gamma0"]),
                     mu0=[float(v) for v in torch.as_tensor(mu0).reshape(-1)] if mu0 is not None else None)
        for name in ("sigma2_scaled", "sigma0_2_scaled"):
            if h.get(name) is not None:
                layer[name] = float(h[name])
        if h.get("sigma2_per_client") is not None:
            layer["sigma2_per_client"] = [float(v) for v in torch.as_tensor(h["sigma2_per_client"]).reshape(-1)]
        layer.update(estimated=list(getattr(result, "estimated", ())),
                     converged=bool(getattr(result, "converged", True)),
                     sweeps=int(getattr(result, "sweeps_run", len(result.objective) - 1)),
                     notes=list(getattr(result, "notes", [])))
        out.append(layer)
    return out


def client_start(match: NetworkMatch, j: Optional[int]) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
    """What a client starts its next round from, and the global ids of its hidden neurons per layer.

    A client that was matched (``j`` its position among the matched clients) gets its slice of the global network
    (:meth:`NetworkMatch.client_slice`: the global neurons its own were matched to, in its own order); a client
    that was not (``j`` None) gets the whole global network.
    """
    if j is None:
        ids = [torch.arange(w.shape[0]) for w, _ in match.layers[:-1]]
        return [(w.clone(), b.clone()) for w, b in match.layers], ids
    return match.client_slice(j), [a[j].clone() for a in match.assignments]

"""The baselines PFNM is compared with (Yurochkin et al. 2019, section 4): local models, their uniform ensemble,
FedAvg (weight averaging, which needs a shared initialisation to mean anything) and k-means over pooled neurons, for
any network with a permutation spec (k-means clusters each group's unit vectors, as PFNM matches them); and the
fusion baselines of the literature since, which align every network to one reference before averaging: weight
matching (Git Re-Basin, Ainsworth et al. 2023) and OT fusion (Singh & Jaggi 2020), see
:mod:`bnpfed.baselines.alignment`. The reference is the client with the most examples (the first on a tie); the
aligned networks are averaged with the clients' weights (their example counts, as FedAvg's).

A global network with batch norm gets its running statistics re-estimated from the clients' data after every
average or match (:func:`~bnpfed.federated.server.batch_norm_step`), whatever the method (FedAvg's rounds:
:class:`~bnpfed.federated.fusion.FedAvgFederation`)."""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from bnpfed.combine import average_deterministic
from bnpfed.baselines.alignment import ot_alignment, weight_matching
from bnpfed.matching import MatchResult
from bnpfed.matching import PermutationSpec, SpecMatch, derive_spec, match_by_spec, network_from_state

__all__ = ["aligned_average", "ensemble_proba", "fedavg_network", "kmeans_layer", "kmeans_networks",
           "reference_client"]


@torch.no_grad()
def ensemble_proba(nets: Sequence[nn.Module], x: Tensor) -> Tensor:
    """(N, C) uniform ensemble: the mean of every network's softmax."""
    if not nets:
        raise ValueError("nets: expected at least one network for the ensemble, got none")
    return torch.stack([torch.softmax(net.eval()(x), dim=-1) for net in nets]).mean(0)


def fedavg_network(nets: Sequence[nn.Module], weights=None) -> nn.Module:
    """One FedAvg aggregation: every parameter averaged with client weights ``b_k`` (default uniform; FedAvg uses
    the clients' data sizes). All networks must have the same architecture."""
    if not nets:
        raise ValueError("nets: expected at least one network for FedAvg, got none")
    states = [dict(n.named_parameters()) for n in nets]
    names = list(states[0])
    for k, s in enumerate(states[1:], 1):
        if list(s) != names or any(s[n].shape != states[0][n].shape for n in names):
            got = (f"names {list(s)}" if list(s) != names else
                   "shapes " + str({n: tuple(s[n].shape) for n in names if s[n].shape != states[0][n].shape}))
            raise ValueError(f"nets[{k}]: expected nets[0]'s parameter names and shapes (FedAvg averages "
                             f"parameters position by position), got {got}")
    out = copy.deepcopy(nets[0])
    with torch.no_grad():
        for name, param in out.named_parameters():
            param.copy_(average_deterministic([s[name].detach() for s in states], weights))
    return out


def kmeans_layer(width: int, *, n_init: int = 3):
    """A one-layer matcher for :func:`~bnpfed.matching.match_by_spec` (``layer_fn``, one per hidden
    layer) that clusters the pooled neuron vectors into ``width`` atoms with k-means (scikit-learn) instead of
    matching them: the k-means baseline of the PFNM paper. Cluster centres are the global neurons; precisions and
    priors are ignored (k-means has none), and two neurons of one client may share a centre (their weights to the
    layer above then add up)."""
    width = int(width)

    def layer_fn(neurons, *, seed=None, **_ignored) -> MatchResult:
        from sklearn.cluster import KMeans  # imported here: Flower's client processes never need scikit-learn

        stacked = torch.cat([torch.as_tensor(v, dtype=torch.float64) for v in neurons]).numpy()
        k = min(width, stacked.shape[0])
        km = KMeans(n_clusters=k, n_init=n_init, random_state=None if seed is None else seed % 2**32).fit(stacked)
        labels = torch.as_tensor(km.labels_, dtype=torch.long)
        sizes = [len(v) for v in neurons]
        centers = torch.as_tensor(km.cluster_centers_)
        return MatchResult(global_atoms=centers, posterior_precision=torch.ones_like(centers),
                           assignments=list(torch.split(labels, sizes)),
                           counts=torch.bincount(labels, minlength=k), objective=[float(-km.inertia_)])

    return layer_fn


def kmeans_networks(nets: Sequence[nn.Module], class_counts, widths: Sequence[int], *, seed: int,
                    spec: Optional[PermutationSpec] = None, input_shape: Optional[Sequence[int]] = None) -> SpecMatch:
    """The k-means baseline for whole networks: every group of the permutation spec (an MLP's hidden layers, a
    CNN's channels and hidden units) clustered bottom-up into ``widths[c]`` atoms, with PFNM's unit vectors,
    re-indexing and output layer (:func:`~bnpfed.matching.permutation.match_by_spec` with :func:`kmeans_layer`).

    :param input_shape: the shape of one input, to derive the spec of a convolutional network (or pass ``spec``).
    """
    return match_by_spec(list(nets), class_counts, spec, input_shape=input_shape,
                         layer_fn=[kmeans_layer(w) for w in widths], seed=seed)


def reference_client(sizes: Sequence[int]) -> int:
    """The client the alignment baselines align to: the one with the most examples (the first on a tie)."""
    sizes = [int(n) for n in sizes]
    if not sizes:
        raise ValueError("sizes: expected one example count per client, got none")
    return max(range(len(sizes)), key=lambda j: (sizes[j], -j))


def aligned_average(nets: Sequence[nn.Module], sizes: Sequence[int], *, method: str, spec=None, input_shape=None,
                    seed: int = 0, reg: Optional[float] = None) -> nn.Module:
    """One global network from ``nets`` aligned to the reference client (:func:`reference_client`) and averaged
    with weights proportional to ``sizes``, at the reference's widths.

    :param str method: ``"weight-matching"`` (Git Re-Basin), ``"ot-fusion"`` (exact OT) or ``"ot-fusion-sinkhorn"``
        (entropic OT, ``reg`` relative to the largest ground cost; default
        :data:`~bnpfed.baselines.alignment.OT_REG`).
    :param spec: the networks' permutation spec (default derived from ``nets[0]`` and ``input_shape``).
    """
    if not nets:
        raise ValueError("nets: expected at least one network, got none")
    if len(sizes) != len(nets):
        raise ValueError(f"sizes: expected one example count per network ({len(nets)}), got {len(sizes)}")
    if spec is None:
        if input_shape is None:
            raise ValueError("input_shape: expected the shape of one input (to derive the spec), got None")
        spec = derive_spec(nets[0], input_shape)
    states = [n.state_dict() for n in nets]
    reference = reference_client(sizes)
    if method == "weight-matching":
        if reg is not None:
            raise ValueError(f"reg: expected only with method='ot-fusion-sinkhorn', got reg={reg!r}")
        aligned = weight_matching(states, spec, reference=reference, seed=seed)
    elif method in ("ot-fusion", "ot-fusion-sinkhorn"):
        sinkhorn = method == "ot-fusion-sinkhorn"
        if reg is not None and not sinkhorn:
            raise ValueError(f"reg: expected only with method='ot-fusion-sinkhorn', got reg={reg!r}")
        extra = {} if reg is None else {"reg": reg}
        aligned, _ = ot_alignment(states, spec, reference=reference, solver="sinkhorn" if sinkhorn else "exact",
                                  **extra)
    else:
        raise ValueError(f"method: expected 'weight-matching', 'ot-fusion' or 'ot-fusion-sinkhorn', got {method!r}")
    total = float(sum(sizes))
    weights = [float(n) / total for n in sizes]
    state = {}
    for key, value in aligned[reference].items():
        if value.is_floating_point():
            state[key] = average_deterministic([a[key] for a in aligned], weights).to(value.dtype)
        else:  # batch norm's num_batches_tracked: the reference's
            state[key] = value
    return network_from_state(nets[reference], state).eval()

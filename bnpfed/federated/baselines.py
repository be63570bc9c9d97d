"""The baselines PFNM is compared with (Yurochkin et al. 2019, section 4): local models, their uniform ensemble,
FedAvg (weight averaging, which needs a shared initialisation to mean anything) and k-means over pooled neurons, for
any network with a permutation spec (k-means clusters each group's unit vectors, as PFNM matches them).

A global network with batch norm gets its running statistics re-estimated from the clients' data after every
average or match (:func:`~bnpfed.federated.server.batch_norm_step`), whatever the method (FedAvg's rounds:
:class:`~bnpfed.federated.fusion.FedAvgFederation`)."""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from bnpfed.combine import average_deterministic
from bnpfed.inference.matching import MatchResult
from bnpfed.inference.permutation import PermutationSpec, SpecMatch, match_by_spec

__all__ = ["ensemble_proba", "fedavg_network", "kmeans_layer", "kmeans_networks"]


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
    """A one-layer matcher for :func:`~bnpfed.inference.match_by_spec` (``layer_fn``, one per hidden
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
    re-indexing and output layer (:func:`~bnpfed.inference.permutation.match_by_spec` with :func:`kmeans_layer`).

    :param input_shape: the shape of one input, to derive the spec of a convolutional network (or pass ``spec``).
    """
    return match_by_spec(list(nets), class_counts, spec, input_shape=input_shape,
                         layer_fn=[kmeans_layer(w) for w in widths], seed=seed)

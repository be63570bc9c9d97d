"""A federated Gaussian mixture: each client fits a Pyro mixture to its own data
(:func:`~bnpfed.models.fit_gaussian_mixture`), the server matches the clients' components
(:func:`~bnpfed.matching.match_components`: the Beta-Bernoulli process decides how many global components there are)
and fuses every global component's members into one Gaussian (:func:`fuse_mixtures`). One round, no data leaves a
client: only its components, their weights and its size.

**The server's step.** Client j with n_j points reports its mixture (weights w_jk, means mu_jk, scales s_jk); its
component k holds about ``n_jk = n_j w_jk`` points, so its mean is known to within ``s_jk^2 / n_jk`` per coordinate:
those are the variances the matcher is given with the means. A global component i with members S_i is the Gaussian
of the members' points pooled, by moments (a merge of Gaussians):

    N_i = sum_{S_i} n_jk,    mean_i = sum_{S_i} n_jk mu_jk / N_i,
    var_i = sum_{S_i} n_jk (s_jk^2 + mu_jk^2) / N_i - mean_i^2,    weight_i = N_i / sum_i' N_i'.

**The experiment** (:func:`run_mixture_experiment`, ``bnpfed mixture``): a real data set projected on its first
principal components (fitted on the training split: one fixed projection every party applies), split among the
clients by label (Dirichlet, so each client sees some classes mostly), and the held-out log-likelihood per test point
of the federated mixture against each client's own mixture, the union of the clients' mixtures (every component
kept, weighted by the clients' sizes: what the server would hold without matching) and a mixture fitted to the pooled
training data (what one site holding all the data would fit), with K components and with as many as the federated
mixture found.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from bnpfed.federated.partition import partition_dirichlet
from bnpfed.matching import MatchResult, match_components
from bnpfed.models import GaussianMixture, fit_gaussian_mixture  # noqa: F401 (the examples use GaussianMixture)
from bnpfed.validation import check_float, check_int, check_positive

__all__ = ["FederatedMixture", "MixtureConfig", "MixtureRow", "fuse_mixtures", "run_mixture_experiment"]


@dataclass
class FederatedMixture:
    """The server's global mixture and how it was found.

    :param GaussianMixture mixture: the global mixture (L components).
    :param MatchResult match: the matching of the clients' components (``assignments[j][k]``: the global component
        of client j's component k).
    :param list members: per global component, its members as ``(client, local component)`` pairs.
    """

    mixture: GaussianMixture
    match: MatchResult
    members: list = field(default_factory=list)


def fuse_mixtures(mixtures, sizes, *, seed: int = 0, **match_options) -> FederatedMixture:
    """The server's step of the federated mixture (module docstring): match the clients' components, fuse each global
    component's members by moments.

    Usage: two clients, each with one of two clusters and a component they share, give three global components::

        >>> a = GaussianMixture(torch.tensor([0.5, 0.5]), torch.tensor([[0.0, 0.0], [8.0, 8.0]]), torch.ones(2, 2))
        >>> b = GaussianMixture(torch.tensor([0.5, 0.5]), torch.tensor([[0.1, 0.0], [-8.0, 8.0]]), torch.ones(2, 2))
        >>> fused = fuse_mixtures([a, b], [100, 300], seed=0)
        >>> fused.mixture.num_components, sorted(round(float(w), 3) for w in fused.mixture.weights)
        (3, [0.125, 0.375, 0.5])

    :param mixtures: J :class:`~bnpfed.models.GaussianMixture` of one dimension D.
    :param sizes: J positive numbers of points the clients fitted on.
    :param int seed: seed of the matching's sweeps.
    :param match_options: options of :func:`~bnpfed.matching.match_components` (with variances:
        :func:`~bnpfed.matching.match_bayesian_layer`'s, e.g. ``tau2``, ``concentration``).
    :returns: :class:`FederatedMixture`.
    """
    mixtures = list(mixtures)
    if not mixtures or not all(isinstance(m, GaussianMixture) for m in mixtures):
        raise ValueError(f"mixtures: expected a non-empty sequence of GaussianMixture, got {mixtures!r}")
    D = mixtures[0].locs.shape[1]
    for j, m in enumerate(mixtures):
        if m.locs.shape[1] != D:
            raise ValueError(f"mixtures[{j}]: expected D = {D} coordinates (as mixtures[0]), got {m.locs.shape[1]}")
    sizes = [float(s) for s in sizes]
    if len(sizes) != len(mixtures) or not all(math.isfinite(s) and s > 0 for s in sizes):
        raise ValueError(f"sizes: expected {len(mixtures)} positive numbers of points (one per mixture), got {sizes}")
    counts = [n * m.weights.double() for n, m in zip(sizes, mixtures)]                   # n_jk
    means = [m.locs.double() for m in mixtures]
    variances = [m.scales.double() ** 2 / c[:, None] for m, c in zip(mixtures, counts)]   # s^2 / n_jk
    match = match_components(means, variances, seed=seed, **match_options)
    L = match.num_atoms
    N = torch.zeros(L, dtype=torch.float64)
    first = torch.zeros(L, D, dtype=torch.float64)
    second = torch.zeros(L, D, dtype=torch.float64)
    members: list = [[] for _ in range(L)]
    for j, (a, m, c) in enumerate(zip(match.assignments, mixtures, counts)):
        a = torch.as_tensor(a, dtype=torch.long)
        N.index_add_(0, a, c)
        first.index_add_(0, a, c[:, None] * m.locs.double())
        second.index_add_(0, a, c[:, None] * (m.scales.double() ** 2 + m.locs.double() ** 2))
        for k, i in enumerate(a.tolist()):
            members[i].append((j, k))
    mean = first / N[:, None]
    var = (second / N[:, None] - mean ** 2).clamp(min=1e-12)
    mixture = GaussianMixture(weights=N / N.sum(), locs=mean, scales=var.sqrt())
    return FederatedMixture(mixture=mixture, match=match, members=members)


@dataclass(frozen=True)
class MixtureConfig:
    """The federated mixture experiment (:func:`run_mixture_experiment`).

    :param str dataset: a name :func:`~bnpfed.data.load_dataset` knows (``"digits"``, bundled; ``"mnist"``,
        ``"fashion-mnist"`` from ``data_dir``). Default ``"digits"``.
    :param str data_dir: where the torchvision data sets are (None: bnpfed's default).
    :param int clients: J, >= 2. Default 5.
    :param int components: K of every client's mixture and of the pooled one, >= 1. Default 10.
    :param int dims: principal components the data are projected on, >= 1. Default 10.
    :param float alpha: Dirichlet concentration of the label split (small: each client sees few classes), > 0.
        Default 0.5.
    :param int steps: Adam steps of every mixture's fit, >= 1. Default 400.
    :param int seed: seed of the split, the fits and the matching, >= 0. Default 0.
    """

    dataset: str = "digits"
    data_dir: str | None = None
    clients: int = 5
    components: int = 10
    dims: int = 10
    alpha: float = 0.5
    steps: int = 400
    seed: int = 0

    def __post_init__(self):
        check_int(self.clients, "clients", low=2)
        check_int(self.components, "components", low=1)
        check_int(self.dims, "dims", low=1)
        check_positive(self.alpha, "alpha")
        check_int(self.steps, "steps", low=1)
        check_int(self.seed, "seed", low=0)


@dataclass(frozen=True)
class MixtureRow:
    """One method's result: its number of components and its held-out log-likelihood per test point (for
    ``"client's own mixture"`` the mean over the clients, with the worst and the best beside it).

    :param str method: which mixture.
    :param int components: its components.
    :param float heldout_loglik: mean log-likelihood of a test point (nats).
    :param float seconds: wall time of the fits (and the server's step) behind it.
    :param str note: what the row is, in words.
    """

    method: str
    components: int
    heldout_loglik: float
    seconds: float
    note: str = ""


def _projected(config: MixtureConfig):
    from bnpfed.data import load_dataset

    ds = load_dataset(config.dataset, data_dir=config.data_dir)
    x_train = ds.x_train.reshape(len(ds.x_train), -1).double()
    x_test = ds.x_test.reshape(len(ds.x_test), -1).double()
    if config.dims > x_train.shape[1]:
        raise ValueError(f"dims: expected at most the data's {x_train.shape[1]} features, got {config.dims}")
    centre = x_train.mean(0)
    # the principal directions of the training split: one fixed projection every party applies
    _, _, v = torch.linalg.svd(x_train - centre, full_matrices=False)
    basis = v[: config.dims].T
    return (x_train - centre) @ basis, (x_test - centre) @ basis, ds.y_train.numpy()


def run_mixture_experiment(config: MixtureConfig) -> list[MixtureRow]:
    """The federated mixture against each client's own, the union of the clients' and the pooled fit, on held-out
    data (module docstring).

    :param MixtureConfig config: the experiment.
    :returns: one :class:`MixtureRow` per method: ``"federated (matched)"``, ``"client's own mixture"``, ``"union of
        the clients' mixtures"``, ``"pooled data"`` (K components) and ``"pooled data, as many components"`` (as the
        federated mixture).
    """
    x_train, x_test, labels = _projected(config)
    parts = partition_dirichlet(labels, config.clients, alpha=config.alpha, min_size=max(10, config.components),
                                seed=config.seed)
    t0 = time.perf_counter()
    local = [fit_gaussian_mixture(x_train[torch.as_tensor(p)], config.components, seed=config.seed + j,
                                  steps=config.steps) for j, p in enumerate(parts)]
    local_seconds = time.perf_counter() - t0
    sizes = [len(p) for p in parts]
    t0 = time.perf_counter()
    fused = fuse_mixtures(local, sizes, seed=config.seed)
    server_seconds = time.perf_counter() - t0
    own = [float(m.log_prob(x_test).mean()) for m in local]
    total = sum(sizes)
    union = GaussianMixture(weights=torch.cat([m.weights * n / total for m, n in zip(local, sizes)]),
                            locs=torch.cat([m.locs for m in local]), scales=torch.cat([m.scales for m in local]))
    t0 = time.perf_counter()
    pooled = fit_gaussian_mixture(x_train, config.components, seed=config.seed, steps=config.steps)
    pooled_seconds = time.perf_counter() - t0
    L = fused.mixture.num_components
    t0 = time.perf_counter()
    pooled_L = fit_gaussian_mixture(x_train, L, seed=config.seed, steps=config.steps)
    pooled_L_seconds = time.perf_counter() - t0
    return [
        MixtureRow("federated (matched)", fused.mixture.num_components, float(fused.mixture.log_prob(x_test).mean()),
                   local_seconds + server_seconds, f"server step {server_seconds:.2f} s"),
        MixtureRow("client's own mixture", config.components, float(np.mean(own)), local_seconds,
                   f"mean of {config.clients} clients (worst {min(own):.2f}, best {max(own):.2f})"),
        MixtureRow("union of the clients' mixtures", union.num_components, float(union.log_prob(x_test).mean()),
                   local_seconds, "every component kept, weighted by the clients' sizes"),
        MixtureRow("pooled data", config.components, float(pooled.log_prob(x_test).mean()), pooled_seconds,
                   "one mixture fitted to all the training data"),
        MixtureRow("pooled data, as many components", L, float(pooled_L.log_prob(x_test).mean()), pooled_L_seconds,
                   "the same with the federated mixture's number of components"),
    ]

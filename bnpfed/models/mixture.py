"""A Gaussian mixture as a Pyro program, fitted by MAP with its assignments enumerated out: the local model of the
federated mixture (:func:`~bnpfed.federated.fuse_mixtures`), whose components are exchangeable like a layer's
neurons (SPAHM, Yurochkin et al., NeurIPS 2019).

The story of :func:`gaussian_mixture` (K components, diagonal covariances, data x in R^D):

* mixing weights ``weights ~ Dirichlet(concentration 1_K)``;
* per component k: ``locs_k ~ N(0, prior_scale^2 I)`` and ``scales_k ~ LogNormal(0, 1)`` per coordinate;
* per point n: ``z_n ~ Categorical(weights)`` and ``x_n ~ N(locs_{z_n}, diag(scales_{z_n}^2))``.

:func:`fit_gaussian_mixture` finds the MAP of weights, locs and scales with ``z`` summed out (``TraceEnum_ELBO`` with
an ``AutoDelta`` guide), from locs at K data points drawn with the seed (k-means++'s spread: each next one far from
those before).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import SVI, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoDelta, init_to_value
from torch import Tensor

from bnpfed.validation import check_int, check_positive

__all__ = ["GaussianMixture", "fit_gaussian_mixture", "gaussian_mixture"]


@dataclass(frozen=True)
class GaussianMixture:
    """A mixture of K Gaussians with diagonal covariances.

    :param Tensor weights: (K,) mixing weights, positive, summing to 1.
    :param Tensor locs: (K, D) means.
    :param Tensor scales: (K, D) standard deviations, positive.
    """

    weights: Tensor
    locs: Tensor
    scales: Tensor

    def __post_init__(self):
        K = self.weights.shape[0]
        if self.weights.dim() != 1 or self.locs.shape[0] != K or self.scales.shape != self.locs.shape:
            raise ValueError(f"GaussianMixture: expected weights (K,), locs and scales (K, D), got shapes "
                             f"{tuple(self.weights.shape)}, {tuple(self.locs.shape)}, {tuple(self.scales.shape)}")
        if not bool((self.weights > 0).all()) or abs(float(self.weights.sum()) - 1.0) > 1e-5:
            raise ValueError(f"GaussianMixture.weights: expected positive weights summing to 1, got "
                             f"{self.weights.tolist()}")
        if not bool((self.scales > 0).all()):
            raise ValueError("GaussianMixture.scales: expected positive standard deviations")

    @property
    def num_components(self) -> int:
        return int(self.weights.shape[0])

    def log_prob(self, x: Tensor) -> Tensor:
        """(N,) ``log sum_k w_k N(x_n; locs_k, diag(scales_k^2))``.

        >>> mix = GaussianMixture(torch.tensor([1.0]), torch.zeros(1, 2), torch.ones(1, 2))
        >>> round(float(mix.log_prob(torch.zeros(1, 2))), 4) == round(-math.log(2 * math.pi), 4)
        True
        """
        x = torch.as_tensor(x, dtype=self.locs.dtype)
        per = dist.Normal(self.locs, self.scales).log_prob(x[:, None, :]).sum(-1)   # (N, K)
        return torch.logsumexp(per + self.weights.log(), dim=-1)


@config_enumerate
def gaussian_mixture(x: Tensor, num_components: int, *, concentration: float = 1.0, prior_scale: float = 10.0):
    """Pyro program of a Gaussian mixture (module docstring); ``x`` (N, D) observed.

    :param Tensor x: (N, D) data.
    :param int num_components: K.
    :param float concentration: of the Dirichlet prior on the weights.
    :param float prior_scale: standard deviation of the Gaussian prior on every mean's coordinates.
    """
    K, D = int(num_components), x.shape[1]
    weights = pyro.sample("weights", dist.Dirichlet(torch.full((K,), float(concentration), dtype=x.dtype)))
    with pyro.plate("components", K):
        locs = pyro.sample("locs", dist.Normal(torch.zeros(D, dtype=x.dtype), prior_scale).to_event(1))
        scales = pyro.sample("scales", dist.LogNormal(torch.zeros(D, dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Categorical(weights))
        pyro.sample("x", dist.Normal(locs[z], scales[z]).to_event(1), obs=x)


def _spread_starts(x: Tensor, K: int, generator: torch.Generator) -> Tensor:
    """K data points, each next drawn with probability proportional to its squared distance to the nearest before
    (k-means++'s seeding)."""
    first = int(torch.randint(x.shape[0], (1,), generator=generator))
    chosen = [x[first]]
    for _ in range(1, K):
        d2 = torch.cdist(x, torch.stack(chosen)).min(dim=1).values ** 2
        p = d2 / d2.sum() if float(d2.sum()) > 0 else torch.full_like(d2, 1.0 / len(d2))
        chosen.append(x[int(torch.multinomial(p, 1, generator=generator))])
    return torch.stack(chosen)


def fit_gaussian_mixture(x, num_components: int, *, seed: int, steps: int = 400, lr: float = 0.05,
                         concentration: float = 1.0, prior_scale: float = 10.0) -> GaussianMixture:
    """The MAP mixture of :func:`gaussian_mixture` on ``x``, the assignments summed out (module docstring).

    Usage::

        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.cat([torch.randn(100, 2, generator=g) - 4, torch.randn(100, 2, generator=g) + 4])
        >>> mix = fit_gaussian_mixture(x, 2, seed=0, steps=300)
        >>> sorted(round(float(m)) for m in mix.locs[:, 0])
        [-4, 4]

    :param x: (N, D) data (N >= num_components).
    :param int num_components: K.
    :param int seed: seed of the starting means (and Pyro's RNG during the fit; the global RNG is restored).
    :param int steps: Adam steps on the MAP objective.
    :param float lr: Adam's learning rate.
    :returns: :class:`GaussianMixture` (float64).
    """
    x = torch.as_tensor(x, dtype=torch.float64)
    if x.dim() != 2 or not bool(torch.isfinite(x).all()):
        raise ValueError(f"x: expected finite data of shape (N, D), got shape {tuple(x.shape)}")
    K = check_int(num_components, "num_components", low=1)
    if x.shape[0] < K:
        raise ValueError(f"num_components: expected at most as many components as points ({x.shape[0]}), got {K}")
    steps = check_int(steps, "steps", low=1)
    lr = check_positive(lr, "lr")
    g = torch.Generator().manual_seed(int(seed))
    starts = _spread_starts(x, K, g)
    spread = x.std(dim=0).clamp(min=1e-3)
    init = dict(weights=torch.full((K,), 1.0 / K, dtype=x.dtype), locs=starts,
                scales=(spread / math.sqrt(K)).expand(K, -1).clone())
    model = gaussian_mixture
    with torch.random.fork_rng(devices=[]), pyro.get_param_store().scope():
        torch.manual_seed(int(seed))
        guide = AutoDelta(poutine.block(model, expose=["weights", "locs", "scales"]),
                          init_loc_fn=init_to_value(values=init))
        svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), TraceEnum_ELBO(max_plate_nesting=1))
        for _ in range(steps):
            svi.step(x, K, concentration=concentration, prior_scale=prior_scale)
        values = guide.median(x, K, concentration=concentration, prior_scale=prior_scale)
    weights = values["weights"].detach().clamp(min=1e-12)
    return GaussianMixture(weights=weights / weights.sum(), locs=values["locs"].detach(),
                           scales=values["scales"].detach())

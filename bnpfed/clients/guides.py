"""The mean-field Gaussian guide of a Bayesian network, whose parameters can be read out and written back.

    q(w) = prod_s N(w_s | loc_s, diag(scale_s^2)),   scale_s = softplus(rho_s) = log(1 + exp(rho_s))

one ``(loc_s, rho_s)`` pair of the site's shape per Bayesian site s (Blundell et al. 2015's parameterisation, the
one Ozer et al. 2022's clients use). A site's guide distribution is a ``Normal(...).to_event(...)`` of the same
shape as its prior, so ``TraceMeanField_ELBO`` computes the KL term in closed form and the local
reparameterisation handler sees Gaussian weights.

The guide is a plain ``nn.Module`` with ``nn.Parameter`` s: Pyro's global parameter store never sees them. Its
posterior is read and written as ``{site: GaussianPosterior}``, the one Gaussian posterior type that the fusion
rules of :mod:`bnpfed.combine` and the Flower records use too.
"""

from __future__ import annotations

from typing import Any, Mapping

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bnpfed.posterior import GaussianPosterior
from bnpfed.validation import check_names, check_positive, check_tensor

__all__ = ["MeanFieldGuide"]


def _softplus_inverse(scale: Tensor) -> Tensor:
    # log(exp(s) - 1) = s + log(1 - exp(-s)), stable for small and large s
    return scale + torch.log(-torch.expm1(-scale))


class MeanFieldGuide(nn.Module):
    """Mean-field Gaussian guide over named sample sites.

    Usage::

        >>> import torch
        >>> from pyro.infer import TraceMeanField_ELBO
        >>> from bnpfed.models import BayesianNetwork, mlp, only_linear_weights
        >>> bnn = BayesianNetwork(mlp(4, [3], 2), only_linear_weights())
        >>> guide = MeanFieldGuide(bnn.init_values, init_scale=0.1)
        >>> guide.site_names
        ('1.weight', '3.weight')
        >>> x, y = torch.zeros(5, 4), torch.zeros(5, dtype=torch.long)
        >>> loss = TraceMeanField_ELBO().differentiable_loss(bnn.model, guide, x, y)   # -ELBO, a scalar
        >>> loc, variance = guide.posterior()["1.weight"]                               # a GaussianPosterior
        >>> loc.shape, round(variance[0, 0].item(), 6)
        (torch.Size([3, 4]), 0.01)

    :param Mapping init_locs: site name -> initial mean (its shape is the site's shape), e.g.
        ``BayesianNetwork.init_values`` (the network's own initialisation).
    :param float init_scale: initial standard deviation of every weight. Default ``1e-2``.
    """

    def __init__(self, init_locs: Mapping[str, Tensor], init_scale: float = 1e-2):
        super().__init__()
        if not isinstance(init_locs, Mapping) or not init_locs:
            raise ValueError(
                "init_locs: expected a non-empty dict site -> initial mean (did the prior make no parameter "
                f"Bayesian?), got {init_locs!r}"
            )
        init_scale = check_positive(init_scale, "init_scale")
        for name, loc in init_locs.items():
            check_tensor(loc, loc.shape if torch.is_tensor(loc) else torch.Size(), f"init_locs[{name!r}]")
        #: Site names, in the order the guide samples them.
        self.site_names: tuple[str, ...] = tuple(init_locs)
        self.locs = nn.ParameterList([nn.Parameter(loc.detach().clone()) for loc in init_locs.values()])
        init_rho = _softplus_inverse(torch.tensor(float(init_scale), dtype=torch.float64)).item()
        self.rhos = nn.ParameterList(
            [nn.Parameter(torch.full_like(loc.detach(), init_rho)) for loc in init_locs.values()]
        )

    def forward(self, *args, **kwargs) -> dict[str, Tensor]:
        """Sample every site (the model's arguments are accepted and ignored). Returns ``{site: value}``."""
        return {
            name: pyro.sample(name, dist.Normal(loc, F.softplus(rho)).to_event(loc.dim()))
            for name, loc, rho in zip(self.site_names, self.locs, self.rhos)
        }

    @torch.no_grad()
    def posterior(self) -> dict[str, GaussianPosterior]:
        """``{site: GaussianPosterior(loc, variance)}``: copies of the current means, and ``softplus(rho)^2``; each
        of the site's shape."""
        return {
            name: GaussianPosterior(loc.detach().clone(), F.softplus(rho).pow(2))
            for name, loc, rho in zip(self.site_names, self.locs, self.rhos)
        }

    @torch.no_grad()
    def load_posterior(self, posterior: Mapping[str, Any]) -> None:
        """Make the guide ``N(loc, variance)`` at every site, writing into its parameters in place
        (``loc_s <- loc``, ``rho_s <- softplus^{-1}(sqrt(variance))``); optimisers holding them keep working.

        :param Mapping posterior: ``{site: GaussianPosterior}`` or ``{site: (loc, variance)}`` for exactly this
            guide's sites, finite tensors of the site's shape, variances > 0.
        :raises ValueError: naming the site, for a missing or unknown site, a wrong shape, a NaN or a variance <= 0;
            the guide is then unchanged.
        """
        shapes = {name: loc.shape for name, loc in zip(self.site_names, self.locs)}
        check_names(posterior, shapes, "posterior", "site")
        checked = {name: GaussianPosterior.of(posterior[name], f"posterior[{name!r}]", shape)
                   for name, shape in shapes.items()}
        for name, loc, rho in zip(self.site_names, self.locs, self.rhos):
            new_loc, new_variance = checked[name]
            loc.copy_(new_loc)
            rho.copy_(_softplus_inverse(new_variance.to(rho).sqrt()))

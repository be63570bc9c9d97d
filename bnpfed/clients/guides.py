"""The mean-field Gaussian guide of a Bayesian network, whose parameters can be read out and written back.

    q(w) = prod_s N(w_s | loc_s, diag(scale_s^2)),   scale_s = softplus(rho_s) = log(1 + exp(rho_s))

one ``(loc_s, rho_s)`` pair of the site's shape per Bayesian site s (Blundell et al. 2015's parameterisation, the
one Ozer et al. 2022's clients use). A site's guide distribution is a ``Normal(...).to_event(...)`` of the same
shape as its prior, so ``TraceMeanField_ELBO`` computes the KL term in closed form and the local
reparameterisation handler sees Gaussian weights.

A site whose support is not the real line (a hyper-parameter such as a positive per-layer prior scale ``tau``) is
Normal in the unconstrained space, as Pyro's autoguides have it: ``u_s ~ N(loc_s, scale_s^2)``, ``z_s =
biject_to(support)(u_s)`` (``tau = exp(u)``), drawn as one ``TransformedDistribution`` whose density counts the
Jacobian; ``(loc_s, scale_s^2)`` is then the Normal of ``u_s``.

The guide is a plain ``nn.Module`` with ``nn.Parameter`` s: Pyro's global parameter store never sees them. Its
posterior is read and written as ``{site: GaussianPosterior}``, the one Gaussian posterior type that the fusion
rules of :mod:`bnpfed.combine` and the Flower records use too.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributions import biject_to, constraints

from bnpfed.posterior import GaussianPosterior
from bnpfed.validation import check_names, check_positive, check_tensor

__all__ = ["MeanFieldGuide"]


def _real(support) -> bool:
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real


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
        ``BayesianNetwork.init_values`` (the network's own initialisation); for a site of ``supports``, its initial
        value in that support (the guide's mean is its image in the unconstrained space).
    :param float init_scale: initial standard deviation of every weight. Default ``1e-2``.
    :param Mapping supports: site name -> the site's support (a ``torch.distributions.constraints`` constraint), for
        sites not on the real line (``BayesianNetwork.supports``); sites not named are real. Default none.
    """

    def __init__(self, init_locs: Mapping[str, Tensor], init_scale: float = 1e-2,
                 supports: Optional[Mapping[str, Any]] = None):
        super().__init__()
        if not isinstance(init_locs, Mapping) or not init_locs:
            raise ValueError(
                "init_locs: expected a non-empty dict site -> initial mean (did the prior make no parameter "
                f"Bayesian?), got {init_locs!r}"
            )
        init_scale = check_positive(init_scale, "init_scale")
        for name, loc in init_locs.items():
            check_tensor(loc, loc.shape if torch.is_tensor(loc) else torch.Size(), f"init_locs[{name!r}]")
        supports = {} if supports is None else dict(supports)
        unknown = [name for name in supports if name not in init_locs]
        if unknown:
            raise ValueError(f"supports: expected sites of init_locs {list(init_locs)}, got {unknown}")
        #: Site name -> the bijection from the real numbers onto the site's support, for the sites not on the real
        #: line (``biject_to(support)``).
        self.transforms = {name: biject_to(support) for name, support in supports.items() if not _real(support)}
        #: Site names, in the order the guide samples them.
        self.site_names: tuple[str, ...] = tuple(init_locs)
        self.locs = nn.ParameterList([nn.Parameter(self._unconstrained(name, loc.detach()).clone())
                                      for name, loc in init_locs.items()])
        init_rho = _softplus_inverse(torch.tensor(float(init_scale), dtype=torch.float64)).item()
        self.rhos = nn.ParameterList(
            [nn.Parameter(torch.full_like(loc.detach(), init_rho)) for loc in self.locs]
        )

    def _unconstrained(self, name: str, value: Tensor) -> Tensor:
        transform = self.transforms.get(name)
        return value if transform is None else transform.inv(value)

    def forward(self, *args, **kwargs) -> dict[str, Tensor]:
        """Sample every site (the model's arguments are accepted and ignored). Returns ``{site: value}``."""
        if not self.transforms:
            return {
                name: pyro.sample(name, dist.Normal(loc, F.softplus(rho)).to_event(loc.dim()))
                for name, loc, rho in zip(self.site_names, self.locs, self.rhos)
            }
        values = {}
        for name, loc, rho in zip(self.site_names, self.locs, self.rhos):
            fn = dist.Normal(loc, F.softplus(rho)).to_event(loc.dim())
            transform = self.transforms.get(name)
            values[name] = pyro.sample(name, fn if transform is None else dist.TransformedDistribution(fn, transform))
        return values

    @torch.no_grad()
    def posterior(self) -> dict[str, GaussianPosterior]:
        """``{site: GaussianPosterior(loc, variance)}``: copies of the current means, and ``softplus(rho)^2``; each
        of the site's shape (in the unconstrained space for a site of ``supports``)."""
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

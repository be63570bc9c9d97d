"""A hierarchical prior by name, for the command line and Flower: one registration line, as a user would write it.

In Python a hierarchical prior is one argument, ``BayesianConfig(prior=HierarchicalPrior())``; a command or a Flower
run config names its prior, so this plugin registers :class:`~bnpfed.models.HierarchicalPrior` as ``"hierarchical"``:
every ``nn.Linear`` weight matrix ``s`` has its own scale ``tau_s ~ HalfNormal(prior_scale)`` and weights
``w_sj | tau_s ~ N(0, tau_s^2)``. The scales are latent sites (``"1.weight_scale"``, ...): each client learns them
with its weights, and weight-wise fusion fuses them as any site, in log space.

Usage (from the repository root, so that ``examples`` is importable; on Flower every machine needs it importable)::

    bnpfed fuse --plugin examples.hierarchical_prior --prior hierarchical --rule gaa,conflation --rounds 3
    bnpfed flower sim --plugin examples.hierarchical_prior --run-config 'method="fusion" prior="hierarchical" rounds=3'

    >>> from bnpfed.federated import BayesianConfig
    >>> BayesianConfig(prior="hierarchical", prior_scale=0.5).build_prior()
    HierarchicalPrior(scale=HalfNormal())
"""

import pyro.distributions as dist

from bnpfed.models import HierarchicalPrior, register_prior


def hierarchical(scale: float, variance: str) -> HierarchicalPrior:
    """:class:`~bnpfed.models.HierarchicalPrior` on the ``nn.Linear`` weight matrices, its scales'
    hyper-prior ``HalfNormal(scale)`` (``scale``: the config's ``prior_scale``). The scales are learned, so there is
    no empirical-Bayes form (``variance`` must be ``"fixed"``)."""
    if variance != "fixed":
        raise ValueError(f"prior_variance: a hierarchical prior learns each layer's scale with the weights; expected "
                         f"'fixed', got {variance!r}")
    return HierarchicalPrior(dist.HalfNormal(scale))


register_prior("hierarchical", hierarchical, overwrite=True)

"""Matching the exchangeable components of any locally fitted models (SPAHM: Yurochkin et al., "Statistical Model
Aggregation via Parameter Matching", NeurIPS 2019): mixture components, topics, a GP's inducing points -- anything a
client reports as an unordered set of parameter vectors -- with the matcher PFNM uses for neurons.

Client j reports its J_j components as rows of a (J_j, D) array (a component's parameters: a mixture component's
mean, say), optionally with per-coordinate variances of those estimates (a mean estimated from n points with
variance s^2 is uncertain by s^2 / n). The components are the neurons of :mod:`bnpfed.matching.layer` (without
variances: :func:`~bnpfed.matching.match_layer`) or of :mod:`bnpfed.matching.bayesian_layer` (with them:
:func:`~bnpfed.matching.match_bayesian_layer`, the variances the posterior variances u): the Beta-Bernoulli process
decides how many global components there are and which local ones are copies of each, and empirical Bayes estimates
what is not given. :func:`~bnpfed.federated.fuse_mixtures` builds a federated Gaussian mixture on it.
"""

from __future__ import annotations

import torch  # noqa: F401 (match_components's examples use it)

from bnpfed.matching.bayesian_layer import match_bayesian_layer
from bnpfed.matching.layer import match_layer
from bnpfed.matching.match_result import MatchResult

__all__ = ["match_components"]


def match_components(components, variances=None, **options) -> MatchResult:
    """Match J clients' exchangeable components into global ones under the Beta-Bernoulli process (module docstring).

    Usage: three clients' mixture means, each client holding some of four well separated components, give the four
    back::

        >>> g = torch.Generator().manual_seed(0)
        >>> truth = 5.0 * torch.randn(4, 3, generator=g)
        >>> held = [[0, 1], [1, 2, 3], [3, 0]]
        >>> means = [truth[h] + 0.05 * torch.randn(len(h), 3, generator=g) for h in held]
        >>> result = match_components(means, [torch.full((len(h), 3), 0.0025) for h in held], seed=0)
        >>> result.num_atoms, [a.tolist() for a in result.assignments]   # true components 0-3 are global 3, 0, 1, 2
        (4, [[3, 0], [0, 1, 2], [2, 3]])

    :param components: J arrays or tensors (J_j, D): each client's components as parameter vectors (J_j may be 0).
    :param variances: optional J arrays of the same shapes, the variances (>= 0) of those estimates; None: the
        components are point estimates, the noise between clients' copies of a component is estimated (``sigma2``).
    :param options: the options of :func:`~bnpfed.matching.match_layer` (without variances: ``sigma2``,
        ``atom_prior``, ``noise``, ``concentration``, ...) or :func:`~bnpfed.matching.match_bayesian_layer` (with
        them: ``tau2``, ``concentration``, ...).
    :returns: :class:`~bnpfed.matching.MatchResult`: the global components (``global_atoms``) and which global
        component each local one is (``assignments``).
    """
    if variances is None:
        return match_layer(components, **options)
    return match_bayesian_layer(components, variances, **options)

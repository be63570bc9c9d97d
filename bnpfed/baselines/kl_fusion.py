"""KL-fusion (Claici, Yurochkin, Ghosh & Solomon, "Model Fusion with Kullback-Leibler Divergence", ICML 2020; code
IBM/KL-fusion): the published method closest to matched posterior fusion, as a baseline.

Each client's hidden unit is a mean-field Gaussian ``p_ju = N(m_ju, diag v_ju)`` over its unit vector (the
coordinates PFNM matches: incoming weights and bias, and for the last hidden group its weights to the output layer;
the lower groups already re-indexed to the global units). G global components ``q_i = N(M_i, diag V_i)`` are fitted
by alternating, ``iterations`` times (the published ``fusion_alternating``, parametric variant):

1. **assignment**, per client j: the optimal-transport plan ``P_j`` (G x L_j, uniform marginals ``1/G`` and
   ``1/L_j``) on the cost
   ``C_j[i, u] = KL(p_ju || q_i) = 1/2 sum_d [log(V_id / v_jud) + (v_jud + (m_jud - M_id)^2) / V_id - 1]``;
2. **barycenters**: ``q_i = argmin_q sum_{j,u} w_iju KL(p_ju || q)`` with ``w_iju`` proportional to ``P_j[i, u]``,
   in closed form the mixture's moments: ``M_i = sum w m``, ``V_i = sum w (v + m^2) - M_i^2``.

The published plan is entropic, ``reg`` = 1 nat (POT's epsilon-scaling Sinkhorn); for network units the costs are
hundreds to thousands of nats (a KL sums over every coordinate), where that plan is the exact one to within the
Sinkhorn iterations' tolerance, at a hundred times the exact solver's time: the default ``reg=None`` takes the exact
plan (``ot.emd``, the limit reg -> 0), ``reg > 0`` the published entropic one.

The KL sums over the Bayesian coordinates (posterior variance > 0); the deterministic ones (a bias the prior keeps
deterministic) carry no posterior and only follow the assignment. G is the clients' common width (every client must
have it), and the components start at the reference client's units. Then each client's units are assigned one to one
to the components by LSA on its final plan (the largest total mass), which the spec's next group needs (its input
columns are re-indexed to global units, through :func:`~bnpfed.matching.posteriors.match_posteriors`), and
every global unit is its members' KL barycenter: the mixture's moments, estimated by the ``pooling`` rule (the mean
and variance of draws pooled from the members, ``num_samples`` = 1000 of them: the variances to a few per cent),
with the members weighted by their clients' sizes (and class shares on the output coordinates) as matched fusion
weights them.

What the published code does and this does not: a single hidden layer only (here every group of a spec, bottom-up);
the nonparametric variant (a group-sparse LP in cvxpy that also chooses G) is not built; its components start from
k-means++ over the pooled local units, here from the reference client's (deterministic, and the same as weight
matching's and OT fusion's reference).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from bnpfed.matching import MatchResult
from bnpfed.matching import PosteriorMatch, match_posteriors
from bnpfed.validation import check_int, check_positive

__all__ = ["KL_REG", "kl_costs", "kl_fusion", "kl_fusion_layer"]

#: The entropic regularisation of the published code's assignment (``fusion_alternating``'s ``reg``), in nats.
KL_REG = 1.0
#: The alternations of assignment and barycenters (the published ``maxiters``).
KL_ITERATIONS = 10
#: The smallest component variance (a component whose members agree exactly would have 0).
KL_MIN_VARIANCE = 1e-12


def kl_costs(m: Tensor, v: Tensor, M: Tensor, V: Tensor) -> Tensor:
    """(G, L) ``KL(N(m_u, diag v_u) || N(M_i, diag V_i))`` between L units (``m``, ``v``: (L, D), ``v > 0``) and G
    components (``M``, ``V``: (G, D), ``V > 0``), by matrix products (no (G, L, D) array)."""
    inv = 1.0 / V
    return 0.5 * (torch.log(V).sum(1)[:, None] - torch.log(v).sum(1)[None, :] + inv @ (v + m * m).T
                  - 2.0 * (M * inv) @ m.T + (M * M * inv).sum(1)[:, None] - m.shape[1])


def kl_fusion_layer(*, reference: int = 0, reg: float | None = None, iterations: int = KL_ITERATIONS):
    """KL-fusion's one-group step as a ``layer_fn`` of :func:`~bnpfed.matching.posteriors.match_posteriors`
    (module docstring): it returns the one-to-one assignments and the components' means. ``reg``: None (default)
    the exact plan, else the entropic one at that regularisation in nats (the published :data:`KL_REG` = 1)."""
    reg = None if reg is None else check_positive(reg, "reg")
    iterations = check_int(iterations, "iterations", low=1)
    reference = check_int(reference, "reference", low=0)

    def layer_fn(means, variances, **_ignored) -> MatchResult:
        import ot

        m = [torch.as_tensor(x, dtype=torch.float64) for x in means]
        v = [torch.as_tensor(x, dtype=torch.float64) for x in variances]
        widths = [len(x) for x in m]
        if len(set(widths)) != 1:
            raise ValueError(f"clients: expected one width per group at every client for KL-fusion (its G global "
                             f"components are the clients' width), got widths {widths}")
        if reference >= len(m):
            raise ValueError(f"reference: expected a client in [0, {len(m)}), got {reference}")
        G = widths[0]
        bayes = (torch.cat(v) > 0).all(0)   # the coordinates with a posterior at every unit
        M, V = m[reference].clone(), v[reference].clone()
        a = np.full(G, 1.0 / G)
        plans, objective = [], []
        for _ in range(iterations):
            plans, total = [], 0.0
            for x, s in zip(m, v):
                C = kl_costs(x[:, bayes], s[:, bayes], M[:, bayes], V[:, bayes].clamp_min(KL_MIN_VARIANCE))
                b = np.full(len(x), 1.0 / len(x))
                P = ot.emd(a, b, C.numpy()) if reg is None else \
                    ot.bregman.sinkhorn_epsilon_scaling(a, b, C.numpy(), reg=reg, epsilon0=1e10)
                P = torch.as_tensor(np.asarray(P), dtype=torch.float64)
                plans.append(P)
                total += float((P * C).sum())
            objective.append(total)
            W = torch.stack(plans)                          # (J, G, L)
            W = W / W.sum((0, 2), keepdim=True).clamp_min(1e-300)
            X, S = torch.stack(m), torch.stack(v)           # (J, L, D)
            M = torch.einsum("jgl,jld->gd", W, X)
            V = torch.where(bayes, (torch.einsum("jgl,jld->gd", W, S + X * X) - M * M).clamp_min(KL_MIN_VARIANCE),
                            torch.zeros_like(M))
        assignments = []
        for P in plans:
            rows, cols = linear_sum_assignment(P.numpy().T, maximize=True)   # client unit u -> component
            labels = torch.empty(len(rows), dtype=torch.long)
            labels[torch.as_tensor(rows)] = torch.as_tensor(cols, dtype=torch.long)
            assignments.append(labels)
        labels = torch.cat(assignments)
        return MatchResult(global_atoms=M, posterior_precision=torch.ones_like(M), assignments=assignments,
                           counts=torch.bincount(labels, minlength=G), objective=objective)

    return layer_fn


def kl_fusion(clients: Sequence, class_counts=None, spec=None, *, sizes=None, input_shape=None, template=None,
              reference: int | None = None, reg: float | None = None, iterations: int = KL_ITERATIONS,
              num_samples: int = 1000, seed: int | None = 0, **kwargs) -> PosteriorMatch:
    """KL-fusion of J Bayesian clients through the spec (module docstring): their units assigned group by group by
    :func:`kl_fusion_layer`, every global unit its members' KL barycenter (``pooling`` with ``num_samples`` draws).

    :param clients: J :class:`~bnpfed.clients.BayesianClient` s (or ``(locs, variances)`` pairs), one width.
    :param class_counts: (J, C) examples per class (class shares on the output coordinates; the default sizes).
    :param reference: the client whose units the components start from (default: the most examples, by
        ``sizes`` or the class counts; the first without either).
    :returns: :class:`~bnpfed.matching.posteriors.PosteriorMatch` (``rule`` ``"pooling"``).
    """
    J = len(clients)
    if reference is None:
        if sizes is not None:
            n = [float(x) for x in sizes]
        elif class_counts is not None:
            n = [float(x) for x in torch.as_tensor(class_counts, dtype=torch.float64).sum(1)]
        else:
            n = [1.0] * J
        reference = max(range(J), key=lambda j: (n[j], -j))
    return match_posteriors(list(clients), class_counts, spec, rule="pooling", sizes=sizes, input_shape=input_shape,
                            template=template, layer_fn=kl_fusion_layer(reference=reference, reg=reg,
                                                                        iterations=iterations),
                            num_samples=num_samples, seed=seed, **kwargs)

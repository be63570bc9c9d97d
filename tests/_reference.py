"""Independent, slow computations the tests compare against (no code shared with bnpfed)."""

import math

import numpy as np
from scipy import stats


def ibp_configuration_logprob(counts, J, gamma0, c=1.0):
    """log of the Beta-Bernoulli (IBP) prior of a configuration of distinguishable atoms:
    L log g - g H_J + sum_i log[(m_i - 1)! (J - m_i)! / J!]; with a concentration c (Ghahramani, Griffiths & Sollich
    2007, eq. 10 with the K_h! of identical columns left out): L log(g c) - g sum_j c/(c + j - 1) + sum_i log B(m_i,
    J - m_i + c)."""
    rate = sum(c / (c + j - 1) for j in range(1, J + 1))
    lp = len(counts) * math.log(gamma0 * c) - gamma0 * rate
    for m in counts:
        lp += math.lgamma(m) + math.lgamma(J - m + c) - math.lgamma(J + c)
    return lp


def groups_of(assignments):
    """dict atom label -> list of (client, neuron index)."""
    groups = {}
    for j, a in enumerate(assignments):
        for l, i in enumerate(np.asarray(a).tolist()):
            groups.setdefault(int(i), []).append((j, l))
    return groups


def map_log_density(neurons, assignments, *, sigma2, sigma0_2, gamma0, mu0=0.0, precisions=None, concentration=1.0):
    """log p_conf(Z, theta_hat, V) with every atom at its posterior mode, from scipy's normal log-densities,
    without the uniform-permutation factor."""
    J = len(neurons)
    D = np.asarray(neurons[0]).shape[1]
    mu0 = np.broadcast_to(np.asarray(mu0, dtype=float), (D,))
    s = np.ones((J, D)) if precisions is None else np.asarray(precisions, dtype=float)
    groups = groups_of(assignments)
    lp = ibp_configuration_logprob([len(g) for g in groups.values()], J, gamma0, concentration)
    for members in groups.values():
        prec = 1.0 / sigma0_2 + sum(s[j] / sigma2 for j, _ in members)
        num = mu0 / sigma0_2 + sum(s[j] * np.asarray(neurons[j][l], dtype=float) / sigma2 for j, l in members)
        theta = num / prec
        lp += stats.norm.logpdf(theta, mu0, math.sqrt(sigma0_2)).sum()
        for j, l in members:
            lp += stats.norm.logpdf(np.asarray(neurons[j][l], dtype=float), theta, np.sqrt(sigma2 / s[j])).sum()
    return lp


def marginal_log_density(neurons, assignments, *, sigma2, sigma0_2, gamma0, mu0=0.0, precisions=None,
                         concentration=1.0):
    """log p_conf(Z, V) with every atom integrated out: per atom and coordinate the members' values are jointly
    Gaussian with mean mu0 and covariance sigma0_2 11^T + diag(sigma2 / s)."""
    J = len(neurons)
    D = np.asarray(neurons[0]).shape[1]
    mu0 = np.broadcast_to(np.asarray(mu0, dtype=float), (D,))
    s = np.ones((J, D)) if precisions is None else np.asarray(precisions, dtype=float)
    groups = groups_of(assignments)
    lp = ibp_configuration_logprob([len(g) for g in groups.values()], J, gamma0, concentration)
    for members in groups.values():
        m = len(members)
        for d in range(D):
            x = np.array([float(neurons[j][l][d]) for j, l in members])
            cov = sigma0_2 * np.ones((m, m)) + np.diag([sigma2 / s[j, d] for j, _ in members])
            lp += stats.multivariate_normal.logpdf(x, np.full(m, mu0[d]), cov)
    return lp

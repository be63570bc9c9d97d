"""The Beta process's part of a matching: the two-parameter Indian buffet process's density of a configuration, its
popularity and new-atom terms, and the maximum-likelihood mass ``gamma0`` and concentration ``c``.

Under :func:`~bnpfed.models.beta_bernoulli_layer` (mass gamma0, concentration c, J clients) a configuration of L
distinguishable atoms, atom i held by m_i clients, has probability (Ghahramani, Griffiths & Sollich 2007)

    log p(Z) = L log(gamma0 c) - gamma0 R_J(c) + sum_i [log Gamma(m_i) + log Gamma(J - m_i + c) - log Gamma(J + c)],

``R_J(c) = sum_{j=1}^J c / (c + j - 1)`` (H_J at c = 1): the expected number of atoms is ``gamma0 R_J(c)``. With the
other clients fixed, client j joining an atom of m others changes it by ``log(m / (J - 1 + c - m))`` (the
*popularity* term) and opening a new atom by ``log(gamma0 c / (J - 1 + c))``; at c = 1 they are PFNM's ``log(m / (J -
m))`` and ``log(gamma0 / J)``.

**Estimates.** ``d/dgamma0 log p = L / gamma0 - R_J(c)`` vanishes at ``gamma0 = L / R_J(c)``; c (when free) maximises
the profile ``L log(L c / R_J(c)) - L + sum_i [log Gamma(J - m_i + c) - log Gamma(J + c)]`` (at a given gamma0, ``L
log c - gamma0 R_J(c) + ...``), found by a bounded scalar search over log c in :data:`CONCENTRATION_RANGE`.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import gammaln

__all__ = ["CONCENTRATION_RANGE", "ibp_estimates", "ibp_log_prob", "ibp_rate", "new_atom_term", "popularity_terms"]

#: The range an estimated concentration c may take: below it every atom is held by every client, above it by one.
CONCENTRATION_RANGE = (1e-3, 1e3)


def ibp_rate(J: int, c: float) -> float:
    """``R_J(c) = sum_{j=1}^J c / (c + j - 1)``: the expected number of atoms per unit of mass (H_J at c = 1)."""
    if c == 1.0:
        return float(np.sum(1.0 / np.arange(1, J + 1)))
    return float(c * np.sum(1.0 / (c + np.arange(J))))


def ibp_log_prob(counts, J: int, gamma0: float, c: float = 1.0) -> float:
    """``log p(Z)`` of a configuration whose atoms are held by ``counts`` (m_i >= 1) of the J clients (module
    docstring).

    >>> round(ibp_log_prob([1], 2, 1.0), 6) == round(-1.5 - math.log(2), 6)   # log 1 - H_2 + log(0! 1! / 2!)
    True
    """
    m = np.asarray(counts, dtype=float).reshape(-1)
    return float(m.size * math.log(gamma0 * c) - gamma0 * ibp_rate(J, c)
                 + np.sum(gammaln(m) + gammaln(J - m + c) - gammaln(J + c)))


def popularity_terms(J: int, c: float, factor: float, cap: int | None = None) -> np.ndarray:
    """(J + 1,) ``factor * log(m' / (J - 1 + c - m'))`` for m = 0 .. J others on an atom, ``m' = min(m, cap)``:
    the score of joining it (``-inf`` at m = 0)."""
    m = np.arange(J + 1, dtype=np.float64)
    mc = np.minimum(m, cap) if cap is not None else m
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(factor) * (np.log(mc) - np.log(J - 1 + c - mc))


def new_atom_term(J: int, gamma0: float, c: float) -> float:
    """``log(gamma0 c / (J - 1 + c))``: the score of opening a new atom (without the factor 2 the matcher puts on
    it)."""
    return math.log(gamma0 / J) if c == 1.0 else math.log(gamma0 * c / (J - 1 + c))


def ibp_estimates(counts, J: int, *, gamma0: float | None = None, c: float | None = None) -> tuple[float, float, bool]:
    """The maximum-likelihood mass and concentration of a configuration (``counts`` the m_i), the given one(s) held:
    ``(gamma0, c, at_bound)``, ``at_bound`` whether an estimated c stopped at :data:`CONCENTRATION_RANGE` (every atom
    alone pushes c up, every atom shared by all pushes it down).

    >>> ibp_estimates([3, 1, 1], 4, c=1.0)[0] == 3 / (1 + 1/2 + 1/3 + 1/4)
    True
    """
    m = np.asarray(counts, dtype=float).reshape(-1)
    L = m.size
    if c is not None:
        return (float(gamma0) if gamma0 is not None else L / ibp_rate(J, c)), float(c), False

    def negative(log_c):
        cc = math.exp(log_c)
        rate = ibp_rate(J, cc)
        g = float(gamma0) if gamma0 is not None else L / rate
        return -(L * math.log(g * cc) - g * rate + float(np.sum(gammaln(J - m + cc) - gammaln(J + cc))))

    lo, hi = (math.log(b) for b in CONCENTRATION_RANGE)
    best = minimize_scalar(negative, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
    c_hat = math.exp(float(best.x))
    at_bound = min(abs(best.x - lo), abs(best.x - hi)) < 1e-3
    return (float(gamma0) if gamma0 is not None else L / ibp_rate(J, c_hat)), c_hat, at_bound

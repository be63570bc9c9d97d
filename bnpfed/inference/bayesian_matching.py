"""Matching of Bayesian neurons: PFNM's Hungarian step when every local neuron comes with posterior variances.

The clients are variational Bayesian networks. Client j's neuron l reports posterior means ``v_jl`` (D,) and posterior
variances ``u_jl`` (D,), ``u_jld >= 0`` (0 for a deterministic coordinate such as a bias). The model is that of
:mod:`bnpfed.inference.matching` with heteroscedastic noise (:func:`~bnpfed.models.beta_bernoulli.beta_bernoulli_layer`
with ``neuron_variance``, its ``sigma2`` playing tau2's role):

    theta_i ~ N(mu0, sigma0_2 I),    Z ~ Beta-Bernoulli(gamma0) (which atoms a client uses),
    v_jld ~ N(theta_id, (u_jld + tau2) / s_jd)     for the atom i that neuron l of client j belongs to,

with ``tau2`` a per-layer extra variance (a unit's posterior variance at one client understates how far its copies at
two clients lie apart: they were trained on different data) and ``s_jd >= 0`` optional per-client precision scales
(PFNM's class shares on output coordinates; 0: the client says nothing about coordinate d). The posterior variances
are data, their law is free of the assignment: a constant of the objective.

Notation (per atom i with members S_i, coordinate d). The noise precision of one neuron's coordinate is

    w_jld = s_jd / (u_jld + tau2),

and (natural parameters of the atom's Gaussian posterior)

    P_id = 1/sigma0_2 + sum_{(j,l) in S_i} w_jld                   (posterior precision)
    g_id = mu0_d/sigma0_2 + sum_{(j,l) in S_i} w_jld v_jld          (precision-weighted sum)

with the posterior mean ``g_i / P_i`` and ``P0 = 1/sigma0_2``, ``g0 = mu0/sigma0_2`` (an atom without members). The
objective is the **marginal** one of :func:`~bnpfed.inference.matching.match_layer` (atoms integrated out; factor-2
convention; m_i clients on atom i, L atoms, c the popularity factor):

    F(Z) = sum_i [ sum_d (g_id^2/P_id - g0_d^2/P0 - log(P_id/P0)) + 2 log(gamma0/J) + c sum_{k=1}^{m_i-1} log(k/(J-k)) ]

For c = 2, ``F(Z) = 2 log p(Z, V | U) + sum_{j,l,d} [log(2 pi / w_jld) + w_jld v_jld^2] - 2 gamma0 H_J``, ``p`` the
configuration density with the atoms integrated out (each atom's members' values are jointly Gaussian, covariance
``sigma0_2 11^T + diag(1/w)`` per coordinate) and no factor for the order of a client's neurons. With every
``u = 0`` and ``s = 1`` it is match_layer's marginal objective at ``sigma2 = tau2``.

**Scores.** With the other clients fixed, client j's neuron l scores, against an existing atom i (m_i other clients),

    sum_d [(g_id + w_jld v_jld)^2/(P_id + w_jld) - g_id^2/P_id - log((P_id + w_jld)/P_id)] + c log(m_i/(J - m_i))

and against a new atom the same with ``(g0, P0)`` and ``2 log(gamma0/J)`` in place of the popularity term: the
exact change of F, so ``scipy.optimize.linear_sum_assignment`` solves each client exactly. Unlike the homoscedastic
case the precision ``P_id + w_jld`` depends on both the atom and the neuron, so the (L_j, L) score matrix is no
matrix product: it is computed by broadcasting over (L_j, atoms, D) in chunks of at most ``CHUNK_ELEMENTS``
entries. A greedy pass (largest client first) and sweeps of remove-and-rematch in a seeded random client order are
coordinate ascent: with the hyper-parameters fixed F never decreases. A client without neurons counts in J only.

**Empirical Bayes** (``hyperparameters="empirical-bayes"``, the default): whatever of tau2, sigma0_2, gamma0, mu0
is not given is estimated from the current assignment after the first pass and after every sweep, until a sweep
changes no assignment and moves no estimate by more than ``EB_RTOL`` (relative; mu0 relative to sqrt(sigma0_2)), or
``sweeps`` sweeps have run (``converged`` False, noted). Per atom i and coordinate d, over its members with s_jd > 0:

    W_id(tau2) = sum_j w_jd,   xbar_id = sum_j w_jd v_jd / W_id,   n_id = #{members with s_jd > 0}.

* tau2, by the Paule-Mandel (generalized Q) moment equation. Given the atom, the members' v_jd are independent
  N(theta_id, 1/w_jd), so ``Q_id = sum_j w_jd (v_jd - xbar_id)^2`` is chi-square with n_id - 1 degrees of freedom at
  the true tau2: the estimate solves ``sum_{i,d} Q_id(tau2) = sum_{i,d} (n_id - 1)``. The left side decreases in
  tau2 (DerSimonian & Kacker 2007), so the root is unique; it is found by ``brentq`` on log tau2. If the left side is
  below the right already at the floor (``TAU2_FLOOR`` times the pooled variance of the means), the floor is the
  estimate (noted); if no atom has two members there are no degrees of freedom and the previous value is kept
  (noted). With u = 0 it is match_layer's pooled within-atom variance.
* sigma0_2, likewise on the atom means: given the assignment, ``xbar_id ~ N(mu0_d, sigma0_2 + 1/W_id)``
  independently over the atoms, so with ``a_id = 1/(sigma0_2 + 1/W_id)`` and ``mu_d`` the a-weighted mean of the
  xbar_id (or the given mu0_d), ``sum_{i,d} a_id (xbar_id - mu_d)^2`` is chi-square with ``sum_d (L_d - 1)``
  degrees of freedom (``sum_d L_d`` about a given mu0): Paule-Mandel solves the equality of the two, the left side
  decreasing in sigma0_2. Floored at ``SIGMA0_2_FLOOR * (tau2 + mean u)`` (relative to the noise, as in
  match_layer); with fewer than two atoms the previous value is kept (noted). With u = 0 and equal W it is
  match_layer's unweighted estimate.
* mu0_d = the a-weighted mean of the atom means at the estimated sigma0_2 (coordinates without data keep their
  start);
* gamma0 = L / H_J, the maximum-likelihood IBP mass.

Coordinates with precision scales other than 1 (``precisions``; PFNM's output weights) are on a scale of their own,
so, as in match_layer, a layer with both kinds gets a second pair ``tau2_scaled``, ``sigma0_2_scaled`` for them (the
same equations on those coordinates; a given tau2 or sigma0_2 fixes every pair). Coordinates of scale 1 whose
posterior variance is 0 at every neuron are deterministic parameters (a bias the prior keeps deterministic): a point
estimate, not a measurement without error, so beside Bayesian coordinates they get a pair of their own,
``tau2_point`` and ``sigma0_2_point`` -- on them the model is match_layer's homoscedastic one, tau2_point its
sigma2. Without it, once the members' Bayesian coordinates agree within their posterior variances (clients that
retrained their slice of a global posterior, which is also their prior) tau2 falls to its floor, the deterministic
coordinates become exact, and members whose biases differ at all can no longer share a unit. A layer with one kind
of coordinate has one pair, named tau2 and sigma0_2.

The start mirrors match_layer: with T the pooled variance of the means and ubar the mean posterior variance (over
the coordinates of the block, entries with s > 0), ``R = T - ubar`` (T where that is not positive, noted) is what
the model gives as ``sigma0_2 + tau2``; ``tau2 = EB_START_NOISE_SHARE * R`` and ``sigma0_2 = R - tau2``, mu0 the
per-coordinate mean, gamma0 the mean number of neurons per client. If the first pass from there leaves every neuron
alone, it is redone from the even split (noted).
"""

from __future__ import annotations

import math
import time
from typing import Literal

import numpy as np
import torch
from scipy.optimize import brentq, linear_sum_assignment
from scipy.sparse import csr_matrix
from torch import Tensor

from bnpfed.inference.matching import (
    EB_RTOL,
    EB_START_NOISE_SHARE,
    SIGMA0_2_FLOOR,
    MatchResult,
    _harmonic,
    _result_dtype,
    _to_numpy,
    _validate_labels,
    _validate_mu0,
    _validate_precisions,
)
from bnpfed.validation import check_choice, check_float, check_int, check_positive

__all__ = ["CHUNK_ELEMENTS", "TAU2_FLOOR", "bayesian_assignment_objective", "match_bayesian_layer"]

#: At most this many (neuron, atom, coordinate) entries are broadcast at once when scoring a client (32 MiB each).
CHUNK_ELEMENTS = 2 ** 22

#: Empirical Bayes: the smallest tau2 an estimate may take, relative to the pooled variance of the means.
TAU2_FLOOR = 1e-10


# --------------------------------------------------------------------------------------------------------------------
# validation


def _validate_clients(means, variances) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """J float64 arrays (L_j, D) of means and of variances, checked against each other."""
    out = {}
    for name, arrays in (("means", means), ("variances", variances)):
        if isinstance(arrays, (Tensor, np.ndarray)) and np.ndim(arrays) == 3:
            arrays = list(arrays)
        if isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__len__") or not len(arrays):
            raise ValueError(f"{name}: expected a non-empty sequence of J arrays of shape (L_j, D), got {arrays!r}")
        out[name] = [_to_numpy(a, f"{name}[{j}]") for j, a in enumerate(arrays)]
    V, U = out["means"], out["variances"]
    if len(U) != len(V):
        raise ValueError(f"variances: expected one array per client ({len(V)}, as many as means), got {len(U)}")
    D = V[0].shape[1] if V[0].ndim == 2 else None
    for j, (v, u) in enumerate(zip(V, U)):
        if v.ndim != 2 or v.shape[1] != D:
            raise ValueError(f"means[{j}]: expected shape (L_j, {D}) (every client shares D), got {v.shape}")
        if u.shape != v.shape:
            raise ValueError(f"variances[{j}]: expected shape {v.shape} (that of means[{j}]), got {u.shape}")
        if not np.isfinite(v).all():
            raise ValueError(f"means[{j}]: contains NaN or inf")
        if not np.isfinite(u).all():
            raise ValueError(f"variances[{j}]: contains NaN or inf")
        if (u < 0).any():
            raise ValueError(f"variances[{j}]: expected posterior variances >= 0, got minimum {float(u.min())}")
    if not any(v.shape[0] for v in V):
        raise ValueError(f"means: expected at least one client with a neuron (L_j >= 1), got {len(V)} client(s), all "
                         "with L_j = 0: nothing to match")
    return [np.ascontiguousarray(v) for v in V], [np.ascontiguousarray(u) for u in U]


# --------------------------------------------------------------------------------------------------------------------
# scores and objective: pure functions of the natural parameters


def noise_precisions(variances: np.ndarray, tau2: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(L_j, D) ``w_jld = s_jd / (u_jld + tau2_d)`` of one client (tau2 per coordinate: a block's value)."""
    return scales[None, :] / (variances + tau2[None, :])


def join_scores(x: np.ndarray, w: np.ndarray, g: np.ndarray, P: np.ndarray) -> np.ndarray:
    """(L_j, K) Gaussian part of the change of F when neuron l (``x = w v``, ``w``) joins atom k (``g``, ``P``):
    ``sum_d [(g + x)^2/(P + w) - g^2/P - log((P + w)/P)]``, broadcast in chunks of at most CHUNK_ELEMENTS."""
    L_j, D = x.shape
    K = g.shape[0]
    out = np.empty((L_j, K))
    base = (g ** 2 / P).sum(axis=1)
    step = max(1, CHUNK_ELEMENTS // max(L_j * D, 1))
    for k0 in range(0, K, step):
        gk, Pk = g[None, k0:k0 + step], P[None, k0:k0 + step]
        Pw = Pk + w[:, None, :]
        part = gk + x[:, None, :]
        np.square(part, out=part)
        part /= Pw
        Pw /= Pk
        np.log(Pw, out=Pw)
        part -= Pw
        out[:, k0:k0 + step] = part.sum(axis=2) - base[None, k0:k0 + step]
    return out


def popularity_terms(J: int, c: float) -> tuple[np.ndarray, np.ndarray]:
    """``pop[m] = c log(m / (J - m))`` (joining an atom held by m other clients) and ``pop_cum[m] = sum_{k=1}^{m-1}
    pop[k]`` (an atom with m members), for m = 0 .. J."""
    m = np.arange(J + 1, dtype=np.float64)
    with np.errstate(divide="ignore"):
        pop = c * (np.log(m) - np.log(J - m))
    pop_cum = np.zeros(J + 1)
    pop_cum[2:] = np.cumsum(pop[1:J])
    return pop, pop_cum


def objective_of_atoms(g: np.ndarray, P: np.ndarray, m: np.ndarray, g0: np.ndarray, P0: np.ndarray,
                       log_new: float, pop_cum: np.ndarray) -> float:
    """F of atoms with natural parameters (g, P) (L, D) and m members each (module docstring)."""
    gauss = (g ** 2 / P).sum() - g.shape[0] * (g0 ** 2 / P0).sum() - np.log(P / P0).sum()
    return float(gauss + g.shape[0] * log_new + pop_cum[m].sum())


# --------------------------------------------------------------------------------------------------------------------
# the state of a matching


class _BayesianMatcher:
    """Per-atom natural parameters (g, P, m) of a partial assignment, with client-by-client (re-)matching. The data
    are set once; :meth:`set_hyperparameters` recomputes every neuron's (w, x = w v) and rebuilds the atoms of the
    current assignment."""

    def __init__(self, V, U, s, popularity_factor: float):
        self.V, self.U = V, U
        self.J, self.D = len(V), V[0].shape[1]
        self.s = np.ones((self.J, self.D)) if s is None else s
        self.L = [v.shape[0] for v in V]
        self.pop, self.pop_cum = popularity_terms(self.J, popularity_factor)
        self.assign: list = [None] * self.J
        self.lsa_seconds = 0.0
        self.rematches: list = []
        self.hyper = None

    def set_hyperparameters(self, *, tau2: np.ndarray, sigma0_2: np.ndarray, gamma0: float, mu0: np.ndarray):
        """tau2, sigma0_2, mu0 per coordinate (D,)."""
        key = (tau2.tobytes(), sigma0_2.tobytes(), float(gamma0), mu0.tobytes())
        if key == self.hyper:
            return
        self.hyper = key
        self.P0 = 1.0 / sigma0_2
        self.g0 = mu0 * self.P0
        self.w = [noise_precisions(u, tau2, self.s[j]) for j, u in enumerate(self.U)]
        self.x = [w * v for w, v in zip(self.w, self.V)]
        self.log_new = 2.0 * math.log(gamma0 / self.J)
        self.new_scores = [join_scores(x, w, self.g0[None], self.P0[None])[:, 0] + self.log_new
                           for x, w in zip(self.x, self.w)]
        labels = None if any(a is None for a in self.assign) else list(self.assign)
        self._reset()
        if labels is not None:
            self.start_from(labels)

    def _reset(self):
        cap = max(2 * max(self.L), 64)
        self.g = np.tile(self.g0, (cap, 1))
        self.P = np.tile(self.P0, (cap, 1))
        self.m = np.zeros(cap, dtype=np.int64)
        self.n_rows = 0
        self.free: list = []
        self.assign = [None] * self.J

    def _new_rows(self, k: int) -> np.ndarray:
        take = self.free[max(len(self.free) - k, 0):] if k else []
        del self.free[len(self.free) - len(take):]
        rest = k - len(take)
        if self.n_rows + rest > self.m.shape[0]:
            extra = max(self.n_rows + rest, 2 * self.m.shape[0]) - self.m.shape[0]
            self.g = np.vstack([self.g, np.tile(self.g0, (extra, 1))])
            self.P = np.vstack([self.P, np.tile(self.P0, (extra, 1))])
            self.m = np.concatenate([self.m, np.zeros(extra, dtype=np.int64)])
        rows = np.array(list(take) + list(range(self.n_rows, self.n_rows + rest)), dtype=np.int64)
        self.n_rows += rest
        return rows

    def add(self, j: int, rows: np.ndarray):
        self.g[rows] += self.x[j]
        self.P[rows] += self.w[j]
        self.m[rows] += 1
        self.assign[j] = rows

    def remove(self, j: int) -> np.ndarray:
        """Take client j off its atoms; return the positions whose atom survives."""
        rows = self.assign[j]
        self.assign[j] = None
        self.m[rows] -= 1
        keep = self.m[rows] > 0
        kept, empty = rows[keep], rows[~keep]
        self.g[kept] -= self.x[j][keep]
        self.P[kept] -= self.w[j][keep]
        self.g[empty] = self.g0
        self.P[empty] = self.P0
        self.free.extend(int(r) for r in empty)
        return np.flatnonzero(keep)

    def match(self, j: int, *, rematch: bool = False) -> bool:
        """Assign client j optimally given the others; return whether the partition changed."""
        L_j = self.L[j]
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        if L_j == 0:
            self.assign[j] = np.empty(0, dtype=np.int64)
            self.rematches.append((j, 0, int(active.size)))
            return False
        if rematch:
            previous = self.assign[j]
            positions = self.remove(j)
            active = np.flatnonzero(self.m[: self.n_rows] > 0)
        L = active.size
        S = np.empty((L_j, L + L_j))
        S[:, L:] = self.new_scores[j][:, None]
        if L:
            S[:, :L] = join_scores(self.x[j], self.w[j], self.g[active], self.P[active])
            S[:, :L] += self.pop[self.m[active]][None, :]
        t0 = time.perf_counter()
        rows, cols = linear_sum_assignment(S, maximize=True)
        self.lsa_seconds += time.perf_counter() - t0
        self.rematches.append((j, L_j, L))
        target = np.empty(L_j, dtype=np.int64)
        is_new = cols >= L
        target[rows[~is_new]] = active[cols[~is_new]]
        target[rows[is_new]] = self._new_rows(int(is_new.sum()))
        self.add(j, target)
        if not rematch:
            return True
        # unchanged: the neurons whose atom survived the removal went back to it, and the others opened new atoms
        was_shared = np.zeros(L_j, dtype=bool)
        was_shared[positions] = True
        opened = np.zeros(L_j, dtype=bool)
        opened[rows[is_new]] = True
        return bool((was_shared == opened).any() or (target[positions] != previous[positions]).any())

    def sweep(self, rng: np.random.Generator) -> bool:
        changed = False
        for j in rng.permutation(self.J):
            changed |= self.match(int(j), rematch=True)
        return changed

    def greedy(self):
        for j in np.argsort(-np.array(self.L), kind="stable"):
            self.match(int(j))

    def start_from(self, labels: list):
        uniq, flat = np.unique(np.concatenate(labels), return_inverse=True)
        flat = flat.reshape(-1)
        self._reset()
        self._new_rows(uniq.size)
        start = 0
        for j, a in enumerate(labels):
            self.add(j, flat[start:start + a.size])
            start += a.size

    def labels(self) -> tuple[list, int]:
        """The assignment as compact labels 0 .. L-1 in storage order, and L."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        relabel = np.full(self.n_rows, -1, dtype=np.int64)
        relabel[active] = np.arange(active.size)
        return [relabel[a] for a in self.assign], int(active.size)

    def objective(self) -> float:
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        return objective_of_atoms(self.g[active], self.P[active], self.m[active], self.g0, self.P0, self.log_new,
                                  self.pop_cum)

    def result(self, objective: list, seconds: float, dtype, **extra) -> MatchResult:
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        labels, _ = self.labels()
        return MatchResult(
            global_atoms=torch.as_tensor(self.g[active] / self.P[active], dtype=dtype),
            posterior_precision=torch.as_tensor(self.P[active], dtype=dtype),
            assignments=[torch.as_tensor(a) for a in labels],
            counts=torch.as_tensor(self.m[active]),
            objective=objective,
            seconds=seconds,
            lsa_seconds=self.lsa_seconds,
            rematches=self.rematches,
            **extra,
        )


# --------------------------------------------------------------------------------------------------------------------
# empirical Bayes: Paule-Mandel moment equations


def _solve_decreasing(f, lo: float, guess: float) -> float:
    """The root in [lo, inf) of ``f`` (decreasing, ``f(lo) > 0``, negative for large arguments), on a log scale."""
    hi = max(guess, 2.0 * lo)
    for _ in range(400):
        if f(hi) < 0:
            break
        hi *= 4.0
    else:
        raise RuntimeError("the moment equation has no root below 4^400 times the start")  # pragma: no cover
    return float(math.exp(brentq(lambda t: f(math.exp(t)), math.log(lo), math.log(hi), xtol=1e-12, rtol=1e-12)))


def _atom_means(membership, v, w):
    """Per atom (L, C): ``W = sum w`` and ``xbar = sum w v / W`` (0 where W = 0)."""
    W = np.asarray(membership @ w)
    S = np.asarray(membership @ (w * v))
    return W, np.divide(S, W, out=np.zeros_like(S), where=W > 0)


def estimate_tau2(membership, labels, v, u, s, floor: float) -> tuple[float | None, bool]:
    """Paule-Mandel tau2 on one block's coordinates: ``v, u, s`` (N, C) of all neurons (``s`` the client's scales),
    ``labels`` (N,) their atoms, ``membership`` the (L, N) 0/1 matrix. Returns (value, floored); value None when
    there are no degrees of freedom (no atom has two members with data)."""
    seen = s > 0
    dof = float(np.maximum(np.asarray(membership @ seen.astype(float)) - 1.0, 0.0).sum())
    if dof <= 0:
        return None, False

    def excess(tau2):
        w = s / (u + tau2)
        _, xbar = _atom_means(membership, v, w)
        return float((w * (v - xbar[labels]) ** 2).sum()) - dof

    if excess(floor) <= 0:
        return floor, True
    return _solve_decreasing(excess, floor, floor * 1e6), False


def _between_weights(W: np.ndarray, xbar: np.ndarray, sigma0_2: float) -> tuple[np.ndarray, np.ndarray]:
    """``a_id = 1/(sigma0_2 + 1/W_id)`` (0 where W_id = 0) and the a-weighted mean of the atom means per coordinate
    (NaN where no atom has data)."""
    held = W > 0
    a = np.where(held, 1.0 / (sigma0_2 + np.divide(1.0, W, out=np.zeros_like(W), where=held)), 0.0)
    A = a.sum(axis=0)
    return a, np.divide((a * xbar).sum(axis=0), A, out=np.full_like(A, np.nan), where=A > 0)


def estimate_sigma0_2(membership, v, u, s, tau2: float, mu0: np.ndarray | None, floor: float
                      ) -> tuple[float | None, bool]:
    """Paule-Mandel sigma0_2 on one block's coordinates from the atom means at ``tau2``; ``mu0`` (C,) given, or None
    (estimated: the a-weighted mean). Returns (value, floored); value None when not estimable."""
    W, xbar = _atom_means(membership, v, s / (u + tau2))
    L_d = (W > 0).sum(axis=0).astype(float)
    dof = float((L_d - 1).clip(min=0).sum() if mu0 is None else L_d.sum())
    if dof <= 0:
        return None, False

    def excess(sig):
        a, centre = _between_weights(W, xbar, sig)
        centre = np.nan_to_num(centre) if mu0 is None else mu0
        return float((a * (xbar - centre) ** 2).sum()) - dof

    if excess(floor) <= 0:
        return floor, True
    return _solve_decreasing(excess, floor, floor * 1e3), False


def estimate_mu0(membership, v, u, s, tau2: float, sigma0_2: float) -> np.ndarray:
    """(C,) the a-weighted mean of the atom means at (tau2, sigma0_2); NaN on a coordinate without data."""
    W, xbar = _atom_means(membership, v, s / (u + tau2))
    return _between_weights(W, xbar, sigma0_2)[1]


# --------------------------------------------------------------------------------------------------------------------
# the empirical-Bayes loop


class _Blocks:
    """The coordinate blocks (A: scale 1 at every client; B: the others) and the flat (N, D) data of all neurons."""

    def __init__(self, V, U, s):
        J, D = len(V), V[0].shape[1]
        self.v, self.u = np.concatenate(V), np.concatenate(U)
        sizes = [x.shape[0] for x in V]
        self.s = np.repeat(np.ones((J, D)) if s is None else s, sizes, axis=0)
        plain = np.arange(D) if s is None else np.flatnonzero((s == 1.0).all(axis=0))
        # coordinates of scale 1 with posterior variance 0 at every neuron: deterministic (point) estimates
        point = plain[(self.u[:, plain] == 0).all(axis=0)] if self.u.shape[0] else plain[:0]
        A = np.setdiff1d(plain, point)
        B = np.setdiff1d(np.arange(D), plain)
        blocks = [(A, ""), (point, "_point" if len(A) else "")]
        blocks = [(c, suffix) for c, suffix in blocks if len(c)]
        if len(B) and (self.s[:, B] > 0).any() and blocks:
            blocks.append((B, "_scaled"))
        elif len(B):   # no scale-1 coordinate, or none with data among the scaled ones: they join the first block
            blocks = [(np.union1d(blocks[0][0], B), blocks[0][1])] + blocks[1:] if blocks else [(B, "")]
        # the blocks with their own pair: (coordinates, suffix of the names)
        self.pairs = blocks if len(blocks) > 1 else [(np.arange(D), "")]

    def vector(self, values: dict, name: str) -> np.ndarray:
        """A (D,) vector of the blocks' values of ``name`` ("tau2" or "sigma0_2")."""
        out = np.empty(self.v.shape[1])
        for coords, suffix in self.pairs:
            out[coords] = values[name + suffix]
        return out

    def moments(self, coords) -> tuple[float, float, np.ndarray]:
        """Pooled variance T of the means, mean posterior variance ubar (entries with s > 0), per-coordinate means."""
        seen = self.s[:, coords] > 0
        v = self.v[:, coords]
        n = seen.sum(axis=0)
        mean = np.divide((v * seen).sum(axis=0), n, out=np.zeros(len(coords)), where=n > 0)
        dof = float(np.maximum(n - 1, 0).sum())
        T = float((((v - mean) ** 2) * seen).sum() / dof) if dof > 0 else 0.0
        ubar = float((self.u[:, coords] * seen).sum() / max(seen.sum(), 1))
        return T, ubar, mean


def _start_values(blocks: _Blocks, given: dict, mu0, N: int, J: int, share: float, notes: list) -> dict:
    values = {"gamma0": given.get("gamma0", N / J)}
    mu = np.zeros(blocks.v.shape[1]) if mu0 is None else mu0.copy()
    for coords, suffix in blocks.pairs:
        T, ubar, mean = blocks.moments(coords)
        if not T > 0:
            _note(notes, "the means have no spread (pooled variance 0): the start uses tau2 + sigma0_2 = 1")
            T = 1.0
        R = T - ubar
        if not R > 0:
            _note(notes, "the posterior variances account for all the spread of the means (mean u >= pooled "
                         "variance): the start splits the pooled variance itself")
            R = T
        values["tau2" + suffix] = given.get("tau2", max(share * R, TAU2_FLOOR * T))
        values["sigma0_2" + suffix] = given.get("sigma0_2", R - share * R)
        values["_T" + suffix], values["_ubar" + suffix] = T, ubar
        if mu0 is None:
            mu[coords] = mean
    values["mu0"] = mu
    return values


def _note(notes: list, message: str):
    if message not in notes:
        notes.append(message)


def _update(blocks: _Blocks, matcher: _BayesianMatcher, values: dict, estimated: tuple, mu0_free: bool,
            notes: list) -> dict:
    """The estimates at the matcher's current assignment (previous values where not estimable)."""
    labels, L = matcher.labels()
    flat = np.concatenate(labels)
    membership = csr_matrix((np.ones(flat.size), (flat, np.arange(flat.size))), shape=(L, flat.size))
    out = dict(values)
    mu = values["mu0"].copy()
    for coords, suffix in blocks.pairs:
        v, u, s = blocks.v[:, coords], blocks.u[:, coords], blocks.s[:, coords]
        T = values["_T" + suffix]
        if "tau2" + suffix in estimated:
            tau2, floored = estimate_tau2(membership, flat, v, u, s, TAU2_FLOOR * T)
            if tau2 is None:
                _note(notes, f"tau2{suffix} not estimable (no atom has two members): the previous value was kept")
            else:
                if floored:
                    _note(notes, f"tau2{suffix} floored at TAU2_FLOOR = {TAU2_FLOOR:g} times the pooled variance of "
                                 "the means (the posterior variances explain the members' spread)")
                out["tau2" + suffix] = tau2
        tau2 = out["tau2" + suffix]
        if "sigma0_2" + suffix in estimated:
            floor = SIGMA0_2_FLOOR * (tau2 + values["_ubar" + suffix])
            sig, floored = estimate_sigma0_2(membership, v, u, s, tau2, None if mu0_free else mu[coords], floor)
            if sig is None:
                _note(notes, f"sigma0_2{suffix} not estimable (fewer than two atoms): the previous value was kept")
            else:
                if floored:
                    _note(notes, f"sigma0_2{suffix} floored at SIGMA0_2_FLOOR * (tau2 + mean u): the atom means "
                                 "spread no more than the noise alone explains")
                out["sigma0_2" + suffix] = sig
        if mu0_free:  # the weighted mean of the atom means at the variances used from here on
            centre = estimate_mu0(membership, v, u, s, tau2, out["sigma0_2" + suffix])
            mu[coords] = np.where(np.isnan(centre), mu[coords], centre)
    out["mu0"] = mu
    if "gamma0" in estimated:
        out["gamma0"] = L / _harmonic(matcher.J)
    return out


def _close(new: dict, old: dict, names) -> bool:
    for name in names:
        if abs(new[name] - old[name]) > EB_RTOL * abs(old[name]):
            return False
    return bool(np.abs(new["mu0"] - old["mu0"]).max(initial=0.0) <= EB_RTOL * math.sqrt(new["sigma0_2"]))


def _public(values: dict, names, dtype) -> dict:
    return dict(mu0=torch.as_tensor(values["mu0"], dtype=dtype), **{n: float(values[n]) for n in names})


# --------------------------------------------------------------------------------------------------------------------
# public functions


def match_bayesian_layer(
    means,
    variances,
    *,
    tau2: float | None = None,
    sigma0_2: float | None = None,
    gamma0: float | None = None,
    mu0=None,
    precisions=None,
    hyperparameters: Literal["empirical-bayes", "fixed"] = "empirical-bayes",
    sweeps: int | None = None,
    seed: int | None = None,
    init_assignments=None,
    popularity_factor: float = 2.0,
) -> MatchResult:
    """Match J clients' Bayesian neurons (posterior means and variances) to global atoms under the Beta-Bernoulli
    process with heteroscedastic noise, the hyper-parameters estimated (empirical Bayes, the default) or given.

    Usage: a layer drawn from the model with posterior variances (Gamma, mean 0.01), extra variance tau2 = 0.002,
    prior variance 1 and IBP mass 10 gives back its atoms and hyper-parameters::

        >>> import pyro.distributions as dist
        >>> from bnpfed.models import sample_federated_layer
        >>> layer = sample_federated_layer(8, 30, seed=0, gamma0=10.0, sigma2=0.002,
        ...                                neuron_variance=dist.Gamma(2.0, 200.0).expand([30]))
        >>> result = match_bayesian_layer(layer.neurons, layer.variances, seed=0)
        >>> result.num_atoms == layer.num_atoms, result.converged
        (True, True)
        >>> {k: round(v, 3) for k, v in result.hyperparameters.items() if k in ("tau2", "sigma0_2")}
        {'tau2': 0.002, 'sigma0_2': 0.96}
        >>> fixed = match_bayesian_layer(layer.neurons, layer.variances, tau2=0.002, sigma0_2=1.0, gamma0=10.0,
        ...                              hyperparameters="fixed", seed=0)
        >>> len(fixed.objective), fixed.num_atoms == layer.num_atoms    # after the greedy pass and 5 sweeps
        (6, True)

    :param means: J arrays or tensors (L_j, D) of posterior means; L_j may be 0 (the client counts in J only).
    :param variances: J arrays or tensors of the same shapes, the posterior variances (>= 0).
    :param float tau2: extra variance of a unit across clients; None: estimated (required with ``"fixed"``).
    :param float sigma0_2: prior variance of the atoms; None: estimated (required with ``"fixed"``).
    :param float gamma0: IBP mass; None: estimated (required with ``"fixed"``).
    :param mu0: prior mean of the atoms, scalar or (D,); None: estimated under empirical Bayes, 0 with ``"fixed"``.
    :param precisions: optional (J, D) per-client precision scales s_jd >= 0 (0: client j has no data on d).
    :param str hyperparameters: ``"empirical-bayes"`` (default) or ``"fixed"``.
    :param int sweeps: remove-and-rematch passes after the first assignment: this many (less any skipped at a fixed
        point, the objective then repeating its last value) with ``"fixed"``, default 5; at most this many under
        empirical Bayes, default 50.
    :param int seed: seed of the sweeps' client order.
    :param init_assignments: optional starting assignment replacing the greedy pass: J integer arrays of length L_j,
        labels distinct within a client.
    :param float popularity_factor: factor c on the popularity term (2: the objective is twice the log density).
    :returns: :class:`~bnpfed.inference.matching.MatchResult`; ``hyperparameters`` holds ``"tau2"``,
        ``"sigma0_2"``, ``"gamma0"``, ``"mu0"`` (and under empirical Bayes ``"tau2_point"``, ``"sigma0_2_point"`` for
        deterministic coordinates beside Bayesian ones, ``"tau2_scaled"``, ``"sigma0_2_scaled"`` for coordinates of
        per-client scales beside coordinates of scale 1); ``estimated`` lists the estimated ones in the order
        ``("mu0", "tau2", "sigma0_2", "tau2_point", "sigma0_2_point", "tau2_scaled", "sigma0_2_scaled",
        "gamma0")``;
        ``objective`` holds F after the first assignment and after every sweep (each at the values that pass used).
    """
    t0 = time.perf_counter()
    mode = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters")
    eb = mode == "empirical-bayes"
    V, U = _validate_clients(means, variances)
    D = V[0].shape[1]
    s = _validate_precisions(precisions, [v.shape[0] for v in V], D)
    c = _check_popularity(popularity_factor)
    sweeps = (50 if eb else 5) if sweeps is None else check_int(sweeps, "sweeps", low=0)
    given = {name: check_positive(value, name) for name, value in
             (("tau2", tau2), ("sigma0_2", sigma0_2), ("gamma0", gamma0)) if value is not None}
    matcher = _BayesianMatcher(V, U, s, c)
    init = None if init_assignments is None else _validate_labels(init_assignments, matcher.L, "init_assignments")
    dtype = _result_dtype(means)
    if eb:
        return _match_empirical_bayes(matcher, given, mu0, init, sweeps=sweeps, seed=seed, dtype=dtype, t0=t0)
    for name in ("tau2", "sigma0_2", "gamma0"):
        if name not in given:
            raise ValueError(f"{name}: expected a positive finite number with hyperparameters='fixed' (nothing is "
                             f"estimated), got None; pass {name}=... or use hyperparameters='empirical-bayes'")
    mu = _validate_mu0(0.0 if mu0 is None else mu0, D)
    matcher.set_hyperparameters(tau2=np.full(D, given["tau2"]), sigma0_2=np.full(D, given["sigma0_2"]),
                                gamma0=given["gamma0"], mu0=mu)
    matcher.greedy() if init is None else matcher.start_from(init)
    history = [matcher.objective()]
    rng = np.random.default_rng(seed)
    run = 0
    for _ in range(sweeps):
        changed = matcher.sweep(rng)
        run += 1
        history.append(matcher.objective())
        if not changed:  # a fixed point of every re-match: further sweeps, in any order, change nothing
            history.extend([history[-1]] * (sweeps + 1 - len(history)))
            break
    values = {"tau2": given["tau2"], "sigma0_2": given["sigma0_2"], "gamma0": given["gamma0"],
              "mu0": torch.as_tensor(mu, dtype=dtype)}
    return matcher.result(history, time.perf_counter() - t0, dtype, hyperparameters=values,
                          hyperparameter_history=[dict(values) for _ in history], converged=True, estimated=(),
                          notes=[], sweeps_run=run)


def _match_empirical_bayes(matcher: _BayesianMatcher, given: dict, mu0, init, *, sweeps: int, seed, dtype,
                           t0: float) -> MatchResult:
    D, J = matcher.D, matcher.J
    blocks = _Blocks(matcher.V, matcher.U, None if (matcher.s == 1.0).all() else matcher.s)
    mu0_free = mu0 is None
    mu = None if mu0_free else _validate_mu0(mu0, D)
    notes: list = []
    empty = [j for j in range(J) if matcher.L[j] == 0]
    if empty:
        _note(notes, f"client(s) {empty} hold no neurons: counted in J (H_J), nowhere else")
    names = [n + suffix for _, suffix in blocks.pairs for n in ("tau2", "sigma0_2")] + ["gamma0"]
    estimated = (("mu0",) if mu0_free else ()) + tuple(
        n + suffix for suffix in ("", "_point", "_scaled") if suffix in [p[1] for p in blocks.pairs]
        for n in ("tau2", "sigma0_2") if n not in given) + (("gamma0",) if "gamma0" not in given else ())
    N = int(sum(matcher.L))

    def apply(values):
        matcher.set_hyperparameters(tau2=blocks.vector(values, "tau2"), sigma0_2=blocks.vector(values, "sigma0_2"),
                                    gamma0=values["gamma0"], mu0=values["mu0"])

    current = _start_values(blocks, given, mu, N, J, EB_START_NOISE_SHARE, notes)
    apply(current)
    if init is None:
        matcher.greedy()
        if "tau2" in estimated and matcher.m[: matcher.n_rows].max(initial=0) <= 1:
            _note(notes, f"the first pass at tau2 = {EB_START_NOISE_SHARE:g} x (pooled variance - mean u) left every "
                         "neuron alone: redone from the even split")
            current = _start_values(blocks, given, mu, N, J, 0.5, notes)
            matcher.assign = [None] * J
            matcher.hyper = None
            apply(current)
            matcher.greedy()
    else:
        matcher.start_from(init)
    objective = [matcher.objective()]
    current = _update(blocks, matcher, current, estimated, mu0_free, notes)
    history = [_public(current, names, dtype)]
    rng = np.random.default_rng(seed)
    converged, run = False, 0
    for k in range(1, sweeps + 1):
        apply(current)
        changed = matcher.sweep(rng)
        run = k
        objective.append(matcher.objective())
        new = _update(blocks, matcher, current, estimated, mu0_free, notes)
        history.append(_public(new, names, dtype))
        converged = not changed and _close(new, current, names)
        current = new
        if converged:
            break
    if not converged:
        _note(notes, f"not converged: the assignment or the estimates still changed at sweep {sweeps}, the limit "
                     "(raise sweeps)" if sweeps else "not converged: no sweep was run (sweeps=0)")
    apply(current)  # the atoms' posterior at the final values
    return matcher.result(objective, time.perf_counter() - t0, dtype, hyperparameters=history[-1],
                          hyperparameter_history=history, converged=converged, estimated=estimated, notes=notes,
                          sweeps_run=run)


def _check_popularity(c) -> float:
    return check_float(c, "popularity_factor", low=0.0)


def bayesian_assignment_objective(
    means,
    variances,
    assignments,
    *,
    tau2: float,
    sigma0_2: float,
    gamma0: float,
    mu0=0.0,
    precisions=None,
    popularity_factor: float = 2.0,
) -> float:
    """The objective F of :func:`match_bayesian_layer` (module docstring) at a given assignment and hyper-parameters.

    :param assignments: J integer arrays of length L_j, atom labels distinct within a client (any values). The
        other parameters are those of :func:`match_bayesian_layer`.

        >>> means = [np.array([[0.0], [3.0]]), np.array([[0.1]])]
        >>> variances = [np.array([[0.01], [0.0]]), np.array([[0.02]])]
        >>> hyper = dict(tau2=0.01, sigma0_2=1.0, gamma0=1.0)
        >>> together = bayesian_assignment_objective(means, variances, [[0, 1], [0]], **hyper)
        >>> apart = bayesian_assignment_objective(means, variances, [[0, 1], [2]], **hyper)
        >>> together > apart
        True
    """
    V, U = _validate_clients(means, variances)
    D = V[0].shape[1]
    s = _validate_precisions(precisions, [v.shape[0] for v in V], D)
    matcher = _BayesianMatcher(V, U, s, _check_popularity(popularity_factor))
    matcher.set_hyperparameters(tau2=np.full(D, check_positive(tau2, "tau2")),
                                sigma0_2=np.full(D, check_positive(sigma0_2, "sigma0_2")),
                                gamma0=check_positive(gamma0, "gamma0"), mu0=_validate_mu0(mu0, D))
    matcher.start_from(_validate_labels(assignments, matcher.L, "assignments"))
    return matcher.objective()

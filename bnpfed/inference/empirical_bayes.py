"""Empirical Bayes for the layer matcher: two estimators of the same hyper-parameters behind one interface, driven
by :func:`~bnpfed.inference.matcher.run_matching`.

* :class:`PooledMoments` (point-estimate neurons, :func:`~bnpfed.inference.matching.match_layer`): the pooled
  within-atom variance for sigma2, the between-atom variance less the noise's share for sigma0_2, DerSimonian &
  Laird's weighted moment estimate on coordinates with per-client precision scales (the module docstring of
  :mod:`bnpfed.inference.matching`, *Empirical Bayes*);
* :class:`PauleMandel` (Bayesian neurons, :func:`~bnpfed.inference.bayesian_matching.match_bayesian_layer`): the
  generalized-Q moment equations of Paule & Mandel for tau2 and sigma0_2, weighted by each neuron's posterior variance
  (the module docstring of :mod:`bnpfed.inference.bayesian_matching`).

An estimator holds the data's pooled moments and says: where to start (``start``), where to start again when the
first pass from there left every neuron alone (``restart``), the estimates at an assignment (``update``), whether two
sets of values agree within :data:`EB_RTOL` (``close``), the per-coordinate values the matcher scores with
(``coordinates``), and the values as the result reports them (``public``); ``estimated`` names what it estimates and
``notes`` what it had to fall back on. (:class:`~bnpfed.inference.matcher.FixedValues` is the estimator of given
values.) Both estimate gamma0 by its maximum-likelihood value ``L / H_J``.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.sparse import csr_matrix

from bnpfed.inference.matcher import LayerMatcher, validate_mu0
from bnpfed.validation import check_positive

__all__ = ["EB_RTOL", "EB_START_NOISE_SHARE", "PauleMandel", "PooledMoments", "SIGMA0_2_FLOOR", "SIGMA2_FLOOR",
           "TAU2_FLOOR", "validate_start"]

#: The smallest sigma0_2 / sigma2 (Bayesian neurons: sigma0_2 / (tau2 + mean u)) an estimate may take. Below it the
#: atoms would be indistinguishable under the noise and the matcher would merge everything; a between-atom variance
#: below what the noise alone explains says as much, and the floor keeps the prior proper (scale-free, as it is
#: relative to the noise).
SIGMA0_2_FLOOR = 1e-2

#: The smallest sigma2 an estimate may take, relative to the pooled variance of all the neurons (reached only when the
#: members of every atom agree exactly).
SIGMA2_FLOOR = 1e-10

#: The smallest tau2 an estimate may take, relative to the pooled variance of the means.
TAU2_FLOOR = 1e-10

#: The alternation has converged when a sweep changed no assignment and no estimate moved by more than this, relative
#: (mu0 relative to sqrt(sigma0_2), as it may be 0).
EB_RTOL = 1e-6

#: The data-driven start splits the pooled variance T of the neurons (less their mean posterior variance) as noise =
#: this * T and sigma0_2 = (1 - this) * T (so that the two add to T, the variance the model gives a neuron), on the
#: side of splitting: the first assignment then merges only neurons far closer than a typical pair. From the even
#: split (1/2) the first pass of a layer of trained networks merges unrelated neurons, whose spread then sets the
#: noise estimate: a fixed point of far lower marginal likelihood (:mod:`bnpfed.inference.matching`, *Empirical
#: Bayes*).
EB_START_NOISE_SHARE = 0.1

_NAMES = ("mu0", "sigma0_2", "sigma2", "gamma0")


def _harmonic(J: int) -> float:
    return float(np.sum(1.0 / np.arange(1, J + 1)))


class _Notes:
    """What an estimator had to fall back on, each message once."""

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)


def validate_start(start, given: Mapping[str, object], D: int) -> dict:
    """Starting values of the estimated hyper-parameters of :class:`PooledMoments`: a dict with some of mu0,
    sigma0_2, sigma2, gamma0 (and their ``_scaled`` variances), none of them given."""
    if start is None:
        return {}
    if not isinstance(start, Mapping):
        raise ValueError(f"start: expected a dict of starting values (keys among {list(_NAMES)}), got "
                         f"{type(start).__name__}")
    allowed = _NAMES + ("sigma0_2_scaled", "sigma2_scaled")
    out = {}
    for name, value in start.items():
        if name not in allowed:
            raise ValueError(f"start: expected keys among {list(allowed)}, got {name!r}")
        base = name.removesuffix("_scaled")
        if base in given and given[base] is not None:
            raise ValueError(f"start[{name!r}]: expected no starting value for {base}, which is given (held fixed); "
                             f"got {value!r}: pass it in one place")
        out[name] = validate_mu0(value, D) if name == "mu0" else check_positive(value, f"start[{name!r}]")
    return out


# --------------------------------------------------------------------------------------------------------------------
# point estimates: pooled moments and DerSimonian-Laird


class PooledMoments(_Notes):
    """Moment estimates of mu0, sigma0_2, sigma2, gamma0 for neurons without posterior variances (the matcher's
    shared coordinates, every scale 1, are block A; its per-client coordinates block B, with their own pair
    ``sigma2_scaled``, ``sigma0_2_scaled`` when the layer has both). Values dicts hold ``mu0`` ((D,) array),
    ``sigma0_2``, ``sigma2``, ``gamma0``, ``sigma0_2_scaled``, ``sigma2_scaled`` (equal to sigma0_2, sigma2 unless
    the layer has both blocks).

    :param LayerMatcher matcher: the matcher of the data (no per-neuron coordinates).
    :param dict given: the hyper-parameters held fixed (of sigma0_2, sigma2, gamma0).
    :param mu0: (D,) the given prior mean, NaN where it is estimated.
    :param dict start: starting values (:func:`validate_start`).
    """

    fixed = False

    def __init__(self, matcher: LayerMatcher, given: Mapping[str, float], mu0: np.ndarray, start: Mapping):
        if matcher.N.size:
            raise ValueError("PooledMoments: expected neurons without posterior variances")
        self.mt = mt = matcher
        self.given = dict(given)
        self.mu0_free = np.isnan(mu0)
        self.mu0_given = mu0
        self.notes: list[str] = []
        J, A, B = mt.J, mt.F, mt.C
        # pooled moments of all the neurons (entries with s_jd > 0): the data-driven start and the scale of the floor
        N = int(mt.offsets[-1])
        total = np.zeros(mt.D)
        count = np.zeros(mt.D)
        total[A] = sum(v.sum(axis=0) for v in mt.vF)
        count[A] = N
        for j in range(J):
            seen = mt.sC[j] > 0
            total[B] += np.where(seen, mt.vC[j].sum(axis=0), 0.0)
            count[B] += seen * mt.L[j]
        self.silent = np.flatnonzero(count == 0)  # coordinates no client has data on
        mean = np.divide(total, count, out=np.zeros(mt.D), where=count > 0)
        ssA = sum(float(((v - mean[A]) ** 2).sum()) for v in mt.vF)
        ssB = sum(float(((mt.vC[j] - mean[B]) ** 2 * (mt.sC[j] > 0)).sum()) for j in range(J))
        dof = np.maximum(count - 1, 0)
        dofA, dofB = float(dof[A].sum()), float(dof[B].sum())
        TA = ssA / dofA if dofA > 0 else 0.0
        TB = ssB / dofB if dofB > 0 else 0.0
        # block B gets its own variances when the layer has both blocks and B carries data
        self.two_blocks = bool(len(A)) and dofB > 0
        T = TA if len(A) else TB
        if not T > 0:
            self.note("the neurons have no spread (pooled variance 0): the start uses sigma2 = sigma0_2 = 1")
            T = 2.0
        if not TB > 0:
            TB = T
        self.pooled_variance = T
        self.pooled_variance_scaled = TB
        names = [n for n in ("sigma0_2", "sigma2", "gamma0") if n not in given]
        scaled = [n + "_scaled" for n in ("sigma0_2", "sigma2") if n not in given] if self.two_blocks else []
        self.estimated = (("mu0",) if self.mu0_free.any() else ()) + tuple(names) + tuple(scaled)
        if self.silent.size:
            self.note(f"{self.silent.size} coordinate(s) with precision 0 at every client (first: "
                      f"{int(self.silent[0])}) carry no data: skipped; mu0 there keeps its starting value")
        empty = [j for j in range(J) if mt.L[j] == 0]
        if empty:
            self.note(f"client(s) {empty} hold no neurons: counted in J (H_J), nowhere else")
        self._first = self._start(given, start, mean, T, TB, N / J, EB_START_NOISE_SHARE)
        # the fallback when the first pass from the small noise leaves every neuron alone: the even split, used only
        # if the variances start from the data (none given, none in ``start``)
        self.from_data = not any(n in given or n in start for n in
                                 ("sigma2", "sigma0_2", "sigma2_scaled", "sigma0_2_scaled"))
        self._even = self._start(given, start, mean, T, TB, N / J, 0.5)

    def _start(self, given, start, mean, T, TB, gamma0, share) -> dict:
        """Starting values: given, else from ``start``, else from the data (the pooled variances T, TB split
        ``share`` to the noise)."""
        default = dict(mu0=mean, sigma0_2=(1 - share) * T, sigma2=share * T, gamma0=gamma0,
                       sigma0_2_scaled=(1 - share) * TB, sigma2_scaled=share * TB)
        values = dict(mu0=np.where(self.mu0_free, start.get("mu0", default["mu0"]), self.mu0_given))
        for n in ("sigma0_2", "sigma2", "gamma0"):
            values[n] = given[n] if n in given else start.get(n, default[n])
        for n in ("sigma0_2", "sigma2"):
            if not self.two_blocks or n in given:
                values[n + "_scaled"] = values[n]
            else:
                values[n + "_scaled"] = start.get(n + "_scaled", default[n + "_scaled"])
        return values

    def start(self) -> dict:
        return self._first

    def restart(self, matcher: LayerMatcher) -> dict | None:
        """The even split, when the first pass at the small starting noise left every neuron alone (sigma2 would not
        be estimable from there) and the variances started from the data."""
        if not (self.from_data and "sigma2" in self.estimated and matcher.m[: matcher.n_rows].max(initial=0) <= 1):
            return None
        self.note(f"the first pass at sigma2 = {EB_START_NOISE_SHARE:g} x the pooled variance left every neuron "
                  "alone: redone from the even split (sigma2 = sigma0_2 = half the pooled variance)")
        return self._even

    def _moments(self, labels: list[np.ndarray], L: int):
        """Per-atom weights W and weighted means xbar (block A: W one number per atom, as s = 1 there), and each
        client's residual sums of squares ``num`` and their degrees of freedom ``den`` on block A and on block B
        (E[num_j] = sigma2 den_j)."""
        mt = self.mt
        J, A, B = mt.J, mt.F, mt.C
        WA = np.zeros(L)
        SA = np.zeros((L, len(A)))
        WB = np.zeros((L, len(B)))
        SB = np.zeros((L, len(B)))
        for j in range(J):
            a = labels[j]
            if a.size:  # labels are distinct within a client: no repeated index in these updates
                WA[a] += 1.0
                SA[a] += mt.vF[j]
                if len(B):
                    WB[a] += mt.sC[j]
                    SB[a] += mt.sC[j] * mt.vC[j]
        xbarA = SA / WA[:, None]
        xbarB = np.divide(SB, WB, out=np.zeros_like(SB), where=WB > 0)
        num, den = np.zeros((2, J)), np.zeros((2, J))
        for j in range(J):
            a = labels[j]
            if not a.size:
                continue
            if len(A):
                res = mt.vF[j] - xbarA[a]
                num[0, j] = float(np.einsum("ld,ld->", res, res))
                den[0, j] = len(A) * float((1.0 - 1.0 / WA[a]).sum())
            if len(B):
                seen = mt.sC[j] > 0
                num[1, j] = float((mt.sC[j] * (mt.vC[j] - xbarB[a]) ** 2).sum())
                lev = np.divide(mt.sC[j], WB[a], out=np.ones_like(WB[a]), where=WB[a] > 0)
                den[1, j] = float(((1.0 - lev) * seen).sum())
        return WA, xbarA, WB, xbarB, num, np.maximum(den, 0.0)  # 1 - s / W is 0 for a lone member, up to rounding

    @staticmethod
    def _between_B(WB, xbarB, mu0B, freeB, sigma2_b) -> float | None:
        """sigma0_2 on block B by the weighted moment estimate of random-effects meta-analysis (DerSimonian & Laird
        1986): per coordinate the held atoms' means x_i with noise variances v_i = sigma2_b / W_id, weights
        w_i = 1 / v_i, ``Q = sum_i w_i (x_i - xbar_w)^2`` (about mu0_d where it is given) has expectation
        ``(k - 1) + sigma0_2 (sum w - sum w^2 / sum w)`` (``k + sigma0_2 sum w`` about a given mu0_d); pooled over
        the coordinates. Atoms whose mean is mostly noise (W_id << 1) get little weight. None if not estimable."""
        held = WB > 0
        w = np.where(held, WB, 0.0) / sigma2_b
        sw = w.sum(axis=0)
        k = held.sum(axis=0).astype(float)
        xw = np.divide((w * xbarB).sum(axis=0), sw, out=np.zeros_like(sw), where=sw > 0)
        centre = np.where(freeB, xw, mu0B)
        Q = (w * (xbarB - centre) ** 2).sum(axis=0)
        dof = np.where(freeB, np.maximum(k - 1, 0), k)
        c = np.where(freeB, sw - np.divide((w ** 2).sum(axis=0), sw, out=np.zeros_like(sw), where=sw > 0), sw)
        if c.sum() <= 0 or dof.sum() <= 0:
            return None
        return float((Q - dof).sum() / c.sum())

    def update(self, labels: list[np.ndarray], L: int, current: dict) -> dict:
        """The estimates at the assignment ``labels`` (compact, L atoms); the current values where not estimable."""
        mt = self.mt
        A, B = mt.F, mt.C
        WA, xbarA, WB, xbarB, num, den = self._moments(labels, L)
        out = dict(current)
        floor2 = SIGMA2_FLOOR * self.pooled_variance
        main = 0 if len(A) else 1  # the block sigma2 comes from: A when there is one
        if "sigma2" in self.estimated:
            ok = den[main] > 1e-9 * np.maximum(np.array(mt.L, dtype=float) * mt.D, 1.0)
            if not ok.any():
                self.note("sigma2 not estimable (no atom has two members: every neuron is alone): the previous "
                          "value was kept (a start far below the noise can stay there; the data-driven start does "
                          "not)")
            else:
                sigma2 = float(num[main].sum() / den[main].sum())
                if sigma2 < floor2:
                    self.note(f"sigma2 floored at SIGMA2_FLOOR = {SIGMA2_FLOOR:g} times the pooled variance of the "
                              "neurons (the members of every atom agree)")
                    sigma2 = floor2
                out["sigma2"] = sigma2
        if "sigma2_scaled" in self.estimated:
            if den[1].sum() > 1e-9:
                out["sigma2_scaled"] = max(float(num[1].sum() / den[1].sum()),
                                           SIGMA2_FLOOR * self.pooled_variance_scaled)
            else:
                self.note("sigma2_scaled not estimable (no atom has two members with data on the coordinates with "
                          "per-client precision scales): the previous value was kept")
        elif not self.two_blocks or "sigma2" in self.given:
            out["sigma2_scaled"] = out["sigma2"]
        sigma2 = out["sigma2"]
        # mu0: the mean of the atom means, per coordinate (atoms with data on it)
        mu0 = current["mu0"].copy()
        free = self.mu0_free
        if free.any():
            freeA, freeB = free[A], free[B]
            mu0[A[freeA]] = xbarA[:, freeA].mean(axis=0)
            if len(B):
                held = WB > 0
                nB = held.sum(axis=0)
                meanB = np.divide((xbarB * held).sum(axis=0), nB, out=mu0[B].copy(), where=nB > 0)
                mu0[B[freeB]] = meanB[freeB]
            out["mu0"] = mu0
        # sigma0_2: between-atom variance less the noise's share, k_d = L_d - 1 (mu0_d estimated) or L_d (given)
        if "sigma0_2" in self.estimated:
            if len(A):
                kA = np.where(free[A], L - 1, L).astype(float)
                between = float(((xbarA - mu0[A]) ** 2).sum())
                noise_share = float((kA / L).sum() * (1.0 / WA).sum())
                k = float(kA.sum())
                sigma0_2 = (between - sigma2 * noise_share) / k if k > 0 else None
            else:
                sigma0_2 = self._between_B(WB, xbarB, mu0[B], free[B], sigma2)
            if sigma0_2 is None:
                self.note("sigma0_2 not estimable (fewer than two atoms carry data on every coordinate, and mu0 is "
                          "estimated from them): the previous value was kept")
            else:
                if sigma0_2 < SIGMA0_2_FLOOR * sigma2:
                    self.note(f"sigma0_2 floored at SIGMA0_2_FLOOR * sigma2 (SIGMA0_2_FLOOR = {SIGMA0_2_FLOOR:g}): "
                              "the atom means spread no more than the noise alone explains")
                    sigma0_2 = SIGMA0_2_FLOOR * sigma2
                out["sigma0_2"] = float(sigma0_2)
        if "sigma0_2_scaled" in self.estimated:
            s2b = out["sigma2_scaled"]
            tau2 = self._between_B(WB, xbarB, mu0[B], free[B], s2b)
            if tau2 is None:
                self.note("sigma0_2_scaled not estimable (fewer than two atoms carry data on the coordinates with "
                          "per-client precision scales): the previous value was kept")
            else:
                if tau2 < SIGMA0_2_FLOOR * s2b:
                    self.note("sigma0_2_scaled floored at SIGMA0_2_FLOOR * sigma2_scaled: the atom means spread no "
                              "more than the noise alone explains there")
                    tau2 = SIGMA0_2_FLOOR * s2b
                out["sigma0_2_scaled"] = float(tau2)
        elif not self.two_blocks or "sigma0_2" in self.given:
            out["sigma0_2_scaled"] = out["sigma0_2"]
        if "gamma0" in self.estimated:
            out["gamma0"] = L / _harmonic(mt.J)
        return out

    def close(self, new: dict, old: dict) -> bool:
        """Whether no estimate moved by more than EB_RTOL."""
        for name in ("sigma0_2", "sigma2", "gamma0", "sigma0_2_scaled", "sigma2_scaled"):
            if abs(new[name] - old[name]) > EB_RTOL * abs(old[name]):
                return False
        return bool(np.abs(new["mu0"] - old["mu0"]).max(initial=0.0) <= EB_RTOL * math.sqrt(new["sigma0_2"]))

    def coordinates(self, values: dict) -> dict:
        """The matcher's per-coordinate noise and prior variance: block A's pair, block B's ``_scaled`` one."""
        mt = self.mt
        noise, prior = np.empty(mt.D), np.empty(mt.D)
        noise[mt.F], noise[mt.C] = values["sigma2"], values["sigma2_scaled"]
        prior[mt.F], prior[mt.C] = values["sigma0_2"], values["sigma0_2_scaled"]
        return dict(noise=noise, prior=prior, gamma0=values["gamma0"], mu0=values["mu0"])

    def public(self, values: dict, dtype) -> dict:
        out = dict(mu0=torch.as_tensor(values["mu0"], dtype=dtype), sigma0_2=float(values["sigma0_2"]),
                   sigma2=float(values["sigma2"]), gamma0=float(values["gamma0"]))
        if self.two_blocks:
            out["sigma0_2_scaled"] = float(values["sigma0_2_scaled"])
            out["sigma2_scaled"] = float(values["sigma2_scaled"])
        return out


# --------------------------------------------------------------------------------------------------------------------
# Bayesian neurons: Paule-Mandel


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


class PauleMandel(_Notes):
    """Paule-Mandel estimates of tau2, sigma0_2, mu0 and gamma0 for Bayesian neurons, one (tau2, sigma0_2) pair per
    block of coordinates: the Bayesian ones of scale 1 (suffix ``""``), the deterministic ones of scale 1
    (``"_point"``, beside Bayesian ones), those with per-client scales (``"_scaled"``, beside scale-1 ones); a layer
    with one kind has one pair, named tau2 and sigma0_2.

    :param LayerMatcher matcher: the matcher of the data (its neurons' means, variances and scales).
    :param dict given: the hyper-parameters held fixed (of tau2, sigma0_2, gamma0; a given one fixes every pair).
    :param mu0: (D,) the given prior mean, or None (estimated).
    """

    fixed = False

    def __init__(self, matcher: LayerMatcher, given: Mapping[str, float], mu0: np.ndarray | None):
        mt = matcher
        self.J, self.D = mt.J, mt.D
        self.given, self.mu0 = dict(given), mu0
        self.notes: list[str] = []
        sizes = list(mt.L)
        self.N = int(sum(sizes))
        # the flat (N, D) means and variances of all neurons, put back together from the matcher's coordinate kinds
        self.v, self.u = np.empty((self.N, self.D)), np.zeros((self.N, self.D))
        for idx, parts in ((mt.F, mt.vF), (mt.C, mt.vC), (mt.N, mt.vN)):
            self.v[:, idx] = np.concatenate(parts)
        if mt.N.size:
            self.u[:, mt.N] = np.concatenate(mt.uN)
        s = mt.scales
        self.s = np.repeat(np.ones((self.J, self.D)) if s is None else s, sizes, axis=0)
        plain = np.arange(self.D) if s is None else np.flatnonzero((s == 1.0).all(axis=0))
        # coordinates of scale 1 with posterior variance 0 at every neuron: deterministic (point) estimates
        point = plain[(self.u[:, plain] == 0).all(axis=0)] if self.u.shape[0] else plain[:0]
        A = np.setdiff1d(plain, point)
        B = np.setdiff1d(np.arange(self.D), plain)
        blocks = [(c, suffix) for c, suffix in [(A, ""), (point, "_point" if len(A) else "")] if len(c)]
        if len(B) and (self.s[:, B] > 0).any() and blocks:
            blocks.append((B, "_scaled"))
        elif len(B):   # no scale-1 coordinate, or none with data among the scaled ones: they join the first block
            blocks = [(np.union1d(blocks[0][0], B), blocks[0][1])] + blocks[1:] if blocks else [(B, "")]
        #: the blocks with their own pair: (coordinates, suffix of the names)
        self.pairs = blocks if len(blocks) > 1 else [(np.arange(self.D), "")]
        empty = [j for j, n in enumerate(sizes) if n == 0]
        if empty:
            self.note(f"client(s) {empty} hold no neurons: counted in J (H_J), nowhere else")
        self.names = [n + suffix for _, suffix in self.pairs for n in ("tau2", "sigma0_2")] + ["gamma0"]
        suffixes = [p[1] for p in self.pairs]
        self.estimated = (("mu0",) if mu0 is None else ()) + tuple(
            n + suffix for suffix in ("", "_point", "_scaled") if suffix in suffixes
            for n in ("tau2", "sigma0_2") if n not in given) + (("gamma0",) if "gamma0" not in given else ())

    def _moments(self, coords) -> tuple[float, float, np.ndarray]:
        """Pooled variance T of the means, mean posterior variance ubar (entries with s > 0), per-coordinate means."""
        seen = self.s[:, coords] > 0
        v = self.v[:, coords]
        n = seen.sum(axis=0)
        mean = np.divide((v * seen).sum(axis=0), n, out=np.zeros(len(coords)), where=n > 0)
        dof = float(np.maximum(n - 1, 0).sum())
        T = float((((v - mean) ** 2) * seen).sum() / dof) if dof > 0 else 0.0
        ubar = float((self.u[:, coords] * seen).sum() / max(seen.sum(), 1))
        return T, ubar, mean

    def _start(self, share: float) -> dict:
        """With T the pooled variance of the means and ubar the mean posterior variance of a block, ``R = T - ubar``
        (T where that is not positive) split ``share`` to tau2; mu0 the means, gamma0 the neurons per client."""
        given = self.given
        values = {"gamma0": given.get("gamma0", self.N / self.J)}
        mu = np.zeros(self.D) if self.mu0 is None else self.mu0.copy()
        for coords, suffix in self.pairs:
            T, ubar, mean = self._moments(coords)
            if not T > 0:
                self.note("the means have no spread (pooled variance 0): the start uses tau2 + sigma0_2 = 1")
                T = 1.0
            R = T - ubar
            if not R > 0:
                self.note("the posterior variances account for all the spread of the means (mean u >= pooled "
                          "variance): the start splits the pooled variance itself")
                R = T
            values["tau2" + suffix] = given.get("tau2", max(share * R, TAU2_FLOOR * T))
            values["sigma0_2" + suffix] = given.get("sigma0_2", R - share * R)
            values["_T" + suffix], values["_ubar" + suffix] = T, ubar
            if self.mu0 is None:
                mu[coords] = mean
        values["mu0"] = mu
        return values

    def start(self) -> dict:
        return self._start(EB_START_NOISE_SHARE)

    def restart(self, matcher: LayerMatcher) -> dict | None:
        """The even split, when the first pass left every neuron alone and tau2 is estimated."""
        if not ("tau2" in self.estimated and matcher.m[: matcher.n_rows].max(initial=0) <= 1):
            return None
        self.note(f"the first pass at tau2 = {EB_START_NOISE_SHARE:g} x (pooled variance - mean u) left every neuron "
                  "alone: redone from the even split")
        return self._start(0.5)

    def update(self, labels: list[np.ndarray], L: int, values: dict) -> dict:
        """The estimates at the assignment ``labels`` (previous values where not estimable)."""
        flat = np.concatenate(labels)
        membership = csr_matrix((np.ones(flat.size), (flat, np.arange(flat.size))), shape=(L, flat.size))
        out = dict(values)
        mu = values["mu0"].copy()
        for coords, suffix in self.pairs:
            v, u, s = self.v[:, coords], self.u[:, coords], self.s[:, coords]
            T = values["_T" + suffix]
            if "tau2" + suffix in self.estimated:
                tau2, floored = estimate_tau2(membership, flat, v, u, s, TAU2_FLOOR * T)
                if tau2 is None:
                    self.note(f"tau2{suffix} not estimable (no atom has two members): the previous value was kept")
                else:
                    if floored:
                        self.note(f"tau2{suffix} floored at TAU2_FLOOR = {TAU2_FLOOR:g} times the pooled variance of "
                                  "the means (the posterior variances explain the members' spread)")
                    out["tau2" + suffix] = tau2
            tau2 = out["tau2" + suffix]
            if "sigma0_2" + suffix in self.estimated:
                floor = SIGMA0_2_FLOOR * (tau2 + values["_ubar" + suffix])
                sig, floored = estimate_sigma0_2(membership, v, u, s, tau2, None if self.mu0 is None else mu[coords],
                                                 floor)
                if sig is None:
                    self.note(f"sigma0_2{suffix} not estimable (fewer than two atoms): the previous value was kept")
                else:
                    if floored:
                        self.note(f"sigma0_2{suffix} floored at SIGMA0_2_FLOOR * (tau2 + mean u): the atom means "
                                  "spread no more than the noise alone explains")
                    out["sigma0_2" + suffix] = sig
            if self.mu0 is None:  # the weighted mean of the atom means at the variances used from here on
                centre = estimate_mu0(membership, v, u, s, tau2, out["sigma0_2" + suffix])
                mu[coords] = np.where(np.isnan(centre), mu[coords], centre)
        out["mu0"] = mu
        if "gamma0" in self.estimated:
            out["gamma0"] = L / _harmonic(self.J)
        return out

    def close(self, new: dict, old: dict) -> bool:
        for name in self.names:
            if abs(new[name] - old[name]) > EB_RTOL * abs(old[name]):
                return False
        return bool(np.abs(new["mu0"] - old["mu0"]).max(initial=0.0) <= EB_RTOL * math.sqrt(new["sigma0_2"]))

    def coordinates(self, values: dict) -> dict:
        """The matcher's per-coordinate noise (tau2) and prior variance, block by block."""
        noise, prior = np.empty(self.D), np.empty(self.D)
        for coords, suffix in self.pairs:
            noise[coords], prior[coords] = values["tau2" + suffix], values["sigma0_2" + suffix]
        return dict(noise=noise, prior=prior, gamma0=values["gamma0"], mu0=values["mu0"])

    def public(self, values: dict, dtype) -> dict:
        return dict(mu0=torch.as_tensor(values["mu0"], dtype=dtype), **{n: float(values[n]) for n in self.names})

"""Empirical Bayes for the layer matcher: two estimators of the same hyper-parameters behind one interface, driven
by :func:`~bnpfed.matching.driver.run_matching`.

* :class:`PooledMoments` (point-estimate neurons, :func:`~bnpfed.matching.layer.match_layer`): the pooled
  within-atom variance for sigma2, the between-atom variance less the noise's share for sigma0_2, DerSimonian &
  Laird's weighted moment estimate on coordinates with per-client precision scales;
* :class:`PauleMandel` (Bayesian neurons, :func:`~bnpfed.matching.bayesian_layer.match_bayesian_layer`): the
  generalized-Q moment equations of Paule & Mandel for tau2 and sigma0_2, weighted by each neuron's posterior variance.

Both hold one (noise, sigma0_2) pair per block of coordinates (its names suffixed ``""``, ``"_point"`` or
``"_scaled"``), start from the pooled moments of the neurons, and estimate gamma0 by its maximum-likelihood value
``L / H_J`` (L is Poisson(gamma0 H_J) under the IBP). The interface: ``start`` (the first values), ``restart`` (the
even split, when the first pass from the start left every neuron alone), ``update`` (the estimates at an assignment),
``close`` (whether two sets of values agree within :data:`EB_RTOL`), ``coordinates`` (the per-coordinate values the
matcher scores with) and ``public`` (the values as the result reports them); ``estimated`` names what is estimated
and ``notes`` what had to fall back. :class:`~bnpfed.matching.driver.FixedValues` is the estimator of given values.
The statistics are derived in the module docstrings of :mod:`bnpfed.matching.layer` (*Empirical Bayes*) and
:mod:`bnpfed.matching.bayesian_layer`.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.sparse import csr_matrix

from bnpfed.matching.atom_sums import shared_atom_moments, shared_moments, shared_sums
from bnpfed.matching.ibp import CONCENTRATION_RANGE, ibp_estimates
from bnpfed.matching.layer_inputs import validate_mu0
from bnpfed.matching.matcher import LayerMatcher
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
#: side of splitting: the first assignment then merges only neurons far closer than a typical pair. The even split
#: (1/2) is the second start; by default both run and the fixed point of higher marginal likelihood is kept
#: (:mod:`bnpfed.matching.layer`, *Empirical Bayes*).
EB_START_NOISE_SHARE = 0.1


def validate_start(start, given: Mapping[str, object], D: int) -> dict:
    """Starting values of the estimated hyper-parameters of :class:`PooledMoments`: a dict with some of mu0,
    sigma0_2, sigma2, gamma0 (and their ``_scaled`` variances), none of them given."""
    if start is None:
        return {}
    allowed = ("mu0", "sigma0_2", "sigma2", "gamma0", "sigma0_2_scaled", "sigma2_scaled", "concentration")
    if not isinstance(start, Mapping):
        raise ValueError(f"start: expected a dict of starting values (keys among {list(allowed[:4])}), got "
                         f"{type(start).__name__}")
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


def _membership(labels: list[np.ndarray], L: int) -> tuple[csr_matrix, np.ndarray]:
    """The (L, N) 0/1 matrix of which atom each neuron (in client order) is on, and the (N,) flat labels."""
    flat = np.concatenate(labels)
    return csr_matrix((np.ones(flat.size), (flat, np.arange(flat.size))), shape=(L, flat.size)), flat


def _atom_means(membership, v, w):
    """Per atom (L, C): ``W = sum w`` and ``xbar = sum w v / W`` (0 where W = 0)."""
    W = np.asarray(membership @ w)
    S = np.asarray(membership @ (w * v))
    return W, np.divide(S, W, out=np.zeros_like(S), where=W > 0)


#: What the result says when every neuron is the same vector on a block of coordinates (e.g. every unit dead, all
#: weights 0; their spread below ``FLAT_RTOL`` of their size, rounding): the noise and the prior variance are not
#: identifiable from no spread at all, so they keep their start (the pooled variance taken as 1: noise and prior
#: variance of one order, which merges identical neurons) and only gamma0 (and mu0, the vector itself) are estimated.
FLAT_RTOL = 1e-12
FLAT_NOTE = ("the neurons have no spread (pooled variance 0: one and the same vector): the variances are not "
             "estimable and keep their start (the pooled variance taken as 1); identical neurons are merged")


class _Estimator:
    """What both estimators share: the blocks of coordinates and their data, the notes, the start from the pooled
    moments, the convergence test, and the values as per-coordinate vectors and as the result reports them. A
    subclass sets ``noise`` (the noise variance's name), ``names`` (the order the result reports), ``estimated`` and
    writes ``update``."""

    fixed = False
    noise = "sigma2"
    #: the smallest starting noise, relative to the pooled variance
    start_floor = 0.0

    def __init__(self, matcher: LayerMatcher, given: Mapping[str, float], pairs: list):
        self.mt, self.given, self.notes = matcher, dict(given), []
        self.J, self.D, self.N = matcher.J, matcher.D, int(matcher.offsets[-1])
        #: (coordinates, suffix of the names, v, u, s): every neuron's means, variances and scales on the block
        self.blocks = [(coords, suffix, *(
            (None, None, None) if matcher.compact and np.array_equal(coords, matcher.F) else matcher.columns(coords)))
            for coords, suffix in pairs]
        self._pooled = {}   # per block suffix, its pooled moments (both starts read them)
        #: the IBP's concentration: estimated when not given (it starts at 1), reported when estimated or not 1
        self.concentration_free = "concentration" not in self.given
        self.ibp_names = ["concentration"] if self.concentration_free or self.given["concentration"] != 1.0 else []
        empty = [j for j in range(self.J) if matcher.L[j] == 0]
        if empty:
            self.note(f"client(s) {empty} hold no neurons: counted in J (H_J), nowhere else")

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    @staticmethod
    def pooled(v, u, s) -> tuple[float, float, np.ndarray]:
        """Pooled variance T of the means, mean posterior variance ubar (entries with s > 0; ``u`` None: 0, ``s``
        None: 1 everywhere), per-coordinate means."""
        seen = np.ones(v.shape, dtype=bool) if s is None else s > 0
        n = seen.sum(axis=0)
        mean = np.divide((v * seen).sum(axis=0), n, out=np.zeros(v.shape[1]), where=n > 0)
        dof = float(np.maximum(n - 1, 0).sum())
        T = float((((v - mean) ** 2) * seen).sum() / dof) if dof > 0 else 0.0
        ubar = 0.0 if u is None else float((u * seen).sum() / max(seen.sum(), 1))
        return T, ubar, mean

    @staticmethod
    def pooled_shared(matcher: LayerMatcher) -> tuple[float, float, np.ndarray]:
        """:meth:`pooled` of the shared block of a compact matcher (every scale 1, no posterior variance), from its
        neurons' sums and sum of squares: ``T = (sum v^2 - N sum_d mean_d^2) / (|F| (N - 1))``."""
        total, square = shared_moments(matcher)
        N = int(matcher.offsets[-1])
        mean = total / N
        dof = float(matcher.F.size * max(N - 1, 0))
        T = max(square - N * float(mean @ mean), 0.0) / dof if dof > 0 else 0.0
        return T, 0.0, mean

    def _start(self, share: float, start: Mapping, mu0: np.ndarray) -> dict:
        """Per block with T its pooled variance and ubar its mean posterior variance: ``R = T - ubar`` (T where not
        positive) split ``share`` to the noise and the rest to sigma0_2, unless given or in ``start``; mu0 the
        neurons' means where it is not given (NaN in ``mu0``); gamma0 the neurons per client. A block without spread
        (:data:`FLAT_NOTE`) starts from :data:`EB_START_NOISE_SHARE` whatever ``share``: its variances are not
        estimable, and at that share identical neurons merge (every start is then the same there)."""
        values = {"gamma0": self.given.get("gamma0", start.get("gamma0", self.N / self.J)),
                  "concentration": self.given.get("concentration", start.get("concentration", 1.0))}
        mu = mu0.copy()
        for coords, suffix, v, u, s in self.blocks:
            if suffix not in self._pooled:
                self._pooled[suffix] = self.pooled(v, u, s) if v is not None else self.pooled_shared(self.mt)
            T, ubar, mean = self._pooled[suffix]
            # no spread beyond rounding: the neurons' standard deviation below FLAT_RTOL of their typical size
            values["_flat" + suffix] = flat = not T > FLAT_RTOL ** 2 * float(np.mean(mean ** 2))
            if flat:
                self.note(FLAT_NOTE)
                T = 1.0
            block_share = EB_START_NOISE_SHARE if flat else share
            R = T - ubar
            if not R > 0:
                self.note("the posterior variances account for all the spread of the means (mean u >= pooled "
                          "variance): the start splits the pooled variance itself")
                R = T
            for name, default in ((self.noise, max(block_share * R, self.start_floor * T)),
                                  ("sigma0_2", R - block_share * R)):
                values[name + suffix] = self.given.get(name, start.get(name + suffix, default))
            values["_T" + suffix], values["_ubar" + suffix] = T, ubar
            free = np.isnan(mu[coords])
            mu[coords[free]] = (start["mu0"][coords] if "mu0" in start else mean)[free]
        values["mu0"] = mu
        return values

    def start(self) -> dict:
        return self._first

    def restart(self, matcher: LayerMatcher) -> dict | None:
        """The even split, when the first pass at the small starting noise left every neuron alone (the noise would
        not be estimable from there) and the noise starts from the data."""
        if not (self._restartable and matcher.m[: matcher.n_rows].max(initial=0) <= 1):
            return None
        self.note(f"the first pass at {self.noise} = {EB_START_NOISE_SHARE:g} x the pooled variance left every "
                  f"neuron alone: redone from the even split ({self.noise} = sigma0_2 = half of it)")
        return self._even

    def alternative_start(self) -> dict | None:
        """The even split, the second start of :func:`~bnpfed.matching.driver.run_matching` (None when the noise
        is given or starts from a given value: there is then one start)."""
        return self._even if self._restartable else None

    def close(self, new: dict, old: dict, rtol: float = EB_RTOL, *, mu0: str = "max") -> bool:
        """Whether no estimate moved by more than ``rtol`` (relative; mu0 relative to sqrt(sigma0_2): ``mu0="max"``
        its largest change over the coordinates, the exact fixed point's test; ``"rms"`` the root mean square of its
        changes, the stopping rule on the result's: the atom prior N(mu0, sigma0_2 I) then moved by at most rtol^2 / 2
        nats per coordinate (its Kullback-Leibler divergence), the size of change the relative test allows a
        variance (a relative change r moves N(0, s) by about r^2 / 4 nats). The largest change is the wrong measure
        there: mu0 is the mean of the L atom means, and with hundreds of clients the few neurons that still move each
        sweep keep shifting some coordinate of it for many sweeps after everything else has settled)."""
        if mu0 not in ("max", "rms"):
            raise ValueError(f"mu0: expected 'max' or 'rms', got {mu0!r}")
        for name in self.names:
            if abs(new[name] - old[name]) > rtol * abs(old[name]):
                return False
        change = np.abs(new["mu0"] - old["mu0"])
        if mu0 == "max":
            size = change.max(initial=0.0)
        else:
            size = math.sqrt(float(np.mean(change ** 2))) if change.size else 0.0
        return bool(size <= rtol * math.sqrt(new["sigma0_2"]))

    def coordinates(self, values: dict) -> dict:
        """The matcher's per-coordinate noise and prior variance, block by block."""
        noise, prior = np.empty(self.D), np.empty(self.D)
        for coords, suffix, *_ in self.blocks:
            noise[coords], prior[coords] = values[self.noise + suffix], values["sigma0_2" + suffix]
        return dict(noise=noise, prior=prior, gamma0=values["gamma0"], mu0=values["mu0"],
                    concentration=values["concentration"])

    def public(self, values: dict, dtype) -> dict:
        return dict(mu0=torch.as_tensor(values["mu0"], dtype=dtype), **{n: float(values[n]) for n in self.names})

    def _gamma0(self, L: int) -> float:
        return L / float(np.sum(1.0 / np.arange(1, self.J + 1)))

    def update_ibp(self, flat: np.ndarray, L: int, out: dict) -> None:
        """gamma0 and the concentration, where estimated, at the assignment of flat labels ``flat`` (L atoms): their
        maximum-likelihood values (:func:`~bnpfed.matching.ibp.ibp_estimates`; gamma0 ``L / H_J`` at c = 1)."""
        if not self.concentration_free:
            if "gamma0" in self.estimated:
                c = out["concentration"]
                out["gamma0"] = self._gamma0(L) if c == 1.0 else ibp_estimates(np.zeros(L), self.J, c=c)[0]
            return
        gamma0 = None if "gamma0" in self.estimated else out["gamma0"]
        out["gamma0"], out["concentration"], at_bound = ibp_estimates(np.bincount(flat, minlength=L), self.J,
                                                                       gamma0=gamma0)
        if at_bound:
            self.note(f"the concentration stopped at the end of its range {CONCENTRATION_RANGE} (every atom held by "
                      "one client pushes it up, every atom held by all down)")


# --------------------------------------------------------------------------------------------------------------------
# point estimates: pooled moments and DerSimonian-Laird


class PooledMoments(_Estimator):
    """Moment estimates of mu0, sigma0_2, sigma2, gamma0 for neurons without posterior variances: block A the
    matcher's shared coordinates (every scale 1), block B its per-client coordinates, with their own pair
    ``sigma2_scaled``, ``sigma0_2_scaled`` when the layer has both and B carries data (a given sigma2 or sigma0_2
    fixes both of its pair).

    :param LayerMatcher matcher: the matcher of the data (no per-neuron coordinates).
    :param dict given: the hyper-parameters held fixed (of sigma0_2, sigma2, gamma0).
    :param mu0: (D,) the given prior mean, NaN where it is estimated.
    :param dict start: starting values (:func:`validate_start`).
    """

    def __init__(self, matcher: LayerMatcher, given: Mapping[str, float], mu0: np.ndarray, start: Mapping):
        if matcher.N.size:
            raise ValueError("matcher: expected neurons without posterior variances")
        A, B = matcher.F, matcher.C
        seenB = (matcher.columns(B)[2] > 0).sum(axis=0) if B.size else np.zeros(0)
        self.two_blocks = bool(A.size) and float(np.maximum(seenB - 1, 0).sum()) > 0
        pairs = [(A, ""), (B, "_scaled")] if self.two_blocks else [(np.arange(matcher.D), "")]
        super().__init__(matcher, given, pairs)
        self.mu0_free = np.isnan(mu0)
        silent = B[seenB == 0]
        if silent.size:
            self.note(f"{silent.size} coordinate(s) with precision 0 at every client (first: {int(silent[0])}) carry "
                      "no data: skipped; mu0 there keeps its starting value")
        self.names = ["sigma0_2", "sigma2", "gamma0"] + (["sigma0_2_scaled", "sigma2_scaled"] if self.two_blocks
                                                         else []) + self.ibp_names
        self.estimated = (("mu0",) if self.mu0_free.any() else ()) + tuple(n for n in self.names
                                                                             if n.removesuffix("_scaled") not in given)
        self._first = self._start(EB_START_NOISE_SHARE, start, mu0)
        # the fallback when the first pass from the small noise leaves every neuron alone: the even split, used only
        # if the variances start from the data (none given, none in ``start``)
        self._restartable = "sigma2" in self.estimated and not any(
            n in given or n in start for n in ("sigma2", "sigma0_2", "sigma2_scaled", "sigma0_2_scaled"))
        self._even = self._start(0.5, start, mu0)
        self._sq_A: float | None = None  # sum of ||v||^2 over the neurons on block A (the data never change)

    def update(self, labels: list[np.ndarray], L: int, current: dict) -> dict:
        """The estimates at the assignment ``labels`` (compact, L atoms); the current values where not estimable."""
        mt = self.mt
        A, B = mt.F, mt.C
        M, flat = _membership(labels, L)
        num, den = {}, {}
        if A.size:   # scale 1 everywhere: an atom's W is its number of members
            # the within-atom sum of squares as sum ||v||^2 - sum_i W_i ||xbar_i||^2 (no (N, D) residual array);
            # computed directly instead where that difference would lose more than half the digits
            # and the atom means xbar_i = S_i / W_i (S_i the sum of the members) through S alone
            WA = np.bincount(flat, minlength=L).astype(float)
            if mt.compact:   # no (N, |A|) array: the sums client by client, atom block by atom block
                SA = None
                sq_xbar, sum_xbar = shared_atom_moments(mt, labels, L, WA)
                if self._sq_A is None:
                    self._sq_A = shared_moments(mt)[1]
            else:
                vA = mt.columns(A)[0]
                SA = shared_sums(mt, labels, L)
                sq_xbar = np.einsum("ld,ld->l", SA, SA) / WA ** 2  # ||xbar_i||^2
                sum_xbar = (1.0 / WA) @ SA                          # sum_i xbar_i, per coordinate
                if self._sq_A is None:
                    self._sq_A = float(np.einsum("nd,nd->", vA, vA))
            within = self._sq_A - float(WA @ sq_xbar)
            if not within > 1e-8 * self._sq_A:
                if SA is None:   # (rare: the members of every atom agree to half the digits) the whole arrays
                    vA, SA = mt.columns(A)[0], shared_sums(mt, labels, L)
                res = vA - (SA / WA[:, None])[flat]
                within = float(np.einsum("nd,nd->", res, res))
            num["A"], den["A"] = within, A.size * float((1.0 - 1.0 / WA[flat]).sum())
        if B.size:
            vB, _, sB = mt.columns(B)
            WB, xbarB = _atom_means(M, vB, sB)
            lev = np.divide(sB, WB[flat], out=np.ones_like(sB), where=WB[flat] > 0)
            num["B"], den["B"] = float((sB * (vB - xbarB[flat]) ** 2).sum()), float(((1.0 - lev) * (sB > 0)).sum())
        den = {k: max(d, 0.0) for k, d in den.items()}  # 1 - s / W is 0 for a lone member, up to rounding
        out = dict(current)
        main = "A" if A.size else "B"   # the block sigma2 comes from: A when there is one
        if "sigma2" in self.estimated and not current["_flat"]:   # (flat: FLAT_NOTE, the start is kept)
            if not den[main] > 1e-9 * max(self.N * self.D, 1):
                self.note("sigma2 not estimable (no atom has two members: every neuron is alone): the previous "
                          "value was kept (a start far below the noise can stay there; the data-driven start does "
                          "not)")
            else:
                floor = SIGMA2_FLOOR * current["_T"]
                if num[main] / den[main] < floor:
                    self.note(f"sigma2 floored at SIGMA2_FLOOR = {SIGMA2_FLOOR:g} times the pooled variance of the "
                              "neurons (the members of every atom agree)")
                out["sigma2"] = max(num[main] / den[main], floor)
        if "sigma2_scaled" in self.estimated and not current["_flat_scaled"]:
            if den["B"] > 1e-9:
                out["sigma2_scaled"] = max(num["B"] / den["B"], SIGMA2_FLOOR * current["_T_scaled"])
            else:
                self.note("sigma2_scaled not estimable (no atom has two members with data on the coordinates with "
                          "per-client precision scales): the previous value was kept")
        # mu0: the mean of the atom means, per coordinate (atoms with data on it)
        mu0, free = current["mu0"].copy(), self.mu0_free
        if free.any():
            if A.size:
                mu0[A[free[A]]] = sum_xbar[free[A]] / L
            if B.size:
                held = WB > 0
                nB = held.sum(axis=0)
                meanB = np.divide((xbarB * held).sum(axis=0), nB, out=mu0[B].copy(), where=nB > 0)
                mu0[B[free[B]]] = meanB[free[B]]
            out["mu0"] = mu0
        # sigma0_2: between-atom variance less the noise's share, k_d = L_d - 1 (mu0_d estimated) or L_d (given)
        between = {}
        if "sigma0_2" in self.estimated:
            if A.size:
                kA = np.where(free[A], L - 1, L).astype(float)
                k = float(kA.sum())
                noise_share = float((kA / L).sum() * (1.0 / WA).sum())
                # sum_i ||xbar_i - mu0||^2 = sum_i ||xbar_i||^2 - 2 mu0 . sum_i xbar_i + L ||mu0||^2
                spread = float(sq_xbar.sum() - 2.0 * mu0[A] @ sum_xbar + L * mu0[A] @ mu0[A])
                if not spread > 1e-8 * float(sq_xbar.sum()):
                    SA = shared_sums(mt, labels, L) if SA is None else SA
                    spread = float(((SA / WA[:, None] - mu0[A]) ** 2).sum())
                between[""] = (spread - out["sigma2"] * noise_share) / k if k > 0 else None
            else:
                between[""] = self._between_B(WB, xbarB, mu0[B], free[B], out["sigma2"])
        if "sigma0_2_scaled" in self.estimated:
            between["_scaled"] = self._between_B(WB, xbarB, mu0[B], free[B], out["sigma2_scaled"])
        for suffix, value in between.items():
            noise = out["sigma2" + suffix]
            if current["_flat" + suffix]:
                continue  # FLAT_NOTE: the start is kept
            if value is None:
                self.note(f"sigma0_2{suffix} not estimable (fewer than two atoms carry data on its coordinates, and "
                          "mu0 is estimated from them): the previous value was kept")
            elif value < SIGMA0_2_FLOOR * noise:
                self.note(f"sigma0_2{suffix} floored at SIGMA0_2_FLOOR * sigma2{suffix} (SIGMA0_2_FLOOR = "
                          f"{SIGMA0_2_FLOOR:g}): the atom means spread no more than the noise alone explains")
                out["sigma0_2" + suffix] = SIGMA0_2_FLOOR * noise
            else:
                out["sigma0_2" + suffix] = float(value)
        self.update_ibp(flat, L, out)
        return out

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


class PauleMandel(_Estimator):
    """Paule-Mandel estimates of tau2, sigma0_2, mu0 and gamma0 for Bayesian neurons, one (tau2, sigma0_2) pair per
    block of coordinates: the Bayesian ones of scale 1 (suffix ``""``), the deterministic ones of scale 1
    (``"_point"``, beside Bayesian ones), those with per-client scales (``"_scaled"``, beside scale-1 ones); a layer
    with one kind has one pair, named tau2 and sigma0_2.

    :param LayerMatcher matcher: the matcher of the data (its neurons' means, variances and scales).
    :param dict given: the hyper-parameters held fixed (of tau2, sigma0_2, gamma0; a given one fixes every pair).
    :param mu0: (D,) the given prior mean, or None (estimated).
    """

    noise = "tau2"
    start_floor = TAU2_FLOOR

    def __init__(self, matcher: LayerMatcher, given: Mapping[str, float], mu0: np.ndarray | None):
        D, s = matcher.D, matcher.scales
        plain = np.arange(D) if s is None else np.flatnonzero((s == 1.0).all(axis=0))
        point = np.intersect1d(plain, matcher.F)   # scale 1, posterior variance 0 at every neuron: point estimates
        A = np.setdiff1d(plain, point)
        B = np.setdiff1d(np.arange(D), plain)
        blocks = [(c, suffix) for c, suffix in [(A, ""), (point, "_point" if len(A) else "")] if len(c)]
        if len(B) and (s[np.asarray(matcher.L) > 0][:, B] > 0).any() and blocks:
            blocks.append((B, "_scaled"))
        elif len(B):   # no scale-1 coordinate, or none with data among the scaled ones: they join the first block
            blocks = [(np.union1d(blocks[0][0], B), blocks[0][1])] + blocks[1:] if blocks else [(B, "")]
        super().__init__(matcher, given, blocks if len(blocks) > 1 else [(np.arange(D), "")])
        self.blocks = [(c, suffix, v, np.zeros_like(v) if u is None else u, np.ones_like(v) if sc is None else sc)
                       for c, suffix, v, u, sc in self.blocks]
        self.mu0 = mu0
        suffixes = [suffix for _, suffix, *_ in self.blocks]
        self.names = [n + suffix for suffix in suffixes for n in ("tau2", "sigma0_2")] + ["gamma0"] + self.ibp_names
        self.estimated = (("mu0",) if mu0 is None else ()) + tuple(
            n + suffix for suffix in ("", "_point", "_scaled") if suffix in suffixes
            for n in ("tau2", "sigma0_2") if n not in given) + (("gamma0",) if "gamma0" not in given else ()) + (
            ("concentration",) if self.concentration_free else ())
        mu = np.full(D, np.nan) if mu0 is None else mu0
        self._first, self._even = self._start(EB_START_NOISE_SHARE, {}, mu), self._start(0.5, {}, mu)
        self._restartable = "tau2" in self.estimated

    def update(self, labels: list[np.ndarray], L: int, values: dict) -> dict:
        """The estimates at the assignment ``labels`` (previous values where not estimable)."""
        membership, flat = _membership(labels, L)
        out = dict(values)
        mu = values["mu0"].copy()
        for coords, suffix, v, u, s in self.blocks:
            T = values["_T" + suffix]
            if values["_flat" + suffix]:  # FLAT_NOTE: the start is kept; mu0 is the one vector itself
                if self.mu0 is None:
                    mu[coords] = v[0]
                continue
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
        self.update_ibp(flat, L, out)
        return out

"""The general path of the layer matcher: (neuron, atom) pairs scored from the model's own log densities, each atom at
its MAP value given its members, for any atom prior and noise law of :func:`~bnpfed.models.beta_bernoulli_layer`
that factorise over the coordinates (the fast path, :mod:`bnpfed.matching.matcher`, is the Gaussian closed form of
the same scores).

**An atom.** With members S (client j's neuron l observing the atom with variance ``sigma2 / s_jd``) an atom's log
density on coordinate d is ``l_d(theta) = log p_0d(theta) + sum_{(j,l) in S} log p(v_jld | theta, sigma2 / s_jd)``
(``p_0`` the atom prior, ``p`` the noise law; a coordinate with ``s_jd = 0`` carries nothing). Its MAP value
``theta_hat_d`` maximises it and ``H_d = -l_d''(theta_hat_d)`` is its curvature there: both found per coordinate by a
few safeguarded Newton steps (first and second derivatives by autograd, a step halved until it does not lower
``l_d``), batched in torch over every (neuron, atom, coordinate) of a client's re-match.

**Objectives** (twice log densities, as the fast path's): an atom is worth

    A(S) = 2 sum_d [l_d(theta_hat_d) - l*_d]                           objective="map"
    A(S) = 2 sum_d log I_d                                              objective="marginal"

with ``l*_d = max log p_0d`` (the prior at its mode: on a Gaussian prior its normalising constant, which the
published MAP objective drops), and ``log I_d`` the log marginal ``log int p_0(theta) prod_S p(v | theta) dtheta`` of
the coordinate: the Laplace approximation ``l_d(theta_hat) + log(2 pi / H_d) / 2`` times a correction ``C_d``, the
mean of ``f / f_Laplace`` under the Laplace Gaussian by :data:`QUADRATURE_NODES`-point Gauss-Hermite quadrature on a
Gaussian :data:`QUADRATURE_WIDTH` times as wide (the weights normalised: ``C_d`` is 1 exactly when the integrand is
Gaussian). The Laplace approximation alone misses the heavy tails: with Student-t noise of 2 degrees of freedom it
undervalues an atom of one neuron by about 0.3 nats per coordinate, and the matcher then merges what it should not;
the correction brings the error below 0.005 nats (tests/test_model_matching.py).

The objective is ``sum_i A(S_i)`` plus the IBP's terms (:mod:`~bnpfed.matching.ibp`: ``2 log(gamma0 c/(J - 1 + c))``
per atom and the popularity terms), and client j's neuron l scores ``A(S_i + l) - A(S_i) + popularity(m_i)`` against
atom i and ``A({l}) + 2 log(gamma0 c/(J - 1 + c))`` against a new one: exact changes of the objective, so the
Hungarian re-matches are coordinate ascent, as on the fast path. On Gaussian layers both objectives equal the fast
path's (up to a constant of the neurons), and so do the assignments (a test pins them).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pyro.distributions as dist
import torch

from bnpfed.matching.ibp import ibp_log_prob, new_atom_term, popularity_terms
from bnpfed.matching.match_result import MatchResult
from bnpfed.matching.matcher import new_columns
from bnpfed.matching.scoring import best_assignment

__all__ = ["NEWTON_STEPS", "NEWTON_TOL", "PAIR_ELEMENTS", "QUADRATURE_NODES", "QUADRATURE_WIDTH", "ModelLaw",
           "ModelMatcher", "atom_law", "log_marginal", "solve_atoms"]

#: At most this many safeguarded Newton steps per MAP (a Gaussian atom takes one, a Student-t one a handful).
NEWTON_STEPS = 50

#: A coordinate's MAP has converged when its next step would raise its log density by at most this many nats.
NEWTON_TOL = 1e-10

#: Gauss-Hermite nodes of the correction of the Laplace approximation (odd: the mode is one of them) and how many
#: times wider than the Laplace Gaussian the Gaussian they are placed on is (heavy tails reach beyond it).
QUADRATURE_NODES = 21
QUADRATURE_WIDTH = 2.0

#: At most this many (neuron, member, coordinate) entries are evaluated at once when a client is scored (the
#: neurons of a client are taken in chunks).
PAIR_ELEMENTS = 2 ** 21


def atom_law(atom_prior: dist.Distribution, D: int, name: str = "atom_prior") -> dist.Distribution:
    """``atom_prior`` as a law of each coordinate of an atom, batch shape (D,) and event shape (): what the general
    path needs (it factorises over the coordinates). Takes a univariate law of batch shape () or (D,), or such a law
    ``.to_event(1)``."""
    if not isinstance(atom_prior, dist.Distribution):
        raise ValueError(f"{name}: expected a pyro.distributions law of an atom, got {type(atom_prior).__name__}")
    law = atom_prior
    if isinstance(law, dist.Independent) and law.reinterpreted_batch_ndims == 1 and law.event_shape == (D,):
        law = law.base_dist
    if law.event_shape != torch.Size() or law.batch_shape not in (torch.Size(), torch.Size([D])):
        raise ValueError(f"{name}: expected a law of each of the {D} coordinates of an atom (event shape (), batch "
                         f"shape () or ({D},), or such a law .to_event(1)): the general path matches coordinate by "
                         f"coordinate; got batch shape {tuple(law.batch_shape)}, event shape {tuple(law.event_shape)}")
    return law.expand(torch.Size([D]))


def _derivatives(f, theta: torch.Tensor):
    """Value, first and second derivative of the elementwise function ``f`` at ``theta`` (each entry of ``f(theta)``
    depends on the same entry of ``theta`` alone)."""
    t = theta.detach().requires_grad_(True)
    with torch.enable_grad():
        value = f(t)
        (g,) = torch.autograd.grad(value.sum(), t, create_graph=True)
        if g.requires_grad:
            (h,) = torch.autograd.grad(g.sum(), t, allow_unused=True)
            h = torch.zeros_like(t) if h is None else h
        else:
            h = torch.zeros_like(t)
    return value.detach(), g.detach(), h.detach()


def solve_atoms(f, theta: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, others=()) -> tuple[torch.Tensor,
                                                                                            torch.Tensor, torch.Tensor]:
    """Maximise the elementwise log density ``f`` within the bracket ``[lo, hi]`` (every entry's maximum lies in it:
    for a unimodal prior and a noise law unimodal about each neuron, between the smallest and the largest of the
    members and the prior's mode) by Newton's method safeguarded by bisection: a Newton step ``-g/h`` where the second
    derivative is negative and the step stays inside the bracket, else the bracket's midpoint, the bracket shrunk
    after every evaluation (``g > 0``: the maximum lies above). It starts from the best (per entry) of ``theta`` and
    the starts ``others``: a heavy-tailed density may have several modes (the atom's and the new neuron's), and the
    higher start puts an entry in the basin of the higher one. Returns ``(theta_hat, value, H)``, ``H = -f''`` at
    ``theta_hat``."""
    lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)
    theta = torch.minimum(torch.maximum(theta, lo), hi)
    if others:
        with torch.no_grad():
            best = f(theta)
            for other in others:
                other = torch.minimum(torch.maximum(other.expand_as(theta), lo), hi)
                v = f(other)
                better = v > best
                theta, best = torch.where(better, other, theta), torch.where(better, v, best)
    for k in range(NEWTON_STEPS + 1):
        value, g, h = _derivatives(f, theta)
        lo, hi = torch.where(g > 0, theta, lo), torch.where(g > 0, hi, theta)
        newton = theta - g / h.clamp(max=-1e-300)
        inside = (h < 0) & (newton > lo) & (newton < hi)
        step = torch.where(inside, newton, 0.5 * (lo + hi)) - theta
        # done: a Newton step would gain at most NEWTON_TOL nats (g^2 / 2|h|), or the bracket is below rounding
        done = ((h < 0) & (g * g <= 2 * NEWTON_TOL * -h)) | (hi - lo <= 1e-13 * (1.0 + theta.abs())) | (g == 0)
        if bool(done.all()) or k == NEWTON_STEPS:
            break
        theta = torch.where(done, theta, theta + step)
    return theta, value, -h


def _quadrature() -> tuple[np.ndarray, np.ndarray]:
    """Nodes z_k (standard units of the Laplace Gaussian, :data:`QUADRATURE_WIDTH` times spread) and the log of
    normalised weights of the mean under the Laplace Gaussian: Gauss-Hermite for ``N(0, kappa^2)`` reweighted by
    ``N(0, 1) / N(0, kappa^2)``."""
    z, w = np.polynomial.hermite_e.hermegauss(QUADRATURE_NODES)   # weight exp(-z^2 / 2)
    kappa = QUADRATURE_WIDTH
    log_w = np.log(w) - (kappa ** 2 - 1) * z ** 2 / 2
    return kappa * z, log_w - np.logaddexp.reduce(log_w)


def log_marginal(f, theta: torch.Tensor, value: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Elementwise ``log int exp(f)``: the Laplace approximation at the maximum ``theta`` (``value = f(theta)``,
    ``H = -f''``) times its Gauss-Hermite correction (module docstring)."""
    nodes, log_w = _quadrature()
    H = H.clamp(min=1e-300)
    scale = H.rsqrt()
    terms = []
    with torch.no_grad():
        for x, lw in zip(nodes, log_w):
            terms.append(lw + torch.nan_to_num(f(theta + x * scale) - value, nan=-math.inf) + 0.5 * x * x)
    correction = torch.logsumexp(torch.stack(terms), dim=0)
    return value + 0.5 * torch.log(2 * math.pi / H) + correction


class ModelLaw:
    """The model's per-coordinate densities at given values: the atom prior (batch shape (D,)), the noise law at
    noise variance ``sigma2`` over each neuron's precision scales, the prior's mode and its log density there, and
    Gaussian guesses of curvatures for the Newton starts.

    :param prior: the atom prior, batch shape (D,) (:func:`atom_law`).
    :param noise: ``noise(loc, variance) -> Distribution``, one law per coordinate.
    :param float sigma2: the noise variance (the ``variance`` passed is ``sigma2 / s_jd``).
    :param ModelMatcher matcher: whose neurons (their scales, device) it scores.
    """

    def __init__(self, prior: dist.Distribution, noise, sigma2: float, matcher: "ModelMatcher"):
        self.prior, self.noise, self.sigma2, self.mt = prior, noise, float(sigma2), matcher
        D, device = matcher.D, matcher.device
        #: every neuron's noise variance (N, D) (a scalar when every scale is 1) and its Gaussian-equivalent precision
        self.var = torch.tensor(self.sigma2, dtype=torch.float64, device=device) if matcher.scale is None else (
            self.sigma2 / matcher.scale)
        self.precision = (1.0 / self.var) * (1.0 if matcher.weight is None else matcher.weight)
        start = torch.nan_to_num(_safe_mean(prior), nan=0.0).to(device).reshape(1, D)
        sd = torch.nan_to_num(_safe_variance(prior), nan=1.0, posinf=1.0).sqrt().to(device).reshape(1, D)
        theta, value, H = solve_atoms(lambda t: prior.log_prob(t), start, start - 10 * sd, start + 10 * sd)
        #: the prior's mode, its log density there (per coordinate), a curvature for the starts (at least its
        #: variance's inverse: a Laplace prior has none at its mode)
        self.mode, self.mode_value = theta.reshape(D), value.reshape(D)
        self.prior_curvature = torch.maximum(H.reshape(D), 1.0 / sd.reshape(D) ** 2)

    def var_of(self, idx):
        return self.var if self.var.dim() == 0 else self.var[idx]

    def precision_of(self, idx):
        return self.precision.expand(len(self.mt.v), self.mt.D)[idx]

    def noise_lp(self, theta, idx):
        """log p(v_n | theta) of neurons ``idx`` (0 where they say nothing), broadcast over theta."""
        lp = self.noise(theta, self.var_of(idx)).log_prob(self.mt.v[idx])
        w = None if self.mt.weight is None else self.mt.weight[idx]
        return lp if w is None else lp * w

    def fit(self, members: np.ndarray, segment: np.ndarray, K: int, start=None, marginal: bool = True):
        """MAP value, per-coordinate log density, curvature and (``marginal``; else None) log marginal of K atoms
        whose members are the neurons ``members``, neuron ``members[k]`` on atom ``segment[k]`` (every atom with one
        at least): (K, D) each."""
        device, D = self.mt.device, self.mt.D
        idx = torch.as_tensor(members, device=device)
        seg = torch.as_tensor(segment, device=device)
        w = self.precision_of(idx)
        if start is None:   # the Gaussian guess: the precision-weighted mean of the members and the prior's mode
            curvature = torch.zeros(K, D, dtype=torch.float64, device=device).index_add_(0, seg, w)
            curvature += self.prior_curvature
            num = torch.zeros(K, D, dtype=torch.float64, device=device).index_add_(0, seg, w * self.mt.v[idx])
            start = (num + self.prior_curvature * self.mode) / curvature

        def f(t):
            return self.prior.log_prob(t).index_add(0, seg, self.noise_lp(t[seg], idx))

        lo, hi = self.bracket(idx, seg, K)
        theta, value, H = solve_atoms(f, start, lo, hi)
        return theta, value, H, log_marginal(f, theta, value, H) if marginal else None

    def bracket(self, idx: torch.Tensor, seg: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, D) the smallest and largest of each atom's members (those that say something) and the prior's mode."""
        v = self.mt.v[idx]
        w = None if self.mt.weight is None else self.mt.weight[idx] > 0
        mode = self.mode.expand(K, self.mt.D)
        low = mode.clone().scatter_reduce(0, seg[:, None].expand_as(v), v if w is None else torch.where(w, v, mode[
            seg]), reduce="amin")
        high = mode.clone().scatter_reduce(0, seg[:, None].expand_as(v), v if w is None else torch.where(w, v, mode[
            seg]), reduce="amax")
        return low, high

    def evidence(self, members: np.ndarray, segment: np.ndarray, K: int, start=None) -> tuple[float, torch.Tensor]:
        """``sum_i log int p_0(theta) prod_{S_i} p(v | theta) dtheta`` (:func:`log_marginal`: exact for Gaussian
        atoms and noise), and the atoms' MAP values."""
        theta, value, H, M = self.fit(members, segment, K, start)
        return float(M.sum()), theta


class ModelMatcher:
    """The state of a matching on the general path: every neuron's atom, every atom's MAP value, curvature and worth
    ``A(S)`` (module docstring), the Hungarian re-match of a client, and the objective; driven by
    :func:`~bnpfed.matching.driver.run_matching` as the fast path's :class:`~bnpfed.matching.matcher.LayerMatcher`.

    :param list V: J float64 arrays (L_j, D), the neurons.
    :param s: (J, D) precision scales or None (all 1).
    :param bool marginal: the marginal objective (else the MAP one).
    :param device: torch device of the densities (None: the CPU).
    """

    gram = None

    def __init__(self, V, s, *, marginal: bool, popularity_factor: float, popularity_cap, max_atoms,
                 new_atom_penalty: str, device=None):
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.J = J = len(V)
        self.D = V[0].shape[1]
        self.L = [v.shape[0] for v in V]
        self.offsets = np.concatenate([[0], np.cumsum(self.L)]).astype(np.int64)
        N = int(self.offsets[-1])
        self.client = np.repeat(np.arange(J), self.L)
        self.v = torch.as_tensor(np.concatenate(V), dtype=torch.float64, device=self.device)   # (N, D)
        scales = None if s is None else torch.as_tensor(np.repeat(s, self.L, axis=0), dtype=torch.float64,
                                                         device=self.device)
        #: per neuron: where it says something (s > 0: 1, else 0; None: everywhere) and its scale there
        self.weight = None if scales is None else (scales > 0).double()
        self.scale = None if scales is None else torch.where(scales > 0, scales, torch.ones_like(scales))
        self.marginal = marginal
        self.popularity_factor, self.popularity_cap = float(popularity_factor), popularity_cap
        self.max_atoms, self.new_atom_penalty = max_atoms, new_atom_penalty
        self.atom_of = np.full(N, -1, dtype=np.int64)
        self.assign: list = [None] * J
        self.hyper = None
        self.lsa_seconds = 0.0
        self.rematches: list = []
        self.moved = 0
        # every atom holds a neuron and a row is taken only when none is free: N rows always suffice
        cap = max(N, 1)
        self.m = np.zeros(cap, dtype=np.int64)
        self.theta, self.H, self.value, self.M = (torch.zeros(cap, self.D, dtype=torch.float64, device=self.device)
                                                  for _ in range(4))
        self.n_rows = 0
        self.free: list = []

    # --- the model ------------------------------------------------------------------------------------------------
    def set_hyperparameters(self, *, prior: dist.Distribution, noise, sigma2: float, gamma0: float,
                            concentration: float = 1.0, key=None) -> None:
        """Score with the atom prior ``prior`` (batch shape (D,)), the noise law ``noise(loc, variance)`` at noise
        variance ``sigma2`` (over the precision scales), and the IBP's ``gamma0`` and ``concentration`` from now on;
        the atoms of the current assignment are refitted. ``key``: a hashable summary of the values (nothing is
        redone when it is unchanged)."""
        if key is not None and key == self.hyper:
            return
        self.hyper = key
        self.law = ModelLaw(prior, noise, sigma2, self)
        self.gamma0, self.concentration = float(gamma0), float(concentration)
        self.pop = popularity_terms(self.J, concentration, self.popularity_factor, self.popularity_cap)
        self.pop_cum = np.zeros(self.J + 1)
        self.pop_cum[2:] = np.cumsum(self.pop[1:self.J])
        self.log_new = 2.0 * new_atom_term(self.J, gamma0, concentration)
        if self.n_rows:
            self._refit(np.flatnonzero(self.m[: self.n_rows] > 0))

    def law_at(self, prior: dist.Distribution, noise, sigma2: float) -> ModelLaw:
        """The model's densities of these neurons at other values (for the estimates; the state is untouched)."""
        return ModelLaw(prior, noise, sigma2, self)

    def worth(self, value: torch.Tensor, M) -> torch.Tensor:
        """``A(S)`` of atoms from their per-coordinate values at the MAP and log marginals (..., D)."""
        if self.marginal:
            return 2.0 * M.sum(-1)
        return 2.0 * (value - self.law.mode_value).sum(-1)

    # --- the assignment -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.atom_of[:] = -1
        self.assign = [None] * self.J
        self.m[:] = 0
        self.n_rows = 0
        self.free: list = []

    def unassign(self) -> None:
        """Take every client off the atoms and forget the values scored with (a fresh start)."""
        self.reset()
        self.hyper = None

    def _refit(self, atoms: np.ndarray, marginal: bool | None = None) -> None:
        """Refit the atoms ``atoms`` (rows with members) from their members (their log marginals too with the
        marginal objective or ``marginal``)."""
        marginal = self.marginal if marginal is None else marginal
        if not atoms.size:
            return
        held = np.flatnonzero(np.isin(self.atom_of, atoms))
        position = np.full(self.n_rows, -1, dtype=np.int64)
        position[atoms] = np.arange(atoms.size)
        rows = torch.as_tensor(atoms, device=self.device)
        theta, value, H, M = self.law.fit(held, position[self.atom_of[held]], atoms.size, start=self.theta[rows],
                                          marginal=marginal)
        self.theta[rows], self.value[rows], self.H[rows] = theta, value, H
        self.M[rows] = 0.0 if M is None else M

    def start_from(self, labels: list) -> None:
        """Put every client on the atoms of a given assignment (labels of any values, compacted in sorted order)."""
        self.reset()
        uniq, flat = np.unique(np.concatenate(labels), return_inverse=True)
        flat = flat.reshape(-1)
        self.n_rows = uniq.size
        self.atom_of[:] = flat
        self.m[: uniq.size] = np.bincount(flat, minlength=uniq.size)
        self.assign = [flat[self.offsets[j]:self.offsets[j + 1]].copy() for j in range(self.J)]
        theta, value, H, M = self.law.fit(np.arange(flat.size), flat, uniq.size, marginal=self.marginal)
        self.theta[: uniq.size], self.value[: uniq.size], self.H[: uniq.size] = theta, value, H
        self.M[: uniq.size] = 0.0 if M is None else M
        self.free = []

    def labels(self) -> tuple[list, int]:
        """The current assignment as compact labels 0 .. L-1 (in storage order), and L."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        relabel = np.full(self.n_rows, -1, dtype=np.int64)
        relabel[active] = np.arange(active.size)
        return [relabel[a] for a in self.assign], int(active.size)

    def _remove(self, j: int) -> np.ndarray:
        """Take client j off its atoms (refitting those that keep members); return its previous atoms."""
        rows = self.assign[j]
        self.assign[j] = None
        self.atom_of[self.offsets[j]:self.offsets[j + 1]] = -1
        self.m[rows] -= 1
        kept = rows[self.m[rows] > 0]
        self.free.extend(int(r) for r in rows[self.m[rows] == 0])
        self._refit(kept)
        return rows

    def _new_rows(self, k: int) -> np.ndarray:
        take = self.free[max(len(self.free) - k, 0):] if k else []
        del self.free[len(self.free) - len(take):]
        rest = k - len(take)
        rows = np.array(list(take) + list(range(self.n_rows, self.n_rows + rest)), dtype=np.int64)
        self.n_rows += rest
        return rows

    # --- scores ---------------------------------------------------------------------------------------------------
    def _candidates(self, j: int, active: np.ndarray):
        """Client j's neurons joined to every active atom and to a new one: their MAP values, per-coordinate values
        and curvatures, (L_j, L + 1, D), the last column the new atom (client j must be off its atoms)."""
        L_j, L, D = self.L[j], active.size, self.D
        mine = np.arange(self.offsets[j], self.offsets[j + 1])
        held = np.flatnonzero(self.atom_of >= 0)
        position = np.full(max(self.n_rows, 1), -1, dtype=np.int64)
        position[active] = np.arange(L)
        seg = torch.as_tensor(position[self.atom_of[held]], device=self.device)
        held_t = torch.as_tensor(held, device=self.device)
        law = self.law
        x = self.v[mine]
        wx = law.precision_of(torch.as_tensor(mine, device=self.device))
        var_x = law.var_of(mine)
        w_x = None if self.weight is None else self.weight[mine]
        rows = torch.as_tensor(active, device=self.device)
        atom_theta = torch.cat([self.theta[rows], law.mode[None]])          # (L + 1, D)
        atom_H = torch.cat([self.H[rows], law.prior_curvature[None]]).clamp(min=1e-300)
        if held.size:
            low, high = law.bracket(held_t, seg, L)
        else:
            low = high = torch.zeros(0, D, dtype=torch.float64, device=self.device)
        low, high = torch.cat([low, law.mode[None]]), torch.cat([high, law.mode[None]])   # (L + 1, D)
        theta_out = torch.empty(L_j, L + 1, D, dtype=torch.float64, device=self.device)
        value_out, H_out, M_out = torch.empty_like(theta_out), torch.empty_like(theta_out), torch.empty_like(theta_out)
        step = max(1, PAIR_ELEMENTS // max((held.size + L + 1) * D, 1))
        for a in range(0, L_j, step):
            b = min(a + step, L_j)
            xa, wa = x[a:b, None, :], wx[a:b, None, :]
            start = (atom_H * atom_theta + wa * xa) / (atom_H + wa)             # (B, L + 1, D)
            va = var_x if var_x.dim() == 0 else var_x[a:b, None, :]
            wt = None if w_x is None else w_x[a:b, None, :]

            def f(t, xa=xa, va=va, wt=wt):
                own = law.noise(t, va).log_prob(xa)
                lp = law.prior.log_prob(t) + (own if wt is None else own * wt)
                if held.size:
                    lp = lp.index_add(1, seg, law.noise_lp(t[:, seg, :], held_t))
                return lp

            others = (atom_theta[None].expand_as(start), xa.expand_as(start))
            own = xa if wt is None else torch.where(wt > 0, xa, law.mode)
            lo, hi = torch.minimum(low[None], own), torch.maximum(high[None], own)
            theta, value, H = solve_atoms(f, start, lo, hi, others)
            theta_out[a:b], value_out[a:b], H_out[a:b] = theta, value, H
            M_out[a:b] = log_marginal(f, theta, value, H) if self.marginal else 0.0
        return theta_out, value_out, H_out, M_out

    def scores(self, j: int, active: np.ndarray):
        """Client j's (L_j, L + n_new) score matrix against the active atoms and new ones, with the candidates'
        fits (:meth:`_candidates`)."""
        L_j, L = self.L[j], active.size
        fits = self._candidates(j, active)
        joined = self.worth(fits[1], fits[3]).cpu().numpy()                 # (L_j, L + 1)
        n_new = new_columns(j, L_j, L, self.max_atoms)
        S = np.empty((L_j, L + n_new))
        rows = torch.as_tensor(active, device=self.device)
        before = self.worth(self.value[rows], self.M[rows]).cpu().numpy() if L else np.zeros(0)
        S[:, :L] = joined[:, :L] - before[None, :] + self.pop[self.m[active]][None, :]
        S[:, L:] = (joined[:, L] + self.log_new)[:, None]
        if self.new_atom_penalty == "log_k":
            S[:, L:] -= 2.0 * np.log(np.arange(1, n_new + 1))
        return S, fits

    def match(self, j: int, *, rematch: bool = False) -> bool:
        """Assign client j optimally given everyone else (taking it off its atoms first if ``rematch``); return
        whether the partition changed."""
        if self.L[j] == 0:
            self.assign[j] = np.empty(0, dtype=np.int64)
            self.rematches.append((j, 0, int((self.m[: self.n_rows] > 0).sum()) if self.n_rows else 0))
            return False
        previous = self._remove(j) if rematch else None
        before = None if previous is None else self._partners(j, previous)
        active = np.flatnonzero(self.m[: self.n_rows] > 0) if self.n_rows else np.zeros(0, dtype=np.int64)
        S, (theta, value, H, M) = self.scores(j, active)
        t0 = time.perf_counter()
        rows, cols = best_assignment(S, active.size, prune=self.max_atoms is None and self.new_atom_penalty == "none")
        self.lsa_seconds += time.perf_counter() - t0
        self.rematches.append((j, self.L[j], active.size))
        target = np.empty(self.L[j], dtype=np.int64)
        is_new = cols >= active.size
        target[rows[~is_new]] = active[cols[~is_new]]
        target[rows[is_new]] = self._new_rows(int(is_new.sum()))
        column = np.where(is_new, active.size, cols)
        pick_l, pick_c = torch.as_tensor(rows), torch.as_tensor(column)
        dest = torch.as_tensor(target[rows], device=self.device)
        self.theta[dest], self.value[dest], self.H[dest], self.M[dest] = (a[pick_l, pick_c] for a in (theta, value, H,
                                                                                                   M))
        self.m[target] += 1
        self.atom_of[self.offsets[j]:self.offsets[j + 1]] = target
        self.assign[j] = target
        if previous is None:
            return True
        moved = self._partners(j, target) != before
        self.moved += int(moved.sum())
        return bool(moved.any())

    def _partners(self, j: int, rows: np.ndarray) -> np.ndarray:
        """Per neuron of client j on atom ``rows[l]``, the other clients' neurons there (a hashable tuple)."""
        others = self.atom_of.copy()
        others[self.offsets[j]:self.offsets[j + 1]] = -1
        out = np.empty(rows.size, dtype=object)
        for l, r in enumerate(rows):
            out[l] = tuple(np.flatnonzero(others == r))
        return out

    def greedy(self) -> None:
        """The first assignment: every client matched in turn given those before it, largest client first."""
        self.reset()
        for j in np.argsort(-np.array(self.L), kind="stable"):
            self.match(int(j))

    def sweep(self, rng: np.random.Generator) -> bool:
        """Re-match every client once, in a random order; return whether any assignment changed."""
        self.moved = 0
        changed = False
        for j in rng.permutation(self.J):
            changed |= self.match(int(j), rematch=True)
        return changed

    def gram_fits(self) -> bool:
        return False

    # --- the objective --------------------------------------------------------------------------------------------
    def objective(self) -> float:
        """``sum_i A(S_i)`` plus the IBP's terms (module docstring)."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        rows = torch.as_tensor(active, device=self.device)
        worth = float(self.worth(self.value[rows], self.M[rows]).sum())
        return worth + active.size * self.log_new + float(self.pop_cum[self.m[active]].sum())

    def log_likelihood(self) -> float:
        """``log p(Z, V)`` of the current assignment with every atom integrated out (:func:`log_marginal`: exact for
        Gaussian atoms and noise), every normalising constant included: the IBP's density
        (:func:`~bnpfed.matching.ibp.ibp_log_prob`) plus ``sum_i sum_d log I_d``."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        if not self.marginal:   # the MAP objective's scores need no marginals: they are computed here
            self._refit(active, marginal=True)
        rows = torch.as_tensor(active, device=self.device)
        return ibp_log_prob(self.m[active], self.J, self.gamma0, self.concentration) + float(self.M[rows].sum())

    def result(self, objective: list, seconds: float, dtype, **extra) -> MatchResult:
        """The :class:`MatchResult` of the current assignment: the atoms at their MAP values, their curvatures as
        posterior precisions (the Laplace approximation's)."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        labels, _ = self.labels()
        rows = torch.as_tensor(active, device=self.device)
        return MatchResult(global_atoms=self.theta[rows].to("cpu", dtype), posterior_precision=self.H[rows].to(
            "cpu", dtype), assignments=[torch.as_tensor(a) for a in labels], counts=torch.as_tensor(self.m[active]),
            objective=objective, seconds=seconds, lsa_seconds=self.lsa_seconds, rematches=self.rematches, **extra)


def _safe_mean(law: dist.Distribution) -> torch.Tensor:
    try:
        return law.mean.to(torch.float64)
    except NotImplementedError:
        return torch.zeros(law.batch_shape, dtype=torch.float64)


def _safe_variance(law: dist.Distribution) -> torch.Tensor:
    try:
        return law.variance.to(torch.float64)
    except NotImplementedError:
        return torch.ones(law.batch_shape, dtype=torch.float64)

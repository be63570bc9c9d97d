"""MAP matching of one federated layer: the Hungarian step of PFNM.

Yurochkin et al., "Bayesian Nonparametric Federated Learning of Neural Networks", ICML 2019, section 3.2. Given J
clients' neurons (vectors in R^D), find the assignment of every local neuron to a global atom (distinct atoms within a
client) that maximises the posterior of the Beta-Bernoulli model of :mod:`bnpfed.models.beta_bernoulli`.

Notation (natural parameters, per atom i and coordinate d). A client j's neuron v_jl has noise precision
``w_jd = s_jd / sigma2``. An atom with members S_i has

    P_id = 1/sigma0_2 + sum_{(j,l) in S_i} w_jd                 (posterior precision)
    g_id = mu0_d/sigma0_2 + sum_{(j,l) in S_i} w_jd v_jld        (precision-weighted sum)

and posterior mean ``theta_i = g_i / P_i``. With m_i = |S_i| clients on atom i, L atoms, c the popularity factor:

**objective="map"** (the published objective: atoms at their MAP values, normalising constants dropped)

    F(Z) = sum_i [ sum_d (g_id^2/P_id - g0_d^2/P0) + 2 log(gamma0/J) + c sum_{k=1}^{m_i-1} log(k/(J-k)) ]

with ``g0 = mu0/sigma0_2``, ``P0 = 1/sigma0_2``. For c = 2 this is twice the log density of the configuration:

    F(Z) = 2 log p_conf(Z, theta_hat, V) + L * D * log(2 pi sigma0_2) + const(V, J, gamma0)

where ``p_conf`` is the Beta-Bernoulli density of the configuration (the IBP prior in its exchangeable form, see
:func:`bnpfed.models.beta_bernoulli.log_joint`) and const(V, J, gamma0) = 2 gamma0 H_J + 2 sum_j log L_j! +
sum_{j,l,d} [log(2 pi sigma2 / s_jd) + s_jd v_jld^2 / sigma2]. The term ``L D log(2 pi sigma0_2)`` -- the atoms'
prior normalising constants, which depend on the number of atoms alone -- is what the published objective drops.

**objective="marginal"** integrates every atom out instead of plugging in its MAP value (the Gaussian marginal
likelihood; Yurochkin et al., "Statistical Model Aggregation via Parameter Matching", NeurIPS 2019):

    F_marg(Z) = F(Z) - sum_i sum_d log(P_id / P0)

The extra Occam factor charges every atom for the precision it concentrates. The MAP objective has no such charge:
at sigma2 equal to the true noise, merging two noisy copies of one atom and keeping them apart are worth about the
same (both of order D), so it over-splits; the marginal objective does not.

A client without neurons (L_j = 0; the Beta-Bernoulli process gives one with probability exp(-gamma0)) holds no
atom and adds nothing to the sums, but it counts in J: it is one of the clients that did not take each atom.

Both objectives decompose over clients: with the other clients fixed, client j's contribution is a sum of per-pair
scores, so its best assignment is a linear assignment problem. Client j's neuron l scores

* against existing atom i (m_i clients other than j):
  ``sum_d [(g_id + w_jd v_jld)^2/(P_id + w_jd) - g_id^2/P_id] + c log(m_i/(J - m_i))`` (marginal: minus
  ``sum_d log((P_id + w_jd)/P_id)``);
* against a new atom: ``sum_d [(g0_d + w_jd v_jld)^2/(P0 + w_jd) - g0_d^2/P0] + 2 log(gamma0/J)`` (marginal: minus
  ``sum_d log((P0 + w_jd)/P0)``),

and ``scipy.optimize.linear_sum_assignment`` solves it exactly. These per-client scores are the exact change of F
(or F_marg) for any c, so a greedy pass followed by sweeps of remove-and-rematch is coordinate ascent: F never
decreases across sweeps (with ``max_atoms`` off).

Reference constants (the published code, ``REFERENCE_CONSTANTS``): popularity factor c = 1; popularity counts capped
at 10 (``min(m, 10)`` inside the log; the cap keeps the ascent exact, the objective then sums the capped terms);
at most 700 atoms in total (a client may open ``min(L_j, max(700 - L, 1))`` new ones); and ``- 2 log k`` on the k-th
new atom of a client. That last term is the 1/K! of the IBP's left-ordered form for a binary matrix; atoms here carry
distinct parameters, so the orderings it divides out are distinct configurations, and no joint density has those
scores as its conditionals. It is available (``new_atom_penalty="log_k"``) but off by default. Every sweep then
still reports F, which the ``log_k`` penalty may lower slightly.

Implementation. Coordinates on which every client has precision scale 1 (all of them unless ``precisions`` is given;
in PFNM all but the output-layer ones) form block A, where ``P_i = P0 + m_i / sigma2`` is one number per atom: the
cross terms of all of a client's neurons against all atoms are one matrix product ``V_j g_A^T``, and the per-atom
statistics (g, m, ||g_A||^2) are updated in place when a client leaves or joins. The remaining coordinates (block B)
keep a dense per-coordinate precision and cost two more, small, products.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from torch import Tensor

from bnpfed.validation import check_positive

__all__ = ["MatchResult", "match_layer", "assignment_objective", "REFERENCE_CONSTANTS"]

#: The constants of the published PFNM code (IBM/probabilistic-federated-neural-matching, ``matching/pfnm.py``):
#: popularity term without the factor 2, popularity counts capped at 10, at most 700 global atoms, and -2 log k on the
#: k-th new atom of a client. Pass as ``match_layer(..., **REFERENCE_CONSTANTS)`` to reproduce it.
REFERENCE_CONSTANTS = dict(popularity_factor=1.0, popularity_cap=10, max_atoms=700, new_atom_penalty="log_k")


@dataclass
class MatchResult:
    """Result of :func:`match_layer`.

    :param Tensor global_atoms: (L, D) posterior means ``g_i / P_i`` given the assignment.
    :param Tensor posterior_precision: (L, D) posterior precisions ``P_i``.
    :param list assignments: J long tensors of length L_j with values in [0, L), distinct within a client (empty
        for a client without neurons).
    :param Tensor counts: (L,) number of clients on each atom (m_i).
    :param list objective: the objective after the greedy pass (or at ``init_assignments``) and after every sweep.
    :param float seconds: wall time of the matching.
    :param float lsa_seconds: part of ``seconds`` spent inside ``linear_sum_assignment``.
    :param list rematches: one ``(client, L_j, L)`` per client (re-)matching, L the atoms it was scored against.
    """

    global_atoms: Tensor
    posterior_precision: Tensor
    assignments: list
    counts: Tensor
    objective: list
    seconds: float = 0.0
    lsa_seconds: float = 0.0
    rematches: list = field(default_factory=list, repr=False)

    @property
    def num_atoms(self) -> int:
        return int(self.global_atoms.shape[0])


# --------------------------------------------------------------------------------------------------------------------
# input validation


def _to_numpy(x, name: str) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be numeric arrays or tensors: {e}") from None


def _validate_neurons(neurons) -> list[np.ndarray]:
    if isinstance(neurons, (Tensor, np.ndarray)) and np.ndim(neurons) == 3:
        neurons = list(neurons)
    if not isinstance(neurons, Sequence) or isinstance(neurons, (str, bytes)):
        raise ValueError(f"neurons must be a sequence of J arrays of shape (L_j, D), got {type(neurons).__name__}")
    if len(neurons) == 0:
        raise ValueError("neurons is empty: expected at least one client's (L_j, D) array")
    out = []
    for j, v in enumerate(neurons):
        a = _to_numpy(v, f"neurons[{j}]")
        if a.ndim != 2:
            raise ValueError(f"neurons[{j}] must have shape (L_j, D), got shape {a.shape}")
        if a.shape[1] != out[0].shape[1] if out else False:
            raise ValueError(f"neurons[{j}] has D = {a.shape[1]} coordinates but neurons[0] has {out[0].shape[1]}: "
                             "every client must share D")
        if not np.isfinite(a).all():
            raise ValueError(f"neurons[{j}] contains NaN or inf")
        out.append(np.ascontiguousarray(a))
    if not any(a.shape[0] for a in out):
        # a client without neurons still counts in J, but some client must hold one for there to be a layer
        raise ValueError(f"neurons: expected at least one client with a neuron (L_j >= 1), got {len(out)} "
                         "client(s), all with L_j = 0: nothing to match")
    return out


def _validate_precisions(precisions, sizes: Sequence[int], D: int) -> np.ndarray | None:
    """(J, D) precision scales; ``sizes`` are the clients' L_j."""
    if precisions is None:
        return None
    J = len(sizes)
    if isinstance(precisions, (Tensor, np.ndarray)) and np.ndim(precisions) == 2:
        s = _to_numpy(precisions, "precisions")
    else:
        if len(precisions) != J:
            raise ValueError(f"precisions must hold one (D,) vector per client: expected {J}, got {len(precisions)}")
        rows = [_to_numpy(p, f"precisions[{j}]") for j, p in enumerate(precisions)]
        for j, r in enumerate(rows):
            if r.shape != (D,):
                raise ValueError(f"precisions[{j}] must have shape ({D},), got {r.shape}")
        s = np.stack(rows)
    if s.shape != (J, D):
        raise ValueError(f"precisions must have shape ({J}, {D}), got {s.shape}")
    if not np.isfinite(s).all() or (s < 0).any():
        raise ValueError("precisions must be finite and >= 0")
    # a client without neurons says nothing whatever its precisions: its row is never used
    silent = np.flatnonzero((s == 0).all(axis=1) & (np.asarray(sizes) > 0))
    if silent.size:
        raise ValueError(f"precisions of client {int(silent[0])} are all 0: its neurons would carry no information "
                         "(a zero precision marks one coordinate a client says nothing about; some must be > 0)")
    return s


def _validate_mu0(mu0, D: int) -> np.ndarray:
    m = _to_numpy(mu0, "mu0")
    if m.ndim == 0:
        m = np.full(D, float(m))
    if m.shape != (D,):
        raise ValueError(f"mu0 must be a scalar or have shape ({D},), got {m.shape}")
    if not np.isfinite(m).all():
        raise ValueError("mu0 contains NaN or inf")
    return m


# --------------------------------------------------------------------------------------------------------------------
# the state of a matching: per-atom sufficient statistics, updated in place


class _LayerMatcher:
    """Per-atom statistics of a partial assignment, and the per-client scoring / rematching on them."""

    def __init__(self, neurons, precisions, *, sigma2, sigma0_2, gamma0, mu0, popularity_factor, popularity_cap,
                 max_atoms, new_atom_penalty, marginal):
        self.J = J = len(neurons)
        self.D = D = neurons[0].shape[1]
        tau = 1.0 / sigma2
        self.P0 = P0 = 1.0 / sigma0_2
        g0 = mu0 * P0
        if precisions is None:
            A = np.arange(D)
        else:
            A = np.flatnonzero((precisions == 1.0).all(axis=0))
        B = np.setdiff1d(np.arange(D), A)
        self.A, self.B, self.tau = A, B, tau
        self.g0A, self.g0B = g0[A].copy(), g0[B].copy()
        self.g0A_sq = float(self.g0A @ self.g0A)
        # per-client natural-parameter contributions x = w * v (w = s / sigma2) and precisions w on block B
        self.xA = [np.ascontiguousarray(v[:, A] * tau) for v in neurons]
        self.xA_sq = [np.einsum("ld,ld->l", x, x) for x in self.xA]
        self.g0x = [x @ self.g0A for x in self.xA]  # cross term of each neuron with an empty (prior-only) atom
        if len(B):
            wB = [(precisions[j, B] if precisions is not None else np.ones(len(B))) * tau for j in range(J)]
        else:
            wB = [np.zeros(0) for _ in range(J)]
        self.wB = wB
        self.xB = [np.ascontiguousarray(v[:, B] * wB[j]) for j, v in enumerate(neurons)]
        self.L = [v.shape[0] for v in neurons]
        self.offsets = np.concatenate([[0], np.cumsum(self.L)])
        self.gram: np.ndarray | None = None  # (N, N) products x_u . x_v of all neurons' block-A parts, when used
        self.marginal = marginal
        self.c = float(popularity_factor)
        self.log_new = 2.0 * math.log(gamma0 / J)
        # popularity score of joining an atom held by m other clients, and its cumulative sum over an atom's life
        m = np.arange(J + 1, dtype=np.float64)
        mc = np.minimum(m, popularity_cap) if popularity_cap is not None else m
        with np.errstate(divide="ignore"):
            self.pop = self.c * (np.log(mc) - np.log(J - mc))  # pop[m], m = 1 .. J-1 used
        self.pop_cum = np.zeros(J + 1)
        self.pop_cum[2:] = np.cumsum(self.pop[1:J])  # pop_cum[m] = sum_{k=1}^{m-1} pop[k]
        self.max_atoms = max_atoms
        self.new_atom_penalty = new_atom_penalty
        self.new_scores = [self._new_atom_scores(j) for j in range(J)]
        # storage for atoms: rows [0, n_rows) used, some of them free (m == 0)
        cap = max(2 * max(self.L), 64)
        self.gA = np.tile(self.g0A, (cap, 1))
        self.gB = np.tile(self.g0B, (cap, 1))
        self.PB = np.full((cap, len(B)), P0)
        self.gA_sq = np.full(cap, self.g0A_sq)
        self.m = np.zeros(cap, dtype=np.int64)
        self.n_rows = 0
        self.free: list[int] = []
        self.assign: list[np.ndarray | None] = [None] * J
        self.lsa_seconds = 0.0
        self.rematches: list[tuple[int, int, int]] = []

    # --- storage ----------------------------------------------------------------------------------------------------
    def _grow(self, needed: int):
        cap = self.m.shape[0]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        extra = new_cap - cap
        self.gA = np.vstack([self.gA, np.tile(self.g0A, (extra, 1))])
        self.gB = np.vstack([self.gB, np.tile(self.g0B, (extra, 1))])
        self.PB = np.vstack([self.PB, np.full((extra, len(self.B)), self.P0)])
        self.gA_sq = np.concatenate([self.gA_sq, np.full(extra, self.g0A_sq)])
        self.m = np.concatenate([self.m, np.zeros(extra, dtype=np.int64)])

    def _new_rows(self, k: int) -> np.ndarray:
        take = self.free[-k:] if k else []
        del self.free[len(self.free) - len(take):]
        rest = k - len(take)
        self._grow(self.n_rows + rest)
        rows = np.array(list(take) + list(range(self.n_rows, self.n_rows + rest)), dtype=np.int64)
        self.n_rows += rest
        return rows

    # --- adding and removing a client -------------------------------------------------------------------------------
    # ||g_A||^2 is kept per atom and updated from the cross terms g.x that scoring computes anyway:
    #   joining:  ||g + x||^2 = ||g||^2 + 2 g.x + ||x||^2      (g before the join)
    #   leaving:  ||g - x||^2 = ||g||^2 - 2 (g - x).x - ||x||^2 (g - x after the leave)
    # so neither costs a pass over the (L_j, D) block beyond the update of g itself.
    def add(self, j: int, rows: np.ndarray, cross: np.ndarray | None = None):
        """Put client j's neurons on atom ``rows``; ``cross[l] = g_rows[l] . x_l`` before the update, if known."""
        self.gA[rows] += self.xA[j]
        if cross is None:
            self.gA_sq[rows] = np.einsum("ld,ld->l", self.gA[rows], self.gA[rows])
        else:
            self.gA_sq[rows] += 2.0 * cross + self.xA_sq[j]
        if len(self.B):
            self.gB[rows] += self.xB[j]
            self.PB[rows] += self.wB[j]
        self.m[rows] += 1
        self.assign[j] = rows

    def _remove_stats(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Take client j off its atoms except for ||g_A||^2; return the positions whose atom survives, and those
        atoms."""
        rows = self.assign[j]
        self.assign[j] = None
        self.m[rows] -= 1
        keep = self.m[rows] > 0
        kept, empty = rows[keep], rows[~keep]
        self.gA[kept] -= self.xA[j][keep]
        self.gA[empty] = self.g0A
        self.gA_sq[empty] = self.g0A_sq
        if len(self.B):
            self.gB[kept] -= self.xB[j][keep]
            self.PB[kept] -= self.wB[j]
            self.gB[empty] = self.g0B
            self.PB[empty] = self.P0
        self.free.extend(int(r) for r in empty)
        return np.flatnonzero(keep), kept

    # --- scores -------------------------------------------------------------------------------------------------------
    def _new_atom_scores(self, j: int) -> np.ndarray:
        """(L_j,) score of each of client j's neurons against a new atom (the prior alone)."""
        tau, P0 = self.tau, self.P0
        xA = self.xA[j]
        new = (self.xA_sq[j] + 2.0 * (xA @ self.g0A)) / (P0 + tau) + self.g0A_sq * (1.0 / (P0 + tau) - 1.0 / P0)
        if len(self.B):
            w = self.wB[j]
            new = new + (((self.xB[j] + self.g0B) ** 2) / (P0 + w) - self.g0B ** 2 / P0).sum(axis=1)
        new = new + self.log_new
        if self.marginal:
            new -= len(self.A) * math.log1p(tau / P0)
            if len(self.B):
                new -= np.log1p(self.wB[j] / P0).sum()
        return new

    def scores(self, j: int, cross: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Score matrix of client j (not on any atom) against the active atoms and new ones, and the active rows.

        ``cross``: (L_j, n_rows) products of client j's block-A contributions with every stored atom's g_A.
        """
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        L_j, tau, P0 = self.L[j], self.tau, self.P0
        L = active.size
        n_new = L_j
        if self.max_atoms is not None:
            n_new = min(L_j, max(self.max_atoms - L, 1))
            if L + n_new < L_j:
                raise ValueError(f"max_atoms={self.max_atoms} leaves client {j} ({L_j} neurons) only {L + n_new} "
                                 "atoms to choose from: raise max_atoms")
        S = np.empty((L_j, L + n_new))
        S[:, L:] = self.new_scores[j][:, None]
        if self.new_atom_penalty == "log_k":
            S[:, L:] -= 2.0 * np.log(np.arange(1, n_new + 1))
        if L:
            m = self.m[active]
            P = P0 + m * tau  # block A posterior precision, one per atom
            inv_new = 1.0 / (P + tau)
            atom_term = self.gA_sq[active] * (inv_new - 1.0 / P) + self.pop[m]
            if self.marginal:
                atom_term -= len(self.A) * np.log1p(tau / P)
            ex = S[:, :L]
            np.multiply(cross[:, active] if L < cross.shape[1] else cross, 2.0, out=ex)
            ex += self.xA_sq[j][:, None]
            ex *= inv_new[None, :]
            ex += atom_term[None, :]
            if len(self.B):
                w = self.wB[j]
                gB, PB = self.gB[active], self.PB[active]
                R = 1.0 / (PB + w)
                t1 = (gB ** 2 * (R - 1.0 / PB)).sum(axis=1)
                ex += t1[None, :] + 2.0 * (self.xB[j] @ (gB * R).T) + (self.xB[j] ** 2) @ R.T
                if self.marginal:
                    ex -= np.log1p(w[None, :] / PB).sum(axis=1)[None, :]
        return S, active

    def match(self, j: int, *, rematch: bool = False) -> bool:
        """Assign client j optimally given everyone else (taking it off its atoms first if ``rematch``); return
        whether the partition changed (a client that is new to it always changes it, unless it has no neurons)."""
        if self.L[j] == 0:
            # no neurons, no atoms: the client counts in J (the scores' gamma0/J and m/(J-m)) and nowhere else
            self.assign[j] = np.empty(0, dtype=np.int64)
            self.rematches.append((j, 0, int((self.m[: self.n_rows] > 0).sum())))
            return False
        if rematch:
            previous = self.assign[j]
            positions, kept = self._remove_stats(j)
        cross = self._gram_cross(j) if self.gram is not None else self.xA[j] @ self.gA[: self.n_rows].T
        if rematch:
            self.gA_sq[kept] -= 2.0 * cross[positions, kept] + self.xA_sq[j][positions]
        S, active = self.scores(j, cross)
        L = active.size
        t0 = time.perf_counter()
        rows, cols = linear_sum_assignment(S, maximize=True)
        self.lsa_seconds += time.perf_counter() - t0
        self.rematches.append((j, self.L[j], L))
        target = np.empty(self.L[j], dtype=np.int64)
        target_cross = np.empty(self.L[j])
        is_new = cols >= L
        old_rows, new_rows = rows[~is_new], rows[is_new]
        target[old_rows] = active[cols[~is_new]]
        target_cross[old_rows] = cross[old_rows, target[old_rows]]
        target[new_rows] = self._new_rows(new_rows.size)
        target_cross[new_rows] = self.g0x[j][new_rows]
        self.add(j, target, target_cross)
        if not rematch:
            return True
        # unchanged: the neurons whose atom survived the removal went back to it, and the others opened new atoms
        was_shared = np.zeros(self.L[j], dtype=bool)
        was_shared[positions] = True
        opened = np.zeros(self.L[j], dtype=bool)
        opened[new_rows] = True
        return bool((was_shared == opened).any() or (target[positions] != previous[positions]).any())

    def use_gram(self) -> None:
        """Score through the Gram matrix of all neurons from now on (see :meth:`_gram_cross`)."""
        x = np.concatenate(self.xA)
        self.gram = x @ x.T
        self.g0x_all = np.concatenate(self.g0x)

    def _gram_cross(self, j: int) -> np.ndarray:
        """``x_l . g_i`` for client j's neurons l and every stored atom i, from the Gram matrix: an atom's g is
        g0 plus its members' x, so ``x_l . g_i = x_l . g0 + sum_{u in S_i} x_l . x_u``. One gather of client j's
        (L_j, N) block of the Gram matrix and a sum per atom replace the (L_j, D) x (D, L) product; worth it when
        the layer stays wide (many atoms against few neurons). The sum per atom is a product with the sparse (N, L)
        membership matrix."""
        others = [k for k in range(self.J) if k != j and self.assign[k] is not None]
        if not others:
            return np.repeat(self.g0x[j][:, None], self.n_rows, axis=1)
        members = np.concatenate([np.arange(self.offsets[k], self.offsets[k + 1]) for k in others])
        atoms = np.concatenate([self.assign[k] for k in others])
        membership = csr_matrix((np.ones(members.size), (members, atoms)), shape=(self.gram.shape[0], self.n_rows))
        cross = np.asarray(self.gram[self.offsets[j]:self.offsets[j + 1]] @ membership)
        cross += self.g0x[j][:, None]
        return cross

    def start_from(self, labels: list[np.ndarray]) -> None:
        """Put every client on the atoms of a given assignment (labels from :func:`_validate_labels`; any values,
        compacted here to rows ``0 .. U-1`` in sorted label order)."""
        uniq, flat = np.unique(np.concatenate(labels), return_inverse=True)
        flat = flat.reshape(-1)
        self._grow(uniq.size)
        self.n_rows = uniq.size
        start = 0
        for j, a in enumerate(labels):
            self.add(j, flat[start:start + a.size])
            start += a.size

    # --- the objective ----------------------------------------------------------------------------------------------
    def objective(self) -> float:
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        m = self.m[active]
        P = self.P0 + m * self.tau
        F = float((self.gA_sq[active] / P).sum() - active.size * self.g0A_sq / self.P0)
        if len(self.B):
            gB, PB = self.gB[active], self.PB[active]
            F += float((gB ** 2 / PB).sum() - active.size * (self.g0B ** 2).sum() / self.P0)
        F += active.size * self.log_new + float(self.pop_cum[m].sum())
        if self.marginal:
            F -= float(len(self.A) * np.log(P / self.P0).sum())
            if len(self.B):
                F -= float(np.log(self.PB[active] / self.P0).sum())
        return F

    def result(self, objective: list[float], seconds: float, dtype) -> MatchResult:
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        relabel = np.full(self.n_rows, -1, dtype=np.int64)
        relabel[active] = np.arange(active.size)
        m = self.m[active]
        P = np.empty((active.size, self.D))
        g = np.empty((active.size, self.D))
        P[:, self.A] = (self.P0 + m * self.tau)[:, None]
        g[:, self.A] = self.gA[active]
        if len(self.B):
            P[:, self.B] = self.PB[active]
            g[:, self.B] = self.gB[active]
        return MatchResult(
            global_atoms=torch.as_tensor(g / P, dtype=dtype),
            posterior_precision=torch.as_tensor(P, dtype=dtype),
            assignments=[torch.as_tensor(relabel[a]) for a in self.assign],
            counts=torch.as_tensor(m),
            objective=objective,
            seconds=seconds,
            lsa_seconds=self.lsa_seconds,
            rematches=self.rematches,
        )


def _validate_labels(assignments, sizes: Sequence[int], name: str) -> list[np.ndarray]:
    """J int64 arrays of atom labels, one of length L_j per client, distinct within a client (any values)."""
    J = len(sizes)
    if isinstance(assignments, (str, bytes)) or not isinstance(assignments, (Sequence, Tensor, np.ndarray)):
        raise ValueError(f"{name}: expected one integer array per client ({J}), got {type(assignments).__name__}")
    if len(assignments) != J:
        raise ValueError(f"{name}: expected one integer array per client ({J}), got {len(assignments)} arrays")
    out = []
    for j, a in enumerate(assignments):
        a = a.detach().cpu().numpy() if isinstance(a, Tensor) else np.asarray(a)
        if a.ndim != 1 or a.size != sizes[j]:
            raise ValueError(f"{name}[{j}]: expected {sizes[j]} atom labels (client {j} has L_j = {sizes[j]} "
                             f"neurons), got shape {a.shape}")
        integral = np.issubdtype(a.dtype, np.integer) or (
            np.issubdtype(a.dtype, np.floating) and bool(np.isfinite(a).all() and (a == np.round(a)).all()))
        if a.size and not integral:
            raise ValueError(f"{name}[{j}]: expected integer atom labels, got {a.tolist()}")
        a = a.astype(np.int64)
        if np.unique(a).size != a.size:
            raise ValueError(f"{name}[{j}]: expected atom labels distinct within client {j} (one neuron per atom), "
                             f"got {a.tolist()}")
        out.append(a)
    return out


def _make_matcher(neurons, *, sigma2, sigma0_2, gamma0, mu0, precisions, objective, popularity_factor,
                  popularity_cap, max_atoms, new_atom_penalty):
    arrays = _validate_neurons(neurons)
    D = arrays[0].shape[1]
    sigma2 = check_positive(sigma2, "sigma2")
    sigma0_2 = check_positive(sigma0_2, "sigma0_2")
    gamma0 = check_positive(gamma0, "gamma0")
    popularity_factor = float(popularity_factor)
    if not math.isfinite(popularity_factor) or popularity_factor < 0:
        raise ValueError(f"popularity_factor must be a finite number >= 0, got {popularity_factor}")
    if popularity_cap is not None and (int(popularity_cap) != popularity_cap or popularity_cap < 1):
        raise ValueError(f"popularity_cap must be None or an integer >= 1, got {popularity_cap}")
    if max_atoms is not None and (int(max_atoms) != max_atoms or max_atoms < 1):
        raise ValueError(f"max_atoms must be None or an integer >= 1, got {max_atoms}")
    if objective not in ("map", "marginal"):
        raise ValueError(f"objective must be 'map' or 'marginal', got {objective!r}")
    if new_atom_penalty not in ("none", "log_k"):
        raise ValueError(f"new_atom_penalty must be 'none' or 'log_k', got {new_atom_penalty!r}")
    return _LayerMatcher(
        arrays, _validate_precisions(precisions, [a.shape[0] for a in arrays], D), sigma2=sigma2, sigma0_2=sigma0_2,
        gamma0=gamma0, mu0=_validate_mu0(mu0, D), popularity_factor=popularity_factor,
        popularity_cap=popularity_cap, max_atoms=max_atoms, new_atom_penalty=new_atom_penalty,
        marginal=objective == "marginal")


def match_layer(
    neurons,
    *,
    sigma2: float,
    sigma0_2: float,
    gamma0: float,
    mu0=0.0,
    precisions=None,
    sweeps: int = 5,
    seed: int | None = None,
    objective: Literal["map", "marginal"] = "map",
    popularity_factor: float = 2.0,
    popularity_cap: int | None = None,
    max_atoms: int | None = None,
    new_atom_penalty: Literal["none", "log_k"] = "none",
    stop_at_fixed_point: bool = True,
    cross_products: Literal["auto", "direct", "gram"] = "auto",
    init_assignments=None,
) -> MatchResult:
    """Match J clients' neurons to global atoms by MAP under the Beta-Bernoulli process (PFNM's server step).

    Greedy pass over the clients (largest first) -- or, given ``init_assignments``, that assignment instead -- then
    ``sweeps`` passes in a fresh random order, each removing a client and re-matching it with the Hungarian algorithm
    given all the others. See the module docstring for the objective and the scores.

    Usage::

        >>> from bnpfed.models import sample_federated_layer
        >>> layer = sample_federated_layer(10, 50, seed=0, gamma0=20.0, sigma2=0.01)
        >>> hyper = dict(sigma2=0.01, sigma0_2=1.0, gamma0=20.0, objective="marginal", seed=0)
        >>> result = match_layer(layer.neurons, **hyper)
        >>> result.num_atoms, layer.num_atoms, tuple(result.global_atoms.shape)
        (49, 49, (49, 50))
        >>> result.counts.sort().values.tolist() == layer.counts.sort().values.tolist()
        True
        >>> len(result.objective)                   # after the greedy pass and after each of the 5 sweeps
        6

    A communication round warm-starts from the previous round's assignment (any labels, distinct within a client);
    the sweeps then run from there, and ``objective[0]`` is the objective of that starting point::

        >>> again = match_layer(layer.neurons, init_assignments=result.assignments, sweeps=2, **hyper)
        >>> math.isclose(again.objective[0], result.objective[-1], rel_tol=1e-9)
        True
        >>> all(bool((a == b).all()) for a, b in zip(again.assignments, result.assignments))
        True

    :param neurons: sequence of J arrays or tensors of shape (L_j, D); L_j may differ, D may not. A client may have
        no neurons (shape (0, D), which the Beta-Bernoulli process gives with probability ``exp(-gamma0)``): it still
        counts in J (in ``log(gamma0/J)`` and ``m/(J-m)``) and gets an empty assignment. At least one client must have
        a neuron.
    :param float sigma2: local noise variance.
    :param float sigma0_2: prior variance of the atoms.
    :param float gamma0: IBP mass.
    :param mu0: prior mean of the atoms, scalar or (D,) (PFNM: 0 for weights, 0.1 for bias coordinates).
    :param precisions: optional per-client per-coordinate scales s_j >= 0, shape (J, D) or J vectors (D,); client
        j's noise variance on coordinate d is ``sigma2 / s_jd``. A zero marks a coordinate the client says nothing
        about (PFNM: the output weights of a class the client never saw); each client with neurons needs some
        s_jd > 0 (the row of a client without neurons is never used: any finite values >= 0).
    :param int sweeps: remove-and-rematch passes after the greedy one.
    :param int seed: seed of the sweeps' client order.
    :param str objective: ``"map"`` (published; atoms plugged in at their MAP values) or ``"marginal"`` (atoms
        integrated out; Occam factor included).
    :param float popularity_factor: factor c on the IBP popularity term ``log(m/(J-m))``; 2 makes the objective twice
        the log density (consistent with the Gaussian part); the published code used 1.
    :param int popularity_cap: cap m at this value inside the popularity term (published: 10; default: no cap).
    :param int max_atoms: at most this many atoms in total, at least one new one per client (published: 700).
    :param str new_atom_penalty: ``"log_k"`` subtracts 2 log k from the k-th new atom of a client (published);
        ``"none"`` (default) keeps the scores the exact conditionals of the objective.
    :param bool stop_at_fixed_point: skip the remaining sweeps once a whole sweep changed no client's assignment
        (the state is then a fixed point of every re-match, so the result is the same; ``objective`` repeats its last
        value for the skipped sweeps and ``rematches`` shows how many were run).
    :param str cross_products: how a re-match gets the products of a client's neurons with every atom:
        ``"direct"``, one (L_j, D) x (D, L) matrix product; ``"gram"``, from the (N, N) Gram matrix of all N neurons,
        computed once after the greedy pass (a gather and a sum per atom per re-match); ``"auto"`` (default) takes the
        Gram matrix when the sweeps' products would cost more than it (``sweeps * L > N`` after the greedy pass, a
        wide layer) and it fits in 512 MiB. Same scores up to rounding.
    :param init_assignments: optional starting point replacing the greedy pass: J integer arrays or tensors, the
        j-th of length L_j (empty for a client without neurons), ``init_assignments[j][l]`` the atom of client j's
        l-th neuron. Labels may take any values (they are compacted internally) but must be distinct within a client.
        Default None: the greedy pass. The sweeps only ever raise the objective from there (with ``max_atoms`` off),
        so the result is at least as good as the starting point; ``max_atoms`` limits only the atoms the sweeps open.
    :returns: :class:`MatchResult`.
    """
    t0 = time.perf_counter()
    if cross_products not in ("auto", "direct", "gram"):
        raise ValueError(f"cross_products must be 'auto', 'direct' or 'gram', got {cross_products!r}")
    if int(sweeps) != sweeps or sweeps < 0:
        raise ValueError(f"sweeps must be an integer >= 0, got {sweeps}")
    matcher = _make_matcher(neurons, sigma2=sigma2, sigma0_2=sigma0_2, gamma0=gamma0, mu0=mu0, precisions=precisions,
                            objective=objective, popularity_factor=popularity_factor, popularity_cap=popularity_cap,
                            max_atoms=max_atoms, new_atom_penalty=new_atom_penalty)
    if init_assignments is None:
        for j in np.argsort(-np.array(matcher.L), kind="stable"):
            matcher.match(int(j))
    else:
        matcher.start_from(_validate_labels(init_assignments, matcher.L, "init_assignments"))
    history = [matcher.objective()]
    N, L = int(matcher.offsets[-1]), int((matcher.m[: matcher.n_rows] > 0).sum())
    wide = sweeps > 0 and sweeps * L > N and N * N * 8 <= 512 * 2 ** 20
    if cross_products == "gram" or (cross_products == "auto" and wide):
        matcher.use_gram()
    rng = np.random.default_rng(seed)
    for _ in range(int(sweeps)):
        changed = False
        for j in rng.permutation(matcher.J):
            changed |= matcher.match(int(j), rematch=True)
        history.append(matcher.objective())
        if not changed and stop_at_fixed_point:
            # every client's re-match returned its own assignment: any further sweep, in any order, does the same
            history.extend([history[-1]] * (int(sweeps) + 1 - len(history)))
            break
    dtype = neurons[0].dtype if isinstance(neurons[0], Tensor) else torch.get_default_dtype()
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    return matcher.result(history, time.perf_counter() - t0, dtype)


def assignment_objective(
    neurons,
    assignments,
    *,
    sigma2: float,
    sigma0_2: float,
    gamma0: float,
    mu0=0.0,
    precisions=None,
    objective: Literal["map", "marginal"] = "map",
    popularity_factor: float = 2.0,
    popularity_cap: int | None = None,
) -> float:
    """The objective F (or F_marg) of :func:`match_layer` at a given assignment.

    :param assignments: J integer arrays of length L_j: atom labels, distinct within a client (any labels; empty for
        a client without neurons). The other parameters are those of :func:`match_layer`.
    """
    matcher = _make_matcher(neurons, sigma2=sigma2, sigma0_2=sigma0_2, gamma0=gamma0, mu0=mu0, precisions=precisions,
                            objective=objective, popularity_factor=popularity_factor, popularity_cap=popularity_cap,
                            max_atoms=None, new_atom_penalty="none")
    matcher.start_from(_validate_labels(assignments, matcher.L, "assignments"))
    return matcher.objective()

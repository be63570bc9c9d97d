"""The one layer matcher: per-atom sufficient statistics of a partial assignment under the Beta-Bernoulli model with
per-neuron, per-coordinate noise, the Hungarian re-match of one client, and the full log likelihood of an assignment
(Yurochkin et al., ICML 2019, section 3.2); the driver that alternates sweeps of re-matches with the estimates of the
hyper-parameters is :mod:`bnpfed.matching.driver`.

**The model.** Atoms ``theta_i ~ N(mu0, sigma0_2)`` in R^D, a Beta-Bernoulli process with mass ``gamma0`` choosing
which atoms each of J clients uses, and client j's neuron l observing its atom i on coordinate d with noise variance
``(u_jld + t_d) / s_jd``: ``u_jld >= 0`` a posterior variance the client reports (0 for a point estimate: PFNM's
deterministic networks, a bias the prior keeps deterministic), ``t_d`` the noise the hyper-parameters give
(``sigma2`` of :func:`~bnpfed.matching.layer.match_layer`, where every u is 0; ``tau2`` of
:func:`~bnpfed.matching.bayesian_layer.match_bayesian_layer`), ``s_jd >= 0`` a per-client precision scale
(PFNM's class shares on output coordinates; 0: the client says nothing about coordinate d). The noise precision of
one neuron's coordinate is ``w_jld = s_jd / (u_jld + t_d)``, and an atom with members S_i has

    P_id = 1/sigma0_2 + sum_{(j,l) in S_i} w_jld                   (posterior precision)
    g_id = mu0_d/sigma0_2 + sum_{(j,l) in S_i} w_jld v_jld          (precision-weighted sum)

and posterior mean ``g_i / P_i``; ``P0 = 1/sigma0_2``, ``g0 = mu0/sigma0_2`` are an atom without members.

**Objectives** (m_i clients on atom i, L atoms, c the popularity factor). ``objective="map"`` (the published one:
atoms at their MAP values, normalising constants dropped) and ``"marginal"`` (atoms integrated out, the Gaussian
marginal likelihood; Yurochkin et al., "Statistical Model Aggregation via Parameter Matching", NeurIPS 2019):

    F(Z) = sum_i [ sum_d (g_id^2/P_id - g0_d^2/P0) + 2 log(gamma0/J) + c sum_{k=1}^{m_i-1} log(k/(J-k)) ]
    F_marg(Z) = F(Z) - sum_i sum_d log(P_id / P0)

With the two-parameter IBP's concentration (``concentration``, default 1) ``2 log(gamma0/J)`` is ``2 log(gamma0
conc/(J - 1 + conc))`` and ``log(k/(J-k))`` is ``log(k/(J - 1 + conc - k))`` (:mod:`~bnpfed.matching.ibp`).
The extra Occam factor of F_marg charges every atom for the precision it concentrates; :mod:`~bnpfed.matching.
layer` and :mod:`~bnpfed.matching.bayesian_layer` say which log densities these are. A client without
neurons (the Beta-Bernoulli process gives one with probability exp(-gamma0)) holds no atom and adds nothing to the
sums, but counts in J: it is one of the clients that did not take each atom.

**Scores.** Both objectives decompose over clients: with the others fixed, client j's neuron l scores against atom i
(m_i clients other than j)

    sum_d [(g_id + w_jld v_jld)^2/(P_id + w_jld) - g_id^2/P_id] + c log(m_i/(J - m_i))

(marginal: minus ``sum_d log((P_id + w_jld)/P_id)``), and against a new atom the same with ``(g0, P0)`` and ``2
log(gamma0/J)`` in place of the popularity term: the exact change of F (or F_marg), so
``scipy.optimize.linear_sum_assignment`` solves each client exactly, and a greedy pass followed by sweeps of
remove-and-rematch is coordinate ascent: with the hyper-parameters fixed (and ``max_atoms`` off) the objective never
decreases across sweeps.

**Three kinds of coordinates**, by how ``w_jld`` varies (fixed by the data, whatever the hyper-parameters):

* *shared* (``s_jd = 1`` at every client and ``u_jld = 0`` at every neuron): ``w = 1/t`` for every neuron, so
  ``P_i = P0 + m_i / t`` is one number per atom and the cross terms of all of a client's neurons against all atoms
  are one matrix product ``x_j g^T`` -- or a gather from the Gram matrix of all neurons (:meth:`LayerMatcher.use_gram`)
  -- with ``||g_i||^2`` updated in place as clients leave and join;
* *per client* (``u = 0`` but some ``s_jd != 1``): ``w_jd`` depends on the client only, and the scores are two more
  small products per client;
* *per neuron* (some ``u_jld > 0``): ``P_id + w_jld`` depends on the atom and the neuron, and the (L_j, L) scores are
  broadcast over (L_j, atoms, D) in chunks of at most ``CHUNK_ELEMENTS`` entries (:func:`join_scores`).

**A client's own columns.** After a Flatten a client's units read only the columns of the global channels it holds
(LeNet's fc1: about a tenth of them at J = 25); where every neuron of a client is 0, its products with any atom, its
share of the atom sums and its Gram entries are 0. So a client whose nonzero shared columns are at most
:data:`SPARSE_SHARE` of them is held on those columns alone (:attr:`LayerMatcher.columns_of`), and its products, sums
and Gram blocks are computed there: the same numbers up to rounding.

A re-estimate of the hyper-parameters is O(N D) (N neurons) and rebuilds the per-atom statistics.
:func:`~bnpfed.matching.driver.run_matching` runs the greedy pass (largest client first) or starts from given
labels, then sweeps in a seeded random client order, re-estimating the hyper-parameters after the first assignment
and after every sweep through an *estimator* (:mod:`bnpfed.matching.empirical_bayes`: pooled moments for point
estimates, Paule-Mandel for Bayesian neurons; :class:`~bnpfed.matching.driver.FixedValues` when nothing is
estimated).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from scipy.sparse import csr_matrix

from bnpfed.matching.atom_sums import shared_moments, shared_sums
from bnpfed.matching.ibp import ibp_log_prob, new_atom_term, popularity_terms
from bnpfed.matching.layer_inputs import CompactRows, validate_clients, validate_precisions
from bnpfed.matching.match_result import MatchResult
from bnpfed.matching.memory import check_matching_memory
from bnpfed.matching.scoring import CHUNK_ELEMENTS, best_assignment, join_scores
from bnpfed.validation import check_choice, check_device, check_float

__all__ = [
    "CHUNK_ELEMENTS",
    "LayerMatcher",
    "MatchResult",
    "best_assignment",
    "join_scores",
    "make_matcher",
]

#: The memory budget of the one N x N object the matcher may hold (N all neurons of the layer): the Gram matrix of
#: their shared coordinates (float64) is used only if it fits in this many bytes (1 GiB: N up to 11,585, e.g.
#: J = 100 clients of 100 neurons); beyond it every re-match pays the direct (L_j, D) x (D, L) product. Everything
#: else the matcher keeps is O(N D) (the neurons, their contributions, the atoms' statistics) or O(L_j L) per client.
GRAM_BYTES = 2 ** 30

#: Entries of the storage moved at a time when the result takes its atoms' rows (:meth:`LayerMatcher._take_rows`).
TAKE_BLOCK = 2 ** 24

#: Under empirical Bayes with ``stop="result"``: the sweeps stop once at most this share of the neurons moved in a
#: sweep and no estimate moved by more than :data:`STOP_RTOL` (relative; mu0 by the root mean square of its changes
#: over the coordinates, relative to sqrt(sigma0_2)).
STOP_MOVED = 0.02
STOP_RTOL = 1e-2

#: A client's products, atom sums and Gram entries on the shared coordinates are computed on the columns where some
#: neuron of it is not 0 (:attr:`LayerMatcher.columns_of`) when they are at most this share of the block: after a
#: Flatten a client's units read only the columns of the global channels it holds (LeNet's fc1 at J = 25: about a
#: tenth of them), and where all of its neurons are 0 every product with them is 0.
SPARSE_SHARE = 0.5

#: Under empirical Bayes, the sweeps a matching is expected to run (about what trained MLP and LeNet layers take at
#: a few tens of clients), for the choice of the Gram matrix after the first assignment.
EB_EXPECTED_SWEEPS = 8


def make_matcher(means, variances=None, *, precisions=None, name: str = "neurons", objective: str = "marginal",
                 popularity_factor: float = 2.0, popularity_cap=None, max_atoms=None,
                 new_atom_penalty: str = "none", device=None) -> LayerMatcher:
    """A :class:`LayerMatcher` of validated data and options (see :func:`~bnpfed.matching.layer.match_layer`
    for the options; ``device``: :class:`LayerMatcher`'s)."""
    V, U = validate_clients(means, variances, name=name)
    check_matching_memory([v.shape[0] for v in V], V[0].shape[1], name=name)   # before the matcher allocates
    popularity_factor = check_float(popularity_factor, "popularity_factor", low=0.0)
    if popularity_cap is not None and (int(popularity_cap) != popularity_cap or popularity_cap < 1):
        raise ValueError(f"popularity_cap: expected None or an integer >= 1, got {popularity_cap!r}")
    if max_atoms is not None and (int(max_atoms) != max_atoms or max_atoms < 1):
        raise ValueError(f"max_atoms: expected None or an integer >= 1, got {max_atoms!r}")
    check_choice(objective, ("map", "marginal"), "objective")
    check_choice(new_atom_penalty, ("none", "log_k"), "new_atom_penalty")
    s = validate_precisions(precisions, [v.shape[0] for v in V], V[0].shape[1])
    if device is not None:
        device = torch.device(check_device(str(device) if isinstance(device, torch.device) else device, "device"))
    return LayerMatcher(V, U, s, popularity_factor=popularity_factor, popularity_cap=popularity_cap,
                        max_atoms=max_atoms, new_atom_penalty=new_atom_penalty, marginal=objective == "marginal",
                        device=device)


def new_columns(j: int, L_j: int, L: int, max_atoms: int | None) -> int:
    """How many new atoms client ``j`` (``L_j`` neurons) may open beside the ``L`` atoms in use: all ``L_j`` without
    a cap, else what ``max_atoms`` leaves (at least one), refused when that cannot hold the client's neurons."""
    if max_atoms is None:
        return L_j
    n_new = min(L_j, max(max_atoms - L, 1))
    if L + n_new < L_j:
        raise ValueError(f"max_atoms: expected enough atoms for client {j} ({L_j} neurons), got {max_atoms}, which "
                         f"leaves it {L + n_new}: raise max_atoms")
    return n_new


def _columns(idx: np.ndarray):
    """``idx`` (sorted coordinates) as a slice when it is one run of consecutive coordinates (a column block written
    at memory speed instead of scattered column by column), else itself."""
    if idx.size and int(idx[-1]) - int(idx[0]) == idx.size - 1:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _flat(arrays: list, idx: np.ndarray, D: int) -> np.ndarray:
    """The (N, |idx|) columns ``idx`` of J (L_j, D) arrays (or J :class:`CompactRows`), stacked in client order."""
    if isinstance(arrays[0], CompactRows):
        return np.ascontiguousarray(np.concatenate([a.on(idx) for a in arrays]))
    if idx.size == D:
        return np.ascontiguousarray(np.concatenate(arrays))
    cols = _columns(idx)
    return np.ascontiguousarray(np.concatenate([a[:, cols] for a in arrays]))


# --------------------------------------------------------------------------------------------------------------------
# the state of a matching


class LayerMatcher:
    """Per-atom statistics of a partial assignment, and the per-client scoring and (re-)matching on them.

    The data (means ``V``, variances ``U`` or None, precision scales ``s`` or None) are set once and split into the
    shared, per-client and per-neuron coordinates (module docstring); :meth:`set_hyperparameters` sets or changes the
    per-coordinate noise, prior variance and mean and the IBP mass, and rebuilds the statistics of the current
    assignment under them.

    ``device`` (None: numpy on the CPU): a torch device where the shared coordinates' atom sums ``g_F`` and the
    neurons' ``x_F`` live, so that the (L_j, D) x (D, L) cross products, the largest work of a wide layer, run
    there; scores, assignment problems (the LSA) and every other statistic stay on the CPU, and only the (L_j, L)
    products and the norms cross over. The Gram matrix is not used there (the direct products are what a GPU does
    well). The same numbers up to rounding."""

    def __init__(self, V, U, s, *, popularity_factor: float, popularity_cap, max_atoms, new_atom_penalty: str,
                 marginal: bool, device: torch.device | None = None):
        self.device = device
        self.J = J = len(V)
        self.D = D = V[0].shape[1]
        self.L = [v.shape[0] for v in V]
        self.offsets = np.concatenate([[0], np.cumsum(self.L)]).astype(np.int64)
        self.scales = s
        plain = np.ones(D, dtype=bool) if s is None else (s == 1.0).all(axis=0)
        exact = np.ones(D, dtype=bool) if U is None else ~np.any([(u > 0).any(axis=0) for u in U], axis=0)
        self.F = np.flatnonzero(plain & exact)   # shared
        self.C = np.flatnonzero(~plain & exact)  # per client
        self.N = np.flatnonzero(~exact)          # per neuron
        own = [v.own_columns(self.F) if isinstance(v, CompactRows) else None for v in V]
        #: whether the neurons' shared block is held per client on its own columns only (every client given as
        #: :class:`CompactRows`, using at most :data:`SPARSE_SHARE` of it: no (N, |F|) array); else all made dense
        self.compact = bool(self.F.size) and all(o is not None and o[0].size <= SPARSE_SHARE * self.F.size
                                                 for o in own)
        V = V if self.compact else [v.dense() if isinstance(v, CompactRows) else v for v in V]
        # every kind's (N, k) data of all neurons (clients in order), and each client's rows of it (views)
        self.vC_all, self.vN_all = (_flat(V, idx, D) for idx in (self.C, self.N))
        self.vF_all = None if self.compact else _flat(V, self.F, D)
        self.uN_all = _flat(U, self.N, D) if U is not None else None
        self.vF = [None] * J if self.compact else self.client_rows(self.vF_all)
        self.vC, self.vN = (self.client_rows(a) for a in (self.vC_all, self.vN_all))
        self.uN = self.client_rows(self.uN_all) if U is not None else [None] * J
        #: per client, the shared-block columns where some neuron of it is not 0, when they are few enough
        #: (:data:`SPARSE_SHARE`; None: all of them)
        if self.compact:
            self.columns_of, self.vF_compact = (list(x) for x in zip(*own))
        else:
            self.columns_of = [c if c.size <= SPARSE_SHARE * self.F.size else None
                               for c in (np.flatnonzero((v != 0).any(axis=0)) for v in self.vF)]
            self.vF_compact = [None if c is None else np.ascontiguousarray(v[:, c]) for v, c in zip(self.vF,
                                                                                                      self.columns_of)]
        #: whether some client uses most of the shared columns (then the (N, |F|) contributions are kept whole)
        self.dense_clients = any(c is None for c in self.columns_of)
        ones = np.ones(D)
        self.sC = [(s[j] if s is not None else ones)[self.C] for j in range(J)]
        self.sN = [(s[j] if s is not None else ones)[self.N] for j in range(J)]
        self.gram: np.ndarray | None = None  # (N, N) products x_u . x_v of all neurons' shared coordinates, if used
        self.shared_moments_: tuple | None = None  # the neurons' sums on the shared block (atom_sums.shared_moments)
        self.gram_tau: float | None = None  # the shared-coordinate precision when the Gram matrix was computed
        self.marginal = marginal
        self.popularity_factor, self.popularity_cap = float(popularity_factor), popularity_cap
        self._set_concentration(1.0)
        self.max_atoms = max_atoms
        self.new_atom_penalty = new_atom_penalty
        self.assign: list[np.ndarray | None] = [None] * J
        #: called after every client's (re-)match of a pass (a progress bar's update; :class:`~bnpfed.matching.
        #: driver.PassProgress`), or None
        self.tick = None
        self.lsa_seconds = 0.0
        self.rematches: list[tuple[int, int, int]] = []
        self.moved = 0
        self.hyper: tuple | None = None
        self.tau = self.g0F = self.inv_noise_C = self.P0C = self.g0C = None  # set by set_hyperparameters
        self.m: np.ndarray | None = None  # atoms' member counts, and the storage's capacity (set by reset)

    def _set_concentration(self, c: float) -> None:
        """The popularity terms at the IBP's concentration c (:mod:`~bnpfed.matching.ibp`)."""
        self.concentration = float(c)
        J = self.J
        self.pop = popularity_terms(J, c, self.popularity_factor, self.popularity_cap)  # joining an atom of m others
        self.pop_cum = np.zeros(J + 1)
        self.pop_cum[2:] = np.cumsum(self.pop[1:J])  # pop_cum[m] = sum_{k=1}^{m-1} pop[k]

    def client_rows(self, flat: np.ndarray) -> list[np.ndarray]:
        """Client j's rows (``L_j`` of them, views) of an (N, k) array of all neurons in client order."""
        return np.split(flat, self.offsets[1:-1])

    # where g_F and x_F live: numpy arrays, or torch tensors on ``device``
    def _there(self, a):
        return a if self.device is None else torch.as_tensor(a, device=self.device)

    def _here(self, a) -> np.ndarray:
        return a if self.device is None else a.cpu().numpy()

    def _at(self, rows, cols):
        """The index of ``g_F``'s storage rows ``rows`` (an index array or a slice, where ``g_F`` lives) on block
        columns ``cols`` (all of them: None)."""
        if cols is None or isinstance(rows, slice):
            return rows if cols is None else (rows, cols)
        return np.ix_(rows, cols) if self.device is None else (rows[:, None], cols)

    def _own(self, j: int):
        """Client j's contributions ``x_F`` where ``g_F`` lives and the block columns they are on: its own columns
        (:attr:`columns_of`) when it has few, else all of them (None)."""
        cols = self.columns_of[j]
        return (self.xF_there[j], None) if cols is None else (self.xF_compact[j], self._there(cols))

    def _shift(self, j: int, rows: np.ndarray, sign: float, keep=None) -> None:
        """``g_F[rows] += sign * x_F`` of client j's neurons (those of ``keep``, a mask, if given), on its own
        columns when it has few (:attr:`columns_of`)."""
        x, cols = self._own(j)
        if keep is not None:
            x = x[self._there(keep)]
        self.gF[self._at(self._there(rows), cols)] += sign * x

    def _norms(self, a) -> np.ndarray:
        """(rows,) squared norms of the rows of ``a`` (numpy or on the device), on the CPU."""
        return np.einsum("ld,ld->l", a, a) if self.device is None else self._here((a * a).sum(dim=1))

    def columns(self, coords) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Every neuron's (N, k) means, posterior variances (None: 0 on every coordinate) and precision scales
        (None: 1 on every coordinate) on the coordinates ``coords`` (sorted): the matcher's own arrays when they are
        one kind's (no copy), else gathered. A compact matcher (:attr:`compact`) has no (N, |F|) array of its shared
        block: asked for shared coordinates it builds one (what the estimators avoid:
        :mod:`~bnpfed.matching.atom_sums`)."""
        coords = np.asarray(coords)
        vF_all = self.vF_all
        if vF_all is None and np.isin(coords, self.F).any():
            vF_all = np.zeros((int(self.offsets[-1]), self.F.size))
            for j, (x, cols) in enumerate(zip(self.vF_compact, self.columns_of)):
                vF_all[self.offsets[j]:self.offsets[j + 1], cols] = x
        scales = None
        if self.scales is not None and not (self.scales[:, coords] == 1.0).all():
            scales = np.repeat(self.scales[:, coords], self.L, axis=0)
        for idx, v, u in ((self.F, vF_all, None), (self.C, self.vC_all, None), (self.N, self.vN_all, self.uN_all)):
            if np.array_equal(coords, idx):
                return v, u, scales
        N = int(self.offsets[-1])
        v, u = np.empty((N, coords.size)), np.zeros((N, coords.size)) if self.N.size else None
        for idx, vk, uk in ((self.F, vF_all, None), (self.C, self.vC_all, None), (self.N, self.vN_all, self.uN_all)):
            here = np.isin(coords, idx)
            v[:, here] = vk[:, np.searchsorted(idx, coords[here])]
            if uk is not None:
                u[:, here] = uk[:, np.searchsorted(idx, coords[here])]
        return v, (u if u is not None and (u > 0).any() else None), scales

    # --- hyper-parameters -------------------------------------------------------------------------------------------
    def set_hyperparameters(self, *, noise: np.ndarray, prior: np.ndarray, gamma0: float, mu0: np.ndarray,
                            concentration: float = 1.0) -> None:
        """Score with these values from now on: ``noise`` (D,) the per-coordinate noise t_d, ``prior`` (D,) the prior
        variance sigma0_2_d, ``mu0`` (D,) the prior mean, ``gamma0`` and ``concentration`` the IBP's mass and c. The
        per-neuron contributions are recomputed and the per-atom statistics of the current assignment follow
        (:meth:`_rescale`, or rebuilt when some neuron has a posterior variance); nothing happens if the values are
        unchanged (a new concentration changes only the popularity and new-atom terms)."""
        if float(concentration) != self.concentration:
            self._set_concentration(concentration)
            if self.hyper is not None:
                self.log_new = 2.0 * new_atom_term(self.J, self.gamma0, self.concentration)
                self.new_scores = [self._new_atom_scores(j) for j in range(self.J)]
        key = (noise.tobytes(), prior.tobytes(), float(gamma0), mu0.tobytes())
        if key == self.hyper:
            return
        F, C, N = self.F, self.C, self.N
        assigned = self.hyper is not None and all(a is not None for a in self.assign)
        old = (self.tau, self.g0F, self.inv_noise_C, self.P0C, self.g0C) if assigned and not N.size else None
        self.hyper = key
        if F.size and (np.ptp(noise[F]) or np.ptp(prior[F])):
            raise ValueError("noise, prior: expected one value on the shared coordinates (every scale 1, no "
                             "posterior variance), got several")
        self.tau = tau = 1.0 / noise[F[0]] if F.size else 1.0   # shared-coordinate noise precision
        self.P0 = P0 = 1.0 / prior[F[0]] if F.size else 1.0
        self.g0F = mu0[F] * P0
        self.g0F_there = self._there(self.g0F)
        self.g0F_sq = float(self.g0F @ self.g0F)
        dense = self.dense_clients
        if old is not None and self.F.size:  # x = tau v: scaled in place, with its squared norms
            r = tau / old[0]
            if dense:
                self.xF_all *= r
                if self.device is not None:
                    self.xF_there_all *= r
            for x in self.xF_compact:
                if x is not None:
                    x *= r
            self.xF_sq_all *= r * r
        else:
            # the (N, |F|) contributions are kept only while some client uses most of the columns (each client
            # with few is held on its own columns alone, and a rescale then never passes over the whole block)
            compact = [None if v is None else v * tau for v in self.vF_compact]
            if dense:
                x_all = self.vF_all * tau
                self.xF_sq_all = np.einsum("nd,nd->n", x_all, x_all)
                self.xF_all, self.xF = x_all, self.client_rows(x_all)
            else:
                self.xF_sq_all = np.concatenate([np.einsum("nd,nd->n", x, x) for x in compact])
                self.xF_all, self.xF = None, [None] * self.J
            self.xF_sq = self.client_rows(self.xF_sq_all)
            self.xF_compact = [None if x is None else self._there(x) for x in compact]
            if self.device is not None and dense:   # its copy on the device, and each client's rows of it (views)
                self.xF_there_all = self._there(self.xF_all.copy())
                self.xF_there = list(torch.split(self.xF_there_all, self.L))
            else:
                self.xF_there = self.xF
        # cross term of each neuron with an empty (prior-only) atom
        self.g0x = [self._here(x @ (self.g0F_there if cols is None else self.g0F_there[cols]))
                    for x, cols in map(self._own, range(self.J))]
        self.P0C = 1.0 / prior[C]
        self.g0C = mu0[C] * self.P0C
        self.inv_noise_C = inv_noise = 1.0 / noise[C]
        self.wC = [self.sC[j] * inv_noise for j in range(self.J)]
        self.xC = [v * w for v, w in zip(self.vC, self.wC)]
        self.P0N = 1.0 / prior[N]
        self.g0N = mu0[N] * self.P0N
        self.wN = [self.sN[j][None, :] / ((u if u is not None else 0.0) + noise[N][None, :])
                   for j, u in enumerate(self.uN)]
        self.xN = [w * v for w, v in zip(self.wN, self.vN)]
        self.log_new = 2.0 * new_atom_term(self.J, gamma0, self.concentration)
        self.gamma0 = float(gamma0)
        self.new_scores = [self._new_atom_scores(j) for j in range(self.J)]
        if old is not None:
            self._rescale(*old)
            return
        labels = None if any(a is None for a in self.assign) else list(self.assign)
        self.reset()
        if labels is not None:
            self.start_from(labels)

    def _rescale(self, tau, g0F, inv_noise_C, P0C, g0C) -> None:
        """The per-atom statistics under new values, from those under the old ones (arguments): without posterior
        variances every member's contribution on a coordinate is its value times the coordinate's noise precision
        (times the client's scale), so ``g = g0 + r (g_old - g0_old)`` and ``P = P0 + r (P_old - P0_old)`` with r the
        ratio of the noise precisions -- O(atoms x D) instead of a rebuild from the N neurons. Free rows hold the
        prior, as they must."""
        n = self.n_rows
        free = self.m[:n] == 0
        if self.F.size:
            r = self.tau / tau
            gF = self.gF[:n]
            gF *= r
            gF += self._there(self.g0F - r * g0F)
            self.gF_sq[:n] = self._norms(gF)
            gF[self._there(free)], self.gF_sq[:n][free] = self.g0F_there, self.g0F_sq
        if self.C.size:
            ratio = self.inv_noise_C / inv_noise_C
            for name, prior_old, prior in (("gC", g0C, self.g0C), ("PC", P0C, self.P0C)):
                a = getattr(self, name)[:n]
                a *= ratio
                a += prior - ratio * prior_old
                a[free] = prior

    def reset(self) -> None:
        """Empty storage (no client on any atom); rows [0, n_rows) used, some of them free (m == 0, the prior's
        statistics); the capacity beyond n_rows is undefined until :meth:`_new_rows` takes it."""
        # every atom holds a neuron and a row is appended only when none is free, so N rows always suffice: taken at
        # once (untouched memory costs nothing until a row is used), no copy as the layer widens; the capacity is kept
        cap = max(int(self.offsets[-1]), 64, self.m.shape[0] if self.m is not None else 0)
        self.gC, self.PC, self.gN, self.PN = (np.empty((cap, k)) for k in (
            self.C.size, self.C.size, self.N.size, self.N.size))
        self.gF = np.empty((cap, self.F.size)) if self.device is None else torch.empty(
            (cap, self.F.size), dtype=torch.float64, device=self.device)
        self.gF_sq = np.empty(cap)
        self.m = np.zeros(cap, dtype=np.int64)
        self.n_rows = 0
        self.free: list[int] = []
        self.assign = [None] * self.J

    def unassign(self) -> None:
        """Take every client off the atoms and forget the values scored with: the next
        :meth:`set_hyperparameters` rebuilds the statistics from nothing (a fresh start)."""
        self.assign = [None] * self.J
        self.hyper = None

    def _grow(self, needed: int):
        cap = self.m.shape[0]
        if needed <= cap:
            return
        extra = max(needed, 2 * cap) - cap
        for name in ("gC", "PC", "gN", "PN"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.empty((extra, a.shape[1]))]))
        self.gF = np.concatenate([self.gF, np.empty((extra, self.F.size))]) if self.device is None else torch.cat(
            [self.gF, self.gF.new_empty((extra, self.F.size))])
        self.gF_sq = np.concatenate([self.gF_sq, np.empty(extra)])
        self.m = np.concatenate([self.m, np.zeros(extra, dtype=np.int64)])

    def _new_rows(self, k: int) -> np.ndarray:
        take = self.free[max(len(self.free) - k, 0):] if k else []
        del self.free[len(self.free) - len(take):]
        rest = k - len(take)
        self._grow(self.n_rows + rest)
        fresh = slice(self.n_rows, self.n_rows + rest)   # storage beyond n_rows is undefined until taken
        self.gF[fresh], self.gF_sq[fresh], self.m[fresh] = self.g0F_there, self.g0F_sq, 0
        self.gC[fresh], self.PC[fresh], self.gN[fresh], self.PN[fresh] = self.g0C, self.P0C, self.g0N, self.P0N
        rows = np.array(list(take) + list(range(self.n_rows, self.n_rows + rest)), dtype=np.int64)
        self.n_rows += rest
        return rows

    # --- adding and removing a client -------------------------------------------------------------------------------
    # ||g_F||^2 is kept per atom and updated from the cross terms g.x that scoring computes anyway:
    #   joining:  ||g + x||^2 = ||g||^2 + 2 g.x + ||x||^2      (g before the join)
    #   leaving:  ||g - x||^2 = ||g||^2 - 2 (g - x).x - ||x||^2 (g - x after the leave)
    # so neither costs a pass over the (L_j, D) block beyond the update of g itself.
    def add(self, j: int, rows: np.ndarray, cross: np.ndarray | None = None, *, norms: bool = True):
        """Put client j's neurons on atom ``rows``; ``cross[l] = g_rows[l] . x_l`` before the update, if known
        (``norms=False``: leave ||g_F||^2 to the caller)."""
        self._shift(j, rows, 1.0)
        if cross is None:
            if norms:
                self.gF_sq[rows] = self._norms(self.gF[self._there(rows)])
        else:
            self.gF_sq[rows] += 2.0 * cross + self.xF_sq[j]
        if self.C.size:
            self.gC[rows] += self.xC[j]
            self.PC[rows] += self.wC[j]
        if self.N.size:
            self.gN[rows] += self.xN[j]
            self.PN[rows] += self.wN[j]
        self.m[rows] += 1
        self.assign[j] = rows

    def _remove(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Take client j off its atoms except for ||g_F||^2; return the positions whose atom survives, and those
        atoms."""
        rows = self.assign[j]
        self.assign[j] = None
        self.m[rows] -= 1
        keep = self.m[rows] > 0
        kept, empty = rows[keep], rows[~keep]
        self._shift(j, kept, -1.0, keep)
        self.gF[self._there(empty)] = self.g0F_there
        self.gF_sq[empty] = self.g0F_sq
        if self.C.size:
            self.gC[kept] -= self.xC[j][keep]
            self.PC[kept] -= self.wC[j]
            self.gC[empty], self.PC[empty] = self.g0C, self.P0C
        if self.N.size:
            self.gN[kept] -= self.xN[j][keep]
            self.PN[kept] -= self.wN[j][keep]
            self.gN[empty], self.PN[empty] = self.g0N, self.P0N
        self.free.extend(int(r) for r in empty)
        return np.flatnonzero(keep), kept

    # --- scores -----------------------------------------------------------------------------------------------------
    def _new_atom_scores(self, j: int) -> np.ndarray:
        """(L_j,) score of each of client j's neurons against a new atom (the prior alone)."""
        tau, P0 = self.tau, self.P0
        new = (self.xF_sq[j] + 2.0 * self.g0x[j]) / (P0 + tau) + self.g0F_sq * (1.0 / (P0 + tau) - 1.0 / P0)
        if self.C.size:
            w = self.wC[j]
            new = new + (((self.xC[j] + self.g0C) ** 2) / (self.P0C + w) - self.g0C ** 2 / self.P0C).sum(axis=1)
        if self.N.size:
            new = new + join_scores(self.xN[j], self.wN[j], self.g0N[None], self.P0N[None], self.marginal)[:, 0]
        new = new + self.log_new
        if self.marginal:
            new -= self.F.size * math.log1p(tau / P0)
            if self.C.size:
                new -= np.log1p(self.wC[j] / self.P0C).sum()
        return new

    def scores(self, j: int, cross: np.ndarray | None, active: np.ndarray) -> np.ndarray:
        """Score matrix of client j (not on any atom) against the atoms ``active`` (rows of the storage, sorted)
        and new ones.

        ``cross``: (L_j, L) products of client j's shared-coordinate contributions with the active atoms' g (None
        without shared coordinates). Every term but the cross one is a product of a per-neuron and a per-atom
        factor (the shared coordinates' ``||x_l||^2 / (P_i + tau)``, the per-atom constants, the per-client
        coordinates' two products), so they are one low-rank matrix product; the cross term is one more pass.
        """
        L_j, tau, P0 = self.L[j], self.tau, self.P0
        L = active.size
        n_new = new_columns(j, L_j, L, self.max_atoms)
        S = np.empty((L_j, L + n_new))
        S[:, L:] = self.new_scores[j][:, None]
        if self.new_atom_penalty == "log_k":
            S[:, L:] -= 2.0 * np.log(np.arange(1, n_new + 1))
        if not L:
            return S
        m = self.m[active]
        atom_term = self.pop[m].astype(float)
        left, right = [np.ones((L_j, 1))], []   # per-neuron and per-atom factors of the low-rank part
        if self.F.size:
            P = P0 + m * tau  # shared-coordinate posterior precision, one per atom
            inv_new = 1.0 / (P + tau)
            atom_term += self.gF_sq[active] * (inv_new - 1.0 / P)
            if self.marginal:
                atom_term -= self.F.size * np.log1p(tau / P)
            left.append(self.xF_sq[j][:, None])
            right.append(inv_new[:, None])
        if self.C.size:
            w = self.wC[j]
            gC, PC = self.gC[active], self.PC[active]
            R = 1.0 / (PC + w)
            atom_term += (gC ** 2 * (R - 1.0 / PC)).sum(axis=1)
            if self.marginal:
                atom_term -= np.log1p(w[None, :] / PC).sum(axis=1)
            left += [2.0 * self.xC[j], self.xC[j] ** 2]
            right += [gC * R, R]
        right.insert(0, atom_term[:, None])
        ex = S[:, :L]
        np.matmul(np.hstack(left), np.hstack(right).T, out=ex)
        if self.F.size:
            ex += cross * (2.0 * inv_new)[None, :]
        if self.N.size:
            ex += join_scores(self.xN[j], self.wN[j], self.gN[active], self.PN[active], self.marginal)
        return S

    def _choose(self, j: int, rematch: bool):
        """Client j's best assignment given everyone else (taken off its atoms first if ``rematch``): the LSA's
        ``(rows, cols)`` over the scores against the ``active`` atoms (then new ones), the cross products, and (when
        ``rematch``) its previous atoms, the positions whose atom survived its removal and those atoms."""
        previous = positions = kept = None
        if rematch:
            previous = self.assign[j]
            positions, kept = self._remove(j)
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        cross = None
        if self.F.size:
            cross = self._cross(j, active)
            if rematch:
                self.gF_sq[kept] -= 2.0 * cross[positions, np.searchsorted(active, kept)] + self.xF_sq[j][positions]
        S = self.scores(j, cross, active)
        t0 = time.perf_counter()
        rows, cols = best_assignment(S, active.size, prune=self.max_atoms is None and self.new_atom_penalty == "none")
        self.lsa_seconds += time.perf_counter() - t0
        self.rematches.append((j, self.L[j], active.size))
        return rows, cols, active, cross, previous, positions, kept

    def match(self, j: int, *, rematch: bool = False) -> bool:
        """Assign client j optimally given everyone else (taking it off its atoms first if ``rematch``); return
        whether the partition changed (a client that is new to it always changes it, unless it has no neurons)."""
        if self.L[j] == 0:
            # no neurons, no atoms: the client counts in J (the scores' gamma0/J and m/(J-m)) and nowhere else
            self.assign[j] = np.empty(0, dtype=np.int64)
            self.rematches.append((j, 0, int((self.m[: self.n_rows] > 0).sum())))
            return False
        rows, cols, active, cross, previous, positions, _ = self._choose(j, rematch)
        L = active.size
        target = np.empty(self.L[j], dtype=np.int64)
        target_cross = np.empty(self.L[j])
        is_new = cols >= L
        old_rows, new_rows = rows[~is_new], rows[is_new]
        target[old_rows] = active[cols[~is_new]]
        target_cross[old_rows] = cross[old_rows, cols[~is_new]] if cross is not None else 0.0
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
        moved = was_shared == opened
        moved[positions] |= target[positions] != previous[positions]
        self.moved += int(moved.sum())
        return bool(moved.any())

    def propose(self, j: int) -> np.ndarray:
        """Client j's best assignment given everyone else, the state left as it was: per neuron the storage row of
        the atom it would join, -1 for a new atom (client j must be on its atoms)."""
        if self.L[j] == 0:
            return np.empty(0, dtype=np.int64)
        rows, cols, active, _, previous, positions, _ = self._choose(j, rematch=True)
        target = np.full(self.L[j], -1, dtype=np.int64)
        joins = cols < active.size
        target[rows[joins]] = active[cols[joins]]
        emptied = self.L[j] - positions.size   # the rows its removal freed (appended last) are its own again
        del self.free[len(self.free) - emptied:]
        self.add(j, previous)
        return target

    def greedy(self) -> None:
        """The first assignment: every client matched in turn given those before it, largest client first."""
        for j in np.argsort(-np.array(self.L), kind="stable"):
            self.match(int(j))
            if self.tick is not None:
                self.tick()

    def sweep(self, rng: np.random.Generator) -> bool:
        """Re-match every client once, in a random order; return whether any assignment changed (``moved``: how many
        neurons did not stay with the others they were with)."""
        self.moved = 0
        changed = False
        for j in rng.permutation(self.J):
            changed |= self.match(int(j), rematch=True)
            if self.tick is not None:
                self.tick()
        return changed

    def jacobi_sweep(self) -> bool:
        """Re-match every client against the assignment at the start of the sweep (frozen: :meth:`propose`), then
        move all of them at once, each client's new neurons opening atoms of their own; return whether the partition
        changed (``moved``: the neurons whose atom's members changed). Unlike :meth:`sweep` (Gauss-Seidel: each
        client sees the moves of those before it) the clients' re-matches are independent of each other, so they
        could run in parallel, but the step is no coordinate ascent: clients moving at once can undo each other
        (the docs' benchmark page on scale: on trained layers Jacobi sweeps do not settle)."""
        a = np.concatenate(self.assign)   # propose leaves every assignment as it was
        new, fresh = [], self.n_rows
        for j in range(self.J):
            target = self.propose(j)
            if self.tick is not None:
                self.tick()
            opened = target < 0
            target[opened] = fresh + np.arange(opened.sum())
            fresh += int(opened.sum())
            new.append(target)
        # a neuron stayed with the others it was with iff its old atom went whole into its new atom and nobody joined
        b = np.concatenate(new)
        _, pair, together = np.unique(np.stack([a, b]), axis=1, return_inverse=True, return_counts=True)
        pair = pair.reshape(-1)
        same = (together[pair] == np.bincount(a)[a]) & (together[pair] == np.bincount(b)[b])
        self.moved = int((~same).sum())
        self.reset()
        self.start_from(new)
        return self.moved > 0

    def use_gram(self) -> None:
        """Score the shared coordinates through the Gram matrix of all neurons from now on (:meth:`_gram_cross`)."""
        if self.device is not None:
            raise ValueError(f"cross_products: expected 'auto' or 'direct' with device={str(self.device)!r} (the "
                             "Gram matrix is kept on the CPU; on a device the direct products are the fast path), got "
                             "'gram'")
        if self.gram is None and self.F.size:
            self.gram = self._gram()
            self.gram_tau = self.tau

    def _gram(self) -> np.ndarray:
        """``x_u . x_v`` of all neurons' shared coordinates: one product, or, when some client has few columns
        (:attr:`columns_of`), client block by client block on the columns both clients use."""
        if all(c is None for c in self.columns_of):
            return self.xF_all @ self.xF_all.T
        N, every = int(self.offsets[-1]), np.arange(self.F.size)
        x, cols = zip(*map(self._own, range(self.J)))   # on the CPU: the Gram matrix is not used on a device
        cols = [every if c is None else c for c in cols]
        gram = np.zeros((N, N))
        for j in range(self.J):
            rj = slice(self.offsets[j], self.offsets[j + 1])
            for k in range(j, self.J):
                common, a, b = np.intersect1d(cols[j], cols[k], assume_unique=True, return_indices=True)
                if not common.size or not self.L[j] or not self.L[k]:
                    continue
                block = x[j][:, a] @ x[k][:, b].T
                rk = slice(self.offsets[k], self.offsets[k + 1])
                gram[rj, rk] = block
                gram[rk, rj] = block.T
        return gram

    def gram_fits(self) -> bool:
        """Whether the Gram matrix of all neurons fits in :data:`GRAM_BYTES` (never on a device: not used there)."""
        N = int(self.offsets[-1])
        return self.device is None and N * N * 8 <= GRAM_BYTES

    def _cross(self, j: int, active: np.ndarray) -> np.ndarray:
        """(L_j, L) products ``x_l . g_i`` of client j's neurons l with the active atoms i (sorted storage rows):
        from the Gram matrix when it is used, else one matrix product with the active atoms' rows (gathered: the
        storage keeps the rows atoms freed, which after a wide first pass can be most of them)."""
        if self.gram is not None:
            return self._gram_cross(j, active)
        n = self.n_rows
        x, cols = self._own(j)   # on client j's own columns when it has few (the others' products with it are 0)
        if active.size == n:
            return self._here(x @ self.gF[self._at(slice(0, n), cols)].T)
        if 2 * active.size >= n:   # the gather costs about what the product does: the product with every stored
            stored = x @ self.gF[self._at(slice(0, n), cols)].T   # row, the freed ones' columns dropped, is cheaper
            return self._here(stored[:, self._there(active)])
        return self._here(x @ self.gF[self._at(self._there(active), cols)].T)

    def _gram_cross(self, j: int, active: np.ndarray) -> np.ndarray:
        """``x_l . g_i`` for client j's neurons l and the active atoms i, from the Gram matrix: an atom's g is
        g0 plus its members' x, so ``x_l . g_i = x_l . g0 + sum_{u in S_i} x_l . x_u``. One gather of client j's
        (L_j, N) block of the Gram matrix and a sum per atom replace the (L_j, D) x (D, L) product; worth it when
        the layer stays wide (many atoms against few neurons). The sum per atom is a product with the sparse (N, L)
        membership matrix. The Gram matrix holds ``x = tau v`` at the precision it was computed with; when it changed
        since (empirical Bayes), the membership and the row carry the ratio of the precisions."""
        others = [k for k in range(self.J) if k != j and self.assign[k] is not None]
        if not others:
            return np.repeat(self.g0x[j][:, None], active.size, axis=1)
        members = np.concatenate([np.arange(self.offsets[k], self.offsets[k + 1]) for k in others])
        column = np.empty(self.n_rows, dtype=np.int64)
        column[active] = np.arange(active.size)
        atoms = column[np.concatenate([self.assign[k] for k in others])]
        ratio = self.tau / self.gram_tau  # exactly 1 while the precision is that of the Gram matrix
        membership = csr_matrix((np.full(members.size, ratio), (members, atoms)),
                                shape=(self.gram.shape[0], active.size))
        cross = np.asarray(self.gram[self.offsets[j]:self.offsets[j + 1]] @ membership)
        if ratio != 1.0:
            cross *= ratio
        cross += self.g0x[j][:, None]
        return cross

    def start_from(self, labels: list[np.ndarray]) -> None:
        """Put every client on the atoms of a given assignment (labels from
        :func:`~bnpfed.matching.layer_inputs.validate_labels`; any values, compacted here to rows ``0 .. U-1`` in
        sorted label order): every atom's statistics as one product of the
        (U, N) membership matrix with the neurons' contributions."""
        uniq, flat = np.unique(np.concatenate(labels), return_inverse=True)
        flat = flat.reshape(-1)
        U, n = uniq.size, flat.size
        self._grow(U)
        self.n_rows = U
        membership = csr_matrix((np.ones(n), (flat, np.arange(n))), shape=(U, n))
        if self.F.size:
            g = self.g0F + (membership @ self.xF_all if self.xF_all is not None else
                            self.tau * shared_sums(self, self.client_rows(flat), U))
            self.gF[:U] = self._there(g)
            self.gF_sq[:U] = np.einsum("ld,ld->l", g, g)
        for kind, g0, P0, x, w in (("C", self.g0C, self.P0C, self.xC, self.wC), ("N", self.g0N, self.P0N, self.xN,
                                                                             self.wN)):
            if getattr(self, kind).size:
                every = np.concatenate([np.broadcast_to(wj, xj.shape) for wj, xj in zip(w, x)])
                getattr(self, "g" + kind)[:U] = g0 + membership @ np.concatenate(x)
                getattr(self, "P" + kind)[:U] = P0 + membership @ every
        self.m[:U] = np.bincount(flat, minlength=U)
        self.assign = [a.copy() for a in self.client_rows(flat)]

    def labels(self) -> tuple[list[np.ndarray], int]:
        """The current assignment as compact labels 0 .. L-1 (in storage order), and L."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        relabel = np.full(self.n_rows, -1, dtype=np.int64)
        relabel[active] = np.arange(active.size)
        return [relabel[a] for a in self.assign], int(active.size)

    # --- the objective ----------------------------------------------------------------------------------------------
    def objective(self) -> float:
        """The objective of the current assignment (the marginal one, or the MAP one: see the matchers)."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        m = self.m[active]
        P = self.P0 + m * self.tau
        F = float((self.gF_sq[active] / P).sum() - active.size * self.g0F_sq / self.P0) if self.F.size else 0.0
        for g, Pk, g0, P0 in ((self.gC, self.PC, self.g0C, self.P0C), (self.gN, self.PN, self.g0N, self.P0N)):
            if g.shape[1]:
                F += float((g[active] ** 2 / Pk[active]).sum() - active.size * (g0 ** 2 / P0).sum())
                if self.marginal:
                    F -= float(np.log(Pk[active] / P0).sum())
        F += active.size * self.log_new + float(self.pop_cum[m].sum())
        if self.marginal and self.F.size:
            F -= float(self.F.size * np.log(P / self.P0).sum())
        return F

    def log_likelihood(self) -> float:
        """``log p(Z, V | hyper-parameters)`` of the current assignment: the Beta-Bernoulli configuration density
        ``gamma0^L exp(-gamma0 H_J) prod_i (m_i - 1)! (J - m_i)! / J!`` times every atom's members' Gaussian marginal
        on every coordinate (atoms integrated out: covariance ``sigma0_2 11^T + diag(1/w)`` over the members with
        ``w > 0``), with every normalising constant -- so that, unlike the objectives, it compares assignments
        reached at *different* hyper-parameters (the two starts of :func:`~bnpfed.matching.driver.run_matching`).
        Per atom and coordinate
        the Gaussian part is ``-(1/2) [sum_members (log(2 pi / w) + w v^2) + log(P/P0) + g0^2/P0 - g^2/P]``; with a
        concentration c the IBP part is :func:`~bnpfed.matching.ibp.ibp_log_prob`'s."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        m = self.m[active]
        J = self.J
        if self.concentration == 1.0:
            ll = active.size * math.log(self.gamma0) - self.gamma0 * float(np.sum(1.0 / np.arange(
                1, J + 1)))
            ll += float(sum(math.lgamma(k) + math.lgamma(J - k + 1) - math.lgamma(J + 1) for k in m))
        else:
            ll = ibp_log_prob(m, J, self.gamma0, self.concentration)
        gauss = 0.0
        if self.F.size:
            P = self.P0 + m * self.tau
            gauss += float(self.F.size * np.log(P / self.P0).sum() + active.size * self.g0F_sq / self.P0
                           - (self.gF_sq[active] / P).sum())
            gauss += self.F.size * int(self.offsets[-1]) * math.log(2 * math.pi / self.tau) + float(
                self.tau * shared_moments(self)[1])
        for g, Pk, g0, P0, ws, vs in ((self.gC, self.PC, self.g0C, self.P0C, self.wC, self.vC),
                                      (self.gN, self.PN, self.g0N, self.P0N, self.wN, self.vN)):
            if not g.shape[1]:
                continue
            gauss += float(np.log(Pk[active] / P0).sum() + active.size * (g0 ** 2 / P0).sum()
                           - (g[active] ** 2 / Pk[active]).sum())
            for w, v in zip(ws, vs):
                w = np.broadcast_to(w, v.shape)
                seen = w > 0
                gauss += float(np.log(2 * math.pi / w[seen]).sum() + (w * v ** 2)[seen].sum())
        return ll - 0.5 * gauss

    def _take_rows(self, rows: np.ndarray) -> np.ndarray:
        """The ``g_F`` rows ``rows`` (increasing) of the storage on the CPU. In numpy, moved to its first ``rows.size``
        rows in place, a block at a time, and the storage cut to them: the result's atoms with no (L, |F|) copy beside
        the storage (gigabytes for LeNet's fc1 at hundreds of clients); the storage is handed over with them and the
        matcher left unassigned (the next :meth:`set_hyperparameters` takes new storage, as after :meth:`unassign`).
        On a torch device, copied to the CPU (the storage stays)."""
        if self.device is not None:
            return self._here(self.gF[self._there(rows)])
        gF, self.gF = self.gF, None
        self.unassign()
        step = max(1, TAKE_BLOCK // max(gF.shape[1], 1))
        for i in range(0, rows.size, step):   # rows[k] >= k: a block's sources lie at or after every row it writes
            block = rows[i:i + step]
            gF[i:i + block.size] = gF[block]
        try:   # the rows beyond them given back (realloc: in place where the allocator can)
            gF.resize((rows.size, gF.shape[1]))
        except ValueError:   # the storage is referenced elsewhere (numpy's reference check): copy the rows out
            gF = gF[: rows.size].copy()
        return gF

    def result(self, objective: list[float], seconds: float, dtype, **extra) -> MatchResult:
        """The :class:`MatchResult` of the current assignment, the end of a run: in numpy the atoms' storage is handed
        over to it and the matcher left unassigned (:meth:`_take_rows`; the next :meth:`set_hyperparameters` starts
        afresh)."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        labels, _ = self.labels()
        P_F = self.P0 + self.m[active] * self.tau   # one precision per atom on the shared coordinates
        if self.F.size == self.D:   # every coordinate shared: one gather and one division, no (L, D) precision copy
            g = self._take_rows(active)
            g /= P_F[:, None]
            P = torch.as_tensor(P_F, dtype=dtype)[:, None].expand(active.size, self.D)   # no (L, D) copy
        else:
            F = _columns(self.F)
            g = np.empty((active.size, self.D))   # the storage's shared block handed over first, then the precisions
            g[:, F] = self._take_rows(active)
            P = np.empty((active.size, self.D))
            P[:, F] = P_F[:, None]
            for idx, gk, Pk in ((self.C, self.gC, self.PC), (self.N, self.gN, self.PN)):
                idx = _columns(idx)
                P[:, idx], g[:, idx] = Pk[active], gk[active]
            np.divide(g, P, out=g)
        return MatchResult(global_atoms=torch.as_tensor(g, dtype=dtype),
                           posterior_precision=torch.as_tensor(P, dtype=dtype),
                           assignments=[torch.as_tensor(a) for a in labels], counts=torch.as_tensor(self.m[active]),
                           objective=objective, seconds=seconds, lsa_seconds=self.lsa_seconds,
                           rematches=self.rematches, **extra)

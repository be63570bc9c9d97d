"""Matching of one federated layer: the Hungarian step of PFNM, with its hyper-parameters fixed or estimated.

Yurochkin et al., "Bayesian Nonparametric Federated Learning of Neural Networks", ICML 2019, section 3.2. Given J
clients' neurons (vectors in R^D), find the assignment of every local neuron to a global atom (distinct atoms within a
client) that maximises the posterior of the Beta-Bernoulli model of :mod:`bnpfed.models.beta_bernoulli`. The
hyper-parameters (mu0, sigma0_2, sigma2, gamma0) are either given (``hyperparameters="fixed"``, the published way) or
estimated from the clients' neurons alone, alternating with the assignment (``"empirical-bayes"``, the default; see
*Empirical Bayes* below).

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
decreases across sweeps (with ``max_atoms`` off and the hyper-parameters held fixed).

Reference constants (the published code, ``REFERENCE_CONSTANTS``): fixed hyper-parameters and the MAP objective;
popularity factor c = 1; popularity counts capped at 10 (``min(m, 10)`` inside the log; the cap keeps the ascent
exact, the objective then sums the capped terms); at most 700 atoms in total (a client may open
``min(L_j, max(700 - L, 1))`` new ones); and ``- 2 log k`` on the k-th new atom of a client. That last term is the
1/K! of the IBP's left-ordered form for a binary matrix; atoms here carry distinct parameters, so the orderings it
divides out are distinct configurations, and no joint density has those scores as its conditionals. It is available
(``new_atom_penalty="log_k"``) but off by default. Every sweep then still reports F, which the ``log_k`` penalty may
lower slightly.

**Empirical Bayes** (``hyperparameters="empirical-bayes"``; SPAHM, Yurochkin et al. 2019, estimates them the same
way). Each of mu0, sigma0_2, sigma2, gamma0 that is given is held fixed; the others are estimated, alternating
assignment sweeps (at the current values) with moment estimates from the current assignment. The objective is
F_marg: the atoms are integrated out, so it is a likelihood of sigma0_2 and sigma2 (F keeps the atoms at their MAP
values and drops ``L D log(2 pi sigma0_2)``, so it is not; and its over-splitting at the true noise would feed back
into the estimates). Per coordinate d and atom i, over its members j:

    W_id = sum_j s_jd,    xbar_id = sum_j s_jd v_jd / W_id,    n_id = #{j : s_jd > 0},    L_d = #{i : W_id > 0}.

Given the assignment and the atom, ``v_jd ~ N(theta_id, sigma2 / s_jd)``, so ``xbar_id ~ N(theta_id, sigma2 / W_id)``
and, as ``sum_j s_jd Var(v_jd) = n_id sigma2`` and ``W_id Var(xbar_id) = sigma2``,

    E[ sum_j s_jd (v_jd - xbar_id)^2 ] = (n_id - 1) sigma2.                                          (within)

Over the atoms, ``theta_id ~ N(mu0_d, sigma0_2)``, so the xbar_id are independent ``N(mu0_d, sigma0_2 + sigma2 /
W_id)`` and ``E[sum_i (xbar_id - mean_i xbar_id)^2] = (L_d - 1)/L_d * sum_i (sigma0_2 + sigma2 / W_id)``. The moment
estimates solve these identities for the unknowns:

* ``sigma2 = sum_{i,d} sum_j s_jd (v_jd - xbar_id)^2 / sum_{i,d} (n_id - 1)``, the pooled within-atom variance (one
  value for all coordinates: per-coordinate variances, tried on MNIST layers, were no more accurate at a given width,
  and the pixels a client rarely sees, whose weights sit near 0 and agree closely, pulled the matching apart);
* ``mu0_d = (1/L_d) sum_i xbar_id``, the mean of the atom means;
* ``sigma0_2 = [sum_d sum_i (xbar_id - mu0_d)^2 - sigma2 sum_d (k_d / L_d) sum_i 1/W_id] / sum_d k_d``, the
  between-atom variance less what the noise alone contributes to it, pooled over coordinates, with ``k_d = L_d - 1``
  where mu0_d is estimated (Bessel's correction: mu0_d comes from the same atoms, and 1/L_d would be biased low by
  (L_d - 1)/L_d) and ``k_d = L_d`` where mu0_d is given; floored at ``SIGMA0_2_FLOOR * sigma2``;
* ``gamma0 = L / H_J``: the IBP gives a configuration of L atoms the probability ``gamma0^L exp(-gamma0 H_J)`` times
  terms free of gamma0 (:func:`~bnpfed.models.beta_bernoulli.log_joint`), and ``d/dgamma0 [L log gamma0 - gamma0
  H_J] = L / gamma0 - H_J`` vanishes there: the maximum-likelihood value (L is Poisson(gamma0 H_J)).

With every s_jd = 1 (``S_id`` the sum of the members' v_d, ``Q_id`` of their squares, m_i members) these are
``sigma2 = sum_{i,d} (Q_id - S_id^2 / m_i) / (D (sum_i m_i - L))``, ``mu0_d = (1/L) sum_i S_id / m_i`` and
``sigma0_2 = mean_d [(1/(L-1)) sum_i (S_id/m_i - mu0_d)^2] - sigma2 (1/L) sum_i 1/m_i`` (1/L where mu0 is given).

Coordinates with per-client precision scales (block B below; PFNM's output weights, scaled by class shares) are
on a scale of their own -- trained output weights spread about ten times as much as input weights -- so a layer that
has both kinds gets a second pair, ``sigma2_scaled`` and ``sigma0_2_scaled``, for them (sigma2 and sigma0_2 come from
the coordinates with every scale 1, where the formulas above apply as written; a given sigma2 or sigma0_2 fixes both
of its pair). sigma2_scaled is the within-atom formula on those coordinates. For sigma0_2_scaled the unweighted
formula would be useless: W_id is a sum of scales that may be far below 1, so an atom mean's noise sigma2 / W_id can
be far above sigma0_2 and the estimate the difference of two large numbers. It takes the weighted moment estimate of
random-effects meta-analysis instead (DerSimonian & Laird 1986): with ``w_i = W_id / sigma2_scaled`` over the atoms
with data on d, ``Q_d = sum_i w_i (xbar_id - xbar_wd)^2`` (xbar_wd the w-weighted mean) has expectation ``(L_d - 1)
+ sigma0_2_scaled (sum_i w_i - sum_i w_i^2 / sum_i w_i)``, so ``sigma0_2_scaled = sum_d (Q_d - (L_d - 1)) / sum_d
(sum_i w_i - sum_i w_i^2 / sum_i w_i)`` (about a given mu0_d: ``Q_d`` about it, ``L_d`` and ``sum_i w_i``): an atom
whose mean is mostly noise gets little weight. (With equal W_id it is the unweighted formula.) A layer with no
coordinate of all scales 1 estimates sigma2 and sigma0_2 this way.

One sigma2 serves every client. A noise variance per client (sigma2_j, as the scale sigma2 / sigma2_j on client j's
precision row, so that a client with little data counts for less) was measured and not kept: on MNIST (784-100-10,
J = 10, Dirichlet(0.5), local models trained on the first 50 000 training images, scored on the last 10 000) it
reached 0.9533 / 0.9586 / 0.9371 against 0.9556 / 0.9599 / 0.9388 with shared noise (seeds 0-2), 0.9590 against
0.9594 on the test set (5 seeds), no gain on IID partitions either, at about twice the matching time.

Degenerate cases. No atom with two members (every neuron alone): sigma2 is not estimable and keeps its previous value.
Fewer than two atoms with data on every coordinate (one atom, with mu0 estimated): sigma0_2 keeps its previous value.
A coordinate on which every client has precision 0 carries no data and is skipped (mu0 there keeps its starting
value). A client without neurons counts in J (in H_J) and nowhere else. Class shares on the output coordinates enter
as the s_jd, and those coordinates get their own variances (above). Each case is recorded in ``MatchResult.notes``.
sigma2 is floored at ``SIGMA2_FLOOR`` times the pooled variance of the neurons (when every atom's members agree
exactly).

The iteration starts from ``start`` or, for what it does not give, from the pooled moments of all the neurons: mu0_d
their mean on coordinate d, ``sigma2 = EB_START_NOISE_SHARE * T`` and ``sigma0_2 = (1 - EB_START_NOISE_SHARE) * T``
with T their pooled variance (``Var(v_d) = sigma0_2 + sigma2`` under the model; the scaled pair likewise from the
scaled coordinates), and gamma0 the mean number of neurons per client (under the IBP every client uses gamma0 atoms
on average). The alternation may have several fixed points, and the start chooses among them. On layers drawn from
the model the small-noise start and the even split (``sigma2 = sigma0_2 = T / 2``) both lead to the truth. On the
layers of independently trained networks they do not, and the small-noise start reaches the fixed point of higher
marginal likelihood, the quantity empirical Bayes maximises. There a few neurons -- units that never activate, their
weights only shrunk by weight decay -- agree across clients within a tenth of the spread of the others, while a
trained neuron's best counterpart at another client is hardly closer than a random one (MNIST 784-100-10, J = 10:
Hungarian-matched pairs of trained neurons 0.087 per coordinate apart, random pairs 0.111, pairs of never-active
ones below 0.01). From the small noise the estimate is the spread of the agreeing neurons and the trained ones stay
apart; from the even split the first pass merges trained neurons, their spread (about 7 times larger) becomes
sigma2, and the iteration stays there, 2.5 to 3.5 x 10^4 nats lower in log marginal likelihood (three IID
partitions; under Dirichlet(0.5) both starts reach the same fixed point). If the first pass from the small noise
leaves every neuron alone (sigma2 not estimable: nothing agrees that closely), it is redone from the even split
(noted). It stops when a sweep changed no assignment and no estimate moved by more than ``EB_RTOL`` (relative; mu0
relative to sqrt(sigma0_2)), or after ``sweeps`` sweeps (``MatchResult.converged`` False). With the estimates held
fixed a sweep never lowers F_marg; re-estimating moves F_marg itself, so ``objective`` need not be monotone across
sweeps.

Implementation. Coordinates on which every client has precision scale 1 (all of them unless ``precisions`` is given;
in PFNM all but the output-layer ones) form block A, where ``P_i = P0 + m_i / sigma2`` is one number per atom: the
cross terms of all of a client's neurons against all atoms are one matrix product ``V_j g_A^T``, and the per-atom
statistics (g, m, ||g_A||^2) are updated in place when a client leaves or joins. The remaining coordinates (block B)
keep a dense per-coordinate precision and cost two more, small, products. A re-estimate is O(N D) (N neurons) and
rebuilds those statistics from the current assignment.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from torch import Tensor

from bnpfed.validation import check_choice, check_int, check_positive

__all__ = [
    "MatchResult",
    "match_layer",
    "assignment_objective",
    "average_atoms",
    "averaging_weights",
    "REFERENCE_CONSTANTS",
    "SIGMA0_2_FLOOR",
    "SIGMA2_FLOOR",
    "EB_RTOL",
    "EB_START_NOISE_SHARE",
]

#: The constants of the published PFNM code (IBM/probabilistic-federated-neural-matching, ``matching/pfnm.py``):
#: hyper-parameters given (not estimated), its MAP objective, popularity term without the factor 2, popularity counts
#: capped at 10, at most 700 global atoms, and -2 log k on the k-th new atom of a client. Pass as
#: ``match_layer(..., sigma2=..., sigma0_2=..., gamma0=..., **REFERENCE_CONSTANTS)`` to reproduce it.
REFERENCE_CONSTANTS = dict(hyperparameters="fixed", objective="map", popularity_factor=1.0, popularity_cap=10,
                           max_atoms=700, new_atom_penalty="log_k")

#: Empirical Bayes: the smallest sigma0_2 / sigma2 an estimate may take. Below it the atoms would be
#: indistinguishable under the noise and the matcher would merge everything; a between-atom variance below what the
#: noise alone explains says as much, and the floor keeps the prior proper (scale-free, as it is relative to sigma2).
SIGMA0_2_FLOOR = 1e-2

#: Empirical Bayes: the smallest sigma2 an estimate may take, relative to the pooled variance of all the neurons
#: (reached only when the members of every atom agree exactly).
SIGMA2_FLOOR = 1e-10

#: Empirical Bayes: the alternation has converged when a sweep changed no assignment and no estimate moved by more
#: than this, relative (mu0 relative to sqrt(sigma0_2), as it may be 0).
EB_RTOL = 1e-6

#: Empirical Bayes: the data-driven start splits the pooled variance T of the neurons as sigma2 = this * T and
#: sigma0_2 = (1 - this) * T (so that sigma2 + sigma0_2 = T, the variance the model gives a neuron), on the side of
#: splitting: the first assignment then merges only neurons far closer than a typical pair. From the even split (1/2)
#: the first pass of a layer of trained networks merges unrelated neurons, whose spread then sets the noise estimate:
#: a fixed point of far lower marginal likelihood (module docstring, *Empirical Bayes*).
EB_START_NOISE_SHARE = 0.1

_NAMES = ("mu0", "sigma0_2", "sigma2", "gamma0")


@dataclass
class MatchResult:
    """Result of :func:`match_layer`.

    :param Tensor global_atoms: (L, D) posterior means ``g_i / P_i`` given the assignment (at the final
        hyper-parameters).
    :param Tensor posterior_precision: (L, D) posterior precisions ``P_i``.
    :param list assignments: J long tensors of length L_j with values in [0, L), distinct within a client (empty
        for a client without neurons).
    :param Tensor counts: (L,) number of clients on each atom (m_i).
    :param list objective: the objective after the greedy pass (or at ``init_assignments``) and after every sweep,
        each at the hyper-parameters that pass used (the starting values for the first). With fixed hyper-parameters
        a sweep skipped at a fixed point repeats the last value (``sweeps + 1`` entries).
    :param float seconds: wall time of the matching.
    :param float lsa_seconds: part of ``seconds`` spent inside ``linear_sum_assignment``.
    :param list rematches: one ``(client, L_j, L)`` per client (re-)matching, L the atoms it was scored against.
    :param dict hyperparameters: the final values, estimated or given: ``"mu0"`` a (D,) tensor, ``"sigma0_2"``,
        ``"sigma2"``, ``"gamma0"`` floats; under empirical Bayes, for a layer with coordinates of per-client
        precision scales (PFNM's output weights) beside coordinates of scale 1, also ``"sigma0_2_scaled"`` and
        ``"sigma2_scaled"``, the variances on the former (module docstring).
    :param list hyperparameter_history: the values (dicts as ``hyperparameters``) after the first assignment and
        after every sweep; the last entry is ``hyperparameters``. With fixed hyper-parameters every entry holds the
        given values (as many as ``objective``).
    :param bool converged: empirical Bayes: whether a sweep changed no assignment and moved no estimate (by more than
        ``EB_RTOL``) before the sweep limit; always True with fixed hyper-parameters.
    :param tuple estimated: names of the estimated hyper-parameters, in the order ``("mu0", "sigma0_2", "sigma2",
        "gamma0", "sigma0_2_scaled", "sigma2_scaled")``; ``()`` with fixed ones. ``"mu0"`` is listed when any
        coordinate of it was estimated.
    :param list notes: what the estimation had to fall back on (see the module docstring's degenerate cases), and
        whether it stopped at the sweep limit; empty with fixed hyper-parameters.
    :param int sweeps_run: sweeps actually run after the first assignment.
    """

    global_atoms: Tensor
    posterior_precision: Tensor
    assignments: list
    counts: Tensor
    objective: list
    seconds: float = 0.0
    lsa_seconds: float = 0.0
    rematches: list = field(default_factory=list, repr=False)
    hyperparameters: dict = field(default_factory=dict)
    hyperparameter_history: list = field(default_factory=list, repr=False)
    converged: bool = True
    estimated: tuple = ()
    notes: list = field(default_factory=list)
    sweeps_run: int = 0

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


def _validate_mu0(mu0, D: int, *, estimable: bool = False) -> np.ndarray:
    """(D,) prior mean; with ``estimable`` NaN entries mark coordinates whose mean is to be estimated."""
    m = _to_numpy(mu0, "mu0")
    if m.ndim == 0:
        m = np.full(D, float(m))
    if m.shape != (D,):
        raise ValueError(f"mu0 must be a scalar or have shape ({D},), got {m.shape}")
    bad = np.isinf(m) if estimable else ~np.isfinite(m)
    if bad.any():
        raise ValueError("mu0 contains inf" if estimable else "mu0 contains NaN or inf")
    return m


def _validate_start(start, given: Mapping[str, object], D: int) -> dict:
    """Starting values of the estimated hyper-parameters: a dict with some of mu0, sigma0_2, sigma2, gamma0 (and
    their ``_scaled`` variances), none of them given."""
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
            raise ValueError(f"start[{name!r}]: {base} is given (held fixed), so it has no starting value; pass it "
                             f"in one place")
        if name == "mu0":
            out[name] = _validate_mu0(value, D)
        else:
            out[name] = check_positive(value, f"start[{name!r}]")
    return out


# --------------------------------------------------------------------------------------------------------------------
# the state of a matching: per-atom sufficient statistics, updated in place


class _LayerMatcher:
    """Per-atom statistics of a partial assignment, and the per-client scoring / rematching on them.

    The data (neurons, precision scales, the block split) are set once; :meth:`set_hyperparameters` sets or changes
    mu0, sigma0_2, sigma2, gamma0 (and block B's variances), and rebuilds the statistics of the current assignment
    under them."""

    def __init__(self, neurons, precisions, *, popularity_factor, popularity_cap, max_atoms, new_atom_penalty,
                 marginal):
        self.J = J = len(neurons)
        self.D = D = neurons[0].shape[1]
        self.precisions = precisions
        if precisions is None:
            A = np.arange(D)
        else:
            A = np.flatnonzero((precisions == 1.0).all(axis=0))
        B = np.setdiff1d(np.arange(D), A)
        self.A, self.B = A, B
        self.vA = [v if not len(B) else np.ascontiguousarray(v[:, A]) for v in neurons]
        self.vB = [np.ascontiguousarray(v[:, B]) for v in neurons]
        self.sB = [precisions[j, B] if precisions is not None else np.ones(len(B)) for j in range(J)]
        self.L = [v.shape[0] for v in neurons]
        self.offsets = np.concatenate([[0], np.cumsum(self.L)]).astype(np.int64)
        self.gram: np.ndarray | None = None  # (N, N) products x_u . x_v of all neurons' block-A parts, when used
        self.gram_tau: float | None = None  # the block-A precision when the Gram matrix was computed
        self.marginal = marginal
        self.c = float(popularity_factor)
        # popularity score of joining an atom held by m other clients, and its cumulative sum over an atom's life
        m = np.arange(J + 1, dtype=np.float64)
        mc = np.minimum(m, popularity_cap) if popularity_cap is not None else m
        with np.errstate(divide="ignore"):
            self.pop = self.c * (np.log(mc) - np.log(J - mc))  # pop[m], m = 1 .. J-1 used
        self.pop_cum = np.zeros(J + 1)
        self.pop_cum[2:] = np.cumsum(self.pop[1:J])  # pop_cum[m] = sum_{k=1}^{m-1} pop[k]
        self.max_atoms = max_atoms
        self.new_atom_penalty = new_atom_penalty
        self.assign: list[np.ndarray | None] = [None] * J
        self.lsa_seconds = 0.0
        self.rematches: list[tuple[int, int, int]] = []
        self.hyper: tuple | None = None

    # --- hyper-parameters -------------------------------------------------------------------------------------------
    def set_hyperparameters(self, *, sigma2: float, sigma0_2: float, gamma0: float, mu0: np.ndarray,
                            sigma2_scaled: float | None = None, sigma0_2_scaled: float | None = None) -> None:
        """Score with these values from now on: the per-client contributions are recomputed and the per-atom
        statistics rebuilt from the current assignment (O(N D)); nothing happens if the values are unchanged.
        ``sigma2_scaled``, ``sigma0_2_scaled``: the variances on block B (default sigma2, sigma0_2)."""
        sigma2_scaled = sigma2 if sigma2_scaled is None else sigma2_scaled
        sigma0_2_scaled = sigma0_2 if sigma0_2_scaled is None else sigma0_2_scaled
        key = (float(sigma2), float(sigma0_2), float(gamma0), mu0.tobytes(), float(sigma2_scaled),
               float(sigma0_2_scaled))
        if key == self.hyper:
            return
        self.hyper = key
        J, A = self.J, self.A
        self.tau = tau = 1.0 / sigma2  # block-A noise precision
        self.P0 = P0 = 1.0 / sigma0_2
        self.P0B = 1.0 / sigma0_2_scaled
        self.g0A, self.g0B = (mu0 * P0)[A].copy(), (mu0 * self.P0B)[self.B].copy()
        self.g0A_sq = float(self.g0A @ self.g0A)
        # per-client natural-parameter contributions x = w * v (w = s / sigma2) and precisions w on block B
        self.xA = [np.ascontiguousarray(v * tau) for v in self.vA]
        self.xA_sq = [np.einsum("ld,ld->l", x, x) for x in self.xA]
        self.g0x = [x @ self.g0A for x in self.xA]  # cross term of each neuron with an empty (prior-only) atom
        tau_scaled = 1.0 / sigma2_scaled
        self.wB = [self.sB[j] * tau_scaled for j in range(J)]
        self.xB = [np.ascontiguousarray(v * self.wB[j]) for j, v in enumerate(self.vB)]
        self.log_new = 2.0 * math.log(gamma0 / J)
        self.new_scores = [self._new_atom_scores(j) for j in range(J)]
        labels = None if any(a is None for a in self.assign) else list(self.assign)
        self._reset_storage()
        if labels is not None:
            self.start_from(labels)

    def _reset_storage(self) -> None:
        # storage for atoms: rows [0, n_rows) used, some of them free (m == 0)
        cap = max(2 * max(self.L), 64)
        self.gA = np.tile(self.g0A, (cap, 1))
        self.gB = np.tile(self.g0B, (cap, 1))
        self.PB = np.full((cap, len(self.B)), self.P0B)
        self.gA_sq = np.full(cap, self.g0A_sq)
        self.m = np.zeros(cap, dtype=np.int64)
        self.n_rows = 0
        self.free: list[int] = []
        self.assign = [None] * self.J

    # --- storage ----------------------------------------------------------------------------------------------------
    def _grow(self, needed: int):
        cap = self.m.shape[0]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        extra = new_cap - cap
        self.gA = np.vstack([self.gA, np.tile(self.g0A, (extra, 1))])
        self.gB = np.vstack([self.gB, np.tile(self.g0B, (extra, 1))])
        self.PB = np.vstack([self.PB, np.full((extra, len(self.B)), self.P0B)])
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
    def add(self, j: int, rows: np.ndarray, cross: np.ndarray | None = None, *, norms: bool = True):
        """Put client j's neurons on atom ``rows``; ``cross[l] = g_rows[l] . x_l`` before the update, if known
        (``norms=False``: leave ||g_A||^2 to the caller)."""
        self.gA[rows] += self.xA[j]
        if cross is None:
            if norms:
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
            self.PB[empty] = self.P0B
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
            P0B = self.P0B
            new = new + (((self.xB[j] + self.g0B) ** 2) / (P0B + w) - self.g0B ** 2 / P0B).sum(axis=1)
        new = new + self.log_new
        if self.marginal:
            new -= len(self.A) * math.log1p(tau / P0)
            if len(self.B):
                new -= np.log1p(self.wB[j] / self.P0B).sum()
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

    def sweep(self, rng: np.random.Generator) -> bool:
        """Re-match every client once, in a random order; return whether any assignment changed."""
        changed = False
        for j in rng.permutation(self.J):
            changed |= self.match(int(j), rematch=True)
        return changed

    def use_gram(self) -> None:
        """Score through the Gram matrix of all neurons from now on (see :meth:`_gram_cross`)."""
        if self.gram is None:
            x = np.concatenate(self.xA)
            self.gram = x @ x.T
            self.gram_tau = self.tau

    def _gram_cross(self, j: int) -> np.ndarray:
        """``x_l . g_i`` for client j's neurons l and every stored atom i, from the Gram matrix: an atom's g is
        g0 plus its members' x, so ``x_l . g_i = x_l . g0 + sum_{u in S_i} x_l . x_u``. One gather of client j's
        (L_j, N) block of the Gram matrix and a sum per atom replace the (L_j, D) x (D, L) product; worth it when
        the layer stays wide (many atoms against few neurons). The sum per atom is a product with the sparse (N, L)
        membership matrix. The Gram matrix holds ``x = tau v`` at the precision it was computed with; when it changed
        since (empirical Bayes), the membership and the row carry the ratio of the precisions."""
        others = [k for k in range(self.J) if k != j and self.assign[k] is not None]
        if not others:
            return np.repeat(self.g0x[j][:, None], self.n_rows, axis=1)
        members = np.concatenate([np.arange(self.offsets[k], self.offsets[k + 1]) for k in others])
        atoms = np.concatenate([self.assign[k] for k in others])
        ratio = self.tau / self.gram_tau  # exactly 1 while the precision is that of the Gram matrix
        membership = csr_matrix((np.full(members.size, ratio), (members, atoms)),
                                shape=(self.gram.shape[0], self.n_rows))
        cross = np.asarray(self.gram[self.offsets[j]:self.offsets[j + 1]] @ membership)
        if ratio != 1.0:
            cross *= ratio
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
            self.add(j, flat[start:start + a.size], norms=False)
            start += a.size
        self.gA_sq[: uniq.size] = np.einsum("ld,ld->l", self.gA[: uniq.size], self.gA[: uniq.size])

    def labels(self) -> list[np.ndarray]:
        """The current assignment as compact labels 0 .. L-1 (in storage order), and L."""
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        relabel = np.full(self.n_rows, -1, dtype=np.int64)
        relabel[active] = np.arange(active.size)
        return [relabel[a] for a in self.assign], int(active.size)

    # --- the objective ----------------------------------------------------------------------------------------------
    def objective(self) -> float:
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        m = self.m[active]
        P = self.P0 + m * self.tau
        F = float((self.gA_sq[active] / P).sum() - active.size * self.g0A_sq / self.P0)
        if len(self.B):
            gB, PB = self.gB[active], self.PB[active]
            F += float((gB ** 2 / PB).sum() - active.size * (self.g0B ** 2).sum() / self.P0B)
        F += active.size * self.log_new + float(self.pop_cum[m].sum())
        if self.marginal:
            F -= float(len(self.A) * np.log(P / self.P0).sum())
            if len(self.B):
                F -= float(np.log(self.PB[active] / self.P0B).sum())
        return F

    def result(self, objective: list[float], seconds: float, dtype, **extra) -> MatchResult:
        active = np.flatnonzero(self.m[: self.n_rows] > 0)
        labels, _ = self.labels()
        P = np.empty((active.size, self.D))
        g = np.empty((active.size, self.D))
        P[:, self.A] = (self.P0 + self.m[active] * self.tau)[:, None]
        g[:, self.A] = self.gA[active]
        if len(self.B):
            P[:, self.B] = self.PB[active]
            g[:, self.B] = self.gB[active]
        return MatchResult(
            global_atoms=torch.as_tensor(g / P, dtype=dtype),
            posterior_precision=torch.as_tensor(P, dtype=dtype),
            assignments=[torch.as_tensor(a) for a in labels],
            counts=torch.as_tensor(self.m[active]),
            objective=objective,
            seconds=seconds,
            lsa_seconds=self.lsa_seconds,
            rematches=self.rematches,
            **extra,
        )


# --------------------------------------------------------------------------------------------------------------------
# empirical Bayes: moment estimates of the hyper-parameters from an assignment


def _harmonic(J: int) -> float:
    return float(np.sum(1.0 / np.arange(1, J + 1)))


class _EmpiricalBayes:
    """Starting values and moment estimates (module docstring, *Empirical Bayes*) of the hyper-parameters that are
    not given; ``values`` dicts hold ``mu0`` ((D,) array), ``sigma0_2``, ``sigma2``, ``gamma0`` and
    ``sigma0_2_scaled``, ``sigma2_scaled`` (block B's variances; equal to sigma0_2, sigma2 unless the layer has both
    blocks)."""

    def __init__(self, matcher: _LayerMatcher, given: Mapping[str, float], mu0: np.ndarray, mu0_free: np.ndarray,
                 start: Mapping[str, object]):
        self.mt = mt = matcher
        self.given = dict(given)
        self.mu0_free = mu0_free
        self.mu0_given = mu0
        self.notes: list[str] = []
        J, A, B = mt.J, mt.A, mt.B
        # pooled moments of all the neurons (entries with s_jd > 0): the data-driven start and the scale of the floor
        N = int(mt.offsets[-1])
        total = np.zeros(mt.D)
        count = np.zeros(mt.D)
        total[A] = sum(v.sum(axis=0) for v in mt.vA)
        count[A] = N
        for j in range(J):
            seen = mt.sB[j] > 0
            total[B] += np.where(seen, mt.vB[j].sum(axis=0), 0.0)
            count[B] += seen * mt.L[j]
        self.silent = np.flatnonzero(count == 0)  # coordinates no client has data on
        mean = np.divide(total, count, out=np.zeros(mt.D), where=count > 0)
        ssA = sum(float(((v - mean[A]) ** 2).sum()) for v in mt.vA)
        ssB = sum(float(((mt.vB[j] - mean[B]) ** 2 * (mt.sB[j] > 0)).sum()) for j in range(J))
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
        self.estimated = (("mu0",) if mu0_free.any() else ()) + tuple(names) + tuple(scaled)
        if self.silent.size:
            self.note(f"{self.silent.size} coordinate(s) with precision 0 at every client (first: "
                      f"{int(self.silent[0])}) carry no data: skipped; mu0 there keeps its starting value")
        empty = [j for j in range(J) if mt.L[j] == 0]
        if empty:
            self.note(f"client(s) {empty} hold no neurons: counted in J (H_J), nowhere else")
        self.start = self._start(given, start, mean, T, TB, N / J, EB_START_NOISE_SHARE)
        # the fallback when the first pass from the small noise leaves every neuron alone: the even split, used only
        # if the variances start from the data (none given, none in ``start``)
        self.from_data = not any(n in given or n in start for n in
                                 ("sigma2", "sigma0_2", "sigma2_scaled", "sigma0_2_scaled"))
        self.even_start = self._start(given, start, mean, T, TB, N / J, 0.5)

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

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    def _moments(self, labels: list[np.ndarray], L: int):
        """Per-atom weights W and weighted means xbar (block A: W one number per atom, as s = 1 there), and each
        client's residual sums of squares ``num`` and their degrees of freedom ``den`` on block A and on block B
        (E[num_j] = sigma2 den_j)."""
        mt = self.mt
        J, A, B = mt.J, mt.A, mt.B
        WA = np.zeros(L)
        SA = np.zeros((L, len(A)))
        WB = np.zeros((L, len(B)))
        SB = np.zeros((L, len(B)))
        for j in range(J):
            a = labels[j]
            if a.size:  # labels are distinct within a client: no repeated index in these updates
                WA[a] += 1.0
                SA[a] += mt.vA[j]
                if len(B):
                    WB[a] += mt.sB[j]
                    SB[a] += mt.sB[j] * mt.vB[j]
        xbarA = SA / WA[:, None]
        xbarB = np.divide(SB, WB, out=np.zeros_like(SB), where=WB > 0)
        num, den = np.zeros((2, J)), np.zeros((2, J))
        for j in range(J):
            a = labels[j]
            if not a.size:
                continue
            if len(A):
                res = mt.vA[j] - xbarA[a]
                num[0, j] = float(np.einsum("ld,ld->", res, res))
                den[0, j] = len(A) * float((1.0 - 1.0 / WA[a]).sum())
            if len(B):
                seen = mt.sB[j] > 0
                num[1, j] = float((mt.sB[j] * (mt.vB[j] - xbarB[a]) ** 2).sum())
                lev = np.divide(mt.sB[j], WB[a], out=np.ones_like(WB[a]), where=WB[a] > 0)
                den[1, j] = float(((1.0 - lev) * seen).sum())
        return WA, xbarA, WB, xbarB, num, np.maximum(den, 0.0)  # 1 - s / W is 0 for a lone member, up to rounding

    def _between_B(self, WB, xbarB, mu0B, freeB, sigma2_b) -> float | None:
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

    def update(self, current: dict) -> dict:
        """The estimates at the matcher's current assignment; the current values where not estimable."""
        mt = self.mt
        labels, L = mt.labels()
        J, A, B = mt.J, mt.A, mt.B
        WA, xbarA, WB, xbarB, num, den = self._moments(labels, L)
        out = dict(current)
        floor2 = SIGMA2_FLOOR * self.pooled_variance
        main = 0 if len(A) else 1  # the block sigma2 comes from: A when there is one
        # sigma2
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
            out["gamma0"] = L / _harmonic(J)
        return out

    def close(self, new: dict, old: dict) -> bool:
        """Whether no estimate moved by more than EB_RTOL."""
        for name in ("sigma0_2", "sigma2", "gamma0", "sigma0_2_scaled", "sigma2_scaled"):
            if abs(new[name] - old[name]) > EB_RTOL * abs(old[name]):
                return False
        return bool(np.abs(new["mu0"] - old["mu0"]).max(initial=0.0) <= EB_RTOL * math.sqrt(new["sigma0_2"]))

    def matcher_values(self, values: dict) -> dict:
        return dict(sigma2=values["sigma2"], sigma0_2=values["sigma0_2"], gamma0=values["gamma0"], mu0=values["mu0"],
                    sigma2_scaled=values["sigma2_scaled"], sigma0_2_scaled=values["sigma0_2_scaled"])

    def public(self, values: dict, dtype) -> dict:
        out = dict(mu0=torch.as_tensor(values["mu0"], dtype=dtype), sigma0_2=float(values["sigma0_2"]),
                   sigma2=float(values["sigma2"]), gamma0=float(values["gamma0"]))
        if self.two_blocks:
            out["sigma0_2_scaled"] = float(values["sigma0_2_scaled"])
            out["sigma2_scaled"] = float(values["sigma2_scaled"])
        return out


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


def _make_matcher(neurons, *, precisions, objective, popularity_factor, popularity_cap, max_atoms,
                  new_atom_penalty) -> _LayerMatcher:
    arrays = _validate_neurons(neurons)
    D = arrays[0].shape[1]
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
        arrays, _validate_precisions(precisions, [a.shape[0] for a in arrays], D), popularity_factor=popularity_factor,
        popularity_cap=popularity_cap, max_atoms=max_atoms, new_atom_penalty=new_atom_penalty,
        marginal=objective == "marginal")


def _result_dtype(neurons):
    dtype = neurons[0].dtype if isinstance(neurons[0], Tensor) else torch.get_default_dtype()
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def match_layer(
    neurons,
    *,
    sigma2: float | None = None,
    sigma0_2: float | None = None,
    gamma0: float | None = None,
    mu0=None,
    precisions=None,
    hyperparameters: Literal["empirical-bayes", "fixed"] = "empirical-bayes",
    start: Mapping[str, object] | None = None,
    sweeps: int | None = None,
    seed: int | None = None,
    objective: Literal["map", "marginal"] | None = None,
    popularity_factor: float = 2.0,
    popularity_cap: int | None = None,
    max_atoms: int | None = None,
    new_atom_penalty: Literal["none", "log_k"] = "none",
    stop_at_fixed_point: bool = True,
    cross_products: Literal["auto", "direct", "gram"] = "auto",
    init_assignments=None,
) -> MatchResult:
    """Match J clients' neurons to global atoms under the Beta-Bernoulli process (PFNM's server step), with the
    hyper-parameters estimated from the neurons (empirical Bayes, the default) or given.

    Greedy pass over the clients (largest first) -- or, given ``init_assignments``, that assignment instead -- then
    sweeps in a fresh random order, each removing a client and re-matching it with the Hungarian algorithm given all
    the others. Under empirical Bayes the hyper-parameters that are not given are re-estimated from the assignment
    after the first pass and after every sweep, until a sweep changes nothing. See the module docstring for the
    objectives, the scores and the estimates.

    Usage: the neurons alone (here a layer drawn from the model with noise 0.01, prior variance 1 and IBP mass 20)
    give back the model's hyper-parameters and its atoms::

        >>> from bnpfed.models import sample_federated_layer
        >>> layer = sample_federated_layer(10, 50, seed=0, gamma0=20.0, sigma2=0.01)
        >>> result = match_layer(layer.neurons, seed=0)
        >>> result.num_atoms, layer.num_atoms, tuple(result.global_atoms.shape)
        (49, 49, (49, 50))
        >>> {k: round(v, 2) for k, v in result.hyperparameters.items() if k != "mu0"}
        {'sigma0_2': 1.0, 'sigma2': 0.01, 'gamma0': 16.73}
        >>> result.converged, result.estimated, result.sweeps_run
        (True, ('mu0', 'sigma0_2', 'sigma2', 'gamma0'), 1)

    (gamma0 = L / H_J = 49 / 2.929: the IBP mass most likely to give the 49 atoms this draw has.) A value that is
    given is held fixed, the others are still estimated; ``hyperparameters="fixed"`` estimates nothing (its defaults
    are the published ones: the MAP objective, 5 sweeps, mu0 = 0)::

        >>> match_layer(layer.neurons, gamma0=20.0, seed=0).estimated
        ('mu0', 'sigma0_2', 'sigma2')
        >>> fixed = dict(sigma2=0.01, sigma0_2=1.0, gamma0=20.0, hyperparameters="fixed", objective="marginal", seed=0)
        >>> result = match_layer(layer.neurons, **fixed)
        >>> result.num_atoms, len(result.objective)          # after the greedy pass and after each of the 5 sweeps
        (49, 6)

    A communication round warm-starts from the previous round's assignment (any labels, distinct within a client);
    the sweeps then run from there, and ``objective[0]`` is the objective of that starting point::

        >>> again = match_layer(layer.neurons, init_assignments=result.assignments, sweeps=2, **fixed)
        >>> math.isclose(again.objective[0], result.objective[-1], rel_tol=1e-9)
        True
        >>> all(bool((a == b).all()) for a, b in zip(again.assignments, result.assignments))
        True

    :param neurons: sequence of J arrays or tensors of shape (L_j, D); L_j may differ, D may not. A client may have
        no neurons (shape (0, D), which the Beta-Bernoulli process gives with probability ``exp(-gamma0)``): it still
        counts in J (in ``log(gamma0/J)``, ``m/(J-m)`` and H_J) and gets an empty assignment. At least one client must
        have a neuron. They are all the estimates see: no data set is needed.
    :param float sigma2: local noise variance; None (default): estimated (required with ``"fixed"``).
    :param float sigma0_2: prior variance of the atoms; None: estimated (required with ``"fixed"``).
    :param float gamma0: IBP mass; None: estimated (required with ``"fixed"``).
    :param mu0: prior mean of the atoms, scalar or (D,) (PFNM: 0 for weights, 0.1 for bias coordinates). None:
        estimated per coordinate under empirical Bayes, 0 with ``"fixed"``. Under empirical Bayes a (D,) vector may
        hold NaN on the coordinates to estimate (the others are held fixed).
    :param precisions: optional per-client per-coordinate scales s_j >= 0, shape (J, D) or J vectors (D,); client
        j's noise variance on coordinate d is ``sigma2 / s_jd``. A zero marks a coordinate the client says nothing
        about (PFNM: the output weights of a class the client never saw); each client with neurons needs some
        s_jd > 0 (the row of a client without neurons is never used: any finite values >= 0).
    :param str hyperparameters: ``"empirical-bayes"`` (default): estimate the hyper-parameters not given, with the
        marginal objective; ``"fixed"``: use the given ones (sigma2, sigma0_2 and gamma0 required).
    :param dict start: empirical Bayes: starting values of some estimated hyper-parameters (keys ``"mu0"``,
        ``"sigma0_2"``, ``"sigma2"``, ``"gamma0"``, ``"sigma0_2_scaled"``, ``"sigma2_scaled"``); the others start
        from the pooled moments of the neurons (module docstring). Only the first assignment depends on it.
    :param int sweeps: remove-and-rematch passes after the first assignment: exactly this many (less any skipped at
        a fixed point) with ``"fixed"``, default 5; at most this many under empirical Bayes, default 50.
    :param int seed: seed of the sweeps' client order.
    :param str objective: ``"map"`` (published; atoms plugged in at their MAP values; the default with ``"fixed"``)
        or ``"marginal"`` (atoms integrated out; Occam factor included; the default and the only choice under
        empirical Bayes, as only it is a likelihood of the variances).
    :param float popularity_factor: factor c on the IBP popularity term ``log(m/(J-m))``; 2 makes the objective twice
        the log density (consistent with the Gaussian part); the published code used 1.
    :param int popularity_cap: cap m at this value inside the popularity term (published: 10; default: no cap).
    :param int max_atoms: at most this many atoms in total, at least one new one per client (published: 700).
    :param str new_atom_penalty: ``"log_k"`` subtracts 2 log k from the k-th new atom of a client (published);
        ``"none"`` (default) keeps the scores the exact conditionals of the objective.
    :param bool stop_at_fixed_point: skip the remaining sweeps once a whole sweep changed no client's assignment (and,
        under empirical Bayes, no estimate): the state is then a fixed point of every re-match, so the result is the
        same. With ``"fixed"``, ``objective`` repeats its last value for the skipped sweeps; ``rematches`` and
        ``sweeps_run`` show how many were run.
    :param str cross_products: how a re-match gets the products of a client's neurons with every atom:
        ``"direct"``, one (L_j, D) x (D, L) matrix product; ``"gram"``, from the (N, N) Gram matrix of all N neurons,
        computed once after the first assignment (a gather and a sum per atom per re-match); ``"auto"`` (default)
        takes the Gram matrix when it fits in 512 MiB and the sweeps' products would cost more than it: with
        ``"fixed"`` decided after the greedy pass (``sweeps * L > N``, a wide layer), under empirical Bayes, where
        ``sweeps`` is only a limit, once the sweeps run so far have cost as much (``k * L > N`` after sweep k). Same
        scores up to rounding.
    :param init_assignments: optional starting point replacing the greedy pass: J integer arrays or tensors, the
        j-th of length L_j (empty for a client without neurons), ``init_assignments[j][l]`` the atom of client j's
        l-th neuron. Labels may take any values (they are compacted internally) but must be distinct within a client.
        Default None: the greedy pass. With the hyper-parameters fixed the sweeps only ever raise the objective from
        there (with ``max_atoms`` off), so the result is at least as good as the starting point; ``max_atoms`` limits
        only the atoms the sweeps open.
    :returns: :class:`MatchResult`, with the hyper-parameters used (``hyperparameters``, their history, what was
        estimated, whether the estimation converged, and notes on its fallbacks).
    """
    t0 = time.perf_counter()
    mode = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters")
    if cross_products not in ("auto", "direct", "gram"):
        raise ValueError(f"cross_products must be 'auto', 'direct' or 'gram', got {cross_products!r}")
    eb = mode == "empirical-bayes"
    if objective is None:
        objective = "marginal" if eb else "map"
    if eb and objective == "map":
        raise ValueError("objective: expected 'marginal' with hyperparameters='empirical-bayes', got 'map': the MAP "
                         "objective drops the atoms' normalising constants L D log(2 pi sigma0_2), so it is no "
                         "likelihood of sigma0_2 and sigma2 to estimate them by (and its over-splitting at the true "
                         "noise would feed back into the estimates); use hyperparameters='fixed' for it")
    sweeps = (50 if eb else 5) if sweeps is None else check_int(sweeps, "sweeps", low=0)
    matcher = _make_matcher(neurons, precisions=precisions, objective=objective, popularity_factor=popularity_factor,
                            popularity_cap=popularity_cap, max_atoms=max_atoms, new_atom_penalty=new_atom_penalty)
    given = {name: check_positive(value, name) for name, value in
             (("sigma0_2", sigma0_2), ("sigma2", sigma2), ("gamma0", gamma0)) if value is not None}
    init = None if init_assignments is None else _validate_labels(init_assignments, matcher.L, "init_assignments")
    dtype = _result_dtype(neurons)
    if eb:
        return _match_empirical_bayes(matcher, given, mu0, start, init, sweeps=sweeps, seed=seed,
                                      stop_at_fixed_point=stop_at_fixed_point, cross_products=cross_products,
                                      dtype=dtype, t0=t0)
    for name in ("sigma2", "sigma0_2", "gamma0"):
        if name not in given:
            raise ValueError(f"{name}: expected a positive finite number with hyperparameters='fixed' (nothing is "
                             f"estimated), got None; pass {name}=... or use hyperparameters='empirical-bayes'")
    if start is not None:
        raise ValueError(f"start: expected None with hyperparameters='fixed' (nothing is estimated), got {start!r}")
    mu0 = _validate_mu0(0.0 if mu0 is None else mu0, matcher.D)
    matcher.set_hyperparameters(**given, mu0=mu0)
    if init is None:
        for j in np.argsort(-np.array(matcher.L), kind="stable"):
            matcher.match(int(j))
    else:
        matcher.start_from(init)
    history = [matcher.objective()]
    N, L = int(matcher.offsets[-1]), int((matcher.m[: matcher.n_rows] > 0).sum())
    wide = sweeps > 0 and sweeps * L > N and N * N * 8 <= 512 * 2 ** 20
    if cross_products == "gram" or (cross_products == "auto" and wide):
        matcher.use_gram()
    rng = np.random.default_rng(seed)
    run = 0
    for _ in range(sweeps):
        changed = matcher.sweep(rng)
        run += 1
        history.append(matcher.objective())
        if not changed and stop_at_fixed_point:
            # every client's re-match returned its own assignment: any further sweep, in any order, does the same
            history.extend([history[-1]] * (sweeps + 1 - len(history)))
            break
    values = dict(mu0=torch.as_tensor(mu0, dtype=dtype), **{n: given[n] for n in ("sigma0_2", "sigma2", "gamma0")})
    return matcher.result(history, time.perf_counter() - t0, dtype, hyperparameters=values,
                          hyperparameter_history=[dict(values) for _ in history], converged=True, estimated=(),
                          notes=[], sweeps_run=run)


def _match_empirical_bayes(matcher: _LayerMatcher, given: dict, mu0, start, init, *, sweeps: int, seed,
                           stop_at_fixed_point: bool, cross_products: str, dtype, t0: float) -> MatchResult:
    """:func:`match_layer` under empirical Bayes: first assignment at the starting values, then sweeps alternating
    with re-estimates until neither changes."""
    D = matcher.D
    if mu0 is None:
        mu0v = np.full(D, np.nan)
    else:
        mu0v = _validate_mu0(mu0, D, estimable=True)
    mu0_free = np.isnan(mu0v)
    start = _validate_start(start, {**given, **({"mu0": mu0} if not mu0_free.any() else {})}, D)
    eb = _EmpiricalBayes(matcher, given, mu0v, mu0_free, start)
    current = eb.start
    matcher.set_hyperparameters(**eb.matcher_values(current))
    if init is None:
        order = np.argsort(-np.array(matcher.L), kind="stable")
        for j in order:
            matcher.match(int(j))
        if eb.from_data and "sigma2" in eb.estimated and matcher.m[: matcher.n_rows].max(initial=0) <= 1:
            # every neuron alone at the small starting noise: sigma2 would not be estimable from there
            eb.note(f"the first pass at sigma2 = {EB_START_NOISE_SHARE:g} x the pooled variance left every neuron "
                    "alone: redone from the even split (sigma2 = sigma0_2 = half the pooled variance)")
            current = eb.even_start
            matcher.assign = [None] * matcher.J
            matcher.set_hyperparameters(**eb.matcher_values(current))
            matcher._reset_storage()  # (set_hyperparameters has reset it unless the values were the same)
            for j in order:
                matcher.match(int(j))
    else:
        matcher.start_from(init)
    objective = [matcher.objective()]
    current = eb.update(current)
    history = [eb.public(current, dtype)]
    N = int(matcher.offsets[-1])
    fits = N * N * 8 <= 512 * 2 ** 20
    if cross_products == "gram":
        matcher.use_gram()
    rng = np.random.default_rng(seed)
    converged, run = False, 0
    for k in range(1, sweeps + 1):
        matcher.set_hyperparameters(**eb.matcher_values(current))
        changed = matcher.sweep(rng)
        run = k
        objective.append(matcher.objective())
        new = eb.update(current)
        history.append(eb.public(new, dtype))
        converged = not changed and eb.close(new, current)
        current = new
        if converged and stop_at_fixed_point:
            break
        L = int((matcher.m[: matcher.n_rows] > 0).sum())
        if cross_products == "auto" and matcher.gram is None and fits and k * L > N:
            matcher.use_gram()
    if not converged and sweeps:
        eb.note(f"not converged: the assignment or the estimates still changed at sweep {sweeps}, the limit "
                "(raise sweeps)")
    elif not sweeps:
        eb.note("not converged: no sweep was run (sweeps=0); the estimates are those of the first assignment")
    matcher.set_hyperparameters(**eb.matcher_values(current))  # the atoms' posterior at the final values
    return matcher.result(objective, time.perf_counter() - t0, dtype, hyperparameters=history[-1],
                          hyperparameter_history=history, converged=converged, estimated=eb.estimated,
                          notes=list(eb.notes), sweeps_run=run)


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
    """The objective F (or F_marg) of :func:`match_layer` at a given assignment and given hyper-parameters.

    :param assignments: J integer arrays of length L_j: atom labels, distinct within a client (any labels; empty for
        a client without neurons). The other parameters are those of :func:`match_layer` (its
        ``MatchResult.hyperparameters`` can be passed as they are).
    """
    matcher = _make_matcher(neurons, precisions=precisions, objective=objective, popularity_factor=popularity_factor,
                            popularity_cap=popularity_cap, max_atoms=None, new_atom_penalty="none")
    matcher.set_hyperparameters(sigma2=check_positive(sigma2, "sigma2"), sigma0_2=check_positive(sigma0_2, "sigma0_2"),
                                gamma0=check_positive(gamma0, "gamma0"), mu0=_validate_mu0(mu0, matcher.D))
    matcher.start_from(_validate_labels(assignments, matcher.L, "assignments"))
    return matcher.objective()


def averaging_weights(scales) -> Tensor:
    """(J, K) weights ``omega_jk = s_jk / sum_j' s_j'k`` of the clients in an average taken column by column:
    ``scales`` (J, K) the per-client precision scales s_jk of the columns (PFNM: the class shares of the output
    coordinates). A column no client has data on (every ``s_jk`` 0) gets weights 0.

        >>> averaging_weights(torch.tensor([[3.0, 0.0], [1.0, 0.0]]))
        tensor([[0.7500, 0.0000],
                [0.2500, 0.0000]], dtype=torch.float64)
    """
    w = torch.as_tensor(scales, dtype=torch.float64)
    total = w.sum(0)
    held = total > 0
    return torch.where(held, w / torch.where(held, total, torch.ones_like(total)), torch.zeros_like(w))


def average_atoms(neurons, assignments, *, precisions=None) -> Tensor:
    """(L, D) the matched neurons averaged atom by atom: the global weights of an average of the clients' networks
    (:func:`~bnpfed.inference.multilayer.match_networks` with ``global_weights="average"``), as against the atoms'
    posterior means (:attr:`MatchResult.global_atoms`).

    On a coordinate where every client has precision scale 1 an atom gets the average of its members' values: the
    estimate under a flat prior, no shrinkage towards mu0. On a coordinate with per-client scales s_jd (PFNM's output
    weights, s_jd the class share) it gets ``sum_{j in S_i} omega_jd v_jd`` with ``omega_jd = s_jd / sum_j' s_j'd``
    over all clients (:func:`averaging_weights`): the average over every client, one without a neuron on the atom
    counting as 0 -- so that the output layer built from it computes the clients' logits averaged class by class.

    :param neurons: J arrays or tensors (L_j, D), as for :func:`match_layer`.
    :param assignments: J integer arrays (L_j,) of atom labels 0 .. L-1 (a :class:`MatchResult`'s); labels may
        repeat within a client (a baseline such as k-means), the members then all count.
    :param precisions: optional (J, D) per-client precision scales, as for :func:`match_layer`.

        >>> average_atoms([torch.tensor([[1.0, 4.0]]), torch.tensor([[3.0, 8.0]])], [[0], [0]],
        ...               precisions=[[1.0, 0.25], [1.0, 0.75]])
        tensor([[2., 7.]], dtype=torch.float64)
    """
    V = [torch.as_tensor(v, dtype=torch.float64) for v in neurons]
    J, D = len(V), V[0].shape[1]
    labels = [torch.as_tensor(a, dtype=torch.long).reshape(-1) for a in assignments]
    if len(labels) != J or any(a.numel() != v.shape[0] for a, v in zip(labels, V)):
        raise ValueError("assignments: expected one label per neuron of every client")
    L = int(max((int(a.max()) + 1 for a in labels if a.numel()), default=0))
    s = torch.ones(J, D, dtype=torch.float64) if precisions is None else torch.as_tensor(precisions,
                                                                                          dtype=torch.float64)
    plain = (s == 1.0).all(0)
    omega = averaging_weights(s)
    total = torch.zeros(L, dtype=torch.float64)
    mean = torch.zeros(L, D, dtype=torch.float64)
    shared = torch.zeros(L, D, dtype=torch.float64)
    for j, (v, a) in enumerate(zip(V, labels)):
        if not a.numel():
            continue
        total.index_add_(0, a, torch.ones(a.numel(), dtype=torch.float64))
        mean.index_add_(0, a, v)
        shared.index_add_(0, a, omega[j] * v)
    return torch.where(plain, mean / total[:, None], shared)

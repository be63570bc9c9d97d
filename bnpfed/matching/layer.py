"""Matching of one federated layer: the Hungarian step of PFNM, with its hyper-parameters fixed or estimated.

Yurochkin et al., "Bayesian Nonparametric Federated Learning of Neural Networks", ICML 2019, section 3.2. Given J
clients' neurons (vectors in R^D), find the assignment of every local neuron to a global atom (distinct atoms within a
client) that maximises the posterior of the Beta-Bernoulli model of :mod:`bnpfed.models.beta_bernoulli`. The
hyper-parameters (mu0, sigma0_2, sigma2, gamma0) are either given (``hyperparameters="fixed"``, the published way) or
estimated from the clients' neurons alone, alternating with the assignment (``"empirical-bayes"``, the default; see
*Empirical Bayes* below).

In the notation of :mod:`bnpfed.matching.matcher` (the one layer matcher, here with every posterior variance 0):
client j's neuron v_jl has noise precision ``w_jd = s_jd / sigma2`` (``s_jd`` 1 unless ``precisions`` says
otherwise), and the objectives are the matcher's F (``objective="map"``, the published one) and F_marg
(``"marginal"``). For popularity factor c = 2, F is twice the log density of the configuration:

    F(Z) = 2 log p_conf(Z, theta_hat, V) + L * D * log(2 pi sigma0_2) + const(V, J, gamma0)

where ``p_conf`` is the Beta-Bernoulli density of the configuration (the IBP prior in its exchangeable form, see
:func:`bnpfed.models.beta_bernoulli.log_joint`) and const(V, J, gamma0) = 2 gamma0 H_J + 2 sum_j log L_j! +
sum_{j,l,d} [log(2 pi sigma2 / s_jd) + s_jd v_jld^2 / sigma2]. The term ``L D log(2 pi sigma0_2)`` -- the atoms'
prior normalising constants, which depend on the number of atoms alone -- is what the published objective drops, and
what F_marg's Occam factor restores in integrated form. Without it, at sigma2 equal to the true noise, merging two
noisy copies of one atom and keeping them apart are worth about the same (both of order D), so the MAP objective
over-splits; the marginal one does not.

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
  H_J] = L / gamma0 - H_J`` vanishes there: the maximum-likelihood value (L is Poisson(gamma0 H_J)). With the
  two-parameter IBP's concentration c given, ``gamma0 = L / sum_j c/(c + j - 1)``; with ``concentration=None`` the
  two are estimated together by maximum likelihood (:mod:`~bnpfed.matching.ibp`).

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

One sigma2 serves every client (a noise variance per client was measured and not kept: no gain in accuracy, for
twice the matching time; the benchmark archive of the docs has the numbers).

Degenerate cases. No atom with two members (every neuron alone): sigma2 is not estimable and keeps its previous value.
Fewer than two atoms with data on every coordinate (one atom, with mu0 estimated): sigma0_2 keeps its previous value.
A coordinate on which every client has precision 0 carries no data and is skipped (mu0 there keeps its starting
value). Every neuron the same vector (no spread at all, e.g. every unit dead): neither variance is estimable, both
keep their start (the small-noise one, the pooled variance taken as 1) and identical neurons merge into max_j L_j
atoms (``FLAT_NOTE`` of :mod:`~bnpfed.matching.empirical_bayes`). A client without neurons counts in J (in H_J) and
nowhere else. Class shares on the output coordinates enter as the s_jd, and those coordinates get their own
variances (above). Each case is recorded in ``MatchResult.notes``.
sigma2 is floored at ``SIGMA2_FLOOR`` times the pooled variance of the neurons (when every atom's members agree
exactly).

The iteration starts from ``start`` or, for what it does not give, from the pooled moments of all the neurons: mu0_d
their mean on coordinate d, ``sigma2 = EB_START_NOISE_SHARE * T`` and ``sigma0_2 = (1 - EB_START_NOISE_SHARE) * T``
with T their pooled variance (``Var(v_d) = sigma0_2 + sigma2`` under the model; the scaled pair likewise from the
scaled coordinates), and gamma0 the mean number of neurons per client (under the IBP every client uses gamma0 atoms
on average). The alternation may have several fixed points, and the start chooses among them. The small-noise
start merges only neurons far closer than a typical pair first, and a few tight neurons that agree across clients
(units dead on the client's data, whose weights are left near their initial values) then set the noise; the even
split (``sigma2 = sigma0_2 = T / 2``) merges widely in its first pass and settles at a fixed point with a larger
noise. ``starts="both"`` runs both and keeps the one of higher marginal likelihood ``log p(Z, V)`` (at its own
estimates, every normalising constant included). While the clients' dead units are matched the small-noise fixed
point is the likelier; once the clients leave them out (:mod:`bnpfed.matching.activity`) the even split is, on
trained MLP layers by a wide margin and at a fraction of the width, and where the small-noise start wins (some
LeNet layers) it wins by little, with an equally accurate global network; on layers sampled from the model it
over-splits where atoms overlap. So the default (``starts="even-split"``) runs the even split alone, at a fraction
of the time of both (the docs' benchmark page on scale has the comparison). If the first pass from the small noise
leaves every neuron alone (sigma2 not estimable: nothing agrees that closely), it is redone from the even split
(noted). It stops when a sweep changed no assignment and no estimate moved by more than ``EB_RTOL`` (relative; mu0
relative to sqrt(sigma0_2)) -- by default already when at most 2 % of the neurons moved in a sweep and no estimate by
more than 1 % (mu0 by the root mean square of its changes; ``stop="result"``) -- or after ``sweeps`` sweeps
(``MatchResult.converged`` False). With the estimates held fixed a sweep never lowers F_marg; re-estimating moves
F_marg itself, so ``objective`` need not be monotone across sweeps.

Implementation: the one layer matcher of :mod:`bnpfed.matching.matcher` (the heteroscedastic model of
:mod:`bnpfed.matching.bayesian_layer` at u = 0, tau2 = sigma2; block A its shared coordinates, block B its
per-client ones) and the estimator :class:`~bnpfed.matching.empirical_bayes.PooledMoments`.
"""

from __future__ import annotations

import math  # noqa: F401 (match_layer's examples use it)
from typing import Literal, Mapping

import numpy as np
import torch
from torch import Tensor

from bnpfed.matching.empirical_bayes import (EB_RTOL, EB_START_NOISE_SHARE, SIGMA0_2_FLOOR, SIGMA2_FLOOR,
                                              PooledMoments, validate_start)
from bnpfed.matching.layer_inputs import CompactRows, validate_clients, validate_mu0
from bnpfed.matching.model_layer import gaussian_model, match_model_layer
from bnpfed.models import gaussian_noise
from bnpfed.matching.driver import assignment_objective_of, match_one_layer
from bnpfed.matching.matcher import MatchResult

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


def match_layer(
    neurons,
    *,
    sigma2: float | None = None,
    sigma0_2: float | None = None,
    gamma0: float | None = None,
    mu0=None,
    precisions=None,
    atom_prior=None,
    noise=None,
    concentration: float | None = 1.0,
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
    stop: Literal["fixed-point", "result"] = "result",
    starts: Literal["even-split", "both", "small-noise"] = "even-split",
    schedule: Literal["gauss-seidel", "jacobi"] = "gauss-seidel",
    device=None,
    progress: bool = False,
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
        (True, ('mu0', 'sigma0_2', 'sigma2', 'gamma0'), 2)

    (gamma0 = L / H_J = 49 / 2.929: the IBP mass most likely to give the 49 atoms this draw has.) The model's own
    noise law, here Student-t of 2 degrees of freedom (heavy tails: the Gaussian matcher splits them), is given as
    ``noise=`` (the general path)::

        >>> from bnpfed.models import StudentTNoise
        >>> heavy = sample_federated_layer(5, 30, seed=0, gamma0=5.0, sigma2=0.05, sigma0_2=0.5,
        ...                                noise=StudentTNoise(df=2.0))
        >>> result = match_layer(heavy.neurons, noise=StudentTNoise(df=2.0), seed=0)
        >>> result.num_atoms, heavy.num_atoms, match_layer(heavy.neurons, seed=0).num_atoms
        (14, 14, 17)

    A value that is
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
        have a neuron. They are all the estimates see: no data set is needed. A client may be given as
        :class:`~bnpfed.matching.CompactRows` (its neurons on the columns it uses; after a Flatten a small share of
        D): when every client is, the layer is held on each client's own columns end to end, with the same result.
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
    :param atom_prior: the model's atom prior, as :func:`~bnpfed.models.beta_bernoulli_layer` takes it: a
        ``pyro.distributions`` law of each coordinate (batch shape () or (D,), or such a law ``.to_event(1)``), held
        fixed (``mu0`` and ``sigma0_2`` then None). Default None: ``Normal(mu0, sqrt(sigma0_2))``. A Normal of one
        scale is that prior (the fast path); any other takes the general path
        (:mod:`~bnpfed.matching.model_matcher`: the same objectives from the model's log densities, each atom at its
        MAP value given its members).
    :param noise: the model's noise law ``noise(loc, variance) -> Distribution`` (one law per coordinate; variance
        ``sigma2 / s_jd``), as :func:`~bnpfed.models.beta_bernoulli_layer` takes it. None or
        :func:`~bnpfed.models.gaussian_noise`: Gaussian (the fast path, unless ``atom_prior`` is not Gaussian); any
        other callable takes the general path. A :class:`~bnpfed.models.NoiseLaw` with free parameters
        (``StudentTNoise(df=None)``) has them estimated by empirical Bayes with sigma2 (the model's log likelihood
        with the atoms integrated out: :mod:`~bnpfed.matching.model_layer`). The general path takes neither
        ``start``, ``starts`` other than ``"even-split"``, ``cross_products="gram"`` nor ``schedule="jacobi"``.
    :param float concentration: c > 0 of the two-parameter Indian buffet process (Ghahramani, Griffiths & Sollich
        2007), the ``concentration`` of :func:`~bnpfed.models.beta_bernoulli_layer`: the popularity term becomes
        ``log(m/(J - 1 + c - m))`` and a new atom's ``2 log(gamma0 c/(J - 1 + c))`` (:mod:`~bnpfed.matching.ibp`).
        Default 1, PFNM's one-parameter IBP; None: estimated with gamma0 under empirical Bayes (its maximum-likelihood
        value, reported in ``hyperparameters`` as ``"concentration"``, as is any value other than 1).
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
        takes the Gram matrix when it fits in :data:`~bnpfed.matching.matcher.GRAM_BYTES` (1 GiB) and the sweeps'
        products would cost more than it: with
        ``"fixed"`` decided after the greedy pass (``sweeps * L > N``, a wide layer), under empirical Bayes, where
        ``sweeps`` is only a limit, after the greedy pass for the sweeps it usually runs
        (:data:`~bnpfed.matching.matcher.EB_EXPECTED_SWEEPS`) and again once the sweeps run so far have cost as much
        (``k * L > N`` after sweep k). Same scores up to rounding.
    :param str stop: empirical Bayes: ``"result"`` (default) stops once a sweep moved at most 2 % of the neurons
        (:data:`~bnpfed.matching.matcher.STOP_MOVED`) and no estimate by more than 1 %
        (:data:`~bnpfed.matching.matcher.STOP_RTOL`; mu0 by the root mean square of its changes over the
        coordinates), as good as settled on trained layers at a fraction of the exact rule's sweeps (the docs'
        benchmark page on scale); ``"fixed-point"`` sweeps until nothing changes (``EB_RTOL``).
    :param str starts: empirical Bayes with the noise estimated from the data's start: ``"even-split"`` (default)
        runs the alternation from the even split; ``"both"`` runs it from the small-noise start as well and keeps the
        assignment of higher ``log p(Z, V)`` at its own estimates (``MatchResult.log_likelihood``, every constant
        included; both runs in ``MatchResult.starts``), at about twice the time; ``"small-noise"`` runs the small-noise
        start only (bnpfed before 2026-12). One start whenever the noise is given or ``start`` sets it, and with fixed
        hyper-parameters.
    :param str schedule: how a sweep re-matches the clients: ``"gauss-seidel"`` (default) one after the other in a
        seeded random order, each given the moves of those before it (coordinate ascent); ``"jacobi"`` every client
        against the assignment at the sweep's start, all moved at once (independent re-matches, which could run in
        parallel; no coordinate ascent, and on trained layers it does not settle: the docs' benchmark page on
        scale).
    :param device: None (default: numpy on the CPU) or a torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``) for the
        shared coordinates' atom sums and the (L_j, D) x (D, L) cross products, the largest work of a wide layer
        (:class:`~bnpfed.matching.matcher.LayerMatcher`); the scores and the LSA stay on the CPU, the Gram matrix is
        not used there (``cross_products="gram"`` is refused). The same matching up to rounding.
    :param init_assignments: optional starting point replacing the greedy pass: J integer arrays or tensors, the
        j-th of length L_j (empty for a client without neurons), ``init_assignments[j][l]`` the atom of client j's
        l-th neuron. Labels may take any values (they are compacted internally) but must be distinct within a client.
        Default None: the greedy pass. With the hyper-parameters fixed the sweeps only ever raise the objective from
        there (with ``max_atoms`` off), so the result is at least as good as the starting point; ``max_atoms`` limits
        only the atoms the sweeps open.
    :param bool progress: show a progress bar of each pass (the greedy pass, every sweep: the J clients
        re-matched; tqdm on stderr). Default False. A layer this machine's memory cannot hold is refused before
        anything is allocated, whatever this says (:func:`~bnpfed.matching.check_matching_memory`).
    :returns: :class:`MatchResult`, with the hyper-parameters used (``hyperparameters``, their history, what was
        estimated, whether the estimation converged, and notes on its fallbacks).
    """
    if atom_prior is not None or (noise is not None and noise is not gaussian_noise):
        V, _ = validate_clients(neurons, None, name="neurons")
        fast = gaussian_model(atom_prior, noise, V[0].shape[1])
        if fast is None:
            return match_model_layer(
                neurons, atom_prior=atom_prior, noise=noise if noise is not None else gaussian_noise, sigma2=sigma2,
                sigma0_2=sigma0_2, gamma0=gamma0, mu0=mu0, precisions=precisions, concentration=concentration,
                hyperparameters=hyperparameters, start=start, sweeps=sweeps, seed=seed, objective=objective,
                popularity_factor=popularity_factor, popularity_cap=popularity_cap, max_atoms=max_atoms,
                new_atom_penalty=new_atom_penalty, stop_at_fixed_point=stop_at_fixed_point,
                cross_products=cross_products, init_assignments=init_assignments, stop=stop, starts=starts,
                schedule=schedule, device=device)
        if fast[0] is not None:   # a Gaussian atom prior of one scale: the fast path's mu0 and sigma0_2
            for name, value in (("mu0", mu0), ("sigma0_2", sigma0_2)):
                if value is not None:
                    raise ValueError(f"{name}: expected None with atom_prior (the prior is given whole), got {value!r}")
            mu0, sigma0_2 = fast

    def estimator(matcher, given):
        mu0v = np.full(matcher.D, np.nan) if mu0 is None else validate_mu0(mu0, matcher.D, estimable=True)
        first = validate_start(start, {**given, **({"mu0": mu0} if not np.isnan(mu0v).any() else {})}, matcher.D)
        return PooledMoments(matcher, given, mu0v, first)

    if hyperparameters == "fixed" and start is not None:
        raise ValueError(f"start: expected None with hyperparameters='fixed' (nothing is estimated), got {start!r}")
    return match_one_layer(neurons, None, noise="sigma2", given=dict(sigma0_2=sigma0_2, sigma2=sigma2, gamma0=gamma0,
                                                                     concentration=concentration),
                           mu0=mu0, precisions=precisions, hyperparameters=hyperparameters, sweeps=sweeps, seed=seed,
                           objective=objective, init_assignments=init_assignments, estimator=estimator,
                           name="neurons", stop_at_fixed_point=stop_at_fixed_point, cross_products=cross_products,
                           stop=stop, starts=starts, schedule=schedule, device=device, progress=progress,
                           popularity_factor=popularity_factor, popularity_cap=popularity_cap, max_atoms=max_atoms,
                           new_atom_penalty=new_atom_penalty)


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
    concentration: float = 1.0,
) -> float:
    """The objective F (or F_marg) of :func:`match_layer` at a given assignment and given hyper-parameters.

    :param assignments: J integer arrays of length L_j: atom labels, distinct within a client (any labels; empty for
        a client without neurons). The other parameters are those of :func:`match_layer` (its
        ``MatchResult.hyperparameters`` can be passed as they are).
    """
    return assignment_objective_of(neurons, None, assignments, noise="sigma2",
                                   values=dict(sigma2=sigma2, sigma0_2=sigma0_2, gamma0=gamma0,
                                               concentration=concentration), mu0=mu0,
                                   precisions=precisions, name="neurons", objective=objective,
                                   popularity_factor=popularity_factor, popularity_cap=popularity_cap)


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
    (:func:`~bnpfed.matching.match_by_spec` with ``global_weights="average"``), as against the atoms'
    posterior means (:attr:`MatchResult.global_atoms`).

    On a coordinate where every client has precision scale 1 an atom gets the average of its members' values: the
    estimate under a flat prior, no shrinkage towards mu0. On a coordinate with per-client scales s_jd (PFNM's output
    weights, s_jd the class share) it gets ``sum_{j in S_i} omega_jd v_jd`` with ``omega_jd = s_jd / sum_j' s_j'd``
    over all clients (:func:`averaging_weights`): the average over every client, one without a neuron on the atom
    counting as 0 -- so that the output layer built from it computes the clients' logits averaged class by class.

    :param neurons: J arrays or tensors (L_j, D) or :class:`~bnpfed.matching.CompactRows`, as for
        :func:`match_layer`.
    :param assignments: J integer arrays (L_j,) of atom labels 0 .. L-1 (a :class:`MatchResult`'s); labels may
        repeat within a client (a baseline such as k-means), the members then all count.
    :param precisions: optional (J, D) per-client precision scales, as for :func:`match_layer`.

        >>> average_atoms([torch.tensor([[1.0, 4.0]]), torch.tensor([[3.0, 8.0]])], [[0], [0]],
        ...               precisions=[[1.0, 0.25], [1.0, 0.75]])
        tensor([[2., 7.]], dtype=torch.float64)
    """
    compact = any(isinstance(v, CompactRows) for v in neurons)
    V = [v if isinstance(v, CompactRows) else torch.as_tensor(v, dtype=torch.float64) for v in neurons]
    J, D = len(V), V[0].shape[1]
    labels = [torch.as_tensor(a, dtype=torch.long).reshape(-1) for a in assignments]
    if len(labels) != J or any(a.numel() != v.shape[0] for a, v in zip(labels, V)):
        raise ValueError("assignments: expected one label per neuron of every client")
    L = int(max((int(a.max()) + 1 for a in labels if a.numel()), default=0))
    s = torch.ones(J, D, dtype=torch.float64) if precisions is None else torch.as_tensor(precisions,
                                                                                          dtype=torch.float64)
    plain = (s == 1.0).all(0)
    omega = averaging_weights(s)
    if compact:
        return _average_compact(V, labels, L, plain, omega)
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


def _average_compact(V: list, labels: list, L: int, plain: Tensor, omega: Tensor) -> Tensor:
    """:func:`average_atoms` of clients given as :class:`CompactRows` (others dense), with one (L, D) array: the
    plain coordinates' sums divided by the member counts, the others' omega-weighted sums (the same sums, added in
    the same client order, as the dense computation)."""
    D = V[0].shape[1]
    out = np.zeros((L, D))
    plain, omega = plain.numpy(), omega.numpy()
    for j, (v, a) in enumerate(zip(V, labels)):
        if not a.numel():
            continue
        a = a.numpy()
        cols, rows = (v.columns, v.values) if isinstance(v, CompactRows) else (np.arange(D), v.numpy())
        rows = rows * np.where(plain[cols], 1.0, omega[j, cols])
        if np.unique(a).size == a.size:
            out[np.ix_(a, cols)] += rows
        else:   # a baseline's labels may repeat within a client: every member counts
            np.add.at(out, (a[:, None], cols[None, :]), rows)
    counts = np.bincount(np.concatenate([a.numpy() for a in labels if a.numel()]), minlength=L).astype(float)
    np.divide(out, counts[:, None], out=out, where=plain[None, :])   # in place: no (L, D) temporary
    return torch.from_numpy(out)

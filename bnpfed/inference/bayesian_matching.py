"""Matching of Bayesian neurons: PFNM's Hungarian step when every local neuron comes with posterior variances.

The clients are variational Bayesian networks. Client j's neuron l reports posterior means ``v_jl`` (D,) and posterior
variances ``u_jl`` (D,), ``u_jld >= 0`` (0 for a deterministic coordinate such as a bias). The model is that of
:mod:`bnpfed.inference.matching` with heteroscedastic noise (:func:`~bnpfed.models.beta_bernoulli.beta_bernoulli_layer`
with ``neuron_variance`` and ``tau2``):

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
entries (:func:`~bnpfed.inference.matcher.join_scores`); coordinates without posterior variance take the
homoscedastic matcher's faster paths (one matrix product per client for the deterministic ones of scale 1: the one
layer matcher of :mod:`bnpfed.inference.matcher`, of which :func:`~bnpfed.inference.matching.match_layer` is the case
u = 0). A greedy pass (largest client first) and sweeps of remove-and-rematch in a seeded random client order are
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

import time
from typing import Literal

import numpy as np

from bnpfed.inference.empirical_bayes import TAU2_FLOOR, PauleMandel
from bnpfed.inference.matcher import (CHUNK_ELEMENTS, FixedValues, MatchResult, make_matcher, result_dtype,
                                      run_matching, validate_labels, validate_mu0)
from bnpfed.validation import check_choice, check_int, check_positive

__all__ = ["CHUNK_ELEMENTS", "TAU2_FLOOR", "bayesian_assignment_objective", "match_bayesian_layer"]


def _coordinates(values: dict) -> dict:
    """Fixed hyper-parameters as the matcher's per-coordinate values (one tau2 and sigma0_2 everywhere)."""
    D = values["mu0"].shape[0]
    return dict(noise=np.full(D, values["tau2"]), prior=np.full(D, values["sigma0_2"]), gamma0=values["gamma0"],
                mu0=values["mu0"])


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
    objective: Literal["map", "marginal"] = "marginal",
    **constants,
) -> MatchResult:
    """Match J clients' Bayesian neurons (posterior means and variances) to global atoms under the Beta-Bernoulli
    process with heteroscedastic noise, the hyper-parameters estimated (empirical Bayes, the default) or given.

    Usage: a layer drawn from the model with posterior variances (Gamma, mean 0.01), extra variance tau2 = 0.002,
    prior variance 1 and IBP mass 10 gives back its atoms and hyper-parameters::

        >>> import pyro.distributions as dist
        >>> from bnpfed.models import sample_federated_layer
        >>> layer = sample_federated_layer(8, 30, seed=0, gamma0=10.0, tau2=0.002,
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
    :param str objective: ``"marginal"`` (default: the atoms integrated out) or, with fixed hyper-parameters,
        ``"map"`` (the atoms at their MAP values, as :func:`~bnpfed.inference.matching.match_layer` has it).
    :param constants: the published code's constants, as for :func:`~bnpfed.inference.matching.match_layer`:
        ``popularity_cap``, ``max_atoms``, ``new_atom_penalty`` (``REFERENCE_CONSTANTS`` without its
        ``hyperparameters`` and ``objective``).
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
    if eb and objective == "map":
        raise ValueError("objective: expected 'marginal' with hyperparameters='empirical-bayes', got 'map' (the MAP "
                         "objective is no likelihood of the variances); use hyperparameters='fixed' for it")
    sweeps = (50 if eb else 5) if sweeps is None else check_int(sweeps, "sweeps", low=0)
    matcher = make_matcher(means, variances, precisions=precisions, name="means", objective=objective,
                           popularity_factor=popularity_factor, **constants)
    given = {name: check_positive(value, name) for name, value in
             (("tau2", tau2), ("sigma0_2", sigma0_2), ("gamma0", gamma0)) if value is not None}
    init = None if init_assignments is None else validate_labels(init_assignments, matcher.L, "init_assignments")
    D = matcher.D
    if eb:
        estimator = PauleMandel(matcher, given, None if mu0 is None else validate_mu0(mu0, D))
    else:
        for name in ("tau2", "sigma0_2", "gamma0"):
            if name not in given:
                raise ValueError(f"{name}: expected a positive finite number with hyperparameters='fixed' (nothing "
                                 f"is estimated), got None; pass {name}=... or use hyperparameters='empirical-bayes'")
        values = {"tau2": given["tau2"], "sigma0_2": given["sigma0_2"], "gamma0": given["gamma0"],
                  "mu0": validate_mu0(0.0 if mu0 is None else mu0, D)}
        estimator = FixedValues(values, _coordinates)
    return run_matching(matcher, estimator, init=init, sweeps=sweeps, seed=seed, dtype=result_dtype(means), t0=t0)


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
    matcher = make_matcher(means, variances, precisions=precisions, name="means", popularity_factor=popularity_factor)
    values = dict(tau2=check_positive(tau2, "tau2"), sigma0_2=check_positive(sigma0_2, "sigma0_2"),
                  gamma0=check_positive(gamma0, "gamma0"), mu0=validate_mu0(mu0, matcher.D))
    matcher.set_hyperparameters(**_coordinates(values))
    matcher.start_from(validate_labels(assignments, matcher.L, "assignments"))
    return matcher.objective()

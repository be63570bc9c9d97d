"""Matching of Bayesian neurons: PFNM's Hungarian step when every local neuron comes with posterior variances.

The clients are variational Bayesian networks. Client j's neuron l reports posterior means ``v_jl`` (D,) and posterior
variances ``u_jl`` (D,), ``u_jld >= 0`` (0 for a deterministic coordinate such as a bias). The model is that of
:mod:`bnpfed.matching.layer` with heteroscedastic noise (:func:`~bnpfed.models.beta_bernoulli.beta_bernoulli_layer`
with ``neuron_variance`` and ``tau2``):

    theta_i ~ N(mu0, sigma0_2 I),    Z ~ Beta-Bernoulli(gamma0) (which atoms a client uses),
    v_jld ~ N(theta_id, (u_jld + tau2) / s_jd)     for the atom i that neuron l of client j belongs to,

with ``tau2`` a per-layer extra variance (a unit's posterior variance at one client understates how far its copies at
two clients lie apart: they were trained on different data) and ``s_jd >= 0`` optional per-client precision scales
(PFNM's class shares on output coordinates; 0: the client says nothing about coordinate d). The posterior variances
are data, their law is free of the assignment: a constant of the objective.

In the notation of :mod:`bnpfed.matching.matcher` (the one layer matcher, whose model this is), one neuron's
coordinate has noise precision ``w_jld = s_jd / (u_jld + tau2)``, and the objective is the matcher's marginal one,
F_marg (``objective="map"``, with fixed hyper-parameters, is its F). For c = 2, ``F_marg(Z) = 2 log p(Z, V | U) +
sum_{j,l,d} [log(2 pi / w_jld) + w_jld v_jld^2] - 2 gamma0 H_J``, ``p`` the configuration density with the atoms
integrated out (each atom's members' values are jointly Gaussian, covariance ``sigma0_2 11^T + diag(1/w)`` per
coordinate) and no factor for the order of a client's neurons. With every ``u = 0`` and ``s = 1`` it is
:func:`~bnpfed.matching.layer.match_layer`'s marginal objective at ``sigma2 = tau2``. The precision ``P_id +
w_jld`` of a Bayesian coordinate depends on both the atom and the neuron, so its scores are no matrix product: the
matcher broadcasts them (its per-neuron coordinates); the deterministic coordinates of scale 1 take the matrix
product of the homoscedastic case.

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

from typing import Literal

import numpy as np  # noqa: F401 (the examples use it)

from bnpfed.matching.empirical_bayes import TAU2_FLOOR, PauleMandel
from bnpfed.matching.layer_inputs import validate_mu0
from bnpfed.matching.driver import assignment_objective_of, match_one_layer
from bnpfed.matching.matcher import CHUNK_ELEMENTS, MatchResult

__all__ = ["CHUNK_ELEMENTS", "TAU2_FLOOR", "bayesian_assignment_objective", "match_bayesian_layer"]


def match_bayesian_layer(
    means,
    variances,
    *,
    tau2: float | None = None,
    sigma0_2: float | None = None,
    gamma0: float | None = None,
    mu0=None,
    precisions=None,
    concentration: float | None = 1.0,
    hyperparameters: Literal["empirical-bayes", "fixed"] = "empirical-bayes",
    sweeps: int | None = None,
    seed: int | None = None,
    init_assignments=None,
    popularity_factor: float = 2.0,
    objective: Literal["map", "marginal"] = "marginal",
    stop: Literal["fixed-point", "result"] = "result",
    starts: Literal["even-split", "both", "small-noise"] = "even-split",
    schedule: Literal["gauss-seidel", "jacobi"] = "gauss-seidel",
    device=None,
    progress: bool = False,
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
    :param float concentration: the two-parameter IBP's concentration c, as for
        :func:`~bnpfed.matching.layer.match_layer` (default 1; None: estimated).
    :param str hyperparameters: ``"empirical-bayes"`` (default) or ``"fixed"``.
    :param int sweeps: remove-and-rematch passes after the first assignment: this many (less any skipped at a fixed
        point, the objective then repeating its last value) with ``"fixed"``, default 5; at most this many under
        empirical Bayes, default 50.
    :param int seed: seed of the sweeps' client order.
    :param init_assignments: optional starting assignment replacing the greedy pass: J integer arrays of length L_j,
        labels distinct within a client.
    :param float popularity_factor: factor c on the popularity term (2: the objective is twice the log density).
    :param str objective: ``"marginal"`` (default: the atoms integrated out) or, with fixed hyper-parameters,
        ``"map"`` (the atoms at their MAP values, as :func:`~bnpfed.matching.layer.match_layer` has it).
    :param str stop: empirical Bayes: ``"result"`` (default) or ``"fixed-point"``, as for
        :func:`~bnpfed.matching.layer.match_layer`; ``schedule`` (``"gauss-seidel"``, ``"jacobi"``) and ``device``
        (None or a torch device: its deterministic coordinates' products there) too, and ``progress`` (a progress
        bar of each pass, default False).
    :param constants: the published code's constants, as for :func:`~bnpfed.matching.layer.match_layer`:
        ``popularity_cap``, ``max_atoms``, ``new_atom_penalty`` (``REFERENCE_CONSTANTS`` without its
        ``hyperparameters`` and ``objective``).
    :returns: :class:`~bnpfed.matching.layer.MatchResult`; ``hyperparameters`` holds ``"tau2"``,
        ``"sigma0_2"``, ``"gamma0"``, ``"mu0"`` (and under empirical Bayes ``"tau2_point"``, ``"sigma0_2_point"`` for
        deterministic coordinates beside Bayesian ones, ``"tau2_scaled"``, ``"sigma0_2_scaled"`` for coordinates of
        per-client scales beside coordinates of scale 1); ``estimated`` lists the estimated ones in the order
        ``("mu0", "tau2", "sigma0_2", "tau2_point", "sigma0_2_point", "tau2_scaled", "sigma0_2_scaled",
        "gamma0")``;
        ``objective`` holds F after the first assignment and after every sweep (each at the values that pass used).
    """
    def estimator(matcher, given):
        return PauleMandel(matcher, given, None if mu0 is None else validate_mu0(mu0, matcher.D))

    return match_one_layer(means, variances, noise="tau2", given=dict(tau2=tau2, sigma0_2=sigma0_2, gamma0=gamma0,
                                                                      concentration=concentration),
                           mu0=mu0, precisions=precisions, hyperparameters=hyperparameters, sweeps=sweeps, seed=seed,
                           objective=objective, init_assignments=init_assignments, estimator=estimator, name="means",
                           stop=stop, starts=starts, schedule=schedule, device=device, progress=progress,
                           popularity_factor=popularity_factor, **constants)


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
    concentration: float = 1.0,
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
    return assignment_objective_of(means, variances, assignments, noise="tau2",
                                   values=dict(tau2=tau2, sigma0_2=sigma0_2, gamma0=gamma0,
                                               concentration=concentration), mu0=mu0,
                                   precisions=precisions, name="means", popularity_factor=popularity_factor)

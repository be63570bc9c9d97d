"""Matching Bayesian neurons (posterior means and variances, heteroscedastic noise), checked against the Pyro model,
an independent marginal density, ground truth and the homoscedastic matcher it generalises."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from _reference import groups_of, ibp_configuration_logprob
from scipy import stats
from sklearn.metrics import adjusted_rand_score

from bnpfed.matching import bayesian_assignment_objective, match_bayesian_layer, match_layer
from bnpfed.models import FederatedLayer, beta_bernoulli_layer, log_joint, sample_federated_layer


def harmonic(J):
    return sum(1.0 / j for j in range(1, J + 1))


def heteroscedastic_marginal_log_density(means, variances, assignments, *, tau2, sigma0_2, gamma0, mu0=0.0,
                                         precisions=None):
    """log p(Z, V | U) with every atom integrated out, without the order of a client's neurons: per atom and
    coordinate the members' values (those with s_jd > 0) are jointly Gaussian with mean mu0 and covariance
    sigma0_2 11^T + diag((u + tau2) / s)."""
    J = len(means)
    D = np.asarray(means[0]).shape[1]
    mu0 = np.broadcast_to(np.asarray(mu0, dtype=float), (D,))
    s = np.ones((J, D)) if precisions is None else np.asarray(precisions, dtype=float)
    groups = groups_of(assignments)
    lp = ibp_configuration_logprob([len(g) for g in groups.values()], J, gamma0)
    for members in groups.values():
        for d in range(D):
            seen = [(j, l) for j, l in members if s[j, d] > 0]
            if not seen:
                continue
            x = np.array([means[j][l][d] for j, l in seen])
            noise = np.array([(variances[j][l][d] + tau2) / s[j, d] for j, l in seen])
            cov = sigma0_2 * np.ones((len(seen), len(seen))) + np.diag(noise)
            lp += stats.multivariate_normal.logpdf(x, np.full(len(seen), mu0[d]), cov)
    return lp


def random_assignments(sizes, seed, num_atoms=4):
    """An assignment of each client's neurons to distinct atoms among ``num_atoms``."""
    rng = np.random.default_rng(seed)
    return [rng.choice(num_atoms, size=L, replace=False) for L in sizes]


def small_bayesian_problem(seed, J=3, D=3, with_zeros=True):
    rng = np.random.default_rng(seed)
    atoms = rng.normal(size=(4, D))
    sizes = [int(rng.integers(1, 4)) for _ in range(J)]
    truth = random_assignments(sizes, seed)
    U = [np.exp(rng.uniform(np.log(0.01), np.log(1.0), size=(L, D))) for L in sizes]
    if with_zeros:
        U[0][:, -1] = 0.0  # a deterministic coordinate (a bias)
    V = [atoms[a] + np.sqrt(u + 0.05) * rng.normal(size=u.shape) for a, u in zip(truth, U)]
    return V, U, truth


def partition(assignments):
    """The assignment as a set of frozensets of (client, neuron): label-free."""
    return {frozenset(g) for g in groups_of([np.asarray(a) for a in assignments]).values()}


def synthetic_bayesian_layer(seed, *, J=10, D=30, gamma0=15.0, tau2=0.01, low=0.05, high=5.0):
    """Atoms and assignment from the model (sigma0_2 = 1, mu0 = 0), posterior variances log-uniform per neuron and
    coordinate on [low, high], means ``v ~ N(theta, u + tau2)``."""
    layer = sample_federated_layer(J, D, seed=seed, gamma0=gamma0, sigma2=1.0)  # atoms and assignment only
    rng = np.random.default_rng(seed)
    atoms = layer.atoms.double().numpy()
    V, U = [], []
    for a in layer.assignments:
        u = np.exp(rng.uniform(math.log(low), math.log(high), size=(a.numel(), D)))
        V.append(atoms[a.numpy()] + np.sqrt(u + tau2) * rng.normal(size=u.shape))
        U.append(u)
    return V, U, np.concatenate([a.numpy() for a in layer.assignments])


def ari(result, truth):
    return adjusted_rand_score(truth, np.concatenate([a.numpy() for a in result.assignments]))


# --------------------------------------------------------------------------------------------------------------------
# the Pyro model with posterior variances


def test_sampled_means_spread_about_their_atom_with_the_posterior_variance_plus_sigma2():
    """v_j ~ N(theta, u_j + sigma2): the standardised residuals have mean square 1 (10 000 entries: standard error
    0.014; tolerance 0.06) among the neurons of small and of large u alike, whereas sigma2 alone would give far more."""
    D, sigma2 = 50, 0.01
    law = dist.LogNormal(math.log(0.01), 1.0).expand([D])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        trace = pyro.poutine.trace(beta_bernoulli_layer).get_trace(10, D, gamma0=20.0, tau2=sigma2,
                                                                    neuron_variance=law)
    layer = trace.nodes["_RETURN"]["value"]
    for j, (v, u) in enumerate(zip(layer.neurons, layer.variances)):
        assert u.shape == v.shape
        if v.shape[0]:
            assert torch.equal(trace.nodes[f"u_{j}"]["value"], u)
            assert trace.nodes[f"u_{j}"]["fn"].event_shape == (D,)
    resid = torch.cat([v - layer.atoms[a] for v, a in zip(layer.neurons, layer.assignments)])
    u = torch.cat(layer.variances)
    z2 = resid ** 2 / (u + sigma2)
    assert z2.numel() > 5000
    small = u < u.median()
    assert float(z2[small].mean()) == pytest.approx(1.0, abs=0.06)
    assert float(z2[~small].mean()) == pytest.approx(1.0, abs=0.06)
    assert float((resid ** 2 / sigma2).mean()) > 2.0


def test_conditioned_log_joint_is_the_hand_computed_density(float64):
    """Two clients sharing one atom in R^2, posterior variances Gamma(2, 200): IBP prior ``log gamma0 - gamma0 H_2 -
    log 2``, the atom's prior, each neuron's variance density and its mean's N(theta, u + sigma2) density."""
    gamma0, sigma2, sigma0_2, mu0 = 1.5, 0.02, 0.7, 0.1
    theta = torch.tensor([[0.3, -0.4]])
    u = [torch.tensor([[0.01, 0.02]]), torch.tensor([[0.005, 0.03]])]
    v = [torch.tensor([[0.35, -0.5]]), torch.tensor([[0.2, -0.3]])]
    layer = FederatedLayer(atoms=theta, assignments=[torch.tensor([0]), torch.tensor([0])], neurons=v, variances=u)
    law = dist.Gamma(2.0, 200.0)
    lp = log_joint(layer, gamma0=gamma0, tau2=sigma2, sigma0_2=sigma0_2, mu0=mu0, neuron_variance=law)
    expected = math.log(gamma0) - gamma0 * 1.5 - math.log(2)
    expected += stats.norm.logpdf(theta.numpy(), mu0, math.sqrt(sigma0_2)).sum()
    for uj, vj in zip(u, v):
        expected += stats.gamma.logpdf(uj.numpy(), 2.0, scale=1 / 200.0).sum()
        expected += stats.norm.logpdf(vj.numpy(), theta.numpy(), np.sqrt(uj.numpy() + sigma2)).sum()
    assert float(lp) == pytest.approx(expected, rel=1e-10)
    with pytest.raises(ValueError, match="neuron_variance"):
        log_joint(layer, gamma0=gamma0, sigma2=sigma2)


# --------------------------------------------------------------------------------------------------------------------
# the objective is twice the log marginal density, up to a constant of the data


@pytest.mark.parametrize("with_precisions", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_objective_is_twice_the_marginal_density_plus_the_stated_constant(seed, with_precisions):
    """For several assignments of the same data, F - 2 log p(Z, V | U) equals
    ``2 gamma0 H_J - sum_{jld: s > 0} [log(w / (2 pi)) - w v^2]`` with w = s / (u + tau2) (module docstring), to
    1e-9 relative; p from scipy's multivariate normals."""
    V, U, truth = small_bayesian_problem(seed)
    J, D = len(V), V[0].shape[1]
    precisions = None
    if with_precisions:
        precisions = np.random.default_rng(seed).uniform(0.2, 2.0, size=(J, D))
        precisions[1, 0] = 0.0  # client 1 says nothing about coordinate 0
    hyper = dict(tau2=0.05, sigma0_2=0.8, gamma0=2.0, mu0=np.array([0.1, -0.2, 0.0]))
    s = np.ones((J, D)) if precisions is None else precisions
    constant = 2 * hyper["gamma0"] * harmonic(J)
    for j in range(J):
        w = s[j] / (U[j] + hyper["tau2"])
        seen = w > 0
        constant -= (np.log(w[seen] / (2 * math.pi)) - w[seen] * V[j][seen] ** 2).sum()
    for k in range(4):
        Z = truth if k == 0 else random_assignments([len(v) for v in V], 100 * seed + k, num_atoms=3 + k)
        F = bayesian_assignment_objective(V, U, Z, precisions=precisions, **hyper)
        lp = heteroscedastic_marginal_log_density(V, U, Z, precisions=precisions, **hyper)
        assert F - 2 * lp == pytest.approx(constant, rel=1e-9)


@pytest.mark.parametrize("seed", range(2))
def test_objective_is_twice_the_pyro_log_joint_at_the_atoms_posterior_mode_less_their_posterior_log_density(
        seed, float64):
    """``2 log p(theta_hat, Z, V, U) - sum_{i,d} log(P_id / (2 pi)) = 2 log p(Z, V, U)`` (the posterior of each atom
    coordinate is Gaussian with precision P_id, its log density at the mode 1/2 log(P/(2 pi))), so against the Pyro
    ``log_joint`` (configuration form) F differs by the same number for every assignment: the u_j densities and the
    orders of the clients' neurons do not depend on it."""
    V, U, truth = small_bayesian_problem(seed, with_zeros=False)  # Gamma(2, 200) needs u > 0
    hyper = dict(tau2=0.05, sigma0_2=0.8, gamma0=2.0, mu0=0.1)
    J, D = len(V), V[0].shape[1]
    precisions = np.random.default_rng(seed).uniform(0.5, 2.0, size=(J, D))
    law = dist.Gamma(2.0, 200.0)
    differences = []
    for k in range(4):
        Z = truth if k == 0 else random_assignments([len(v) for v in V], 100 * seed + k, num_atoms=3 + k)
        groups = groups_of(Z)
        labels = {i: n for n, i in enumerate(sorted(groups))}
        P = np.full((len(groups), D), 1 / hyper["sigma0_2"])
        g = np.full((len(groups), D), hyper["mu0"] / hyper["sigma0_2"])
        for i, members in groups.items():
            for j, l in members:
                w = precisions[j] / (U[j][l] + hyper["tau2"])
                P[labels[i]] += w
                g[labels[i]] += w * V[j][l]
        layer = FederatedLayer(atoms=torch.as_tensor(g / P), neurons=[torch.as_tensor(v) for v in V],
                               assignments=[torch.tensor([labels[int(i)] for i in a]) for a in Z],
                               variances=[torch.as_tensor(u) for u in U])
        lj = log_joint(layer, configuration=True, gamma0=hyper["gamma0"], tau2=hyper["tau2"],
                       sigma0_2=hyper["sigma0_2"], mu0=hyper["mu0"], precisions=torch.as_tensor(precisions),
                       neuron_variance=law)
        F = bayesian_assignment_objective(V, U, Z, precisions=precisions, **hyper)
        differences.append(F - (2 * float(lj) - np.log(P / (2 * math.pi)).sum()))
    assert differences == pytest.approx([differences[0]] * len(differences), rel=1e-9)


# --------------------------------------------------------------------------------------------------------------------
# the homoscedastic special case


@pytest.mark.parametrize("with_precisions", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_without_posterior_variances_it_is_the_homoscedastic_marginal_matching(seed, with_precisions):
    """u = 0: the same assignment (labels included) and objective list (after the greedy pass and every sweep) as
    ``match_layer(..., hyperparameters="fixed", objective="marginal")`` at sigma2 = tau2, to 1e-8 relative."""
    layer = sample_federated_layer(8, 20, seed=seed, gamma0=10.0, sigma2=0.1)
    V = [v.double().numpy() for v in layer.neurons]
    precisions = None
    if with_precisions:
        precisions = np.ones((8, 20))
        precisions[:, 15:] = np.random.default_rng(seed).uniform(0.0, 1.0, size=(8, 5))
    hyper = dict(sigma0_2=1.0, gamma0=10.0, mu0=0.05, precisions=precisions, hyperparameters="fixed", seed=seed,
                 sweeps=4)
    homo = match_layer(V, sigma2=0.1, objective="marginal", **hyper)
    bayes = match_bayesian_layer(V, [np.zeros_like(v) for v in V], tau2=0.1, **hyper)
    assert all(torch.equal(a, b) for a, b in zip(homo.assignments, bayes.assignments))
    assert bayes.objective == pytest.approx(homo.objective, rel=1e-8)
    assert torch.allclose(bayes.global_atoms.double(), homo.global_atoms.double(), rtol=1e-8, atol=1e-10)
    assert torch.allclose(bayes.posterior_precision.double(), homo.posterior_precision.double(), rtol=1e-8)


# --------------------------------------------------------------------------------------------------------------------
# the matching


@pytest.mark.parametrize("seed", range(3))
def test_fixed_hyperparameter_sweeps_never_lower_the_objective(seed):
    V, U, _ = synthetic_bayesian_layer(seed, D=10, high=1.0)
    precisions = np.ones((10, 10))
    precisions[:, 8:] = np.random.default_rng(seed).uniform(0.0, 1.0, size=(10, 2))
    r = match_bayesian_layer(V, U, tau2=0.01, sigma0_2=1.0, gamma0=15.0, precisions=precisions,
                             hyperparameters="fixed", sweeps=6, seed=seed)
    assert all(b >= a - 1e-9 * abs(a) for a, b in zip(r.objective, r.objective[1:]))
    F = bayesian_assignment_objective(V, U, r.assignments, tau2=0.01, sigma0_2=1.0, gamma0=15.0,
                                      precisions=precisions)
    assert F == pytest.approx(r.objective[-1], rel=1e-10)


def test_with_the_estimates_held_at_their_final_values_sweeps_from_the_result_do_not_lower_it():
    V, U, _ = synthetic_bayesian_layer(0, D=20, high=1.0)
    r = match_bayesian_layer(V, U, seed=0)
    h = {k: r.hyperparameters[k] for k in ("tau2", "sigma0_2", "gamma0")}
    again = match_bayesian_layer(V, U, mu0=r.hyperparameters["mu0"], hyperparameters="fixed",
                                 init_assignments=r.assignments, sweeps=3, seed=1, **h)
    assert again.objective[0] == pytest.approx(
        bayesian_assignment_objective(V, U, r.assignments, mu0=r.hyperparameters["mu0"], **h), rel=1e-12)
    assert all(b >= a - 1e-9 * abs(a) for a, b in zip(again.objective, again.objective[1:]))


@pytest.mark.parametrize("seed", range(3))
def test_posterior_variances_recover_the_assignment_that_one_noise_level_cannot(seed):
    """J = 10, D = 30, atoms from N(0, 1), IBP mass 15, tau2 = 0.01, posterior variances log-uniform on [0.05, 5]
    per neuron and coordinate (two orders of magnitude). Empirical-Bayes matching with the variances recovers the
    assignment (ARI 0.994 / 1.000 / 0.997 for seeds 0-2, >= 0.99 over seeds 0-9); the homoscedastic matcher on the
    same means, at the best of 13 noise levels 1e-3 .. 10 with the true sigma0_2 and gamma0, reaches 0.863 / 0.779 /
    0.794 (0.78-0.94 over seeds 0-9). Asserted: >= 0.95, and at least 0.1 below."""
    V, U, truth = synthetic_bayesian_layer(seed)
    bayes = ari(match_bayesian_layer(V, U, seed=seed), truth)
    homo = max(ari(match_layer(V, sigma2=float(s2), sigma0_2=1.0, gamma0=15.0, hyperparameters="fixed",
                               objective="marginal", seed=seed), truth) for s2 in np.geomspace(1e-3, 10, 13))
    assert bayes >= 0.95
    assert homo <= bayes - 0.1


@pytest.mark.parametrize("seed", range(3))
def test_empirical_bayes_recovers_tau2_sigma0_2_and_the_atoms(seed):
    """A layer from the Pyro model (J = 10, D = 50, gamma0 = 30: 75-91 atoms), posterior variances Gamma(2, 200)
    (mean 0.01), tau2 = 0.02, sigma0_2 = 1: tau2 within 5% (observed within 1%), sigma0_2 within 10% (observed
    within 5%: a few thousand atom coordinates), the number of atoms exact."""
    law = dist.Gamma(2.0, 200.0).expand([50])
    layer = sample_federated_layer(10, 50, seed=seed, gamma0=30.0, tau2=0.02, neuron_variance=law)
    r = match_bayesian_layer(layer.neurons, layer.variances, seed=seed)
    assert r.converged and r.estimated == ("mu0", "tau2", "sigma0_2", "gamma0")
    assert r.hyperparameters["tau2"] == pytest.approx(0.02, rel=0.05)
    assert r.hyperparameters["sigma0_2"] == pytest.approx(1.0, rel=0.1)
    assert r.num_atoms == layer.num_atoms
    assert r.hyperparameters["gamma0"] == pytest.approx(layer.num_atoms / harmonic(10), rel=1e-12)
    assert set(r.hyperparameters) == {"tau2", "sigma0_2", "gamma0", "mu0"}
    assert len(r.hyperparameter_history) == len(r.objective) == r.sweeps_run + 1


def test_coordinates_with_per_client_scales_get_their_own_pair():
    """Output-like coordinates seen at class shares s and on a larger scale (atoms N(0, 9), extra variance 0.2) beside
    coordinates of scale 1 (N(0, 1), 0.02): each block's pair is estimated on its own (within 15%)."""
    rng = np.random.default_rng(0)
    layer = sample_federated_layer(10, 45, seed=0, gamma0=25.0, sigma2=1.0)
    atoms = layer.atoms.double().numpy()
    atoms[:, 40:] *= 3.0
    s = np.ones((10, 45))
    s[:, 40:] = rng.uniform(0.3, 1.0, size=(10, 5))
    V, U = [], []
    for j, a in enumerate(layer.assignments):
        u = rng.gamma(2.0, 0.005, size=(a.numel(), 45))
        tau2 = np.where(np.arange(45) < 40, 0.02, 0.2)
        V.append(atoms[a.numpy()] + np.sqrt((u + tau2) / s[j]) * rng.normal(size=u.shape))
        U.append(u)
    r = match_bayesian_layer(V, U, precisions=s, seed=0)
    h = r.hyperparameters
    assert r.estimated == ("mu0", "tau2", "sigma0_2", "tau2_scaled", "sigma0_2_scaled", "gamma0")
    assert h["tau2"] == pytest.approx(0.02, rel=0.15) and h["sigma0_2"] == pytest.approx(1.0, rel=0.15)
    assert h["tau2_scaled"] == pytest.approx(0.2, rel=0.15) and h["sigma0_2_scaled"] == pytest.approx(9.0, rel=0.15)
    given = match_bayesian_layer(V, U, precisions=s, tau2=0.02, seed=0).hyperparameters
    assert given["tau2"] == given["tau2_scaled"] == 0.02


def test_the_order_of_the_clients_and_of_their_neurons_changes_nothing():
    V, U, _ = synthetic_bayesian_layer(1, D=20, high=1.0)
    r = match_bayesian_layer(V, U, seed=0)
    rng = np.random.default_rng(5)
    order = rng.permutation(len(V))
    perms = [rng.permutation(len(V[j])) for j in order]
    V2 = [V[j][p] for j, p in zip(order, perms)]
    U2 = [U[j][p] for j, p in zip(order, perms)]
    r2 = match_bayesian_layer(V2, U2, seed=3)
    back = [None] * len(V)
    for k, (j, p) in enumerate(zip(order, perms)):
        a = np.empty(len(p), dtype=np.int64)
        a[p] = r2.assignments[k].numpy()
        back[j] = a
    assert partition(back) == partition(r.assignments)
    for name in ("tau2", "sigma0_2", "gamma0"):
        assert r2.hyperparameters[name] == pytest.approx(r.hyperparameters[name], rel=1e-8)
    assert r2.objective[-1] == pytest.approx(r.objective[-1], rel=1e-9)


def test_clients_without_neurons_count_in_J_only():
    V, U, _ = small_bayesian_problem(0)
    D = V[0].shape[1]
    V_e = V + [np.zeros((0, D))]
    U_e = U + [np.zeros((0, D))]
    hyper = dict(tau2=0.05, sigma0_2=1.0, gamma0=2.0)
    r = match_bayesian_layer(V_e, U_e, hyperparameters="fixed", seed=0, **hyper)
    assert r.assignments[-1].numel() == 0
    with_empty = bayesian_assignment_objective(V_e, U_e, r.assignments, **hyper)
    without = bayesian_assignment_objective(V, U, r.assignments[:-1], **hyper)
    assert with_empty == pytest.approx(r.objective[-1], rel=1e-12)
    assert with_empty != pytest.approx(without, rel=1e-6)  # J enters log(gamma0 / J) and m / (J - m)
    eb = match_bayesian_layer(V_e, U_e, seed=0)
    assert eb.assignments[-1].numel() == 0
    assert eb.hyperparameters["gamma0"] == pytest.approx(eb.num_atoms / harmonic(len(V_e)))
    assert any("hold no neurons" in n for n in eb.notes)


def test_torch_input_float32_gives_float32_atoms_and_the_same_matching():
    V, U, _ = small_bayesian_problem(1)
    hyper = dict(tau2=0.05, sigma0_2=1.0, gamma0=2.0, hyperparameters="fixed", seed=0)
    a = match_bayesian_layer(V, U, **hyper)
    b = match_bayesian_layer([torch.as_tensor(v, dtype=torch.float32) for v in V],
                             [torch.as_tensor(u, dtype=torch.float32) for u in U], **hyper)
    assert b.global_atoms.dtype == torch.float32
    assert partition(a.assignments) == partition(b.assignments)


@pytest.mark.parametrize("case, kwargs, match", [
    ("shape", {}, r"variances\[0\]"),
    ("D", {}, r"means\[1\]"),
    ("nan", {}, r"means\[0\]"),
    ("inf", {}, r"variances\[1\]"),
    ("negative", {}, r"variances\[0\]"),
    ("count", {}, "variances"),
    ("ok", dict(hyperparameters="mle"), "hyperparameters"),
    ("ok", dict(tau2=0.0), "tau2"),
    ("ok", dict(sigma0_2=-1.0), "sigma0_2"),
    ("ok", dict(gamma0=float("nan")), "gamma0"),
    ("ok", dict(hyperparameters="fixed", sigma0_2=1.0, gamma0=1.0), "tau2"),
    ("ok", dict(precisions=np.ones((2, 3))), "precisions"),
    ("ok", dict(sweeps=-1), "sweeps"),
    ("ok", dict(popularity_factor=-1.0), "popularity_factor"),
    ("ok", dict(init_assignments=[[0, 0], [1]]), r"init_assignments\[0\]"),
    ("ok", dict(mu0=np.zeros(3)), "mu0"),
])
def test_bad_input_raises_naming_the_argument(case, kwargs, match):
    V = [np.zeros((2, 2)), np.ones((1, 2))]
    U = [np.full((2, 2), 0.1), np.full((1, 2), 0.1)]
    if case == "shape":
        U[0] = np.zeros((2, 3))
    elif case == "D":
        V[1] = np.ones((1, 3))
    elif case == "nan":
        V[0][0, 0] = np.nan
    elif case == "inf":
        U[1][0, 0] = np.inf
    elif case == "negative":
        U[0][1, 1] = -1e-3
    elif case == "count":
        U = U[:1]
    with pytest.raises(ValueError, match=match):
        match_bayesian_layer(V, U, **kwargs)


def test_bad_objective_arguments_raise_naming_them():
    V, U = [np.zeros((2, 2))], [np.zeros((2, 2))]
    hyper = dict(tau2=0.1, sigma0_2=1.0, gamma0=1.0)
    with pytest.raises(ValueError, match=r"assignments\[0\]"):
        bayesian_assignment_objective(V, U, [[0]], **hyper)
    with pytest.raises(ValueError, match="tau2"):
        bayesian_assignment_objective(V, U, [[0, 1]], **{**hyper, "tau2": -1.0})


def test_deterministic_coordinates_get_a_noise_variance_of_their_own():
    """Clients that retrained their slice of a global posterior agree on their Bayesian coordinates far within their
    posterior variances, while their deterministic biases (variance 0) drift apart: each kind gets its own estimate
    -- tau2 at its floor, tau2_point the biases' drift -- and copies of a unit merge."""
    from sklearn.metrics import adjusted_rand_score

    rng = np.random.default_rng(0)
    J, L, D = 6, 12, 20
    atoms, biases = rng.normal(size=(L, D)), rng.normal(size=L)
    means, variances, truth = [], [], []
    for _ in range(J):
        order = rng.permutation(L)
        w = atoms[order] + 1e-3 * rng.normal(size=(L, D))             # agree within 1e-3, posterior sd 0.03
        b = biases[order] + 0.2 * rng.normal(size=L)                   # deterministic, drift sd 0.2
        means.append(np.column_stack([w, b]))
        variances.append(np.column_stack([np.full((L, D), 1e-3), np.zeros(L)]))
        truth.append(order)
    r = match_bayesian_layer(means, variances, seed=0)
    assert {"tau2_point", "sigma0_2_point"} <= set(r.estimated)
    assert adjusted_rand_score(np.concatenate(truth), np.concatenate([a.numpy() for a in r.assignments])) == 1.0
    assert r.num_atoms == L
    # 60 degrees of freedom: the Paule-Mandel estimate of the bias noise 0.04 within 40 % (about 2 standard errors)
    assert r.hyperparameters["tau2_point"] == pytest.approx(0.04, rel=0.4)
    assert r.hyperparameters["tau2"] < 1e-6 and any("tau2 floored" in note for note in r.notes)

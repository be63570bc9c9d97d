"""Hungarian MAP matching of one layer (PFNM's server step), checked against brute force, Pyro and ground truth."""

import itertools
import math

import numpy as np
import pytest
import torch
from _reference import map_log_density, marginal_log_density
from sklearn.metrics import adjusted_rand_score

from bnpfed.matching import REFERENCE_CONSTANTS, assignment_objective, match_layer
from bnpfed.matching.layer import average_atoms, averaging_weights
from bnpfed.models import FederatedLayer, log_joint, sample_federated_layer


def small_problem(J, seed, D=3, L_max=3):
    rng = np.random.default_rng(seed)
    atoms = rng.normal(size=(4, D))
    neurons = []
    for _ in range(J):
        L = int(rng.integers(1, L_max + 1))
        idx = rng.choice(4, size=L, replace=False)
        neurons.append(atoms[idx] + 0.3 * rng.normal(size=(L, D)))
    return neurons


def client_assignments(j, assignments):
    """Every assignment of client j's neurons given the others: each neuron to a distinct atom used by another
    client, or to its own new atom."""
    others = sorted({int(i) for k, a in enumerate(assignments) if k != j for i in np.asarray(a)})
    L_j = len(assignments[j])
    fresh = [10_000 + l for l in range(L_j)]
    for choice in itertools.product(others + ["new"], repeat=L_j):
        taken = [c for c in choice if c != "new"]
        if len(set(taken)) != len(taken):
            continue
        yield [fresh[l] if c == "new" else c for l, c in enumerate(choice)]


def brute_force_best(j, assignments, neurons, **hyper):
    best = -math.inf
    for cand in client_assignments(j, assignments):
        trial = [np.asarray(a) for a in assignments]
        trial[j] = np.array(cand)
        # the matcher's objective is 2 log p(configuration, theta_hat) plus the L D log(2 pi sigma0_2) it drops
        L = len({int(i) for a in trial for i in a})
        D = neurons[0].shape[1]
        value = 2 * map_log_density(neurons, trial, **hyper) + L * D * math.log(2 * math.pi * hyper["sigma0_2"])
        best = max(best, value)
    return best


def objective_of(assignments, neurons, **hyper):
    L = len({int(i) for a in assignments for i in np.asarray(a)})
    D = neurons[0].shape[1]
    return 2 * map_log_density(neurons, assignments, **hyper) + L * D * math.log(2 * math.pi * hyper["sigma0_2"])


@pytest.mark.parametrize("J", [2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_step_maximises_objective_over_all_assignments_of_last_client(J, seed):
    """With sweeps=0 the last client of the greedy pass is matched once, given all the others."""
    neurons = small_problem(J, seed)
    hyper = dict(sigma2=0.2, sigma0_2=1.0, gamma0=2.0, mu0=0.1)
    r = match_layer(neurons, hyperparameters="fixed", sweeps=0, **hyper)
    last = int(np.argsort(-np.array([len(v) for v in neurons]), kind="stable")[-1])
    found = objective_of(r.assignments, neurons, **hyper)
    assert found == pytest.approx(brute_force_best(last, r.assignments, neurons, **hyper), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_converged_matching_is_optimal_for_every_client_given_the_others(seed):
    neurons = small_problem(3, seed + 10)
    precisions = np.random.default_rng(seed).uniform(0.5, 2.0, size=(3, 3))
    precisions[:, 0] = 1.0  # one block-A coordinate, two per-client-precision coordinates
    hyper = dict(sigma2=0.2, sigma0_2=1.0, gamma0=2.0, mu0=np.array([0.0, 0.1, -0.1]), precisions=precisions)
    r = match_layer(neurons, hyperparameters="fixed", sweeps=10, seed=seed, **hyper)
    assert r.objective[-1] == pytest.approx(r.objective[-2], rel=1e-12)  # converged
    found = objective_of(r.assignments, neurons, **hyper)
    for j in range(3):
        assert found == pytest.approx(brute_force_best(j, r.assignments, neurons, **hyper), rel=1e-9)


def random_assignments(sizes, num_atoms, rng):
    return [rng.choice(num_atoms, size=L, replace=False) for L in sizes]


def offset_from_log_joint(neurons, assignments, *, gamma0, sigma2, sigma0_2, mu0, precisions):
    """F(Z) - 2 log p_conf(Z, theta_hat, V) - L D log(2 pi sigma0_2), the log joint from the Pyro model at the atoms'
    MAP values given Z."""
    s, D = precisions, neurons[0].shape[1]
    kw = dict(gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2, mu0=mu0, precisions=s)
    F = assignment_objective(neurons, assignments, **kw)
    labels = sorted({int(i) for a in assignments for i in a})
    theta = []
    for i in labels:
        members = [(j, l) for j, a in enumerate(assignments) for l, x in enumerate(a) if x == i]
        prec = 1 / sigma0_2 + sum(s[j] / sigma2 for j, _ in members)
        theta.append((mu0 / sigma0_2 + sum(s[j] * neurons[j][l] / sigma2 for j, l in members)) / prec)
    relabel = {x: k for k, x in enumerate(labels)}
    layer = FederatedLayer(atoms=torch.stack(theta),
                           assignments=[torch.tensor([relabel[int(x)] for x in a], dtype=torch.long)
                                        for a in assignments],
                           neurons=neurons)
    lp = log_joint(layer, configuration=True, **kw).item()
    return F - 2 * lp - len(labels) * D * math.log(2 * math.pi * sigma0_2)


def written_out_constant(neurons, *, gamma0, sigma2, precisions):
    """const(V, J, gamma0) = 2 gamma0 H_J + 2 sum_j log L_j! + sum_{j,l,d} [log(2 pi sigma2/s_jd) + s_jd v_jld^2 /
    sigma2]; J counts every client, those without neurons included."""
    J, s = len(neurons), precisions
    H = sum(1 / j for j in range(1, J + 1))
    const = 2 * gamma0 * H + sum(2 * math.lgamma(len(v) + 1) for v in neurons)
    const += sum(float((torch.log(2 * math.pi * sigma2 / s[j]) + s[j] * v ** 2 / sigma2).sum())
                 for j, v in enumerate(neurons))
    return const


@pytest.mark.parametrize("with_precisions", [False, True])
def test_objective_is_twice_the_pyro_log_joint_up_to_terms_in_the_number_of_atoms(float64, with_precisions):
    """F(Z) - 2 log p_conf(Z, theta_hat, V) = L D log(2 pi sigma0_2) + const, for any assignment Z: the published
    objective drops only the atoms' prior normalising constants (popularity factor 2, caps off)."""
    J, D = 4, 5
    gamma0, sigma2, sigma0_2 = 3.0, 0.3, 0.7
    mu0 = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1])
    rng = np.random.default_rng(0)
    neurons = [torch.randn(L, D, generator=torch.Generator().manual_seed(L)) for L in (3, 2, 4, 3)]
    s = torch.ones(J, D)
    if with_precisions:
        s[:, 3:] = torch.rand(J, 2, generator=torch.Generator().manual_seed(1)) + 0.2
    kw = dict(gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2, mu0=mu0, precisions=s)
    offsets = [offset_from_log_joint(neurons, random_assignments([len(v) for v in neurons], 7, rng), **kw)
               for _ in range(6)]
    const = written_out_constant(neurons, gamma0=gamma0, sigma2=sigma2, precisions=s)
    assert np.allclose(offsets, const, rtol=1e-9, atol=1e-7)


def layer_with_empty_clients(J, D, *, at_least=1, gamma0=1.0, sigma2=0.1, **model_kwargs):
    """The first sampled layer (seeds 0, 1, ...) in which at least ``at_least`` clients drew no atom (probability
    exp(-gamma0) each) and the others hold at least 3 neurons in all."""
    for seed in range(1000):
        layer = sample_federated_layer(J, D, seed=seed, gamma0=gamma0, sigma2=sigma2, **model_kwargs)
        sizes = [len(a) for a in layer.assignments]
        if sizes.count(0) >= at_least and sum(sizes) >= 3:
            return layer
    raise AssertionError("no such layer in 1000 seeds")


def by_hand_layer_with_empty_clients(D):
    """Clients 0 and 3 of five hold no neuron; client 0 is first, so client 1 opens the first atoms."""
    g = torch.Generator().manual_seed(0)
    atoms = torch.randn(3, D, generator=g)
    assignments = [torch.zeros(0, dtype=torch.long), torch.tensor([1, 0]), torch.tensor([2, 0, 1]),
                   torch.zeros(0, dtype=torch.long), torch.tensor([2])]
    neurons = [atoms[a] + 0.3 * torch.randn(len(a), D, generator=g) for a in assignments]
    return FederatedLayer(atoms=atoms, assignments=assignments, neurons=neurons)


@pytest.mark.parametrize("source", ["sampled", "by hand"])
@pytest.mark.parametrize("with_precisions", [False, True])
def test_objective_with_clients_without_neurons_is_twice_the_pyro_log_joint_up_to_the_same_constant(
        float64, source, with_precisions):
    """The relation above holds with clients that have no neurons: they count in J (in log(gamma0/J), m/(J-m) and
    the model's IBP), have no assignment, and add nothing else to either side."""
    D, gamma0, sigma2, sigma0_2 = 4, 1.5, 0.2, 0.8
    if source == "sampled":
        layer = layer_with_empty_clients(6, D, at_least=1, gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2)
    else:
        layer = by_hand_layer_with_empty_clients(D)
    neurons, J = layer.neurons, layer.num_clients
    sizes = [len(v) for v in neurons]
    assert 0 in sizes
    mu0 = torch.tensor([0.0, 0.0, 0.0, 0.1])
    s = torch.ones(J, D)
    if with_precisions:
        s[:, 2:] = torch.rand(J, 2, generator=torch.Generator().manual_seed(1)) + 0.2
    kw = dict(gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2, mu0=mu0, precisions=s)
    rng = np.random.default_rng(0)
    trials = [layer.assignments] + [random_assignments(sizes, max(sizes) + 3, rng) for _ in range(5)]
    offsets = [offset_from_log_joint(neurons, assignments, **kw) for assignments in trials]
    const = written_out_constant(neurons, gamma0=gamma0, sigma2=sigma2, precisions=s)
    assert np.allclose(offsets, const, rtol=1e-9, atol=1e-7)
    # the row of a client without neurons is never used: zeros there change nothing
    silent = s.clone()
    silent[[j for j in range(J) if sizes[j] == 0]] = 0.0
    for assignments in trials[:2]:
        assert assignment_objective(neurons, assignments, **{**kw, "precisions": silent}) == pytest.approx(
            assignment_objective(neurons, assignments, **kw), rel=1e-12)


def test_a_client_without_neurons_counts_in_J_so_dropping_it_changes_the_objective():
    """F depends on J only through the IBP terms, sum_i [2 log(gamma0/J) + 2 sum_{k<m_i} log(k/(J-k))]: dropping the
    empty clients changes F by exactly the change of those terms."""
    layer = by_hand_layer_with_empty_clients(3)
    gamma0 = 2.0
    kw = dict(sigma2=0.1, sigma0_2=1.0, gamma0=gamma0)
    kept = [j for j, v in enumerate(layer.neurons) if len(v)]
    full = assignment_objective(layer.neurons, layer.assignments, **kw)
    dropped = assignment_objective([layer.neurons[j] for j in kept], [layer.assignments[j] for j in kept], **kw)

    def ibp_terms(J):
        return sum(2 * math.log(gamma0 / J) + 2 * sum(math.log(k / (J - k)) for k in range(1, m))
                   for m in layer.counts.tolist())

    assert full - dropped == pytest.approx(ibp_terms(5) - ibp_terms(3), rel=1e-10)
    assert abs(full - dropped) > 1.0
    # and the matcher reports the objective with J = 5
    r = match_layer(layer.neurons, hyperparameters="fixed", seed=0, **kw)
    assert r.objective[-1] == pytest.approx(assignment_objective(layer.neurons, r.assignments, **kw), rel=1e-10)


@pytest.mark.parametrize("settings", [{}, REFERENCE_CONSTANTS])
def test_clients_without_neurons_get_empty_assignments_on_every_path(settings):
    """Greedy pass, sweeps, direct and Gram cross products, zero precision rows for the empty clients."""
    layer = layer_with_empty_clients(8, 6, at_least=2, gamma0=1.0, sigma2=0.05)
    J = layer.num_clients
    empty = [j for j, v in enumerate(layer.neurons) if len(v) == 0]
    prec = torch.ones(J, 6)
    prec[:, -2:] = 0.5
    prec[empty] = 0.0
    kw = dict(sigma2=0.05, sigma0_2=1.0, gamma0=1.0, precisions=prec)
    runs = {cp: match_layer(layer.neurons, seed=0, sweeps=4, cross_products=cp, stop_at_fixed_point=False, **kw,
                            **{"hyperparameters": "fixed", **settings}) for cp in ("direct", "gram")}
    r = runs["direct"]
    assert len(r.assignments) == J and all(r.assignments[j].numel() == 0 for j in empty)
    assert all(a.dtype == torch.long for a in r.assignments)
    assert torch.equal(r.counts, torch.bincount(torch.cat(r.assignments), minlength=r.num_atoms))
    assert (r.counts <= J - len(empty)).all()
    assert len(r.rematches) == J * 5  # every client once per pass, the empty ones included
    assert all(torch.equal(a, b) for a, b in zip(runs["gram"].assignments, r.assignments))
    assert runs["gram"].objective == pytest.approx(r.objective, rel=1e-10)
    pop = {k: v for k, v in settings.items() if k in ("popularity_factor", "popularity_cap")}
    assert r.objective[-1] == pytest.approx(assignment_objective(layer.neurons, r.assignments, **kw, **pop),
                                            rel=1e-10)
    if not settings:
        assert (np.diff(r.objective) >= -1e-9 * abs(r.objective[0])).all()


def test_marginal_objective_is_twice_the_marginal_likelihood_up_to_a_constant():
    """F_marg(Z) = 2 log p_conf(Z, V) with the atoms integrated out, + a constant in V alone (no L-dependent term)."""
    neurons = small_problem(3, 5, D=4)
    prec = np.ones((3, 4))
    prec[:, 2:] = [[0.5, 2.0], [1.5, 0.7], [1.0, 3.0]]
    hyper = dict(sigma2=0.2, sigma0_2=1.3, gamma0=2.0, mu0=0.1, precisions=prec)
    rng = np.random.default_rng(1)
    offsets = []
    for _ in range(6):
        assignments = random_assignments([len(v) for v in neurons], 6, rng)
        F = assignment_objective(neurons, assignments, objective="marginal", **hyper)
        offsets.append(F - 2 * marginal_log_density(neurons, assignments, **hyper))
    assert np.ptp(offsets) < 1e-8 * max(1.0, abs(offsets[0]))


@pytest.mark.parametrize("objective", ["map", "marginal"])
@pytest.mark.parametrize("settings", [{}, {"popularity_factor": 1.0, "popularity_cap": 3}])
@pytest.mark.parametrize("seed", range(3))
def test_objective_never_decreases_across_sweeps(objective, settings, seed):
    layer = sample_federated_layer(8, 20, seed=seed, gamma0=6.0, sigma2=0.3, sigma0_2=1.0)
    r = match_layer(layer.neurons, hyperparameters="fixed", sigma2=0.3, sigma0_2=1.0, gamma0=6.0, sweeps=8, seed=seed,
                    objective=objective, **settings)
    diffs = np.diff(r.objective)
    assert (diffs >= -1e-9 * abs(r.objective[0])).all(), r.objective


def test_reported_objective_equals_objective_of_returned_assignment():
    layer = sample_federated_layer(5, 6, seed=0, gamma0=4.0, sigma2=0.1)
    kw = dict(sigma2=0.1, sigma0_2=1.0, gamma0=4.0, mu0=0.05)
    r = match_layer(layer.neurons, hyperparameters="fixed", seed=0, **kw)
    assert r.objective[-1] == pytest.approx(assignment_objective(layer.neurons, r.assignments, **kw), rel=1e-10)


@pytest.mark.parametrize("seed", range(3))
def test_recovers_ground_truth_at_twice_the_noise_variance(seed):
    """Noise variance 0.01 << sigma0_2 = 1; matching with sigma2 = 0.02."""
    layer = sample_federated_layer(10, 100, seed=seed, gamma0=20.0, sigma2=0.01, sigma0_2=1.0)
    r = match_layer(layer.neurons, hyperparameters="fixed", sigma2=0.02, sigma0_2=1.0, gamma0=20.0, seed=seed)
    ari = adjusted_rand_score(torch.cat(layer.assignments), torch.cat(r.assignments))
    assert ari >= 0.95
    assert abs(r.num_atoms - layer.num_atoms) <= 0.05 * layer.num_atoms


def test_recovered_atoms_are_the_posterior_means():
    layer = sample_federated_layer(10, 30, seed=4, gamma0=10.0, sigma2=0.001, sigma0_2=1.0)
    r = match_layer(layer.neurons, hyperparameters="fixed", sigma2=0.002, sigma0_2=1.0, gamma0=10.0, seed=0)
    # map found atoms to true ones through any member neuron
    for j, (a_true, a_found) in enumerate(zip(layer.assignments, r.assignments)):
        assert torch.allclose(r.global_atoms[a_found], layer.atoms[a_true], atol=0.15)


@pytest.mark.parametrize("seed", range(3))
def test_marginal_objective_recovers_truth_at_the_true_noise_where_map_oversplits(seed):
    """J = 10, D = 50, noise 0.01: at sigma2 = the true noise the published objective splits atoms (merging and
    splitting are balanced, both of order D); integrating the atoms out adds the Occam factor that settles it."""
    layer = sample_federated_layer(10, 50, seed=seed, gamma0=20.0, sigma2=0.01, sigma0_2=1.0)
    truth = torch.cat(layer.assignments)
    hyper = dict(sigma2=0.01, sigma0_2=1.0, gamma0=20.0, seed=seed)
    published = match_layer(layer.neurons, hyperparameters="fixed", **hyper)
    marginal = match_layer(layer.neurons, hyperparameters="fixed", objective="marginal", **hyper)
    assert adjusted_rand_score(truth, torch.cat(published.assignments)) < 0.8
    assert published.num_atoms > 1.2 * layer.num_atoms
    assert adjusted_rand_score(truth, torch.cat(marginal.assignments)) >= 0.99
    assert abs(marginal.num_atoms - layer.num_atoms) <= 0.05 * layer.num_atoms


def test_permuting_a_clients_neurons_permutes_its_assignment_and_nothing_else():
    layer = sample_federated_layer(6, 12, seed=2, gamma0=6.0, sigma2=0.05)
    kw = dict(sigma2=0.1, sigma0_2=1.0, gamma0=6.0, seed=3, sweeps=3)
    base = match_layer(layer.neurons, hyperparameters="fixed", **kw)
    for j in range(6):
        perm = torch.randperm(layer.neurons[j].shape[0], generator=torch.Generator().manual_seed(j))
        permuted = list(layer.neurons)
        permuted[j] = permuted[j][perm]
        r = match_layer(permuted, hyperparameters="fixed", **kw)
        # atoms carry no labels: find the relabelling through the other clients' (unchanged) neurons
        relabel = {}
        for k in range(6):
            ids = base.assignments[k] if k != j else base.assignments[k][perm]
            for x, y in zip(ids.tolist(), r.assignments[k].tolist()):
                assert relabel.setdefault(x, y) == y  # same partition
        assert len(relabel) == base.num_atoms == r.num_atoms
        order = torch.tensor([relabel[i] for i in range(base.num_atoms)])
        assert torch.equal(r.assignments[j], order[base.assignments[j][perm]])
        torch.testing.assert_close(r.global_atoms[order], base.global_atoms, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r.counts[order], base.counts)
        assert r.objective == pytest.approx(base.objective, rel=1e-10)


def test_single_client_returns_its_neurons_shrunk_towards_the_prior():
    v = torch.randn(7, 4, dtype=torch.float64)
    sigma2, sigma0_2, mu0 = 0.5, 2.0, 0.1
    r = match_layer([v], hyperparameters="fixed", sigma2=sigma2, sigma0_2=sigma0_2, gamma0=1.0, mu0=mu0)
    assert r.num_atoms == 7 and (r.counts == 1).all()
    expected = (mu0 / sigma0_2 + v / sigma2) / (1 / sigma0_2 + 1 / sigma2)
    torch.testing.assert_close(r.global_atoms[r.assignments[0]], expected)


def test_identical_clients_are_merged_one_to_one():
    v = torch.randn(5, 30, dtype=torch.float64)
    r = match_layer([v, v[torch.tensor([3, 0, 4, 1, 2])], v], hyperparameters="fixed", sigma2=0.01, sigma0_2=1.0,
                    gamma0=5.0, seed=0)
    assert r.num_atoms == 5 and (r.counts == 3).all()


@pytest.mark.parametrize("widths", [(5, 5, 5), (3, 5, 2, 5), (4, 4), (1, 7)])
@pytest.mark.parametrize("value", [0.0, 0.3], ids=["dead-units", "constant"])
def test_identical_neurons_merge_into_as_few_atoms_as_a_client_has_under_empirical_bayes(widths, value):
    """Every neuron the same vector (e.g. every unit dead): no spread to estimate a variance from, so the variances
    keep their start and say so; the neurons merge into max_j L_j atoms (a client's neurons cannot share an atom).
    Before, the estimates fell to their floors, where joining and opening an atom score alike, and the IBP's mass
    (estimated from the atoms it had opened) kept up to every neuron apart."""
    from bnpfed.matching import match_bayesian_layer

    layers = [torch.full((w, 6), value, dtype=torch.float64) for w in widths]
    for r in (match_layer(layers, seed=0),
              match_bayesian_layer(layers, [torch.full((w, 6), 0.01, dtype=torch.float64) for w in widths], seed=0)):
        assert r.num_atoms == max(widths) and int(r.counts.sum()) == sum(widths)
        assert any("no spread" in note for note in r.notes)
        torch.testing.assert_close(r.global_atoms, torch.full((max(widths), 6), value, dtype=torch.float64))


def test_reference_constants_run_and_respect_the_atom_cap():
    layer = sample_federated_layer(6, 10, seed=0, gamma0=30.0, sigma2=0.5)
    r = match_layer(layer.neurons, sigma2=0.5, sigma0_2=1.0, gamma0=30.0, sweeps=0,
                    **{**REFERENCE_CONSTANTS, "max_atoms": 45})
    # a client may open min(L_j, max(45 - L, 1)) atoms: past the cap, still one per client (as published)
    assert r.num_atoms <= 45 + len(layer.neurons)
    uncapped = match_layer(layer.neurons, hyperparameters="fixed", sigma2=0.5, sigma0_2=1.0, gamma0=30.0, sweeps=0)
    assert uncapped.num_atoms > r.num_atoms


def test_same_seed_same_result_and_result_types():
    layer = sample_federated_layer(6, 8, seed=1, gamma0=5.0, sigma2=0.2)
    a = match_layer(layer.neurons, hyperparameters="fixed", sigma2=0.2, sigma0_2=1.0, gamma0=5.0, seed=7)
    b = match_layer(layer.neurons, hyperparameters="fixed", sigma2=0.2, sigma0_2=1.0, gamma0=5.0, seed=7)
    assert a.objective == b.objective
    assert all(torch.equal(x, y) for x, y in zip(a.assignments, b.assignments))
    assert a.global_atoms.dtype == layer.neurons[0].dtype
    assert all(x.dtype == torch.long for x in a.assignments)
    assert len(a.objective) == 6  # greedy pass + 5 sweeps
    assert torch.equal(a.counts, torch.bincount(torch.cat(a.assignments)))


def test_numpy_input_is_accepted():
    v = [np.random.default_rng(0).normal(size=(3, 4)), np.random.default_rng(1).normal(size=(2, 4))]
    r = match_layer(v, hyperparameters="fixed", sigma2=0.1, sigma0_2=1.0, gamma0=1.0)
    assert r.global_atoms.shape[1] == 4


@pytest.mark.parametrize(
    "neurons, kwargs, match",
    [
        ([], {}, "neurons: expected at least one client's"),
        ([torch.zeros(2, 3), torch.zeros(2, 4)], {}, r"neurons\[1\]: expected D = 3 coordinates.*got 4"),
        ([torch.zeros(0, 3), torch.zeros(0, 3)], {}, r"neurons: expected at least one client with a neuron.*all "
                                                     "with L_j = 0: nothing to match"),
        ([torch.zeros(0, 3), torch.zeros(2, 3)], {"precisions": torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])},
         r"precisions\[1\]: expected some scale > 0, got all 0"),
        ([torch.tensor([[0.0, float("nan")]])], {}, r"neurons\[0\]: expected finite values, got NaN"),
        ([torch.tensor([[0.0, float("inf")]])], {}, r"neurons\[0\]: expected finite values, got NaN or inf"),
        ([torch.zeros(2, 3)], {"sigma2": 0.0}, "sigma2: expected a positive finite number, got 0.0"),
        ([torch.zeros(2, 3)], {"sigma0_2": -1.0}, "sigma0_2: expected a positive finite number, got -1.0"),
        ([torch.zeros(2, 3)], {"gamma0": float("nan")}, "gamma0: expected a positive finite number, got nan"),
        ([torch.zeros(2, 3)], {"precisions": torch.ones(1, 4)}, "precisions"),
        ([torch.zeros(2, 3)], {"precisions": -torch.ones(1, 3)}, r"precisions: expected finite scales >= 0"),
        ([torch.zeros(2, 3)], {"precisions": torch.zeros(1, 3)}, r"precisions\[0\]: expected some scale > 0"),
        ([torch.zeros(2, 3)], {"precisions": torch.tensor([[1.0, float("nan"), 1.0]])},
         "precisions: expected finite scales"),
        ([torch.zeros(2, 3)], {"mu0": torch.zeros(2)}, "mu0"),
        ([torch.zeros(2, 3)], {"objective": "exact"}, "objective"),
        ([torch.zeros(2, 3)], {"sweeps": -1}, "sweeps"),
        ([torch.zeros(2)], {}, r"neurons\[0\]: expected shape \(L_j, D\)"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(neurons, kwargs, match):
    hyper = dict(sigma2=1.0, sigma0_2=1.0, gamma0=1.0)
    hyper.update(kwargs)
    with pytest.raises(ValueError, match=match):
        match_layer(neurons, hyperparameters="fixed", **hyper)


@pytest.mark.parametrize("seed", range(3))
def test_stopping_at_a_fixed_point_gives_the_result_of_all_sweeps(seed):
    layer = sample_federated_layer(8, 15, seed=seed, gamma0=6.0, sigma2=0.2)
    kw = dict(sigma2=0.2, sigma0_2=1.0, gamma0=6.0, seed=seed, sweeps=6)
    early = match_layer(layer.neurons, hyperparameters="fixed", **kw)
    full = match_layer(layer.neurons, hyperparameters="fixed", stop_at_fixed_point=False, **kw)
    assert len(early.rematches) < len(full.rematches) == 8 * 7
    assert early.objective == pytest.approx(full.objective, rel=1e-12)
    torch.testing.assert_close(early.counts.sort().values, full.counts.sort().values)
    assert adjusted_rand_score(torch.cat(early.assignments), torch.cat(full.assignments)) == 1.0


def test_zero_precision_coordinates_are_ignored():
    """A coordinate with precision 0 (a class the client never saw) does not pull the atom: the posterior mean on it
    comes from the clients that did see it."""
    a = torch.tensor([[1.0, 2.0, 5.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 2.0, -7.0]], dtype=torch.float64)
    prec = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    r = match_layer([a, b], hyperparameters="fixed", sigma2=0.01, sigma0_2=1.0, gamma0=1.0, precisions=prec)
    assert r.num_atoms == 1
    expected_last = (5.0 / 0.01) / (1.0 + 1 / 0.01)
    assert r.global_atoms[0, 2].item() == pytest.approx(expected_last)


@pytest.mark.parametrize("objective", ["map", "marginal"])
@pytest.mark.parametrize("seed", range(3))
def test_gram_and_direct_cross_products_give_the_same_matching(objective, seed):
    layer = sample_federated_layer(7, 12, seed=seed, gamma0=6.0, sigma2=0.3)
    prec = torch.ones(7, 12)
    prec[:, -2:] = torch.rand(7, 2, generator=torch.Generator().manual_seed(seed)) + 0.1
    kw = dict(sigma2=0.3, sigma0_2=1.0, gamma0=6.0, seed=seed, objective=objective, precisions=prec, mu0=0.1,
              stop_at_fixed_point=False)
    direct = match_layer(layer.neurons, hyperparameters="fixed", cross_products="direct", **kw)
    gram = match_layer(layer.neurons, hyperparameters="fixed", cross_products="gram", **kw)
    assert gram.objective == pytest.approx(direct.objective, rel=1e-10)
    assert all(torch.equal(a, b) for a, b in zip(gram.assignments, direct.assignments))
    torch.testing.assert_close(gram.global_atoms, direct.global_atoms)


# --------------------------------------------------------------------------------------------------------------------
# warm starts: init_assignments


@pytest.mark.parametrize("objective", ["map", "marginal"])
@pytest.mark.parametrize("cross_products", ["direct", "gram"])
@pytest.mark.parametrize("seed", range(3))
def test_sweeps_from_the_true_assignment_start_at_its_objective_and_never_lower_it(objective, cross_products, seed):
    layer = sample_federated_layer(8, 15, seed=seed, gamma0=6.0, sigma2=0.3)
    kw = dict(sigma2=0.3, sigma0_2=1.0, gamma0=6.0, mu0=0.05, objective=objective)
    start = assignment_objective(layer.neurons, layer.assignments, **kw)
    r = match_layer(layer.neurons, hyperparameters="fixed", init_assignments=layer.assignments, sweeps=10, seed=seed,
                    cross_products=cross_products, **kw)
    assert len(r.objective) == 11
    assert r.objective[0] == pytest.approx(start, rel=1e-10)
    assert (np.diff(r.objective) >= -1e-9 * abs(start)).all(), r.objective
    assert r.objective[-1] >= start - 1e-9 * abs(start)
    assert r.objective[-1] == pytest.approx(assignment_objective(layer.neurons, r.assignments, **kw), rel=1e-10)


def test_initial_labels_may_take_any_values():
    layer = sample_federated_layer(6, 10, seed=1, gamma0=5.0, sigma2=0.2)
    kw = dict(sigma2=0.2, sigma0_2=1.0, gamma0=5.0, seed=0, sweeps=2)
    perm = torch.randperm(layer.num_atoms, generator=torch.Generator().manual_seed(0))
    odd = [(5 - 3 * perm[a]).numpy() for a in layer.assignments]  # negative, sparse, shuffled, numpy
    a = match_layer(layer.neurons, hyperparameters="fixed", init_assignments=layer.assignments, **kw)
    b = match_layer(layer.neurons, hyperparameters="fixed", init_assignments=odd, **kw)
    c = match_layer(layer.neurons, hyperparameters="fixed", init_assignments=[x.tolist() for x in layer.assignments],
                    **kw)
    assert b.objective == pytest.approx(a.objective, rel=1e-10)
    assert adjusted_rand_score(torch.cat(a.assignments), torch.cat(b.assignments)) == 1.0
    assert all(torch.equal(x, y) for x, y in zip(a.assignments, c.assignments))


def test_warm_start_from_a_previous_result_returns_it():
    """With no sweeps the initial assignment comes back as it was given (labels 0..L-1 stay as they are); from a
    fixed point of the sweeps, sweeping changes nothing either."""
    layer = sample_federated_layer(8, 12, seed=2, gamma0=6.0, sigma2=0.1)
    kw = dict(sigma2=0.1, sigma0_2=1.0, gamma0=6.0)
    previous = match_layer(layer.neurons, hyperparameters="fixed", seed=0, sweeps=30, **kw)
    assert len(previous.rematches) < 8 * 31  # stopped at a fixed point
    for sweeps in (0, 3):
        again = match_layer(layer.neurons, hyperparameters="fixed", init_assignments=previous.assignments,
                            sweeps=sweeps, seed=5, **kw)
        assert all(torch.equal(a, b) for a, b in zip(again.assignments, previous.assignments))
        assert torch.equal(again.counts, previous.counts)
        torch.testing.assert_close(again.global_atoms, previous.global_atoms)
        assert again.objective == pytest.approx([previous.objective[-1]] * (sweeps + 1), rel=1e-10)


def test_warm_start_with_clients_without_neurons():
    layer = layer_with_empty_clients(6, 5, at_least=1)
    kw = dict(sigma2=0.1, sigma0_2=1.0, gamma0=1.0)
    r = match_layer(layer.neurons, hyperparameters="fixed", init_assignments=layer.assignments, sweeps=3, seed=0, **kw)
    assert r.objective[0] == pytest.approx(assignment_objective(layer.neurons, layer.assignments, **kw), rel=1e-10)
    assert [len(a) for a in r.assignments] == [len(a) for a in layer.assignments]


@pytest.mark.parametrize(
    "init, match",
    [
        ([[0, 1, 2], [0, 1]], r"init_assignments: expected one integer array per client \(3\), got 2"),
        ([[0, 1, 2], [0], [0, 1, 2, 3]], r"init_assignments\[1\]: expected 2 atom labels \(client 1 has L_j = 2"),
        ([[0, 1, 2], [[0, 1]], [0, 1, 2, 3]], r"init_assignments\[1\]: expected 2 atom labels"),
        ([[0, 1, 2], [0, 1], [0, 1, 1, 3]], r"init_assignments\[2\]: expected atom labels distinct within client 2"),
        ([[0, 1, 2], [0.5, 1], [0, 1, 2, 3]], r"init_assignments\[1\]: expected integer atom labels"),
        ("abc", r"init_assignments: expected one integer array per client"),
    ],
)
def test_bad_initial_assignment_raises_naming_the_client(init, match):
    g = torch.Generator().manual_seed(0)
    neurons = [torch.randn(L, 4, generator=g) for L in (3, 2, 4)]
    with pytest.raises(ValueError, match=match):
        match_layer(neurons, hyperparameters="fixed", sigma2=1.0, sigma0_2=1.0, gamma0=1.0, init_assignments=init)


def test_average_atoms_are_the_members_mean_and_on_scaled_coordinates_the_all_client_weighted_sum():
    """Coordinate 0 (scale 1 everywhere): the members' mean; coordinate 1 (scales s_j): sum over the members of
    s_j v_j / sum over all clients of s_j, an absent client counting as 0."""
    neurons = [np.array([[1.0, 10.0], [2.0, 20.0]]), np.array([[3.0, 30.0]]), np.zeros((0, 2))]
    labels = [np.array([0, 1]), np.array([0]), np.array([], dtype=int)]
    scales = np.array([[1.0, 0.5], [1.0, 0.3], [1.0, 0.2]])
    atoms = average_atoms(neurons, labels, precisions=scales).numpy()
    omega = averaging_weights(scales[:, 1:]).numpy()[:, 0]  # 0.5, 0.3, 0.2 over their sum 1
    np.testing.assert_allclose(omega, [0.5, 0.3, 0.2])
    np.testing.assert_allclose(atoms[:, 0], [(1.0 + 3.0) / 2, 2.0])
    np.testing.assert_allclose(atoms[:, 1], [omega[0] * 10 + omega[1] * 30, omega[0] * 20])
    # a neuron label repeated within a client (a baseline such as k-means): both members count
    twice = average_atoms([np.array([[1.0], [3.0]])], [np.array([0, 0])]).numpy()
    np.testing.assert_allclose(twice, [[2.0]])


# --------------------------------------------------------------------------------------------------------------------
# issue 18: the pruned assignment, and stopping on the result


@pytest.mark.parametrize("seed", range(6))
def test_the_pruned_assignment_is_the_optimum_of_the_full_assignment_problem(seed):
    """Independent computation: scipy's LSA on the whole (L_j, L + L_j) score matrix, new columns holding each row's
    new-atom score; the assignment problem shrunk to the rows and atoms that beat a row's new-atom score has the same
    optimum and the same assignment."""
    from scipy.optimize import linear_sum_assignment

    from bnpfed.matching.matcher import best_assignment

    rng = np.random.default_rng(seed)
    L_j, L = 30, 80
    new = rng.normal(size=L_j)
    atoms = rng.normal(size=(L_j, L)) - 2.0          # most atoms worse than a new one ...
    good = rng.random((L_j, L)) < 0.04
    atoms[good] += 4.0                               # ... a few better
    S = np.concatenate([atoms, np.repeat(new[:, None], L_j, axis=1)], axis=1)
    rows, cols = linear_sum_assignment(S, maximize=True)
    pr, pc = best_assignment(S, L)
    assert S[pr, pc].sum() == pytest.approx(S[rows, cols].sum(), rel=1e-12)
    np.testing.assert_array_equal(np.where(pc < L, pc, -1), np.where(cols < L, cols, -1))
    assert len(set(pc.tolist())) == L_j               # distinct columns


def test_stopping_on_the_result_keeps_the_width_and_accuracy_of_the_exact_fixed_point():
    """Trained networks (digits, J = 6 MLPs from their own initialisations): the default stops once a sweep moved at
    most 2 % of the neurons and no estimate by more than 1 % -- in no more sweeps than the exact fixed point, at the
    same width (within 2 %) and accuracy (within a point); the note says where it stopped."""
    from bnpfed.data import load_dataset
    from bnpfed.federated.clients import initial_network, train_network
    from bnpfed.federated.config import NetworkConfig, PartitionConfig, TrainingConfig
    from bnpfed.federated.partition import class_counts
    from bnpfed.matching import match_by_spec

    ds = load_dataset("digits")
    parts = PartitionConfig(clients=6).split(ds.y_train.numpy(), seed=0)
    nets = [train_network(initial_network(NetworkConfig(hidden=(40,)), ds.input_shape, 10, seed=0, client=j),
                          ds.x_train[p], ds.y_train[p], TrainingConfig(epochs=20), seed=0, round=1, client=j)
            for j, p in enumerate(parts)]
    counts = class_counts(ds.y_train.numpy(), parts, 10)

    def accuracy(match):
        with torch.no_grad():
            return float((match.network().eval()(ds.x_test).argmax(-1) == ds.y_test).double().mean())

    exact = match_by_spec(nets, counts, seed=0, stop="fixed-point")
    quick = match_by_spec(nets, counts, seed=0)
    a, b = exact.layer_results["1"], quick.layer_results["1"]
    assert b.sweeps_run <= a.sweeps_run and b.converged and a.converged
    assert abs(quick.hidden_sizes[0] - exact.hidden_sizes[0]) <= 0.02 * exact.hidden_sizes[0]
    assert accuracy(quick) == pytest.approx(accuracy(exact), abs=0.01)
    if b.sweeps_run < a.sweeps_run:
        assert any("stopped on the result" in n for n in b.notes)


# --- the matcher's exact speed-ups (issue 18): the same numbers as the plain computations ---------------------------

def _layer_with_shares(seed=0, J=6, D=7):
    """Overlapping atoms, clients of different sizes, and per-client precision scales on the last 3 coordinates
    (PFNM's class shares), some of them 0."""
    layer = sample_federated_layer(J, D, seed=seed, gamma0=6.0, sigma2=0.05)
    rng = np.random.default_rng(seed)
    scales = np.ones((J, D))
    scales[:, -3:] = rng.choice([0.0, 0.3, 1.0, 2.0], size=(J, 3))
    return [n.numpy() for n in layer.neurons], scales


def _statistics(matcher):
    active = np.flatnonzero(matcher.m[: matcher.n_rows] > 0)
    order = np.lexsort(matcher.gF[active].T[::-1]) if matcher.F.size else np.arange(active.size)
    rows = active[order]
    return {name: getattr(matcher, name)[rows] for name in ("gF", "gF_sq", "gC", "PC", "m")}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rescaled_statistics_equal_a_rebuild_from_the_neurons(seed):
    """New hyper-parameters on an assigned matcher: its per-atom statistics, scaled by the ratio of the noise
    precisions (no pass over the neurons), equal those rebuilt from scratch at the new values, and so do its scores."""
    from bnpfed.matching.matcher import make_matcher
    neurons, scales = _layer_with_shares(seed)
    D = neurons[0].shape[1]
    first = dict(noise=np.full(D, 0.1), prior=np.full(D, 1.0), gamma0=5.0, mu0=np.zeros(D))
    second = dict(noise=np.r_[np.full(D - 3, 0.03), np.full(3, 0.2)], prior=np.r_[np.full(D - 3, 0.7), np.full(3, 2.)],
                  gamma0=3.0, mu0=np.linspace(-0.2, 0.3, D))
    scaled = make_matcher(neurons, precisions=torch.as_tensor(scales))
    scaled.set_hyperparameters(**first)
    scaled.greedy()
    scaled.sweep(np.random.default_rng(seed))   # free rows and reused ones, as in a run
    labels = [a.copy() for a in scaled.assign]
    scaled.set_hyperparameters(**second)
    rebuilt = make_matcher(neurons, precisions=torch.as_tensor(scales))
    rebuilt.set_hyperparameters(**second)
    rebuilt.start_from(labels)
    a, b = _statistics(scaled), _statistics(rebuilt)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-12, atol=1e-12, err_msg=name)
    assert scaled.objective() == pytest.approx(rebuilt.objective(), rel=1e-12)
    for j in range(len(neurons)):   # the same move for every client
        for m in (scaled, rebuilt):
            m.match(j, rematch=True)
        assert sorted(map(tuple, _statistics(scaled)["gF"].round(9))) == \
            sorted(map(tuple, _statistics(rebuilt)["gF"].round(9)))


def test_scores_equal_the_per_neuron_formula():
    """The low-rank score matrix equals the score of the module docstring computed neuron by neuron, atom by atom,
    on shared and per-client coordinates (marginal objective)."""
    from bnpfed.matching.matcher import make_matcher
    neurons, scales = _layer_with_shares(3)
    D = neurons[0].shape[1]
    values = dict(noise=np.r_[np.full(D - 3, 0.05), np.full(3, 0.2)], prior=np.r_[np.full(D - 3, 0.8), np.full(3, 1.5)],
                  gamma0=4.0, mu0=np.linspace(-0.1, 0.1, D))
    mt = make_matcher(neurons, precisions=torch.as_tensor(scales))
    mt.set_hyperparameters(**values)
    mt.greedy()
    j = 2
    mt._remove(j)
    mt.gF_sq[: mt.n_rows] = np.einsum("ld,ld->l", mt.gF[: mt.n_rows], mt.gF[: mt.n_rows])
    active = np.flatnonzero(mt.m[: mt.n_rows] > 0)
    S = mt.scores(j, mt._cross(j, active), active)
    noise, prior, mu0 = values["noise"], values["prior"], values["mu0"]
    J = len(neurons)
    for i, row in enumerate(active):
        P = np.empty(D)
        g = np.empty(D)
        P[mt.F], g[mt.F] = 1 / prior[mt.F] + mt.m[row] / noise[mt.F], mt.gF[row]
        P[mt.C], g[mt.C] = mt.PC[row], mt.gC[row]
        for l, v in enumerate(neurons[j]):
            w = scales[j] / noise
            expected = ((g + w * v) ** 2 / (P + w) - g ** 2 / P - np.log((P + w) / P)).sum() + \
                2 * (np.log(mt.m[row]) - np.log(J - mt.m[row]))
            assert S[l, i] == pytest.approx(expected, rel=1e-10, abs=1e-9)
    P0, g0 = 1 / prior, mu0 / prior
    for l, v in enumerate(neurons[j]):
        w = scales[j] / noise
        new = ((g0 + w * v) ** 2 / (P0 + w) - g0 ** 2 / P0 - np.log((P0 + w) / P0)).sum() + 2 * np.log(4.0 / J)
        assert S[l, active.size] == pytest.approx(new, rel=1e-10, abs=1e-9)


def test_pooled_moments_equal_the_residual_computation():
    """sigma2 and sigma0_2 from sums of the atom means (no residual array) equal the plain residual formulas."""
    from bnpfed.matching.empirical_bayes import PooledMoments
    from bnpfed.matching.matcher import make_matcher
    layer = sample_federated_layer(8, 6, seed=4, gamma0=5.0, sigma2=0.05)
    neurons = [n.numpy().astype(np.float64) for n in layer.neurons]
    result = match_layer(neurons, seed=0)
    labels = [a.numpy() for a in result.assignments]
    L = result.num_atoms
    mt = make_matcher(neurons)
    est = PooledMoments(mt, {}, np.full(6, np.nan), {})
    out = est.update(labels, L, est.start())
    v = np.concatenate(neurons)
    flat = np.concatenate(labels)
    W = np.bincount(flat, minlength=L).astype(float)
    xbar = np.stack([v[flat == i].mean(axis=0) for i in range(L)])
    sigma2 = ((v - xbar[flat]) ** 2).sum() / (6 * (1 - 1 / W[flat]).sum())
    assert out["sigma2"] == pytest.approx(sigma2, rel=1e-10)
    mu0 = xbar.mean(axis=0)
    np.testing.assert_allclose(out["mu0"], mu0, rtol=1e-10, atol=1e-12)
    sigma0_2 = (((xbar - mu0) ** 2).sum() - sigma2 * (6 * (L - 1) / L) * (1 / W).sum()) / (6 * (L - 1))
    assert out["sigma0_2"] == pytest.approx(max(sigma0_2, 0.0), rel=1e-10)


def test_direct_cross_products_over_freed_storage_rows_equal_the_products_with_each_active_atom():
    """After a wide first pass most storage rows are freed (the atoms merged); the direct (L_j, L) products read the
    active atoms' rows only, and equal x_l . g_i computed atom by atom."""
    from bnpfed.matching.matcher import make_matcher
    layer = sample_federated_layer(6, 10, seed=2, gamma0=4.0, sigma2=0.05)
    neurons = [n.numpy().astype(np.float64) for n in layer.neurons]
    D = neurons[0].shape[1]
    mt = make_matcher(neurons)
    mt.set_hyperparameters(noise=np.full(D, 1e-6), prior=np.ones(D), gamma0=4.0, mu0=np.zeros(D))
    mt.greedy()   # a tiny noise: every neuron alone
    wide = mt.n_rows
    mt.set_hyperparameters(noise=np.full(D, 0.05), prior=np.ones(D), gamma0=4.0, mu0=np.zeros(D))
    mt.sweep(np.random.default_rng(0))
    j = 1
    mt._remove(j)
    active = np.flatnonzero(mt.m[: mt.n_rows] > 0)
    assert mt.gram is None and active.size < mt.n_rows == wide, (active.size, mt.n_rows)
    cross = mt._cross(j, active)
    expected = np.array([[mt.xF[j][l] @ mt.gF[row] for row in active] for l in range(mt.L[j])])
    np.testing.assert_allclose(cross, expected, rtol=1e-12, atol=1e-12)


def test_direct_cross_products_with_few_freed_rows_equal_the_products_with_each_active_atom():
    """With at most half of the storage rows freed, the product with every stored row (the freed ones' columns then
    dropped) replaces the gather of the active rows: the same x_l . g_i, atom by atom."""
    from bnpfed.matching.matcher import make_matcher
    layer = sample_federated_layer(6, 10, seed=2, gamma0=4.0, sigma2=0.05)
    neurons = [n.numpy().astype(np.float64) for n in layer.neurons]
    D = neurons[0].shape[1]
    mt = make_matcher(neurons)
    mt.set_hyperparameters(noise=np.full(D, 1e-6), prior=np.ones(D), gamma0=4.0, mu0=np.zeros(D))
    mt.greedy()   # every neuron alone
    j = 1
    mt._remove(j)  # client j's atoms freed: a few holes in the storage
    active = np.flatnonzero(mt.m[: mt.n_rows] > 0)
    assert mt.gram is None and mt.n_rows / 2 <= active.size < mt.n_rows, (active.size, mt.n_rows)
    cross = mt._cross(j, active)
    expected = np.array([[mt.xF[j][l] @ mt.gF[row] for row in active] for l in range(mt.L[j])])
    np.testing.assert_allclose(cross, expected, rtol=1e-12, atol=1e-12)


def test_a_match_through_the_block_products_equals_one_through_gathered_rows(monkeypatch):
    """The choice between the product with every stored row and the gather of the active ones changes no number:
    empirical Bayes on overlapping atoms from every neuron alone (the storage as wide as the layer; the merges then
    free most of it, as after a wide first pass) gives the same assignments, objective and estimates when every
    re-match gathers its atoms' rows, as the matcher did before the choice."""
    from bnpfed.matching.matcher import LayerMatcher
    layer = sample_federated_layer(12, 20, seed=2, gamma0=8.0, sigma2=0.3)
    neurons = [n.double() for n in layer.neurons]
    ends = np.cumsum([0] + [n.shape[0] for n in neurons])
    alone = [np.arange(ends[j], ends[j + 1]) for j in range(len(neurons))]
    branches = []
    plain = LayerMatcher._cross

    def recording(self, j, active):
        branches.append(active.size == self.n_rows or 2 * active.size >= self.n_rows)
        return plain(self, j, active)

    monkeypatch.setattr(LayerMatcher, "_cross", recording)
    block = match_layer(neurons, seed=0, cross_products="direct", init_assignments=alone)
    assert any(branches) and not all(branches)   # both kinds of re-match ran

    def gathered(self, j, active):
        return self.xF[j] @ self.gF[active].T

    monkeypatch.setattr(LayerMatcher, "_cross", gathered)
    gather = match_layer(neurons, seed=0, cross_products="direct", init_assignments=alone)
    assert [a.tolist() for a in block.assignments] == [a.tolist() for a in gather.assignments]
    assert block.objective == gather.objective and block.sweeps_run == gather.sweeps_run
    for name, value in gather.hyperparameters.items():
        assert torch.equal(torch.as_tensor(block.hyperparameters[name]), torch.as_tensor(value)), name


# --- the Jacobi schedule (issue 18): every client against the frozen assignment, moved at once ----------------------

def _jacobi_matcher(seed, with_variances=False):
    """An assigned matcher of overlapping atoms with per-client scales (and, ``with_variances``, per-neuron posterior
    variances on two coordinates), after the greedy pass and one sweep (freed rows, reused ones)."""
    from bnpfed.matching.matcher import make_matcher
    neurons, scales = _layer_with_shares(seed)
    D = neurons[0].shape[1]
    rng = np.random.default_rng(seed)
    variances = None
    if with_variances:
        variances = [np.zeros_like(v) for v in neurons]
        for u in variances:
            u[:, :2] = rng.uniform(0.0, 0.05, size=(u.shape[0], 2))
    mt = make_matcher(neurons, variances, precisions=torch.as_tensor(scales))
    mt.set_hyperparameters(noise=np.full(D, 0.05), prior=np.full(D, 1.0), gamma0=5.0, mu0=np.zeros(D))
    mt.greedy()
    mt.sweep(np.random.default_rng(seed))
    return mt


def _partition(labels):
    """The partition of all neurons (client order) as a set of frozensets of flat neuron indices."""
    flat = np.concatenate(labels)
    return {frozenset(np.flatnonzero(flat == a).tolist()) for a in np.unique(flat)}


@pytest.mark.parametrize("with_variances", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_proposal_is_the_client_s_best_move_and_leaves_the_state_as_it_was(seed, with_variances):
    """``propose(j)`` chooses what ``match(j, rematch=True)`` does (the same atoms joined, the same neurons opening new
    ones) and leaves every per-atom statistic, the free rows and the objective as they were."""
    for j in range(6):
        mt = _jacobi_matcher(seed, with_variances)
        before, free, objective = _statistics(mt), list(mt.free), mt.objective()
        target = mt.propose(j)
        after = _statistics(mt)
        for name in before:
            np.testing.assert_allclose(after[name], before[name], rtol=1e-12, atol=1e-12, err_msg=name)
        assert mt.free == free and mt.objective() == pytest.approx(objective, rel=1e-12)
        assert all(len(set(a.tolist())) == len(a) for a in mt.assign)
        others = [a.copy() for k, a in enumerate(mt.assign) if k != j]
        mt.match(j, rematch=True)
        joined = target >= 0
        np.testing.assert_array_equal(mt.assign[j][joined], target[joined])
        assert not np.isin(mt.assign[j][~joined], np.concatenate(others)).any()   # the others opened new atoms


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_jacobi_sweep_moves_every_client_to_its_proposal_against_the_frozen_assignment(seed):
    """After a Jacobi sweep each neuron is on the atom it proposed against the assignment at the sweep's start (its
    new neurons alone), the statistics are those of that assignment rebuilt from the neurons, and ``moved`` counts
    the neurons whose atom's members changed (counted here pair by pair)."""
    from bnpfed.matching.matcher import make_matcher
    mt = _jacobi_matcher(seed)
    old = [a.copy() for a in mt.assign]
    proposals = [mt.propose(j) for j in range(mt.J)]
    expected, fresh = [], 10_000
    for t in proposals:
        t, opened = t.copy(), t < 0
        t[opened] = fresh + np.arange(opened.sum())
        fresh += int(opened.sum())
        expected.append(t)
    assert mt.jacobi_sweep() == (mt.moved > 0)
    assert _partition(mt.assign) == _partition(expected)
    members = {n: group for group in _partition(old) for n in group}
    changed = {n for group in _partition(expected) for n in group if members[n] != group}
    assert mt.moved == len(changed)
    rebuilt = make_matcher(*_layer_with_shares(seed)[:1], precisions=torch.as_tensor(_layer_with_shares(seed)[1]))
    rebuilt.set_hyperparameters(noise=np.full(7, 0.05), prior=np.full(7, 1.0), gamma0=5.0, mu0=np.zeros(7))
    rebuilt.start_from(expected)
    for name, a in _statistics(rebuilt).items():
        np.testing.assert_allclose(_statistics(mt)[name], a, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_at_a_gauss_seidel_fixed_point_a_jacobi_sweep_changes_nothing(seed):
    """Every client already optimal given the others proposes to stay, so the Jacobi sweep moves no neuron."""
    layer = sample_federated_layer(8, 6, seed=seed, gamma0=6.0, sigma2=0.02)
    fixed = dict(hyperparameters="fixed", sigma2=0.04, sigma0_2=1.0, gamma0=6.0, seed=seed)
    gauss = match_layer(layer.neurons, sweeps=20, **fixed)
    assert gauss.objective[-1] == pytest.approx(gauss.objective[-2], rel=1e-12)   # at a fixed point
    jacobi = match_layer(layer.neurons, sweeps=3, init_assignments=gauss.assignments, schedule="jacobi", **fixed)
    assert jacobi.moved == [0] and jacobi.converged
    assert _partition([a.numpy() for a in jacobi.assignments]) == _partition([a.numpy() for a in gauss.assignments])


def test_jacobi_matching_runs_under_empirical_bayes_and_reports_whether_it_settled():
    """On well-separated atoms the Jacobi schedule finds the model's atoms too; a bad schedule is refused by name."""
    layer = sample_federated_layer(10, 50, seed=0, gamma0=20.0, sigma2=0.01)
    result = match_layer(layer.neurons, seed=0, schedule="jacobi")
    assert result.num_atoms == layer.num_atoms and result.converged
    assert adjusted_rand_score(torch.cat(layer.assignments).numpy(), torch.cat(result.assignments).numpy()) == 1.0
    with pytest.raises(ValueError, match="schedule"):
        match_layer(layer.neurons, schedule="parallel")


# --- the matcher's products on a torch device (issue 18): the numpy path's numbers -----------------------------------

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("settings", [dict(), dict(hyperparameters="fixed", sigma2=0.05, sigma0_2=1.0, gamma0=6.0),
                                      dict(schedule="jacobi", sweeps=4)])
def test_products_on_a_torch_device_give_the_numpy_matching(device, settings):
    """The atom sums and cross products held as torch tensors (on the CPU here, the code a GPU runs) give the
    assignments, atoms, precisions and objectives of the numpy matcher, with per-client scales and Bayesian
    neurons' per-neuron coordinates beside the shared ones."""
    from bnpfed.matching import match_bayesian_layer
    neurons, scales = _layer_with_shares(4)
    for direct in ("auto", "direct"):
        a = match_layer(neurons, precisions=torch.as_tensor(scales), seed=0, cross_products=direct, **settings)
        b = match_layer(neurons, precisions=torch.as_tensor(scales), seed=0, device=device, **settings)
        assert _partition([x.numpy() for x in a.assignments]) == _partition([x.numpy() for x in b.assignments])
        torch.testing.assert_close(b.global_atoms, a.global_atoms, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(b.posterior_precision, a.posterior_precision, rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(b.objective, a.objective, rtol=1e-9)
    variances = [np.zeros_like(v) for v in neurons]
    for u in variances:
        u[:, :2] = 0.01
    bayes = {k.replace("sigma2", "tau2"): v for k, v in settings.items()}
    a = match_bayesian_layer(neurons, variances, seed=0, **bayes)
    b = match_bayesian_layer(neurons, variances, seed=0, device=device, **bayes)
    assert _partition([x.numpy() for x in a.assignments]) == _partition([x.numpy() for x in b.assignments])
    torch.testing.assert_close(b.global_atoms, a.global_atoms, rtol=1e-9, atol=1e-10)


def test_a_device_the_matcher_cannot_use_is_refused_by_name():
    neurons = small_problem(3, 0)
    with pytest.raises(ValueError, match="device: expected"):
        match_layer(neurons, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: .*torch sees no CUDA device"):
            match_layer(neurons, device="cuda")
    with pytest.raises(ValueError, match="cross_products: expected 'auto' or 'direct' with device"):
        match_layer(neurons, device="cpu", cross_products="gram")


# --- a client's own columns (issue 18): the products of a layer after a Flatten -------------------------------------

def _layer_after_a_flatten(seed=0, J=6, blocks=8, width=5):
    """Units reading ``blocks`` channels of ``width`` columns each (the columns of a Flatten) plus a bias; every
    client holds 2-3 of the channels and is 0 on the others' columns, as a client's fc1 units are once its conv
    channels are re-indexed to the global ones; overlapping atoms, clients of different sizes."""
    rng = np.random.default_rng(seed)
    D = blocks * width + 1
    atoms = rng.normal(size=(12, D))
    neurons = []
    for j in range(J):
        held = rng.choice(blocks, size=int(rng.integers(2, 4)), replace=False)
        mask = np.zeros(D, dtype=bool)
        for c in held:
            mask[c * width:(c + 1) * width] = True
        mask[-1] = True
        L = int(rng.integers(3, 7))
        v = atoms[rng.choice(12, size=L, replace=False)] + 0.3 * rng.normal(size=(L, D))
        neurons.append(torch.as_tensor(np.where(mask, v, 0.0)))
    return neurons


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("cross_products", ["direct", "gram"])
@pytest.mark.parametrize("settings", [dict(seed=0), dict(seed=1, hyperparameters="fixed", sigma2=0.1, sigma0_2=1.0,
                                                         gamma0=3.0)])
def test_products_on_a_client_s_own_columns_give_the_dense_matching(monkeypatch, device, cross_products, settings):
    """A client 0 on most columns has its cross products, atom sums and Gram entries computed on its own columns;
    the matching (assignments, atoms, precisions, objectives) equals the one with every column computed."""
    import bnpfed.matching.matcher as matcher
    from bnpfed.matching.matcher import make_matcher
    neurons = _layer_after_a_flatten(settings["seed"])
    assert all(c is not None and c.size < neurons[0].shape[1] / 2 for c in make_matcher(neurons).columns_of)
    if device is not None and cross_products == "gram":
        cross_products = "auto"   # the Gram matrix is not used on a device
    compact = match_layer(neurons, cross_products=cross_products, device=device, **settings)
    monkeypatch.setattr(matcher, "SPARSE_SHARE", 0.0)
    assert all(c is None for c in make_matcher(neurons).columns_of)
    dense = match_layer(neurons, cross_products=cross_products, device=device, **settings)
    assert [a.tolist() for a in compact.assignments] == [a.tolist() for a in dense.assignments]
    torch.testing.assert_close(compact.global_atoms, dense.global_atoms, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(compact.posterior_precision, dense.posterior_precision, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(compact.objective, dense.objective, rtol=1e-10)


def test_the_gram_matrix_from_client_blocks_equals_the_full_product():
    from bnpfed.matching.matcher import make_matcher
    neurons = _layer_after_a_flatten(3, J=5)
    mt = make_matcher(neurons)
    D = neurons[0].shape[1]
    mt.set_hyperparameters(noise=np.full(D, 0.2), prior=np.full(D, 1.0), gamma0=2.0, mu0=np.zeros(D))
    x = mt.vF_all * mt.tau
    np.testing.assert_allclose(mt._gram(), x @ x.T, rtol=1e-12, atol=1e-12)


def _atom_sums_neuron_by_neuron(neurons, labels, L, F):
    """(L, |F|) every atom's members' means added one neuron at a time."""
    out = np.zeros((L, F.size))
    for v, a in zip(neurons, labels):
        for l, i in enumerate(a):
            out[i] += np.asarray(v)[l, F]
    return out


@pytest.mark.parametrize("layer", ["after a flatten", "dense"])
def test_the_atom_sums_of_an_assignment_are_its_members_sums(layer):
    """``shared_sums`` (what the pooled moments read) equals the sum of each atom's members, counted neuron by
    neuron, whether clients have few columns or all."""
    from bnpfed.matching.atom_sums import shared_sums
    from bnpfed.matching.matcher import make_matcher
    neurons = _layer_after_a_flatten(5) if layer == "after a flatten" else _layer_with_shares(5)[0]
    mt = make_matcher(neurons)
    assert any(c is not None for c in mt.columns_of) == (layer == "after a flatten")
    rng = np.random.default_rng(0)
    L = 9
    labels = [rng.choice(L, size=len(v), replace=False) for v in neurons]
    expected = _atom_sums_neuron_by_neuron(neurons, labels, L, mt.F)
    np.testing.assert_allclose(shared_sums(mt, labels, L), expected, rtol=1e-13, atol=1e-13)


# --- compact rows (issue 18): a layer after a Flatten held on each client's own columns end to end ------------------

@pytest.mark.parametrize("settings", [dict(seed=0), dict(seed=2), dict(seed=1, hyperparameters="fixed", sigma2=0.1,
                                                                       sigma0_2=1.0, gamma0=3.0)])
@pytest.mark.parametrize("cross_products", ["direct", "gram"])
def test_compact_rows_give_the_matching_of_the_dense_arrays(settings, cross_products):
    """The neurons as CompactRows (no (N, D) array of them anywhere: the matcher, the estimator's moments and the
    atom sums read each client's own columns) give the dense arrays' matching: assignments, atoms, precisions,
    objectives, estimates and the full log likelihood."""
    from bnpfed.matching.layer_inputs import CompactRows
    from bnpfed.matching.matcher import make_matcher
    neurons = _layer_after_a_flatten(settings["seed"], J=8)
    rows = [CompactRows.from_dense(v) for v in neurons]
    mt = make_matcher(rows)
    assert mt.compact and mt.vF_all is None and not mt.dense_clients
    compact = match_layer(rows, cross_products=cross_products, **settings)
    dense = match_layer(neurons, cross_products=cross_products, **settings)
    assert [a.tolist() for a in compact.assignments] == [a.tolist() for a in dense.assignments]
    assert compact.global_atoms.dtype == dense.global_atoms.dtype == torch.float64
    torch.testing.assert_close(compact.global_atoms, dense.global_atoms, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(compact.posterior_precision, dense.posterior_precision, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(compact.objective, dense.objective, rtol=1e-10)
    assert compact.log_likelihood == pytest.approx(dense.log_likelihood, rel=1e-10)
    for name, value in dense.hyperparameters.items():
        torch.testing.assert_close(torch.as_tensor(compact.hyperparameters[name]), torch.as_tensor(value),
                                   rtol=1e-9, atol=1e-12)


def test_compact_atom_moments_in_blocks_equal_the_whole_sums():
    """The pooled moments' per-atom ``||S_i / W_i||^2`` and per-coordinate ``sum_i S_i / W_i``, atom block by atom
    block (a wide layer's), equal those of the whole (L, |F|) sums, counted neuron by neuron."""
    from bnpfed.matching.atom_sums import shared_atom_moments, shared_moments
    from bnpfed.matching.layer_inputs import CompactRows
    from bnpfed.matching.matcher import make_matcher
    neurons = _layer_after_a_flatten(4, J=7)
    mt = make_matcher([CompactRows.from_dense(v) for v in neurons])
    rng = np.random.default_rng(1)
    L = 11
    labels = [rng.choice(L, size=len(v), replace=False) for v in neurons]
    S = _atom_sums_neuron_by_neuron(neurons, labels, L, mt.F)
    W = np.bincount(np.concatenate(labels), minlength=L).astype(float)
    W[W == 0] = 1.0
    for budget in (2 ** 24, mt.F.size, 3 * mt.F.size + 1):   # whole, one atom a block, three atoms a block
        sq, total = shared_atom_moments(mt, labels, L, W, budget=budget)
        np.testing.assert_allclose(sq, (S ** 2).sum(axis=1) / W ** 2, rtol=1e-12)
        np.testing.assert_allclose(total, (S / W[:, None]).sum(axis=0), rtol=1e-12, atol=1e-14)
    x = np.concatenate([np.asarray(v)[:, mt.F] for v in neurons])
    np.testing.assert_allclose(shared_moments(mt)[0], x.sum(axis=0), rtol=1e-12, atol=1e-14)
    assert shared_moments(mt)[1] == pytest.approx(float((x ** 2).sum()), rel=1e-12)


def test_a_compact_client_on_most_columns_makes_the_layer_dense():
    """CompactRows are a way of holding the data, not a different model: where some client uses more than
    SPARSE_SHARE of the shared columns, the matcher holds the layer dense, with the same matching."""
    from bnpfed.matching.layer_inputs import CompactRows
    from bnpfed.matching.matcher import make_matcher
    neurons = _layer_after_a_flatten(6)
    neurons[0] = torch.as_tensor(np.random.default_rng(0).normal(size=tuple(neurons[0].shape)))
    rows = [CompactRows.from_dense(v) for v in neurons]
    assert not make_matcher(rows).compact
    a, b = match_layer(rows, seed=0), match_layer(neurons, seed=0)
    assert [x.tolist() for x in a.assignments] == [x.tolist() for x in b.assignments]
    torch.testing.assert_close(a.global_atoms, b.global_atoms, rtol=1e-12, atol=1e-14)


def test_the_average_of_compact_rows_is_the_average_of_the_dense_ones():
    from bnpfed.matching.layer_inputs import CompactRows
    neurons = _layer_after_a_flatten(7)
    rng = np.random.default_rng(2)
    labels = [rng.choice(9, size=len(v), replace=False) for v in neurons]
    D = neurons[0].shape[1]
    shares = np.ones((len(neurons), D))
    shares[:, -1] = rng.uniform(0.1, 1.0, size=len(neurons))   # a per-client coordinate, weighted by omega
    dense = average_atoms(neurons, labels, precisions=shares)
    compact = average_atoms([CompactRows.from_dense(v) for v in neurons], labels, precisions=shares)
    assert torch.equal(compact, dense)


def test_compact_rows_are_refused_where_they_do_not_apply():
    from bnpfed.matching import match_bayesian_layer
    from bnpfed.matching.layer_inputs import CompactRows
    with pytest.raises(ValueError, match="columns: expected increasing coordinates in \\[0, 4\\)"):
        CompactRows(np.ones((2, 2)), [3, 1], 4)
    with pytest.raises(ValueError, match="values: expected shape \\(L_j, 3\\)"):
        CompactRows(np.ones((2, 2)), [0, 1, 2], 4)
    rows = [CompactRows.from_dense(v) for v in _layer_after_a_flatten(0)]
    with pytest.raises(ValueError, match="means\\[0\\]: expected an array of shape \\(L_j, D\\), got CompactRows"):
        match_bayesian_layer(rows, [np.full(r.shape, 0.1) for r in rows], seed=0)


@pytest.mark.parametrize("kind", ["dense", "flatten", "shares"])
def test_the_result_takes_its_atoms_from_the_storage_block_by_block_as_at_once(monkeypatch, kind):
    """The result moves the atoms' rows of the storage to its front in place (no (L, D) copy beside it), a block of
    rows at a time: one row a block gives the atoms of one block for the whole, and both are the posterior means of
    the assignment, (mu0 / sigma0_2 + sum_j w_jd x_jd) / (1 / sigma0_2 + sum_j w_jd) with w_jd = s_jd / sigma2 --
    on a dense layer, a layer after a Flatten held compact, and with a per-client coordinate (PFNM's class shares)."""
    from bnpfed.matching import matcher as matcher_module
    from bnpfed.matching.layer_inputs import CompactRows
    rng = np.random.default_rng(3)
    pool = rng.normal(size=(12, 9))   # overlapping atoms: each client holds 5 of 12, seen with noise
    dense = _layer_after_a_flatten(3) if kind == "flatten" else [
        torch.as_tensor(pool[rng.choice(12, 5, replace=False)] + 0.5 * rng.normal(size=(5, 9))) for _ in range(6)]
    neurons = [CompactRows.from_dense(v) for v in dense] if kind == "flatten" else dense
    D = dense[0].shape[1]
    s = np.ones((len(dense), D))
    if kind == "shares":
        s[:, -1] = rng.uniform(0.1, 1.0, size=len(dense))
    settings = dict(sigma2=0.5, sigma0_2=2.0, gamma0=3.0, seed=0, precisions=s if kind == "shares" else None)
    whole = match_layer(neurons, **settings)
    monkeypatch.setattr(matcher_module, "TAKE_BLOCK", 1)
    blocks = match_layer(neurons, **settings)
    assert [a.tolist() for a in blocks.assignments] == [a.tolist() for a in whole.assignments]
    assert torch.equal(blocks.global_atoms, whole.global_atoms)
    assert torch.equal(blocks.posterior_precision, whole.posterior_precision)
    L = whole.global_atoms.shape[0]
    weighted = torch.zeros(L, D, dtype=torch.float64)
    precision = torch.full((L, D), 1 / 2.0, dtype=torch.float64)
    for j, (v, a) in enumerate(zip(dense, whole.assignments)):
        w = torch.as_tensor(s[j] / 0.5)
        weighted.index_add_(0, a, w * torch.as_tensor(v, dtype=torch.float64))
        precision.index_add_(0, a, w.expand(len(a), D).contiguous())
    mu0 = torch.as_tensor(whole.hyperparameters["mu0"], dtype=torch.float64)   # estimated: not given
    torch.testing.assert_close(whole.posterior_precision, precision, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole.global_atoms, (mu0 / 2.0 + weighted) / precision, rtol=1e-12, atol=1e-12)

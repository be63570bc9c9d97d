"""The matcher reads the model: the two-parameter IBP's concentration, other atom priors and noise laws (issue "The
neuron model is the program"), checked against Pyro's log joint, brute force and layers drawn from the model."""

import itertools
import math

import numpy as np
import pytest
import torch
from _reference import marginal_log_density
from sklearn.metrics import adjusted_rand_score

from bnpfed.matching import assignment_objective, match_layer
from bnpfed.matching.ibp import ibp_estimates, ibp_log_prob
from bnpfed.models import sample_federated_layer


def ari(layer, result):
    return adjusted_rand_score(torch.cat(layer.assignments).numpy(), torch.cat(result.assignments).numpy())


def small_problem(J, seed, D=3, L_max=3):
    rng = np.random.default_rng(seed)
    atoms = rng.normal(size=(4, D))
    neurons = []
    for _ in range(J):
        L = int(rng.integers(1, L_max + 1))
        neurons.append(atoms[rng.choice(4, size=L, replace=False)] + 0.3 * rng.normal(size=(L, D)))
    return neurons


def client_assignments(j, assignments):
    """Every assignment of client j's neurons given the others (distinct atoms of other clients, or new ones)."""
    others = sorted({int(i) for k, a in enumerate(assignments) if k != j for i in np.asarray(a)})
    fresh = [10_000 + l for l in range(len(assignments[j]))]
    for choice in itertools.product(others + ["new"], repeat=len(assignments[j])):
        taken = [c for c in choice if c != "new"]
        if len(set(taken)) == len(taken):
            yield [fresh[l] if c == "new" else c for l, c in enumerate(choice)]


# --- the two-parameter IBP ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [0.3, 1.0, 5.0])
def test_marginal_objective_with_a_concentration_is_twice_the_marginal_likelihood_up_to_a_constant(c):
    """F_marg(Z) = 2 log p(Z, V) under the two-parameter IBP (scipy's Gaussians, the IBP written out), + a constant."""
    neurons = small_problem(3, 5, D=4)
    hyper = dict(sigma2=0.2, sigma0_2=1.3, gamma0=2.0, mu0=0.1)
    rng = np.random.default_rng(1)
    offsets = []
    for _ in range(6):
        assignments = [rng.choice(6, size=len(v), replace=False) for v in neurons]
        F = assignment_objective(neurons, assignments, objective="marginal", concentration=c, **hyper)
        offsets.append(F - 2 * marginal_log_density(neurons, assignments, concentration=c, **hyper))
    assert np.ptp(offsets) < 1e-8 * max(1.0, abs(offsets[0]))


@pytest.mark.parametrize("seed", range(3))
def test_a_client_matched_with_a_concentration_takes_its_best_assignment_given_the_others(seed):
    """Every client of a converged matching at c = 4 holds the best of all its assignments (brute force over the
    objective written out)."""
    neurons = small_problem(3, seed + 20)
    hyper = dict(sigma2=0.2, sigma0_2=1.0, gamma0=2.0, mu0=0.0, concentration=4.0)
    r = match_layer(neurons, hyperparameters="fixed", objective="marginal", sweeps=10, seed=seed, **hyper)

    def value(assignments):
        return 2 * marginal_log_density(neurons, assignments, **hyper)

    found = value(r.assignments)
    for j in range(3):
        best = max(value([np.array(c) if k == j else a for k, a in enumerate(r.assignments)])
                   for c in client_assignments(j, r.assignments))
        assert found == pytest.approx(best, rel=1e-9)


def test_ibp_density_and_estimates():
    """ibp_log_prob is the written-out density; the estimates maximise it (a grid over gamma0 and c finds nothing
    better), and a given c gives gamma0 = L / R_J(c)."""
    counts, J = [1, 1, 1, 2, 4, 1, 3, 1, 1], 6
    for c in (0.5, 1.0, 3.0):
        rate = sum(c / (c + j - 1) for j in range(1, J + 1))
        written = len(counts) * math.log(2.0 * c) - 2.0 * rate + sum(
            math.lgamma(m) + math.lgamma(J - m + c) - math.lgamma(J + c) for m in counts)
        assert ibp_log_prob(counts, J, 2.0, c) == pytest.approx(written, rel=1e-12)
        assert ibp_estimates(counts, J, c=c)[0] == pytest.approx(len(counts) / rate, rel=1e-12)
    gamma0, c, at_bound = ibp_estimates(counts, J)
    assert not at_bound
    best = ibp_log_prob(counts, J, gamma0, c)
    grid = [ibp_log_prob(counts, J, g, cc) for g in np.linspace(0.5, 10, 40) for cc in np.geomspace(0.05, 50, 60)]
    assert best >= max(grid) - 1e-9
    assert ibp_estimates([1] * 8, J)[2]   # every atom alone: c runs to the top of its range


@pytest.mark.parametrize("seed", [0, 1])
def test_layers_drawn_with_concentration_5_are_recovered_when_the_matcher_knows_it(seed):
    """J = 10, D = 10, sigma2 = 0.05, sigma0_2 = 0.5, gamma0 = 8.7, c = 5 (about 50 atoms), empirical Bayes for the
    rest: with c = 5 given the matching is right (ARI >= 0.95, the atom count within 10 %); seed 1 is one where the
    one-parameter matcher (c = 1) merges too much (ARI 0.80 at 44 of 52 atoms: docs/benchmarks/models.md)."""
    layer = sample_federated_layer(10, 10, seed=seed, gamma0=8.7, sigma2=0.05, sigma0_2=0.5, concentration=5.0)
    r = match_layer(layer.neurons, seed=0, concentration=5.0)
    assert ari(layer, r) >= 0.95
    assert abs(r.num_atoms - layer.num_atoms) <= 0.1 * layer.num_atoms
    assert r.hyperparameters["concentration"] == 5.0 and "concentration" not in r.estimated
    estimated = match_layer(layer.neurons, seed=0, concentration=None)
    assert "concentration" in estimated.estimated and ari(layer, estimated) >= 0.95
    if seed == 1:
        assert ari(layer, match_layer(layer.neurons, seed=0)) < 0.9


def test_a_concentration_is_reported_only_when_it_is_not_one():
    layer = sample_federated_layer(4, 6, seed=0, gamma0=4.0, sigma2=0.05)
    fixed = dict(sigma2=0.05, sigma0_2=1.0, gamma0=4.0, hyperparameters="fixed")
    assert "concentration" not in match_layer(layer.neurons, **fixed).hyperparameters
    assert match_layer(layer.neurons, concentration=2.0, **fixed).hyperparameters["concentration"] == 2.0
    with pytest.raises(ValueError, match="concentration: expected a positive finite number with hyperparameters="):
        match_layer(layer.neurons, concentration=None, **fixed)
    with pytest.raises(ValueError, match="concentration: expected a positive finite number, got -1"):
        match_layer(layer.neurons, concentration=-1.0)

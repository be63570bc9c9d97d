"""The layer matcher's full log likelihood (every normalising constant), and empirical Bayes from both starts with
the higher marginal likelihood kept (issue: compression by default)."""

import math

import numpy as np
import pytest
from scipy.stats import multivariate_normal

from bnpfed.matching.matcher import make_matcher
from bnpfed.experimental import ExperimentalOptions


def _brute_force(V, U, s, labels, noise, prior, mu0, gamma0):
    """log p(Z, V) by its definition: the configuration density times, per atom and coordinate, the members' joint
    Gaussian (covariance prior * 11^T + diag(noise_jld)) over the members with s > 0."""
    J = len(V)
    L = int(max(int(lab.max(initial=-1)) for lab in labels) + 1)
    m = np.zeros(L, dtype=int)
    for lab in labels:
        np.add.at(m, lab, 1)
    ll = L * math.log(gamma0) - gamma0 * sum(1.0 / k for k in range(1, J + 1))
    ll += sum(math.lgamma(k) + math.lgamma(J - k + 1) - math.lgamma(J + 1) for k in m)
    D = V[0].shape[1]
    for i in range(L):
        for d in range(D):
            vals, var = [], []
            for j in range(J):
                for l in np.flatnonzero(labels[j] == i):
                    sc = 1.0 if s is None else s[j, d]
                    if sc > 0:
                        u = 0.0 if U is None else U[j][l, d]
                        vals.append(V[j][l, d])
                        var.append((u + noise[d]) / sc)
            if vals:
                cov = prior[d] * np.ones((len(vals), len(vals))) + np.diag(var)
                ll += multivariate_normal(np.full(len(vals), mu0[d]), cov).logpdf(vals)
    return ll


@pytest.mark.parametrize("kind", ["shared", "scaled", "bayesian"])
def test_the_log_likelihood_is_the_model_density_with_every_constant(kind):
    rng = np.random.default_rng(0)
    J, D = 3, 5
    V = [rng.normal(size=(n, D)) for n in (3, 2, 4)]
    U = [rng.uniform(0.01, 0.3, size=v.shape) * (np.arange(D) >= 3) for v in V] if kind == "bayesian" else None
    s = None
    if kind != "shared":
        s = np.ones((J, D))
        s[:, 3:] = rng.uniform(0.0, 1.0, size=(J, 2))
        s[1, 4] = 0.0   # client 1 says nothing about coordinate 4
    labels = [np.array([0, 1, 2]), np.array([1, 3]), np.array([0, 4, 2, 5])]
    noise = np.array([0.3] * 3 + ([0.3, 0.3] if kind == "shared" else [0.5, 0.7]))  # one value on shared ones
    prior = np.array([1.2] * 3 + ([1.2, 1.2] if kind == "shared" else [2.0, 0.8]))
    mu0 = rng.normal(size=D)
    matcher = make_matcher(V, U, precisions=s)
    matcher.set_hyperparameters(noise=noise, prior=prior, gamma0=1.7, mu0=mu0)
    matcher.start_from(labels)
    expected = _brute_force(V, U, s, labels, noise, prior, mu0, 1.7)
    assert matcher.log_likelihood() == pytest.approx(expected, rel=1e-10, abs=1e-9)


def test_both_starts_keep_the_likelier_fixed_point_and_it_is_closer_to_the_truth_on_overlapping_atoms():
    """The audit's case: atoms N(0, 1) observed with noise 0.5 (atoms overlap). From the small-noise start alone the
    alternation over-splits and under-estimates the noise; the even split's fixed point (the default start) is
    likelier and closer."""
    import torch  # noqa: F401  (the model samples through torch)

    from bnpfed.matching import match_layer
    from bnpfed.models.beta_bernoulli import sample_federated_layer

    err_small, err_both, err_even, noise_small, noise_both = 0, 0, 0, 0.0, 0.0
    for seed in range(6):
        layer = sample_federated_layer(10, 20, seed=seed, gamma0=15.0, sigma2=0.5, sigma0_2=1.0)
        small = match_layer(layer.neurons, seed=0, starts="small-noise")
        both = match_layer(layer.neurons, seed=0, starts="both")
        even = match_layer(layer.neurons, seed=0)   # the default: the even split alone
        assert [s["start"] for s in both.starts] == ["small-noise", "even-split"] and not small.starts
        assert not even.starts and even.log_likelihood == pytest.approx(both.starts[1]["log_likelihood"], rel=1e-10)
        err_even += abs(even.num_atoms - layer.num_atoms)
        assert both.log_likelihood == max(s["log_likelihood"] for s in both.starts)
        assert both.starts[0]["log_likelihood"] == pytest.approx(small.log_likelihood, rel=1e-12)
        assert both.log_likelihood >= small.log_likelihood
        err_small += abs(small.num_atoms - layer.num_atoms)
        err_both += abs(both.num_atoms - layer.num_atoms)
        noise_small += abs(small.hyperparameters["sigma2"] - 0.5)
        noise_both += abs(both.hyperparameters["sigma2"] - 0.5)
    # measured: 30 atoms off in all from the small-noise start, 6 from both; noise off by 0.14 against 0.06 in all
    assert err_both <= err_small / 2 and err_even <= err_small / 2
    assert noise_both < noise_small


def test_one_start_where_the_noise_is_given_or_fixed():
    from bnpfed.matching import match_layer

    rng = np.random.default_rng(1)
    V = [rng.normal(size=(6, 4)) for _ in range(3)]
    assert not match_layer(V, seed=0, sigma2=0.3).starts
    assert not match_layer(V, seed=0, hyperparameters="fixed", sigma2=0.3, sigma0_2=1.0, gamma0=2.0).starts
    assert len(match_layer(V, seed=0, starts="both").starts) == 2 and not match_layer(V, seed=0).starts
    with pytest.raises(ValueError, match="starts: expected one of"):
        match_layer(V, seed=0, starts="even")


def test_the_second_start_reading_the_first_starts_gram_matrix_matches_as_direct_products_do():
    """The even-split start reuses the Gram matrix the small-noise start took (its noise differs, so the precision
    ratio is applied when it is read): same starts, same labels, same likelihoods as with direct products."""
    from bnpfed.matching import match_layer
    from bnpfed.models.beta_bernoulli import sample_federated_layer

    layer = sample_federated_layer(8, 12, seed=4, gamma0=10.0, sigma2=0.5, sigma0_2=1.0)
    s = np.random.default_rng(4).uniform(0.3, 1.0, size=(8, 12))
    gram = match_layer(layer.neurons, precisions=s, seed=1, cross_products="gram", starts="both")
    direct = match_layer(layer.neurons, precisions=s, seed=1, cross_products="direct", starts="both")
    assert [st["start"] for st in gram.starts] == ["small-noise", "even-split"]
    for a, b in zip(gram.starts, direct.starts):
        assert a["log_likelihood"] == pytest.approx(b["log_likelihood"], rel=1e-10)
    assert gram.num_atoms == direct.num_atoms
    for a, b in zip(gram.assignments, direct.assignments):
        np.testing.assert_array_equal(a, b)


def test_a_federation_runs_each_layer_from_the_even_split_unless_asked_for_both_starts():
    import torch

    from bnpfed.federated import NetworkConfig, PFNMConfig
    from bnpfed.federated.clients import initial_network
    from bnpfed.matching import match_by_spec

    assert PFNMConfig().starts == "even-split" and PFNMConfig().matcher_kwargs()["starts"] == "even-split"
    template = initial_network(NetworkConfig(hidden=(12,)), (6,), 3, seed=0)
    states = [initial_network(NetworkConfig(hidden=(12,)), (6,), 3, seed=j).state_dict() for j in range(4)]
    counts = torch.ones(4, 3)
    for starts, n in (("even-split", 0), ("both", 2)):
        config = PFNMConfig(experimental=ExperimentalOptions(starts=starts))
        match = match_by_spec(states, counts, template=template, seed=0, **config.matcher_kwargs())
        assert all(len(r.starts) == n for r in match.layer_results.values())
    with pytest.raises(ValueError, match="starts: applies under empirical Bayes only"):
        PFNMConfig(hyperparameters="fixed", sigma2=1.0, sigma0_2=1.0, gamma0=1.0,
                   experimental=ExperimentalOptions(starts="both"))


def test_the_stopping_rule_is_a_setting_of_empirical_bayes_only():
    """``stop`` chooses when empirical Bayes's sweeps stop: with fixed hyper-parameters PFNM has nothing to choose,
    and a value other than the default is refused, naming the field. (A ``FusionConfig`` holds it for the matched
    methods of an experiment beside weight-wise ones, so it takes it with any ``align``; ``bnpfed fuse`` refuses
    ``--stop`` without ``--align match``.)"""
    from bnpfed.federated import FusionConfig, PFNMConfig
    assert PFNMConfig(experimental=ExperimentalOptions(stop="fixed-point")).matcher_kwargs()["stop"] == "fixed-point"
    with pytest.raises(ValueError, match="stop: applies under empirical Bayes only"):
        PFNMConfig(hyperparameters="fixed", sigma2=1.0, sigma0_2=1.0, gamma0=1.0,
                   experimental=ExperimentalOptions(stop="fixed-point"))
    with pytest.raises(ValueError, match="stop: applies under empirical Bayes only"):
        PFNMConfig(constants="reference", experimental=ExperimentalOptions(stop="fixed-point"))
    assert FusionConfig(align="match", experimental=ExperimentalOptions(stop="fixed-point")).stop == "fixed-point"
    with pytest.raises(ValueError, match="stop: expected one of"):
        FusionConfig(experimental=ExperimentalOptions(stop="exact"))


def test_the_schedule_and_the_matcher_device_reach_every_group_through_the_config():
    """``PFNMConfig(matcher_device=)`` and the probe ``ExperimentalOptions(schedule=)`` travel to each group's matcher
    (a Jacobi sweep moves every client at once,
    so its sweeps repeat no Gauss-Seidel run's; torch on the CPU gives the numpy path's match), and bad values are
    refused by name."""
    import torch

    from bnpfed.federated import NetworkConfig, PFNMConfig
    from bnpfed.federated.clients import initial_network
    from bnpfed.matching import match_by_spec

    template = initial_network(NetworkConfig(hidden=(12,)), (6,), 3, seed=0)
    states = [initial_network(NetworkConfig(hidden=(12,)), (6,), 3, seed=j).state_dict() for j in range(4)]
    counts = torch.ones(4, 3)
    assert "schedule" not in PFNMConfig().matcher_kwargs() and "device" not in PFNMConfig().matcher_kwargs()
    numpy = match_by_spec(states, counts, template=template, seed=0, **PFNMConfig().matcher_kwargs())
    on_torch = match_by_spec(states, counts, template=template, seed=0, **PFNMConfig(matcher_device="cpu").matcher_kwargs())
    for g, r in numpy.layer_results.items():
        assert [a.tolist() for a in r.assignments] == [a.tolist() for a in on_torch.layer_results[g].assignments]
        torch.testing.assert_close(on_torch.layer_results[g].global_atoms, r.global_atoms, rtol=1e-9, atol=1e-10)
    jacobi = match_by_spec(states, counts, template=template, seed=0,
                           **PFNMConfig(experimental=ExperimentalOptions(schedule="jacobi")).matcher_kwargs())
    assert all(r.sweeps_run >= 1 and r.hyperparameter_history for r in jacobi.layer_results.values())
    with pytest.raises(ValueError, match="schedule: expected one of"):
        PFNMConfig(experimental=ExperimentalOptions(schedule="parallel"))
    with pytest.raises(ValueError, match="matcher_device: expected"):
        PFNMConfig(matcher_device="gpu")

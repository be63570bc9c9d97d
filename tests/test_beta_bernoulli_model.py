"""The Beta-Bernoulli neuron model of PFNM as a Pyro program: sampling and log densities."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from _reference import ibp_configuration_logprob
from scipy import stats

from bnpfed.models import (
    FederatedLayer,
    StudentTNoise,
    UniformPermutation,
    beta_bernoulli_layer,
    canonical_conditioning,
    log_joint,
    sample_federated_layer,
)


def harmonic(J):
    return sum(1.0 / j for j in range(1, J + 1))


def test_sampled_layer_is_consistent():
    layer = sample_federated_layer(6, 7, seed=3, gamma0=5.0, sigma2=0.01)
    assert layer.atoms.shape == (layer.num_atoms, 7)
    for a, v in zip(layer.assignments, layer.neurons):
        assert v.shape == (a.numel(), 7)
        assert a.unique().numel() == a.numel()  # one neuron per atom per client
        assert (a >= 0).all() and (a < layer.num_atoms).all()
    assert (layer.counts >= 1).all()  # every atom is used by the client that opened it


def test_same_seed_same_layer_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = sample_federated_layer(4, 5, seed=11, gamma0=4.0, sigma2=0.1)
    after = torch.rand(1)
    b = sample_federated_layer(4, 5, seed=11, gamma0=4.0, sigma2=0.1)
    assert torch.equal(before, after)
    assert torch.equal(a.atoms, b.atoms)
    assert all(torch.equal(x, y) for x, y in zip(a.neurons, b.neurons))


def test_ibp_moments_match_closed_form():
    """Each client uses gamma0 atoms on average; the number of atoms has mean gamma0 * H_J (Poisson)."""
    J, gamma0, n = 5, 6.0, 400
    per_client, atoms = [], []
    for seed in range(n):
        layer = sample_federated_layer(J, 1, seed=seed, gamma0=gamma0, sigma2=1.0)
        per_client.append(np.mean([a.numel() for a in layer.assignments]))
        atoms.append(layer.num_atoms)
    # 4 standard errors: per-client count is Poisson(gamma0) marginally, total atoms Poisson(gamma0 H_J)
    assert abs(np.mean(per_client) - gamma0) < 4 * math.sqrt(gamma0 / n)
    assert abs(np.mean(atoms) - gamma0 * harmonic(J)) < 4 * math.sqrt(gamma0 * harmonic(J) / n)


def test_neuron_noise_has_variance_sigma2_over_precision():
    J, D, sigma2 = 4, 200, 0.05
    s = torch.full((J, D), 1.0)
    s[:, :100] = 4.0
    layer = sample_federated_layer(J, D, seed=0, gamma0=30.0, sigma2=sigma2, precisions=s)
    resid = torch.cat([v - layer.atoms[a] for v, a in zip(layer.neurons, layer.assignments)])
    n = resid[:, :100].numel()
    # sample variance of n Gaussians: relative standard error sqrt(2/n); allow 5 of them
    assert abs(resid[:, :100].var().item() - sigma2 / 4) < 5 * math.sqrt(2 / n) * sigma2 / 4
    assert abs(resid[:, 100:].var().item() - sigma2) < 5 * math.sqrt(2 / n) * sigma2


def test_atoms_follow_prior_mean_per_coordinate():
    mu0 = torch.tensor([0.0, 0.1, -2.0])
    layer = sample_federated_layer(3, 3, seed=1, gamma0=300.0, sigma2=1.0, sigma0_2=0.25, mu0=mu0)
    n = layer.num_atoms
    assert torch.allclose(layer.atoms.mean(0), mu0, atol=5 * 0.5 / math.sqrt(n))


def closed_form_log_joint(layer, s, *, gamma0, sigma2, sigma0_2, mu0):
    """(sequential, configuration) log densities from scipy: IBP + Gaussian atoms + noise + permutations."""
    J = layer.num_clients
    counts = layer.counts.tolist()
    # K_j: atoms first used by client j
    seen, K = set(), []
    for a in layer.assignments:
        new = set(a.tolist()) - seen
        K.append(len(new))
        seen |= new
    expected = ibp_configuration_logprob(counts, J, gamma0) - sum(math.lgamma(k + 1) for k in K)
    expected += stats.norm.logpdf(layer.atoms.numpy(), mu0.numpy(), math.sqrt(sigma0_2)).sum()
    for j, (a, v) in enumerate(zip(layer.assignments, layer.neurons)):
        expected += stats.norm.logpdf(v.numpy(), layer.atoms[a].numpy(), np.sqrt(sigma2 / s[j].numpy())).sum()
        expected -= math.lgamma(a.numel() + 1)
    return expected, expected + sum(math.lgamma(k + 1) for k in K)


def test_log_joint_equals_closed_form(float64):
    """trace.log_prob_sum() of the conditioned program = sequential IBP + Gaussian atoms + noise + permutations."""
    J, D, gamma0, sigma2, sigma0_2 = 5, 4, 3.0, 0.2, 1.5
    mu0 = torch.tensor([0.0, 0.0, 0.0, 0.1])
    s = torch.rand(J, D) + 0.5
    layer = sample_federated_layer(J, D, seed=2, gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2, mu0=mu0,
                                   precisions=s)
    kw = dict(gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2, mu0=mu0)
    expected, expected_conf = closed_form_log_joint(layer, s, **kw)
    assert log_joint(layer, precisions=s, **kw).item() == pytest.approx(expected, rel=1e-10)
    assert log_joint(layer, configuration=True, precisions=s, **kw).item() == pytest.approx(expected_conf, rel=1e-10)


def sampled_layer_with_an_empty_client(J, D, **model_kwargs):
    for seed in range(1000):
        layer = sample_federated_layer(J, D, seed=seed, **model_kwargs)
        sizes = [a.numel() for a in layer.assignments]
        if 0 in sizes[:-1] and sum(sizes) > 0:  # an empty client some later client comes after
            return layer
    raise AssertionError("no such layer in 1000 seeds")


def by_hand_layer_with_empty_clients(D, first_empty=True):
    g = torch.Generator().manual_seed(0)
    atoms = torch.randn(3, D, generator=g)
    empty = torch.zeros(0, dtype=torch.long)
    assignments = [empty, torch.tensor([1, 0]), torch.tensor([2, 0, 1]), empty, torch.tensor([2])]
    if not first_empty:
        assignments = assignments[1:] + assignments[:1]
    neurons = [atoms[a] + 0.3 * torch.randn(len(a), D, generator=g) for a in assignments]
    return FederatedLayer(atoms=atoms, assignments=assignments, neurons=neurons)


@pytest.mark.parametrize("source", ["sampled", "by hand, first client empty", "by hand, last client empty"])
def test_log_joint_with_clients_without_neurons_equals_closed_form(float64, source):
    """A client without neurons counts in the IBP's J and in the later clients' m_i / j and gamma0 / j; it has no
    permutation or neuron term."""
    D, gamma0, sigma2, sigma0_2 = 3, 1.0, 0.2, 1.5
    mu0 = torch.tensor([0.0, 0.0, 0.1])
    if source == "sampled":
        layer = sampled_layer_with_an_empty_client(5, D, gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2, mu0=mu0)
    else:
        layer = by_hand_layer_with_empty_clients(D, first_empty=source.endswith("first client empty"))
    s = torch.rand(layer.num_clients, D, generator=torch.Generator().manual_seed(0)) + 0.5
    kw = dict(gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2, mu0=mu0)
    expected, expected_conf = closed_form_log_joint(layer, s, **kw)
    assert log_joint(layer, precisions=s, **kw).item() == pytest.approx(expected, rel=1e-10)
    assert log_joint(layer, configuration=True, precisions=s, **kw).item() == pytest.approx(expected_conf, rel=1e-10)


def test_a_client_without_neurons_has_no_neuron_sites():
    layer = by_hand_layer_with_empty_clients(3)
    data = canonical_conditioning(layer.neurons, layer.assignments, layer.atoms)
    trace = pyro.poutine.trace(pyro.poutine.condition(beta_bernoulli_layer, data=data)).get_trace(
        5, 3, gamma0=1.0, sigma2=0.1)
    for j in (0, 3):
        assert f"perm_{j}" not in trace.nodes and f"v_{j}" not in trace.nodes
        assert trace.nodes[f"new_{j}"]["value"].item() == 0
    assert "z_0" not in trace.nodes  # nothing was open before client 0
    assert torch.equal(trace.nodes["z_3"]["value"], torch.zeros(3))
    out = trace.nodes["_RETURN"]["value"]
    assert [tuple(v.shape) for v in out.neurons] == [(0, 3), (2, 3), (3, 3), (0, 3), (1, 3)]
    assert out.counts.tolist() == [2, 2, 2]


def test_counts_accept_empty_assignments_of_any_dtype():
    layer = FederatedLayer(atoms=torch.zeros(2, 1), assignments=[torch.tensor([]), torch.tensor([1, 0])],
                           neurons=[torch.zeros(0, 1), torch.zeros(2, 1)])
    assert layer.counts.tolist() == [1, 1]


def test_log_joint_does_not_depend_on_atom_labels(float64):
    layer = sample_federated_layer(4, 3, seed=5, gamma0=4.0, sigma2=0.1)
    perm = torch.randperm(layer.num_atoms, generator=torch.Generator().manual_seed(0))
    inv = torch.argsort(perm)
    relabelled = type(layer)(atoms=layer.atoms[perm], assignments=[inv[a] for a in layer.assignments],
                             neurons=layer.neurons)
    kw = dict(gamma0=4.0, sigma2=0.1)
    assert log_joint(relabelled, **kw).item() == pytest.approx(log_joint(layer, **kw).item(), rel=1e-12)


def test_swapping_the_atom_prior_changes_only_the_atom_terms(float64):
    """A Laplace prior on the atoms: the log joint moves by sum log Laplace(theta) - sum log Normal(theta)."""
    J, D = 4, 6
    laplace = dist.Laplace(torch.zeros(D), 0.5)
    layer = sample_federated_layer(J, D, seed=0, gamma0=5.0, sigma2=0.05, atom_prior=laplace)
    gauss = log_joint(layer, gamma0=5.0, sigma2=0.05, sigma0_2=1.0)
    lap = log_joint(layer, gamma0=5.0, sigma2=0.05, atom_prior=laplace)
    theta = layer.atoms.numpy()
    delta = stats.laplace.logpdf(theta, 0, 0.5).sum() - stats.norm.logpdf(theta, 0, 1).sum()
    assert (lap - gauss).item() == pytest.approx(delta, rel=1e-10)
    # and the samples really are Laplace: a KS test accepts Laplace(0, 0.5) and rejects the Gaussian of equal variance
    many = sample_federated_layer(2, D, seed=1, gamma0=300.0, sigma2=0.01, atom_prior=laplace)
    x = many.atoms.flatten().numpy()
    assert stats.kstest(x, stats.laplace(0, 0.5).cdf).pvalue > 0.01
    assert stats.kstest(x, stats.norm(0, math.sqrt(2) * 0.5).cdf).pvalue < 1e-3


def test_student_t_noise_can_replace_the_gaussian(float64):
    def student_t(loc, variance):
        return dist.StudentT(3.0, loc, variance.sqrt())

    layer = sample_federated_layer(3, 5, seed=0, gamma0=4.0, sigma2=0.1, noise=student_t)
    lp = log_joint(layer, gamma0=4.0, sigma2=0.1, noise=student_t)
    lp_gauss = log_joint(layer, gamma0=4.0, sigma2=0.1)
    resid = np.concatenate([(v - layer.atoms[a]).numpy().ravel() for v, a in zip(layer.neurons, layer.assignments)])
    delta = stats.t.logpdf(resid, 3.0, 0, math.sqrt(0.1)).sum() - stats.norm.logpdf(resid, 0, math.sqrt(0.1)).sum()
    assert (lp - lp_gauss).item() == pytest.approx(delta, rel=1e-10)


def test_conditioning_on_neurons_fixes_them():
    layer = sample_federated_layer(3, 4, seed=0, gamma0=3.0, sigma2=0.1)
    # condition client 0's count of new atoms and its neurons; the program must reproduce them
    data = {"new_0": torch.tensor(float(layer.neurons[0].shape[0])), "v_0": layer.neurons[0]}
    with torch.random.fork_rng():
        torch.manual_seed(9)
        out = pyro.poutine.condition(beta_bernoulli_layer, data=data)(3, 4, gamma0=3.0, sigma2=0.1)
    assert torch.equal(out.neurons[0], layer.neurons[0])


def test_uniform_permutation_log_prob():
    d = UniformPermutation(4)
    assert d.log_prob(torch.tensor([2, 0, 3, 1])).item() == pytest.approx(-math.log(24))
    assert d.log_prob(torch.tensor([0, 0, 3, 1])).item() == -math.inf
    assert sorted(d.sample().tolist()) == [0, 1, 2, 3]


def test_conditioning_on_a_layer_with_mismatched_neurons_raises():
    layer = by_hand_layer_with_empty_clients(3)
    neurons = list(layer.neurons)
    neurons[0] = torch.zeros(1, 3)  # client 0's assignment is empty
    with pytest.raises(ValueError, match=r"neurons\[0\]: expected shape \(0, 3\)"):
        canonical_conditioning(neurons, layer.assignments, layer.atoms)
    with pytest.raises(ValueError, match=r"assignments: expected one per client \(5"):
        canonical_conditioning(layer.neurons, layer.assignments[:4], layer.atoms)


def test_bad_model_arguments_raise():
    with pytest.raises(ValueError, match="gamma0"):
        beta_bernoulli_layer(2, 3, gamma0=0.0, sigma2=1.0)
    with pytest.raises(ValueError, match="sigma2"):
        beta_bernoulli_layer(2, 3, gamma0=1.0, sigma2=-1.0)
    with pytest.raises(ValueError, match="precisions"):
        beta_bernoulli_layer(2, 3, gamma0=1.0, sigma2=1.0, precisions=torch.ones(2, 4))
    with pytest.raises(ValueError, match="atom_prior"):
        beta_bernoulli_layer(2, 3, gamma0=1.0, sigma2=1.0, atom_prior=dist.Normal(torch.zeros(4), 1.0))
    with pytest.raises(ValueError, match="mu0"):
        beta_bernoulli_layer(2, 3, gamma0=1.0, sigma2=1.0, mu0=torch.zeros(4))
    with pytest.raises(ValueError, match="concentration: expected a positive finite number, got 0.0"):
        beta_bernoulli_layer(2, 3, gamma0=1.0, sigma2=1.0, concentration=0.0)


def test_a_price_per_parameter_is_the_same_program_at_a_lower_ibp_mass(float64):
    """The size prior of bnpfed.matching.size: p(Z, V) exp(-lambda L D) is the program at gamma0 exp(-lambda D),
    up to a constant free of the configuration (checked on layers of different atom counts, through Pyro's trace
    density)."""
    gamma0, lam, D = 4.0, 0.3, 6
    kw = dict(sigma2=0.2, sigma0_2=1.0)
    offsets = []
    for seed in range(4):
        layer = sample_federated_layer(5, D, seed=seed, gamma0=gamma0, **kw)
        priced = log_joint(layer, gamma0=gamma0, **kw).item() - lam * layer.num_atoms * D
        lowered = log_joint(layer, gamma0=gamma0 * math.exp(-lam * D), **kw).item()
        offsets.append((layer.num_atoms, lowered - priced))
    assert len({n for n, _ in offsets}) > 1                     # the layers differ in their number of atoms
    constant = gamma0 * (1 - math.exp(-lam * D)) * sum(1 / k for k in range(1, 6))   # (gamma0 - gamma0') H_J
    for _, offset in offsets:
        assert offset == pytest.approx(constant, rel=1e-9)



def test_sample_federated_layer_names_a_missing_or_unknown_keyword_before_drawing():
    with pytest.raises(TypeError, match=r"sample_federated_layer\(\) missing 1 required keyword-only argument: "
                                        r"'gamma0'"):
        sample_federated_layer(3, 4, seed=0)
    with pytest.raises(ValueError, match=r"gamma: not a keyword of beta_bernoulli_layer; expected gamma0 and any of "
                                         r"sigma2, sigma0_2"):
        sample_federated_layer(3, 4, seed=0, gamma0=1.0, gamma=2.0)
    with pytest.raises(ValueError, match="seed: expected an int >= 0"):
        sample_federated_layer(3, 4, seed=-1, gamma0=1.0)


def test_concentration_one_is_the_one_parameter_program():
    """concentration=1 draws exactly what the program drew before it had a concentration."""
    a = sample_federated_layer(6, 4, seed=5, gamma0=5.0, sigma2=0.1)
    b = sample_federated_layer(6, 4, seed=5, gamma0=5.0, sigma2=0.1, concentration=1.0)
    assert torch.equal(a.atoms, b.atoms) and all(torch.equal(x, y) for x, y in zip(a.neurons, b.neurons))


def test_two_parameter_ibp_moments_match_closed_form():
    """With concentration c every client still uses gamma0 atoms on average, and the number of atoms is
    Poisson(gamma0 sum_j c / (c + j - 1)): more atoms than at c = 1, each held by fewer clients."""
    J, gamma0, c, n = 5, 4.0, 5.0, 400
    per_client, atoms = [], []
    for seed in range(n):
        layer = sample_federated_layer(J, 1, seed=seed, gamma0=gamma0, sigma2=1.0, concentration=c)
        per_client.append(np.mean([a.numel() for a in layer.assignments]))
        atoms.append(layer.num_atoms)
    rate = sum(c / (c + j - 1) for j in range(1, J + 1))
    assert rate > harmonic(J)
    # 4 standard errors (per client Poisson(gamma0) marginally; the atoms Poisson(gamma0 * rate))
    assert abs(np.mean(per_client) - gamma0) < 4 * math.sqrt(gamma0 / n)
    assert abs(np.mean(atoms) - gamma0 * rate) < 4 * math.sqrt(gamma0 * rate / n)


@pytest.mark.parametrize("c", [0.5, 5.0])
def test_log_joint_with_a_concentration_equals_closed_form(float64, c):
    """The conditioned trace's density is the two-parameter IBP's (Ghahramani et al. 2007) with the Gaussian terms."""
    J, D, gamma0, sigma2, sigma0_2 = 5, 3, 3.0, 0.2, 1.5
    mu0 = torch.zeros(D)
    layer = sample_federated_layer(J, D, seed=4, gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2, concentration=c)
    kw = dict(gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2, mu0=mu0)
    _, gaussian_conf = closed_form_log_joint(layer, torch.ones(J, D), **kw)
    counts = layer.counts.tolist()
    expected = gaussian_conf - ibp_configuration_logprob(counts, J, gamma0) + ibp_configuration_logprob(
        counts, J, gamma0, c)
    got = log_joint(layer, configuration=True, concentration=c, **kw).item()
    assert got == pytest.approx(expected, rel=1e-10)


def test_a_student_t_noise_law_scores_as_scipy_and_refuses_to_sample_with_a_free_df(float64):
    layer = sample_federated_layer(3, 5, seed=0, gamma0=4.0, sigma2=0.1, noise=StudentTNoise(df=2.0))
    resid = np.concatenate([(v - layer.atoms[a]).numpy().ravel() for v, a in zip(layer.neurons, layer.assignments)])
    delta = stats.t.logpdf(resid, 2.0, 0, math.sqrt(0.1)).sum() - stats.norm.logpdf(resid, 0, math.sqrt(0.1)).sum()
    lp = log_joint(layer, gamma0=4.0, sigma2=0.1, noise=StudentTNoise(df=2.0))
    assert (lp - log_joint(layer, gamma0=4.0, sigma2=0.1)).item() == pytest.approx(delta, rel=1e-10)
    with pytest.raises(ValueError, match="df: expected a value to sample or score with, got None"):
        sample_federated_layer(3, 5, seed=0, gamma0=4.0, sigma2=0.1, noise=StudentTNoise())
    with pytest.raises(ValueError, match=r"df: expected None \(estimated\) or a number in"):
        StudentTNoise(df=-1.0)
    with pytest.raises(ValueError, match="scale: expected a parameter of StudentTNoise"):
        StudentTNoise(df=2.0).with_values(scale=1.0)
    assert StudentTNoise().with_values(df=3.0).parameters == {"df": 3.0}

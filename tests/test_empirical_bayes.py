"""Empirical-Bayes matching: hyper-parameters estimated from the clients' neurons alone, checked against the model
they were drawn from, against the moment formulas written out independently here, and for invariance.

The layers come from the Beta-Bernoulli model (:func:`bnpfed.models.sample_federated_layer`) with prior mean 0 on the
weight coordinates and 0.1 on one bias coordinate, sigma0_2 = 1, sigma2 = 0.01 and gamma0 = 40: noise well below
the prior's spread (sigma2 / sigma0_2 = 0.01), so that neurons of one atom are far closer to each other than to any
other atom and the assignment is identifiable, and enough atoms (gamma0 H_J, about 120 at J = 10 and 150 at J = 25)
that gamma0 = L / H_J is within 30 % of the truth for the draws (L is Poisson(gamma0 H_J): a sd of 8-9 %).
"""

import inspect
import itertools
import math

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment
from scipy.special import gammaln
from sklearn.metrics import adjusted_rand_score

from bnpfed.matching import REFERENCE_CONSTANTS, assignment_objective, match_by_spec, match_layer
from bnpfed.matching.layer import EB_START_NOISE_SHARE, SIGMA0_2_FLOOR, SIGMA2_FLOOR
from bnpfed.models import sample_federated_layer

TRUTH = dict(sigma0_2=1.0, sigma2=0.01, gamma0=40.0)


def harmonic(J):
    return sum(1.0 / j for j in range(1, J + 1))


def true_mu0(D):
    mu0 = torch.zeros(D)
    mu0[-1] = 0.1  # the bias coordinate
    return mu0


def model_layer(J, D, seed, **overrides):
    truth = {**TRUTH, **overrides}
    return sample_federated_layer(J, D, seed=seed, mu0=true_mu0(D), **truth)


def ari(layer, result):
    return adjusted_rand_score(torch.cat(layer.assignments).numpy(), torch.cat(result.assignments).numpy())


def same_atoms(a, b, tol):
    """The rows of a and b are the same set of atoms (up to order) within tol."""
    assert a.shape == b.shape
    cost = torch.cdist(a.double(), b.double()).numpy()
    rows, cols = linear_sum_assignment(cost)
    return cost[rows, cols].max() <= tol


# --------------------------------------------------------------------------------------------------------------------
# recovery


@pytest.mark.parametrize("J, D", [(10, 50), (25, 50), (10, 200), (25, 200)])
@pytest.mark.parametrize("off", [10.0, 0.1], ids=["10x above", "10x below"])
def test_recovers_the_model_s_hyperparameters_and_atoms_from_a_start_ten_times_off(J, D, off):
    layer = model_layer(J, D, seed=J + D)
    start = {name: value * off for name, value in TRUTH.items()}
    r = match_layer(layer.neurons, start=start, seed=0)
    h = r.hyperparameters
    assert r.converged and r.estimated == ("mu0", "sigma0_2", "sigma2", "gamma0")
    assert h["sigma2"] == pytest.approx(TRUTH["sigma2"], rel=0.10)
    assert h["sigma0_2"] == pytest.approx(TRUTH["sigma0_2"], rel=0.10)
    assert h["gamma0"] == pytest.approx(TRUTH["gamma0"], rel=0.30)
    assert ari(layer, r) >= 0.95
    assert abs(r.num_atoms - layer.num_atoms) <= 0.05 * layer.num_atoms
    # gamma0 is the maximiser of the IBP's probability of the L atoms found
    assert h["gamma0"] == pytest.approx(r.num_atoms / harmonic(J), rel=1e-12)
    # mu0: the mean of the atom means, which is the realised atoms' mean up to the noise, and the prior mean up to
    # the atoms' spread (4.5 standard errors over D coordinates)
    L = layer.num_atoms
    realised = layer.atoms.mean(0)
    assert (h["mu0"] - realised).abs().max() <= 4.5 * math.sqrt(TRUTH["sigma2"] / L)
    assert (h["mu0"] - true_mu0(D)).abs().max() <= 4.5 * math.sqrt((TRUTH["sigma0_2"] + TRUTH["sigma2"]) / L)


def test_the_data_driven_start_recovers_the_same_estimates():
    layer = model_layer(10, 50, seed=60)
    default = match_layer(layer.neurons, seed=0)
    started = match_layer(layer.neurons, seed=0, start={n: 10 * v for n, v in TRUTH.items()})
    assert default.converged and ari(layer, default) == 1.0
    for name in ("sigma0_2", "sigma2", "gamma0"):
        assert default.hyperparameters[name] == pytest.approx(started.hyperparameters[name], rel=1e-9)


def pooled_variance(neurons):
    """T of the data-driven start: the neurons' variance per coordinate (about the coordinate's mean), pooled."""
    v = np.concatenate([np.asarray(n, dtype=np.float64) for n in neurons])
    return float(((v - v.mean(0)) ** 2).sum() / (v.shape[1] * (v.shape[0] - 1)))


def log_marginal_likelihood(neurons, assignments, h):
    """log p(V | Z, sigma2, sigma0_2, mu0) + log p(Z | gamma0), written out: every atom integrated out (precision 1
    on every coordinate), and the IBP's exchangeable form, sum_i log[(m_i - 1)! (J - m_i)! / J!] + L log gamma0 -
    gamma0 H_J (the labelling terms free of the hyper-parameters and of the partition left out)."""
    V = [np.asarray(n, dtype=np.float64) for n in neurons]
    J, D = len(V), V[0].shape[1]
    s2, s0, g0, mu0 = h["sigma2"], h["sigma0_2"], h["gamma0"], h["mu0"].double().numpy()
    labels = np.concatenate([np.asarray(a) for a in assignments])
    stacked = np.concatenate(V)
    L = labels.max() + 1
    m = np.bincount(labels, minlength=L).astype(float)
    sums = np.zeros((L, D))
    np.add.at(sums, labels, stacked)
    P = 1 / s0 + m / s2  # posterior precision of every coordinate of atom i
    g = mu0 / s0 + sums / s2
    ll = -0.5 * (stacked.size * math.log(2 * math.pi * s2) + (stacked ** 2).sum() / s2)
    ll += 0.5 * float((g ** 2).sum(1) @ (1 / P)) - 0.5 * L * float(mu0 @ mu0) / s0 - 0.5 * D * np.log(P * s0).sum()
    ll += L * math.log(g0) - g0 * harmonic(J) + float((gammaln(m) + gammaln(J - m + 1) - gammaln(J + 1)).sum())
    return float(ll)


def test_two_fixed_points_when_some_neurons_agree_closely_and_both_starts_keep_the_likelier():
    """A layer like those of independently trained networks with their dead units kept: 20 small atoms every client
    holds, its copies within 0.03 of each other (units that never activate, shrunk by weight decay), and 80 loose
    ones, each client's copy correlated only 0.5 with the others'. The alternation has two fixed points here. From
    the even split sigma2 = sigma0_2 = T / 2 (the default start) the first pass merges the loose neurons and their
    spread becomes the noise; from the small noise only the close copies merge, and that fixed point has the higher
    marginal likelihood, which ``starts="both"`` keeps."""
    rng = np.random.default_rng(0)
    J, D, n_close, n_loose, rho = 10, 100, 20, 80, 0.5
    close = rng.normal(0.0, 0.1, (n_close, D))
    loose = rng.normal(0.0, 1.0, (n_loose, D))
    neurons, truth = [], []
    for j in range(J):
        order = rng.permutation(n_close + n_loose)
        v = np.vstack([close + rng.normal(0.0, 0.03, close.shape),
                       math.sqrt(rho) * loose + math.sqrt(1 - rho) * rng.normal(0.0, 1.0, loose.shape)])
        neurons.append(v[order])
        # the close atoms shared, every loose neuron its own atom: what the higher fixed point finds
        truth.append(np.where(order < n_close, order, n_close + j * n_loose + order - n_close))
    small = match_layer(neurons, seed=0, starts="small-noise")
    T = pooled_variance(neurons)
    even = match_layer(neurons, seed=0, start=dict(sigma2=T / 2, sigma0_2=T / 2))
    default, both = match_layer(neurons, seed=0), match_layer(neurons, seed=0, starts="both")
    assert small.converged and even.converged
    assert adjusted_rand_score(np.concatenate(truth), torch.cat(small.assignments).numpy()) == 1.0
    assert small.hyperparameters["sigma2"] == pytest.approx(0.03 ** 2, rel=0.1)
    assert even.num_atoms < 0.2 * small.num_atoms  # the loose neurons merged
    assert even.hyperparameters["sigma2"] > 100 * small.hyperparameters["sigma2"]
    ll_small = log_marginal_likelihood(neurons, small.assignments, small.hyperparameters)
    ll_even = log_marginal_likelihood(neurons, even.assignments, even.hyperparameters)
    assert ll_small > ll_even + 1e4
    assert all(torch.equal(a, b) for a, b in zip(default.assignments, even.assignments)) and not default.starts
    assert all(torch.equal(a, b) for a, b in zip(both.assignments, small.assignments))
    assert [s["start"] for s in both.starts] == ["small-noise", "even-split"]


@pytest.mark.parametrize("starts,share", [("small-noise", EB_START_NOISE_SHARE), ("even-split", 0.5)])
def test_the_small_noise_start_is_a_tenth_of_the_pooled_variance_to_the_noise_and_the_even_split_half(starts, share):
    layer = model_layer(10, 50, seed=3)
    T = pooled_variance(layer.neurons)
    default = match_layer(layer.neurons, seed=0, sweeps=0, starts=starts)
    started = match_layer(layer.neurons, seed=0, sweeps=0, start=dict(sigma2=share * T, sigma0_2=(1 - share) * T))
    assert all(torch.equal(a, b) for a, b in zip(default.assignments, started.assignments))
    assert default.objective == pytest.approx(started.objective, rel=1e-12)


def test_a_first_pass_that_leaves_every_neuron_alone_is_redone_from_the_even_split():
    """Noise as large as the atoms' spread: at a tenth of the pooled variance no two neurons merge (sigma2 would not
    be estimable); the first pass is redone from sigma2 = sigma0_2 = T / 2, noted."""
    layer = sample_federated_layer(10, 50, seed=1, sigma0_2=1.0, sigma2=1.0, gamma0=5.0)
    r = match_layer(layer.neurons, seed=0, starts="small-noise")
    assert any("left every neuron alone: redone from the even split" in n for n in r.notes)
    T = pooled_variance(layer.neurons)
    even = match_layer(layer.neurons, seed=0, start=dict(sigma2=T / 2, sigma0_2=T / 2))
    assert all(torch.equal(a, b) for a, b in zip(r.assignments, even.assignments))
    for name in ("sigma0_2", "sigma2", "gamma0"):
        assert r.hyperparameters[name] == pytest.approx(even.hyperparameters[name], rel=1e-12)
    # a start that is given is kept, even where nothing merges from it
    started = match_layer(layer.neurons, seed=0, sweeps=0, start=dict(sigma2=T / 10, sigma0_2=0.9 * T))
    assert started.num_atoms == sum(len(v) for v in layer.neurons)
    assert not any("redone" in n for n in started.notes)


def test_given_hyperparameters_are_held_fixed_and_the_others_estimated():
    layer = model_layer(10, 50, seed=1)
    r = match_layer(layer.neurons, sigma0_2=2.0, gamma0=30.0, seed=0)
    assert r.estimated == ("mu0", "sigma2")
    assert r.hyperparameters["sigma0_2"] == 2.0 and r.hyperparameters["gamma0"] == 30.0
    assert all(h["sigma0_2"] == 2.0 and h["gamma0"] == 30.0 for h in r.hyperparameter_history)
    assert r.hyperparameters["sigma2"] == pytest.approx(TRUTH["sigma2"], rel=0.1)
    # a (D,) mu0 with NaN entries: those coordinates estimated, the others held
    mu0 = torch.full((50,), float("nan"))
    mu0[-1] = 0.1
    r = match_layer(layer.neurons, mu0=mu0, seed=0)
    assert r.hyperparameters["mu0"][-1].item() == pytest.approx(0.1) and "mu0" in r.estimated
    held = match_layer(layer.neurons, mu0=0.0, seed=0)
    assert "mu0" not in held.estimated and (held.hyperparameters["mu0"] == 0).all()


# --------------------------------------------------------------------------------------------------------------------
# the estimates are the moment formulas (written out here from the issue's definitions)


def moments_by_hand(neurons, assignments, coordinates, precisions=None, *, mu0_given=None, weighted=False):
    """The estimates on the given coordinates at an assignment. W_id = sum s_jd, xbar_id = sum s_jd v_jd / W_id,
    n_id = #{s_jd > 0} over atom i's members; sigma2 = sum s (v - xbar)^2 / sum (n_id - 1); mu0_d = mean_i xbar_id
    over atoms with W_id > 0. sigma0_2: unweighted, [sum_d sum_i (xbar_id - mu0_d)^2 - sigma2 sum_d (k_d / L_d)
    sum_i 1/W_id] / sum_d k_d, k_d = L_d - 1 (L_d if mu0 is given); weighted (DerSimonian-Laird), w_i = W_id /
    sigma2 and sum_d [Q_d - (L_d - 1)] / sum_d [sum w - sum w^2 / sum w], Q_d the w-weighted sum of squares about
    the w-weighted mean (about a given mu0: L_d and sum w)."""
    J = len(neurons)
    D = neurons[0].shape[1]
    s = np.ones((J, D)) if precisions is None else np.asarray(precisions, dtype=float)
    labels = sorted({int(i) for a in assignments for i in a})
    groups = {i: [] for i in labels}
    for j, a in enumerate(assignments):
        for l, i in enumerate(np.asarray(a).tolist()):
            groups[i].append((j, l))
    within = dof = 0.0
    xbar = {d: [] for d in coordinates}  # per coordinate: (W_id, xbar_id) of the atoms with data on it
    for i in labels:
        for d in coordinates:
            members = [(j, l) for j, l in groups[i] if s[j, d] > 0]
            if not members:
                continue
            w = np.array([s[j, d] for j, _ in members])
            v = np.array([float(neurons[j][l][d]) for j, l in members])
            mean = (w * v).sum() / w.sum()
            xbar[d].append((w.sum(), mean))
            within += (w * (v - mean) ** 2).sum()
            dof += len(members) - 1
    sigma2 = within / dof
    mu0 = {d: np.mean([x for _, x in xbar[d]]) if mu0_given is None else mu0_given for d in coordinates}
    top = bottom = 0.0
    for d in coordinates:
        W = np.array([w for w, _ in xbar[d]])
        x = np.array([x for _, x in xbar[d]])
        L_d = len(x)
        if weighted:
            w = W / sigma2
            centre = (w * x).sum() / w.sum() if mu0_given is None else mu0_given
            top += (w * (x - centre) ** 2).sum() - (L_d - 1 if mu0_given is None else L_d)
            bottom += w.sum() - ((w ** 2).sum() / w.sum() if mu0_given is None else 0.0)
        else:
            k = L_d - 1 if mu0_given is None else L_d
            top += ((x - mu0[d]) ** 2).sum() - sigma2 * k / L_d * (1 / W).sum()
            bottom += k
    return dict(mu0=np.array([mu0[d] for d in coordinates]), sigma0_2=top / bottom, sigma2=sigma2,
                gamma0=len(labels) / harmonic(J))


def issue_formulas(neurons, assignments):
    """The issue's formulas with all precisions 1 (S_id, Q_id sums of v and v^2, m_i members), 1/(L-1) in sigma0_2."""
    V = np.concatenate([v.double().numpy() for v in neurons])
    a = np.concatenate([np.asarray(x) for x in assignments])
    L, D = a.max() + 1, V.shape[1]
    m = np.bincount(a, minlength=L).astype(float)
    S = np.zeros((L, D))
    Q = np.zeros((L, D))
    np.add.at(S, a, V)
    np.add.at(Q, a, V ** 2)
    mu0 = (S / m[:, None]).mean(0)
    sigma2 = (Q - S ** 2 / m[:, None]).sum() / (D * (m.sum() - L))
    sigma0_2 = (((S / m[:, None] - mu0) ** 2).sum(0) / (L - 1) - sigma2 * (1 / m).mean()).mean()
    return dict(mu0=mu0, sigma0_2=sigma0_2, sigma2=sigma2, gamma0=L / harmonic(len(neurons)))


def test_estimates_are_the_issue_s_formulas_at_the_returned_assignment():
    layer = model_layer(10, 50, seed=2)
    r = match_layer(layer.neurons, seed=0)
    expected = issue_formulas(layer.neurons, r.assignments)
    for name in ("sigma0_2", "sigma2", "gamma0"):
        assert r.hyperparameters[name] == pytest.approx(expected[name], rel=1e-9)
    np.testing.assert_allclose(r.hyperparameters["mu0"].double().numpy(), expected["mu0"], rtol=1e-6, atol=1e-7)


def shares_layer(J, D, C, seed, *, zeros=True):
    """A layer from the model whose last C coordinates carry class shares as precision scales (PFNM's output weights),
    some of them 0 (classes a client never saw) when ``zeros``; the model draws those coordinates at the shares'
    precision (0 replaced by 1e-3 there: a client that never saw a class still has some weight)."""
    g = torch.Generator().manual_seed(seed)
    shares = torch.rand(J, C, generator=g) * ((torch.rand(J, C, generator=g) > 0.3) if zeros else 1.0)
    shares[0] = shares[0].clamp(min=0.5)  # every class held by someone
    shares = shares / shares.sum(0)
    precisions = torch.ones(J, D)
    precisions[:, -C:] = shares
    layer = model_layer(J, D, seed=seed, gamma0=10.0, precisions=list(precisions.clamp(min=1e-3)))
    return layer, precisions


def test_output_coordinates_get_their_own_variances_and_the_others_the_issue_s_formulas():
    """Coordinates of scale 1 (the first D - C): the issue's formulas; the C with class shares: sigma2_scaled from
    their share-weighted residuals and sigma0_2_scaled by the weighted (DerSimonian-Laird) moment; zero shares
    skipped."""
    J, D, C = 8, 24, 3
    layer, precisions = shares_layer(J, D, C, seed=4)
    r = match_layer(layer.neurons, precisions=precisions, seed=0)
    h = r.hyperparameters
    assert r.estimated == ("mu0", "sigma0_2", "sigma2", "gamma0", "sigma0_2_scaled", "sigma2_scaled")
    plain = moments_by_hand(layer.neurons, r.assignments, range(D - C), precisions)
    scaled = moments_by_hand(layer.neurons, r.assignments, range(D - C, D), precisions, weighted=True)
    for name in ("sigma0_2", "sigma2", "gamma0"):
        assert h[name] == pytest.approx(plain[name], rel=1e-9)
        assert h[name + "_scaled" if name != "gamma0" else name] == pytest.approx(scaled[name], rel=1e-9)
    mu0 = h["mu0"].double().numpy()
    np.testing.assert_allclose(mu0, np.concatenate([plain["mu0"], scaled["mu0"]]), rtol=1e-6, atol=1e-7)
    issue = issue_formulas([v[:, :D - C] for v in layer.neurons], r.assignments)
    assert h["sigma2"] == pytest.approx(issue["sigma2"], rel=1e-9)
    assert h["sigma0_2"] == pytest.approx(issue["sigma0_2"], rel=1e-9)
    # with mu0 given, sigma0_2 counts L_d degrees of freedom, not L_d - 1, and Q is about mu0
    given = match_layer(layer.neurons, precisions=precisions, mu0=0.05, seed=0)
    plain = moments_by_hand(layer.neurons, given.assignments, range(D - C), precisions, mu0_given=0.05)
    scaled = moments_by_hand(layer.neurons, given.assignments, range(D - C, D), precisions, mu0_given=0.05,
                             weighted=True)
    assert given.hyperparameters["sigma0_2"] == pytest.approx(plain["sigma0_2"], rel=1e-9)
    assert given.hyperparameters["sigma0_2_scaled"] == pytest.approx(scaled["sigma0_2"], rel=1e-9)


def test_a_layer_without_coordinates_of_scale_1_estimates_its_variances_the_weighted_way():
    J, D = 8, 12
    g = torch.Generator().manual_seed(0)
    precisions = 0.2 + torch.rand(J, D, generator=g)
    layer = model_layer(J, D, seed=12, gamma0=10.0, precisions=list(precisions))
    r = match_layer(layer.neurons, precisions=precisions, seed=0)
    assert r.estimated == ("mu0", "sigma0_2", "sigma2", "gamma0")
    expected = moments_by_hand(layer.neurons, r.assignments, range(D), precisions, weighted=True)
    for name in ("sigma0_2", "sigma2", "gamma0"):
        assert r.hyperparameters[name] == pytest.approx(expected[name], rel=1e-9)


def test_output_coordinates_drawn_at_the_shares_precision_give_back_the_model_s_variances():
    """The model draws the shared coordinates at noise sigma2 / share: their own estimates find the same sigma2 and
    sigma0_2 (looser: 6 coordinates only)."""
    layer, precisions = shares_layer(10, 106, 6, seed=13, zeros=False)
    r = match_layer(layer.neurons, precisions=precisions, seed=0)
    assert ari(layer, r) >= 0.95
    assert r.hyperparameters["sigma2_scaled"] == pytest.approx(TRUTH["sigma2"], rel=0.25)
    assert r.hyperparameters["sigma0_2_scaled"] == pytest.approx(TRUTH["sigma0_2"], rel=0.35)


# --------------------------------------------------------------------------------------------------------------------
# invariance


def test_permuting_clients_and_their_neurons_changes_neither_estimates_nor_atoms():
    layer = model_layer(12, 40, seed=5)
    base = match_layer(layer.neurons, seed=0)
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(12, generator=g).tolist()
    shuffled = []
    for j in order:
        v = layer.neurons[j]
        shuffled.append(v[torch.randperm(v.shape[0], generator=g)])
    for seed in (0, 7):
        r = match_layer(shuffled, seed=seed)
        for name in ("sigma0_2", "sigma2", "gamma0"):
            assert r.hyperparameters[name] == pytest.approx(base.hyperparameters[name], rel=1e-9)
        torch.testing.assert_close(r.hyperparameters["mu0"], base.hyperparameters["mu0"], rtol=1e-6, atol=1e-7)
        assert r.num_atoms == base.num_atoms
        assert same_atoms(r.global_atoms, base.global_atoms, tol=1e-5)
        assert sorted(r.counts.tolist()) == sorted(base.counts.tolist())


# --------------------------------------------------------------------------------------------------------------------
# the objective


def test_with_the_estimates_held_fixed_every_sweep_raises_the_marginal_objective():
    """Sweep k runs at the estimates E_{k-1} of the assignment Z_{k-1}: F_marg(Z_k; E_{k-1}) >= F_marg(Z_{k-1};
    E_{k-1}). Z_{k-1} is the result of the same run stopped after k - 1 sweeps."""
    layer = model_layer(10, 30, seed=6)
    kw = dict(seed=3, cross_products="direct", start=dict(sigma2=0.001, sigma0_2=0.1, gamma0=4.0))
    runs = [match_layer(layer.neurons, sweeps=k, **kw) for k in range(6)]
    K = runs[-1].sweeps_run
    assert K >= 3  # the start is far enough off for several sweeps to move
    for k in range(1, K + 1):
        before, after = runs[k - 1], runs[k]
        values = before.hyperparameters
        earlier = after.hyperparameter_history[k - 1]
        assert all(earlier[n] == values[n] for n in ("sigma0_2", "sigma2", "gamma0"))
        assert torch.equal(earlier["mu0"], values["mu0"])
        fixed = dict(objective="marginal", **values)
        F_before = assignment_objective(layer.neurons, before.assignments, **fixed)
        F_after = assignment_objective(layer.neurons, after.assignments, **fixed)
        assert F_after >= F_before - 1e-9 * abs(F_before)
        assert after.objective[k] == pytest.approx(F_after, rel=1e-9)


def test_nothing_to_estimate_is_the_fixed_marginal_matching():
    layer = model_layer(8, 20, seed=7)
    values = dict(mu0=true_mu0(20), **TRUTH)
    eb = match_layer(layer.neurons, seed=0, **values)
    fixed = match_layer(layer.neurons, seed=0, hyperparameters="fixed", objective="marginal", sweeps=50, **values)
    assert eb.estimated == () and eb.converged
    assert all(torch.equal(a, b) for a, b in zip(eb.assignments, fixed.assignments))
    torch.testing.assert_close(eb.global_atoms, fixed.global_atoms)
    assert (np.diff(eb.objective) >= -1e-9 * abs(eb.objective[0])).all()


# --------------------------------------------------------------------------------------------------------------------
# degenerate cases


def test_every_neuron_alone_keeps_sigma2_at_its_previous_value():
    v = torch.randn(6, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    r = match_layer([v], start=dict(sigma2=0.05), seed=0)  # one client: every atom has one member
    assert r.num_atoms == 6
    assert r.hyperparameters["sigma2"] == 0.05
    assert any("sigma2 not estimable" in n for n in r.notes)
    assert r.hyperparameters["gamma0"] == 6.0  # L / H_1
    xbar = v.numpy()
    expected = ((xbar - xbar.mean(0)) ** 2).sum() / (10 * 5) - 0.05
    assert r.hyperparameters["sigma0_2"] == pytest.approx(expected, rel=1e-9)


def test_one_atom_keeps_sigma0_2_at_its_previous_value():
    g = torch.Generator().manual_seed(0)
    centre = torch.randn(1, 20, generator=g, dtype=torch.float64)
    neurons = [centre + 0.01 * torch.randn(1, 20, generator=g, dtype=torch.float64) for _ in range(5)]
    r = match_layer(neurons, start=dict(sigma2=1e-4, sigma0_2=3.0), seed=0)
    assert r.num_atoms == 1
    assert r.hyperparameters["sigma0_2"] == 3.0
    assert any("sigma0_2 not estimable" in n for n in r.notes)
    assert r.hyperparameters["sigma2"] == pytest.approx(1e-4, rel=0.3)
    torch.testing.assert_close(r.hyperparameters["mu0"], torch.cat(neurons).mean(0))
    # with mu0 given, one atom is enough (its deviation from mu0)
    given = match_layer(neurons, mu0=0.0, start=dict(sigma2=1e-4, sigma0_2=3.0), seed=0)
    assert given.num_atoms == 1 and given.hyperparameters["sigma0_2"] != 3.0


def test_a_coordinate_nobody_has_data_on_is_skipped():
    layer = model_layer(8, 21, seed=8)
    J = layer.num_clients
    precisions = torch.ones(J, 21)
    precisions[:, 20] = 0.0
    noisy = [torch.cat([v[:, :20], 100 + 50 * torch.randn(v.shape[0], 1)], dim=1) for v in layer.neurons]
    r = match_layer(noisy, precisions=precisions, start=dict(mu0=0.3), seed=0)
    without = match_layer([v[:, :20] for v in layer.neurons], start=dict(mu0=0.3), seed=0)
    assert any("precision 0 at every client" in n for n in r.notes)
    for name in ("sigma0_2", "sigma2", "gamma0"):
        assert r.hyperparameters[name] == pytest.approx(without.hyperparameters[name], rel=1e-9)
    torch.testing.assert_close(r.hyperparameters["mu0"][:20], without.hyperparameters["mu0"])
    assert r.hyperparameters["mu0"][20].item() == pytest.approx(0.3)
    assert (r.global_atoms[:, 20] - 0.3).abs().max() < 1e-6  # the prior mean: no data there


def test_clients_without_neurons_count_in_J_only():
    layer = model_layer(8, 30, seed=9)
    empty = torch.zeros(0, 30)
    with_empty = list(layer.neurons[:4]) + [empty, empty] + list(layer.neurons[4:])
    r = match_layer(with_empty, seed=0)
    base = match_layer(layer.neurons, seed=0)
    assert any("hold no neurons" in n for n in r.notes)
    assert [a.numel() for a in r.assignments][4:6] == [0, 0]
    assert r.num_atoms == base.num_atoms
    assert r.hyperparameters["gamma0"] == pytest.approx(r.num_atoms / harmonic(10), rel=1e-12)
    for name in ("sigma0_2", "sigma2"):
        assert r.hyperparameters[name] == pytest.approx(base.hyperparameters[name], rel=1e-9)


def test_atoms_closer_than_the_noise_floor_sigma0_2():
    """Three atoms 0.001 apart under noise 0.01: the atom means spread less than the noise explains."""
    g = torch.Generator().manual_seed(0)
    atoms = 0.001 * torch.randn(3, 10, generator=g, dtype=torch.float64)
    truth = [torch.tensor([0, 1, 2]) for _ in range(6)]
    neurons = [atoms[a] + 0.1 * torch.randn(3, 10, generator=g, dtype=torch.float64) for a in truth]
    r = match_layer(neurons, init_assignments=truth, sweeps=0)
    h = r.hyperparameters
    assert h["sigma0_2"] == pytest.approx(SIGMA0_2_FLOOR * h["sigma2"], rel=1e-12)
    assert any("sigma0_2 floored" in n for n in r.notes)
    assert not r.converged and any("no sweep" in n for n in r.notes)


def test_identical_copies_floor_sigma2():
    v = torch.randn(5, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    r = match_layer([v, v[torch.tensor([3, 0, 4, 1, 2])], v], seed=0)
    assert r.num_atoms == 5 and (r.counts == 3).all()
    pooled = float(v.var(0, unbiased=False).mean()) * 15 / 14  # the pooled variance of the 15 neurons
    assert r.hyperparameters["sigma2"] == pytest.approx(SIGMA2_FLOOR * pooled, rel=1e-6)
    assert any("sigma2 floored" in n for n in r.notes)


def test_the_sweep_limit_is_reported_not_raised():
    layer = model_layer(10, 30, seed=10)
    r = match_layer(layer.neurons, sweeps=1, seed=0, start=dict(sigma2=0.001, sigma0_2=0.1, gamma0=4.0))
    assert not r.converged and r.sweeps_run == 1
    assert len(r.hyperparameter_history) == len(r.objective) == 2
    assert any("not converged" in n for n in r.notes)


# --------------------------------------------------------------------------------------------------------------------
# the fixed path, the API


def test_fixed_hyperparameters_give_the_previous_matcher_s_results():
    """Pinned from the matcher before empirical Bayes (same layer, same seed). The layer's draws are float32, and
    torch's normal sampler rounds their last bits differently on different processors (on one machine its default,
    AVX2 and AVX-512 kernels already disagree: ATEN_CPU_CAPABILITY), so the objectives recorded on another machine
    agree to float32's precision (rel 1e-6; they differed here by 1.5e-8) and the assignments exactly."""
    layer = sample_federated_layer(8, 15, seed=3, gamma0=6.0, sigma2=0.2)
    prec = torch.ones(8, 15)
    prec[:, -3:] = torch.linspace(0.1, 1.0, 24).reshape(8, 3)
    hyper = dict(sigma2=0.2, sigma0_2=1.0, gamma0=6.0, seed=0, hyperparameters="fixed")
    r = match_layer(layer.neurons, **hyper)
    assert r.objective == pytest.approx([2224.253816491416] + [2229.7738722643608] * 5, rel=1e-6)
    assert r.counts.tolist() == [1, 1, 3, 1, 2, 1, 2, 1, 1, 1, 2, 1, 2, 3, 1, 1, 1, 2, 1, 1, 1, 1]
    assert [a.tolist() for a in r.assignments[:2]] == [[18, 19, 4], [0, 1, 2, 3, 4]]
    r = match_layer(layer.neurons, objective="marginal", precisions=prec, mu0=0.1, **hyper)
    assert r.objective == pytest.approx([1532.3551679016095] * 6, rel=1e-6)
    assert r.counts.tolist() == [5, 8, 3, 1, 7, 2, 1, 2, 1, 1]
    r = match_layer(layer.neurons, sigma2=1.0, sigma0_2=1.0, gamma0=1.0, seed=0, **REFERENCE_CONSTANTS)
    assert r.objective == pytest.approx([306.050371278563] + [306.1929287936495] * 5, rel=1e-6)
    assert r.counts.tolist() == [5, 8, 3, 1, 7, 2, 2, 2, 1]
    assert [a.tolist() for a in r.assignments[:2]] == [[1, 7, 4], [0, 1, 2, 8, 4]]
    assert r.converged and r.estimated == () and r.notes == []
    assert r.hyperparameters["sigma2"] == 1.0 and (r.hyperparameters["mu0"] == 0).all()
    assert len(r.hyperparameter_history) == len(r.objective)


def test_reference_constants_fix_the_hyperparameters_and_the_map_objective():
    assert REFERENCE_CONSTANTS["hyperparameters"] == "fixed" and REFERENCE_CONSTANTS["objective"] == "map"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hyperparameters="fixed", sigma0_2=1.0, gamma0=1.0), "sigma2: expected a positive finite number with "
                                                                   "hyperparameters='fixed'"),
        (dict(hyperparameters="fixed", sigma2=1.0, sigma0_2=1.0), "gamma0: expected"),
        (dict(objective="map"), "objective: expected 'marginal' with hyperparameters='empirical-bayes', got 'map': the"
                                " MAP objective drops"),
        (dict(hyperparameters="EB"), "hyperparameters: expected one of"),
        (dict(hyperparameters="fixed", sigma2=1.0, sigma0_2=1.0, gamma0=1.0, start={"sigma2": 1.0}), "start: expected "
                                                                                                    "None"),
        (dict(sigma2=0.1, start={"sigma2": 1.0}),
         r"start\['sigma2'\]: expected no starting value for sigma2, which is given"),
        (dict(start={"tau": 1.0}), "start: expected keys among"),
        (dict(start={"sigma0_2": -1.0}), r"start\['sigma0_2'\]: expected a positive finite number"),
        (dict(sigma0_2=0.0), "sigma0_2: expected a positive finite number, got 0.0"),
        (dict(mu0=float("inf")), r"mu0: expected finite values or NaN \(estimated\), got inf"),
        (dict(sweeps=-1), "sweeps: expected an int >= 0"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, match):
    neurons = [torch.randn(3, 4, generator=torch.Generator().manual_seed(j)) for j in range(3)]
    with pytest.raises(ValueError, match=match):
        match_layer(neurons, **kwargs)


def test_the_estimates_need_nothing_but_the_clients_weights():
    """No data argument anywhere: the layer API takes neurons (and their precision scales) only."""
    assert list(inspect.signature(match_layer).parameters) == [
        "neurons", "sigma2", "sigma0_2", "gamma0", "mu0", "precisions", "atom_prior", "noise", "concentration",
        "hyperparameters", "start",
        "sweeps", "seed",
        "objective", "popularity_factor", "popularity_cap", "max_atoms", "new_atom_penalty",
        "stop_at_fixed_point", "cross_products", "init_assignments", "stop", "starts", "schedule", "device",
        "progress"]
    network_args = list(inspect.signature(match_by_spec).parameters)
    assert network_args[:3] == ["client_nets", "class_counts", "spec"]
    assert not {"data", "dataset", "loader", "x", "y", "inputs"} & {a.lower() for a in network_args}


def test_history_holds_the_values_after_the_first_assignment_and_every_sweep():
    layer = model_layer(10, 30, seed=11)
    r = match_layer(layer.neurons, seed=0, start=dict(sigma2=0.1, sigma0_2=10.0, gamma0=400.0))
    assert len(r.hyperparameter_history) == r.sweeps_run + 1 == len(r.objective)
    assert r.hyperparameter_history[-1] is r.hyperparameters or r.hyperparameter_history[-1] == r.hyperparameters
    assert r.hyperparameter_history[0]["sigma2"] != 0.1  # re-estimated after the first assignment
    assert all(set(h) == {"mu0", "sigma0_2", "sigma2", "gamma0"} for h in r.hyperparameter_history)
    for a, b in itertools.pairwise(r.hyperparameter_history[-2:]):
        assert a["sigma2"] == b["sigma2"]  # the last sweep changed nothing


def test_the_result_rule_measures_mu0_by_the_prior_it_moves():
    """The stopping rule on the result measures mu0's change by its root mean square over the coordinates relative
    to sqrt(sigma0_2): at that change r the atom prior N(mu0, sigma0_2 I) moves by r^2 / 2 nats per coordinate
    (Kullback-Leibler, computed by torch), the size of change the relative test allows a variance (r^2 / 4 nats). One
    coordinate that moves by 5 % of sqrt(sigma0_2) fails the largest-change test of the exact fixed point and passes
    the result rule's; a change of that size in every coordinate fails both."""
    from types import SimpleNamespace

    from bnpfed.matching.empirical_bayes import PooledMoments
    D, s, r = 100, 0.04, 0.01
    rng = np.random.default_rng(0)
    delta = rng.normal(size=D)
    delta *= r * math.sqrt(s) / math.sqrt(np.mean(delta ** 2))   # root mean square r sqrt(s)
    mu = torch.zeros(D, dtype=torch.float64)
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mu + torch.as_tensor(delta), math.sqrt(s)),
                                           torch.distributions.Normal(mu, math.sqrt(s))).sum() / D
    assert float(kl) == pytest.approx(r ** 2 / 2, rel=1e-10)
    kl_var = torch.distributions.kl_divergence(torch.distributions.Normal(0.0, math.sqrt(s * (1 + r))),
                                               torch.distributions.Normal(0.0, math.sqrt(s)))
    assert float(kl_var) == pytest.approx(r ** 2 / 4, rel=0.02)

    stub = SimpleNamespace(names=["sigma2"])
    old = dict(sigma2=1.0, sigma0_2=s, mu0=np.zeros(D))
    one = dict(old, mu0=np.r_[0.05 * math.sqrt(s), np.zeros(D - 1)])
    every = dict(old, mu0=np.full(D, 0.05 * math.sqrt(s)))
    assert not PooledMoments.close(stub, one, old, rtol=r)
    assert PooledMoments.close(stub, one, old, rtol=r, mu0="rms")
    assert not PooledMoments.close(stub, every, old, rtol=r, mu0="rms")
    assert not PooledMoments.close(stub, dict(old, sigma2=1.02), old, rtol=r, mu0="rms")   # the variances as before
    with pytest.raises(ValueError, match="mu0: expected 'max' or 'rms'"):
        PooledMoments.close(stub, old, old, rtol=r, mu0="mean")

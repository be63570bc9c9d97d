"""PFNM for whole MLPs: match_by_spec on :func:`bnpfed.models.mlp` networks, every hidden layer (groups "1", "3",
...) matched through match_layer and the global MLP built from the matched neurons."""

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from bnpfed.matching import PermutationSpec, assignment_objective, match_by_spec, match_layer
from bnpfed.models import mlp, sample_federated_layer


def fixed(sigma2=0.3, sigma0_2=1.0, gamma0=2.0):
    """Hyper-parameters given, the published way (the tests of the matching's arithmetic)."""
    return dict(hyperparameters="fixed", sigma2=sigma2, sigma0_2=sigma0_2, gamma0=gamma0)


def random_net(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(o, i, generator=g, dtype=torch.float64) * 0.3,
             torch.randn(o, generator=g, dtype=torch.float64) * 0.1) for i, o in zip(sizes[:-1], sizes[1:])]


def mlp_with(layers):
    """The float64 :func:`bnpfed.models.mlp` carrying the given (weight (out, in), bias (out,)) pairs."""
    sizes = [int(layers[0][0].shape[1])] + [int(w.shape[0]) for w, _ in layers]
    net = mlp(sizes[0], sizes[1:-1], sizes[-1]).double()
    with torch.no_grad():
        for linear, (w, b) in zip((m for m in net if isinstance(m, nn.Linear)), layers, strict=True):
            linear.weight.copy_(w)
            linear.bias.copy_(b)
    return net


def mlps(nets):
    return [mlp_with(n) for n in nets]


def pairs(state):
    """The (weight, bias) pairs of an mlp's state_dict (or a match's global state), bottom layer first."""
    positions = sorted({int(k.partition(".")[0]) for k in state})
    return [(state[f"{i}.weight"], state[f"{i}.bias"]) for i in positions]


def permute_hidden(layers, perms):
    """A functionally identical network: hidden layer c's neurons reordered by perms[c]."""
    out = [list(l) for l in layers]
    for c, p in enumerate(perms):
        out[c][0], out[c][1] = out[c][0][p], out[c][1][p]
        out[c + 1][0] = out[c + 1][0][:, p]
    return [tuple(l) for l in out]


@pytest.mark.parametrize("direction", ["bottom-up", "top-down"])
def test_global_network_carries_the_posterior_means_exactly(direction):
    nets = [random_net([6, 5, 4, 3], seed) for seed in range(3)]
    r = match_by_spec(mlps(nets), np.ones((3, 3)), **fixed(sigma2=0.5, gamma0=1.0), seed=0, direction=direction)
    assert list(r.layer_results) == ["1", "3"]
    net = r.network()
    for (w, b), (w_net, b_net) in zip(pairs(r.state), pairs(net.state_dict()), strict=True):
        assert torch.equal(w, w_net) and torch.equal(b, b_net)
    # and they are the matcher's posterior means: the first layer's incoming block (bottom-up) / outgoing (top-down)
    first = r.layer_results["1"].global_atoms
    if direction == "bottom-up":
        torch.testing.assert_close(r.state["1.weight"], first[:, :6].to(r.state["1.weight"].dtype))
    else:
        torch.testing.assert_close(r.state["3.weight"], first[:, 7:].T.to(r.state["3.weight"].dtype))
    assert r.hidden_sizes == [lr.num_atoms for lr in r.layer_results.values()]


def test_one_hidden_layer_is_the_same_in_both_directions():
    nets = [random_net([8, 6, 3], seed) for seed in range(4)]
    counts = np.random.default_rng(0).integers(1, 20, size=(4, 3))
    a = match_by_spec(mlps(nets), counts, **fixed(gamma0=2.0), seed=1, direction="bottom-up")
    b = match_by_spec(mlps(nets), counts, **fixed(gamma0=2.0), seed=1, direction="top-down")
    for (wa, ba), (wb, bb) in zip(pairs(a.state), pairs(b.state), strict=True):
        torch.testing.assert_close(wa, wb)
        torch.testing.assert_close(ba, bb)


@pytest.mark.parametrize("direction", ["bottom-up", "top-down"])
def test_single_client_gets_its_own_network_shrunk_towards_the_prior(direction):
    """J = 1: every neuron is its own atom; each weight is the posterior mean (mu/sigma0_2 + s w/sigma2) /
    (1/sigma0_2 + s/sigma2) with s = 1, prior mean 0 for weights and 0.1 for biases, and s = 1 (the client holds all
    of every class) on the output weights and biases."""
    sigma2, sigma0_2 = 0.2, 1.5
    net = random_net([5, 4, 3, 2], 0)
    r = match_by_spec([mlp_with(net)], None, **fixed(sigma2=sigma2, sigma0_2=sigma0_2, gamma0=1.0),
                      direction=direction)

    def shrink(x, mu):
        return (mu / sigma0_2 + x / sigma2) / (1 / sigma0_2 + 1 / sigma2)

    # undo the matcher's relabelling: the client's neuron l is global neuron assignments[group][0][l]
    aligned = permute_hidden([(w.double(), b.double()) for w, b in pairs(r.state)],
                             [r.assignments[g][0] for g in ("1", "3")])
    for (w, b), (w0, b0) in zip(aligned, net, strict=True):
        torch.testing.assert_close(w, shrink(w0, 0.0), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b, shrink(b0, 0.1), rtol=1e-6, atol=1e-6)


def test_permuting_a_clients_hidden_neurons_changes_nothing():
    nets = [random_net([7, 5, 4, 3], seed) for seed in range(3)]
    counts = np.ones((3, 3))
    base = match_by_spec(mlps(nets), counts, **fixed(gamma0=1.0), seed=0)
    g = torch.Generator().manual_seed(0)
    shuffled = list(nets)
    shuffled[1] = permute_hidden(nets[1], [torch.randperm(5, generator=g), torch.randperm(4, generator=g)])
    other = match_by_spec(mlps(shuffled), counts, **fixed(gamma0=1.0), seed=0)
    assert other.hidden_sizes == base.hidden_sizes
    x = torch.randn(50, 7, dtype=torch.float64)
    torch.testing.assert_close(other.network()(x), base.network()(x), rtol=1e-5, atol=1e-5)


def test_client_slice_is_the_global_neurons_a_client_was_matched_to():
    nets = [random_net([6, 5, 4, 3], seed) for seed in range(3)]
    r = match_by_spec(mlps(nets), np.ones((3, 3)), **fixed(sigma2=0.5, gamma0=1.0), seed=0)
    layers = pairs(r.state)
    for j in range(3):
        sl = pairs(r.client_slice(j))
        assert [w.shape for w, _ in sl] == [w.shape for w, _ in nets[j]]
        a1, a2 = r.assignments["1"][j], r.assignments["3"][j]
        torch.testing.assert_close(sl[0][0], layers[0][0][a1])
        torch.testing.assert_close(sl[1][0], layers[1][0][a2][:, a1])
        torch.testing.assert_close(sl[2][0], layers[2][0][:, a2])
        torch.testing.assert_close(sl[2][1], layers[2][1])
        # and the client's network is the mlp carrying that slice
        assert [type(m) for m in r.client_network(j)] == [type(m) for m in mlp(6, [5, 4], 3)]
        for (w, b), (w_net, b_net) in zip(sl, pairs(r.client_network(j).state_dict()), strict=True):
            assert torch.equal(w, w_net) and torch.equal(b, b_net)


def test_output_bias_is_the_class_share_weighted_posterior_mean():
    nets = [random_net([4, 3, 2], seed) for seed in range(2)]
    counts = np.array([[30.0, 0.0], [10.0, 5.0]])  # client 0 never saw class 1
    sigma2, sigma0_2 = 0.5, 2.0
    r = match_by_spec(mlps(nets), counts, **fixed(sigma2=sigma2, sigma0_2=sigma0_2, gamma0=1.0))
    shares = counts / counts.sum(0)
    b = np.stack([net[-1][1].numpy() for net in nets])
    expected = (0.1 / sigma0_2 + (shares * b).sum(0) / sigma2) / (1 / sigma0_2 + shares.sum(0) / sigma2)
    np.testing.assert_allclose(r.state["3.bias"].numpy(), expected, rtol=1e-6)
    assert r.output_bias_mu0 == 0.1
    # client 0 saw no example of class 1, so class 1's output bias is client 1's, shrunk by the prior
    assert shares[0, 1] == 0


def test_a_class_a_client_never_saw_does_not_pull_its_output_weights():
    """Two identical hidden layers; client 0 never saw class 1 and its class-1 output weights are garbage."""
    net = random_net([4, 3, 2], 0)
    broken = [tuple(t.clone() for t in l) for l in net]
    broken[1][0][1] = 100.0
    r = match_by_spec(mlps([net, broken]), np.array([[1.0, 1.0], [1.0, 0.0]]), **fixed(sigma2=0.01, gamma0=1.0),
                      seed=0)
    # client 1 (broken) holds class 0 only: class 1's shares are (1, 0), so the 100s carry no weight
    assert r.hidden_sizes == [3]
    w_out = r.state["3.weight"]
    assert w_out[1].abs().max() < 5.0  # class-1 row comes from client 0 alone (no 100s)


def test_mlp_modules_of_different_widths_are_accepted_and_the_global_network_is_an_mlp():
    nets = [mlp(10, [6], 3), mlp(10, [4], 3)]
    r = match_by_spec(nets, None, **fixed(sigma2=1.0, gamma0=1.0))
    x = torch.randn(5, 10)
    net = r.network()
    assert net(x).shape == (5, 3)
    # the models' mlp, with the matched width and the same parameter names
    reference = mlp(10, r.hidden_sizes, 3)
    assert [type(m) for m in net] == [type(m) for m in reference]
    assert list(net.state_dict()) == list(reference.state_dict()) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert net[1].out_features == r.widths["1"] == r.hidden_sizes[0]
    # every client keeps its own width in its slice
    assert [r.client_network(j)[1].out_features for j in range(2)] == [6, 4]


def test_class_shares_do_not_depend_on_the_scale_of_class_counts():
    nets = mlps([random_net([5, 4, 2], seed) for seed in range(2)])
    counts = np.array([[30.0, 10.0], [10.0, 30.0]])
    kw = dict(**fixed(gamma0=1.0), seed=0)
    a = match_by_spec(nets, counts, **kw)
    b = match_by_spec(nets, counts / 1000, **kw)
    torch.testing.assert_close(b.class_shares, a.class_shares, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(a.class_shares, torch.tensor([[0.75, 0.25], [0.25, 0.75]], dtype=torch.float64))
    assert a.hidden_sizes == b.hidden_sizes
    assert all(torch.equal(x, y) for x, y in zip(a.assignments["1"], b.assignments["1"], strict=True))
    for (wa, ba), (wb, bb) in zip(pairs(a.state), pairs(b.state), strict=True):
        torch.testing.assert_close(wb, wa, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(bb, ba, rtol=1e-6, atol=1e-7)
    # a class nobody holds still gets share 0
    none = match_by_spec(nets, np.array([[0.003, 0.0], [0.001, 0.0]]), **kw)
    torch.testing.assert_close(none.class_shares, torch.tensor([[0.75, 0.0], [0.25, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("direction", ["bottom-up", "top-down"])
def test_warm_start_from_a_previous_match_of_the_same_networks_returns_it(direction):
    nets = mlps([random_net([7, 5, 4, 3], seed) for seed in range(3)])
    counts = np.array([[5, 1, 1], [1, 5, 1], [1, 1, 5]])
    kw = dict(**fixed(gamma0=2.0), direction=direction)
    previous = match_by_spec(nets, counts, seed=0, **kw)
    again = match_by_spec(nets, counts, seed=1, sweeps=0, warm_start=previous, **kw)
    for g in ("1", "3"):
        assert all(torch.equal(a, b) for a, b in zip(again.assignments[g], previous.assignments[g], strict=True))
        assert len(again.layer_results[g].objective) == 1
    for (wa, ba), (wb, bb) in zip(pairs(again.state), pairs(previous.state), strict=True):
        torch.testing.assert_close(wa, wb)
        torch.testing.assert_close(ba, bb)


def test_warm_started_round_starts_every_layer_at_the_previous_assignment_and_only_improves_on_it():
    """Round 2: every client holds its slice of round 1's global network, moved by local training (here noise);
    each layer's matching starts from round 1's assignment, whose objective is objective[0], and sweeps only raise
    it."""
    nets = mlps([random_net([7, 5, 4, 3], seed) for seed in range(3)])
    counts = np.ones((3, 3))
    kw = fixed(gamma0=2.0)
    round1 = match_by_spec(nets, counts, seed=0, **kw)
    g = torch.Generator().manual_seed(0)
    trained = [{k: v.double() + 0.05 * torch.randn(v.shape, generator=g, dtype=torch.float64)
                for k, v in round1.client_slice(j).items()} for j in range(3)]
    round2 = match_by_spec(trained, counts, template=nets[0], seed=1, sweeps=4, warm_start=round1, **kw)
    first = round2.layer_results["1"]
    # layer "1" is matched first (bottom-up), on the clients' incoming weights, bias and nothing else
    neurons = [torch.cat([t["1.weight"], t["1.bias"][:, None]], dim=1) for t in trained]
    mu0 = torch.tensor([0.0] * 7 + [0.1], dtype=torch.float64)
    start = assignment_objective(neurons, round1.assignments["1"], sigma2=0.3, sigma0_2=1.0, gamma0=2.0, mu0=mu0)
    assert first.objective[0] == pytest.approx(start, rel=1e-10)
    for r in round2.layer_results.values():
        assert (np.diff(r.objective) >= -1e-9 * abs(r.objective[0])).all(), r.objective


@pytest.mark.parametrize(
    "warm, match",
    [
        (lambda r: "round 1", "warm_start: expected a previous match, assignments per group .* got str"),
        (lambda r: list(r.assignments.values())[:1], r"warm_start: expected assignments of 2 group\(s\), got 1"),
        (lambda r: {"1": r.assignments["1"]},
         r"warm_start: expected assignments of the groups \['1', '3'\], got \['1'\]"),
        (lambda r: dataclasses.replace(r, assignments={"1": r.assignments["1"][:2], "3": r.assignments["3"]}),
         r"warm_start\['1'\]: expected one assignment per client \(3\), got 2"),
        (lambda r: dataclasses.replace(r, assignments={
            "1": r.assignments["1"], "3": [*r.assignments["3"][:2], r.assignments["3"][2][:-1]]}),
         r"warm_start\['3'\]\[2\]: expected 4 labels \(client 2 has 4 units in group '3'\), got shape \(3,\)"),
    ],
    ids=["not-a-match", "too-few-groups-in-order", "too-few-groups-by-name", "too-few-clients", "too-few-labels"],
)
def test_bad_warm_start_raises_naming_the_group_and_client(warm, match):
    nets = mlps([random_net([7, 5, 4, 3], seed) for seed in range(3)])
    previous = match_by_spec(nets, None, **fixed(gamma0=2.0), seed=0)
    with pytest.raises(ValueError, match=match):
        match_by_spec(nets, None, **fixed(gamma0=2.0), warm_start=warm(previous))


def nan_net():
    net = mlp_with(random_net([4, 3, 2], 0))
    with torch.no_grad():
        net[1].weight[0, 0] = float("nan")
    return net


@pytest.mark.parametrize(
    "nets, counts, kwargs, match",
    [
        (list, None, {}, "client_nets: expected a non-empty sequence"),
        # an mlp without a hidden layer: its derived spec has no group
        (lambda: [mlp(4, [], 3)], None, {},
         r"spec: expected at least one hidden permutation \(PFNM needs a hidden layer\), got none"),
        (lambda: [mlp(4, [], 3)], None, {"spec": PermutationSpec([], {})},
         r"spec: expected at least one hidden permutation \(PFNM needs a hidden layer\), got none"),
        (lambda: [mlp(4, [3], 2), mlp(5, [3], 2)], None, {},
         (r"client_nets\[1\]: expected '1.weight' of client 0's shape \(3, 4\) but on the axes a group acts on, "
          r"got \(3, 5\)")),
        (lambda: [mlp(4, [3], 2), mlp(4, [3, 3], 2)], None, {},
         r"client_nets\[1\]: expected the parameters of client 0's network \(one network kind\), got unexpected "
         r"\['5.bias', '5.weight'\]"),
        (lambda: [mlp(4, [3, 3], 2), mlp(4, [3], 2)], None, {},
         r"client_nets\[1\]: expected the parameters of client 0's network \(one network kind\), got missing "
         r"\['5.bias', '5.weight'\]"),
        (lambda: [mlp(4, [3], 2)], np.ones((1, 3)), {},
         r"class_counts: expected shape \(1, 2\) \(clients x classes\), got \(1, 3\)"),
        (lambda: [mlp(4, [3], 2)], -np.ones((1, 2)), {}, "class_counts: expected finite counts >= 0"),
        (lambda: [mlp(4, [3], 2)], None, {"direction": "sideways"}, "direction: expected one of"),
        (lambda: [mlp(4, [3, 3], 2)], None, {"sigma2": [1.0]},
         r"sigma2: expected a scalar, one value per group \(2\) or a mapping by group name, got 1 values"),
        (lambda: [nan_net()], None, {},
         r"client_nets\[0\]: expected '1.weight' to be a finite floating-point tensor"),
        (lambda: [mlp(4, [3], 2).state_dict()], None, {},
         r"spec: expected a PermutationSpec when client_nets are state dicts \(or a template\)"),
    ],
    ids=["no-clients", "no-hidden-layer", "no-hidden-permutation", "other-inputs", "deeper", "shallower",
         "counts-shape", "negative-counts", "direction", "sigma2-per-group", "nan", "state-without-template"],
)
def test_bad_input_raises(nets, counts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        match_by_spec(nets(), counts, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# empirical Bayes, per hidden layer


def networks_from_the_model(J, D_in, C, *, seed, shares=None, sigma2=0.01, sigma0_2=1.0, gamma0=15.0, bias_mu0=0.1):
    """One-hidden-layer networks whose hidden neurons [W_in, b, W_out] are a layer drawn from the Beta-Bernoulli
    model (prior mean 0 on the weights, ``bias_mu0`` on the bias; noise variance sigma2 / share_jk on client j's
    output weights of class k, (J, C) ``shares`` default 1/J), and output biases N(0.2, 1)."""
    mu0 = torch.zeros(D_in + 1 + C, dtype=torch.float64)
    mu0[D_in] = bias_mu0
    precisions = torch.ones(J, D_in + 1 + C, dtype=torch.float64)
    precisions[:, D_in + 1:] = torch.full((J, C), 1 / J) if shares is None else torch.as_tensor(shares)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layer = sample_federated_layer(J, D_in + 1 + C, seed=seed, gamma0=gamma0, sigma2=sigma2, sigma0_2=sigma0_2,
                                       mu0=mu0, precisions=precisions)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator().manual_seed(seed)
    nets = [[(v[:, :D_in], v[:, D_in]), (v[:, D_in + 1:].T, 0.2 + torch.randn(C, generator=g, dtype=torch.float64))]
            for v in layer.neurons]
    return layer, nets


def test_each_hidden_layer_estimates_its_own_hyperparameters_by_default():
    nets = mlps([random_net([12, 8, 6, 3], seed) for seed in range(4)])
    r = match_by_spec(nets, None, seed=0)
    assert list(r.hyperparameters) == ["1", "3"]
    names = ("mu0", "sigma0_2", "sigma2", "gamma0")
    output = ("sigma0_2_scaled", "sigma2_scaled")  # the top layer's output weights have their own variances
    for c, (h, lr) in enumerate(zip(r.hyperparameters.values(), r.layer_results.values(), strict=True)):
        assert h is lr.hyperparameters or h == lr.hyperparameters
        assert lr.estimated == names + (output if c == 1 else ())
        assert set(h) == set(lr.estimated)
        assert h["mu0"].shape == (lr.global_atoms.shape[1],)
        assert lr.hyperparameter_history[-1] == h
    assert r.hyperparameters["1"]["sigma2"] != r.hyperparameters["3"]["sigma2"]


def test_the_model_s_network_is_recovered_with_its_hyperparameters_from_the_weights_alone():
    """Hidden neurons drawn from the model: the matched width is the number of atoms, and the estimates are the
    model's (sigma2, sigma0_2 within 10 %)."""
    layer, nets = networks_from_the_model(10, 40, 4, seed=0)
    r = match_by_spec(mlps(nets), None, seed=0)
    h = r.hyperparameters["1"]
    assert r.hidden_sizes == [layer.num_atoms]
    assert h["sigma2"] == pytest.approx(0.01, rel=0.1)
    assert h["sigma0_2"] == pytest.approx(1.0, rel=0.1)
    # the output weights (4 coordinates, at the shares' precision): the same variances, more loosely
    assert h["sigma2_scaled"] == pytest.approx(0.01, rel=0.3)
    assert h["sigma0_2_scaled"] == pytest.approx(1.0, rel=0.5)


def test_a_scalar_fixes_a_hyperparameter_in_every_layer_and_a_list_gives_one_per_layer():
    nets = mlps([random_net([12, 8, 6, 3], seed) for seed in range(4)])
    r = match_by_spec(nets, None, seed=0, sigma2=0.3, sigma0_2=[None, 2.0], gamma0=[1.5, None])
    first, second = r.layer_results.values()
    assert [h["sigma2"] for h in r.hyperparameters.values()] == [0.3, 0.3]
    assert first.estimated == ("mu0", "sigma0_2") and second.estimated == ("mu0", "gamma0")
    assert r.hyperparameters["3"]["sigma0_2"] == 2.0 and r.hyperparameters["1"]["gamma0"] == 1.5


@pytest.mark.parametrize("direction", ["bottom-up", "top-down"])
def test_mu0_and_bias_mu0_each_fix_their_own_coordinates(direction):
    nets = mlps([random_net([12, 8, 3], seed) for seed in range(4)])
    weights_given = match_by_spec(nets, None, seed=0, mu0=0.0, direction=direction).hyperparameters["1"]["mu0"]
    bias_given = match_by_spec(nets, None, seed=0, bias_mu0=0.1, direction=direction).hyperparameters["1"]["mu0"]
    bias = 12  # the coordinates are [incoming weights (12), bias, output weights (3)]
    weights = torch.ones(16, dtype=torch.bool)
    weights[bias] = False
    assert (weights_given[weights] == 0).all() and weights_given[bias] != 0
    assert bias_given[bias].item() == pytest.approx(0.1) and (bias_given[weights] != 0).all()


def test_a_posterior_mean_output_bias_uses_the_last_hidden_layer_s_final_estimates():
    counts = np.array([[30.0, 1.0, 5.0], [10.0, 5.0, 5.0], [1.0, 9.0, 5.0]] * 2)
    layer, nets = networks_from_the_model(6, 20, 3, seed=1, shares=counts / counts.sum(0))
    r = match_by_spec(mlps(nets), counts, seed=0, global_weights="posterior-mean")
    h = list(r.hyperparameters.values())[-1]
    shares = counts / counts.sum(0)
    # the output bias is seen at the shares' precision, as the output weights: their variances
    sigma2, sigma0_2 = h["sigma2_scaled"], h["sigma0_2_scaled"]
    w = shares / sigma2
    b = np.stack([net[-1][1].numpy() for net in nets])
    mu = np.mean((w * b).sum(0) / w.sum(0))
    assert r.output_bias_mu0 == pytest.approx(mu, rel=1e-9)
    expected = (mu / sigma0_2 + (w * b).sum(0)) / (1 / sigma0_2 + w.sum(0))
    np.testing.assert_allclose(r.state["3.bias"].numpy(), expected, rtol=1e-6)
    given = match_by_spec(mlps(nets), counts, seed=0, bias_mu0=0.5, global_weights="posterior-mean")
    assert given.output_bias_mu0 == 0.5


def test_a_layer_fn_without_the_empirical_bayes_keywords_is_not_passed_them():
    nets = mlps([random_net([6, 5, 3], seed) for seed in range(3)])
    seen = []

    def strict(neurons, *, sigma2, sigma0_2, gamma0, mu0, precisions, sweeps, seed):
        seen.append((sigma2, mu0))
        return match_layer(neurons, sigma2=0.3, sigma0_2=1.0, gamma0=1.0, hyperparameters="fixed", seed=seed)

    r = match_by_spec(nets, None, layer_fn=strict, seed=0)
    assert seen and seen[0][0] is None and seen[0][1] is None  # nothing given: all estimated, as far as it knows
    assert r.hyperparameters["1"]["sigma2"] == 0.3


def test_the_k_means_baseline_still_plugs_in():
    from bnpfed.baselines.averaging import kmeans_layer

    nets = [random_net([6, 5, 3], seed) for seed in range(3)]
    r = match_by_spec(mlps(nets), None, layer_fn=kmeans_layer(4), seed=0)
    assert r.hidden_sizes == [4] and r.hyperparameters == {"1": {}}
    # the average of the clients' networks: hidden neurons are the cluster centres' incoming part, the output bias
    # the clients' average (equal shares)
    centres = r.layer_results["1"].global_atoms
    torch.testing.assert_close(r.state["1.weight"].double(), centres[:, :6].double(), rtol=1e-6, atol=1e-6)
    b = np.stack([net[-1][1].numpy() for net in nets])
    np.testing.assert_allclose(r.state["3.bias"].numpy(), b.mean(0), rtol=1e-6)
    # no estimates from k-means: a posterior-mean output bias falls back to sigma2 = sigma0_2 = 1 and the estimated
    # prior mean
    r = match_by_spec(mlps(nets), None, layer_fn=kmeans_layer(4), seed=0, global_weights="posterior-mean")
    shares = np.full((3, 3), 1 / 3)
    mu = np.mean((shares * b).sum(0))
    np.testing.assert_allclose(r.state["3.bias"].numpy(), (mu + (shares * b).sum(0)) / 2, rtol=1e-6)


def test_fixed_hyperparameters_need_sigma2_sigma0_2_and_gamma0():
    nets = mlps([random_net([6, 5, 3], seed) for seed in range(2)])
    with pytest.raises(ValueError, match="sigma0_2: expected a positive finite number with hyperparameters='fixed'"):
        match_by_spec(nets, None, hyperparameters="fixed", sigma2=0.3, gamma0=1.0)
    with pytest.raises(ValueError, match="hyperparameters: expected one of"):
        match_by_spec(nets, None, hyperparameters="estimated")


# --------------------------------------------------------------------------------------------------------------------
# global weights: the clients' networks averaged on the matched neurons


def logits(net, x):
    """The float64 logits of a network, or of the mlp carrying a list of (weight, bias) pairs."""
    net = net if isinstance(net, nn.Module) else mlp_with(net)
    return net.double()(x)


def test_global_weights_default_to_the_average_under_empirical_bayes_and_the_posterior_means_when_fixed():
    """SpecMatch records no ``global_weights``; what the default builds is told by what it equals."""
    nets = mlps([random_net([6, 5, 3], seed) for seed in range(3)])

    def same(a, b):
        return list(a.state) == list(b.state) and all(torch.equal(a.state[k], b.state[k]) for k in a.state)

    eb = match_by_spec(nets, None, seed=0)
    assert same(eb, match_by_spec(nets, None, seed=0, global_weights="average"))
    assert not same(eb, match_by_spec(nets, None, seed=0, global_weights="posterior-mean"))
    assert eb.output_bias_mu0 is None  # nothing is shrunk by the average
    posterior = match_by_spec(nets, None, seed=0, **fixed())
    assert same(posterior, match_by_spec(nets, None, seed=0, global_weights="posterior-mean", **fixed()))
    assert posterior.output_bias_mu0 == 0.1
    average = match_by_spec(nets, None, seed=0, global_weights="average", **fixed())
    assert not same(average, posterior) and average.output_bias_mu0 is None
    with pytest.raises(ValueError, match="global_weights: expected one of"):
        match_by_spec(nets, None, seed=0, global_weights="mean")


@pytest.mark.parametrize("direction", ["bottom-up", "top-down"])
def test_with_every_neuron_its_own_atom_the_average_computes_the_class_share_weighted_average_of_the_logits(
        direction):
    """No two neurons merged (a noise far below the neurons' spread): the global network is the clients' networks
    side by side, its logits ``sum_j share_jk logit_jk(x)`` exactly."""
    nets = [random_net([7, 5, 4, 3], seed) for seed in range(3)]
    counts = np.array([[30.0, 0.0, 5.0], [10.0, 5.0, 5.0], [1.0, 9.0, 0.0]])
    r = match_by_spec(mlps(nets), counts, seed=0, direction=direction, global_weights="average",
                      **fixed(sigma2=1e-6, gamma0=1.0))
    assert r.hidden_sizes == [15, 12]
    shares = torch.as_tensor(counts / counts.sum(0))
    x = torch.randn(20, 7, dtype=torch.float64)
    expected = sum(shares[j] * logits(nets[j], x) for j in range(3))
    torch.testing.assert_close(logits(r.network(), x), expected, rtol=1e-5, atol=1e-5)
    assert r.output_bias_mu0 is None


def test_an_averaged_neuron_s_pre_activation_is_the_average_of_its_members():
    """Layer by layer, written out: a global neuron's incoming weights and bias are its members' average (their
    incoming weights re-indexed to the global neurons below), the output layer the clients' class-share-weighted
    sum re-indexed to the global neurons."""
    nets = [random_net([6, 5, 4, 3], seed) for seed in range(3)]
    counts = np.array([[3.0, 1.0, 2.0], [1.0, 4.0, 2.0], [2.0, 2.0, 0.0]])
    r = match_by_spec(mlps(nets), counts, seed=0, global_weights="average", **fixed(sigma2=2.0, gamma0=1.0))
    assert min(r.hidden_sizes) < 12  # some neurons were merged
    shares = counts / counts.sum(0)
    a1, a2 = ([a.numpy() for a in r.assignments[g]] for g in ("1", "3"))
    L1, L2 = r.hidden_sizes
    W1 = np.zeros((L1, 6)); b1 = np.zeros(L1); n1 = np.zeros(L1)
    W2 = np.zeros((L2, L1)); b2 = np.zeros(L2); n2 = np.zeros(L2)
    W3 = np.zeros((3, L2)); b3 = np.zeros(3)
    for j, net in enumerate(nets):
        (w1, c1), (w2, c2), (w3, c3) = [(w.numpy(), b.numpy()) for w, b in net]
        for l, i in enumerate(a1[j]):
            W1[i] += w1[l]; b1[i] += c1[l]; n1[i] += 1
        for l, i in enumerate(a2[j]):
            for l_below, i_below in enumerate(a1[j]):
                W2[i, i_below] += w2[l, l_below]
            b2[i] += c2[l]; n2[i] += 1
        for l, i in enumerate(a2[j]):
            W3[:, i] += shares[j] * w3[:, l]
        b3 += shares[j] * c3
    expected = [(W1 / n1[:, None], b1 / n1), (W2 / n2[:, None], b2 / n2), (W3, b3)]
    for (w, b), (we, be) in zip(pairs(r.state), expected, strict=True):
        np.testing.assert_allclose(w.numpy(), we, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b.numpy(), be, rtol=1e-5, atol=1e-6)


def test_identical_clients_average_back_to_their_network():
    net = random_net([6, 5, 4, 3], 0)
    g = torch.Generator().manual_seed(1)
    nets = [permute_hidden(net, [torch.randperm(5, generator=g), torch.randperm(4, generator=g)]) for _ in range(4)]
    r = match_by_spec(mlps(nets), np.random.default_rng(0).integers(1, 9, size=(4, 3)), seed=0)
    assert r.hidden_sizes == [5, 4]
    x = torch.randn(10, 6, dtype=torch.float64)
    torch.testing.assert_close(logits(r.network(), x), logits(net, x), rtol=1e-5, atol=1e-5)

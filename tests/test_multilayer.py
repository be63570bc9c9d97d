"""PFNM for whole networks: matching every hidden layer through match_layer and building the global MLP."""

import numpy as np
import pytest
import torch

from bnpfed.inference.multilayer import linear_layers, match_networks, network_from_layers
from bnpfed.models import mlp


def random_net(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(o, i, generator=g, dtype=torch.float64) * 0.3, torch.randn(o, generator=g, dtype=torch.float64) * 0.1)
            for i, o in zip(sizes[:-1], sizes[1:])]


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
    r = match_networks(nets, np.ones((3, 3)), sigma2=0.5, sigma0_2=1.0, gamma0=1.0, seed=0, direction=direction)
    net = r.network()
    for (w, b), (w_net, b_net) in zip(r.layers, linear_layers(net)):
        assert torch.equal(w, w_net) and torch.equal(b, b_net)
    # and they are the matcher's posterior means: the first layer's incoming block (bottom-up) / outgoing (top-down)
    first = r.layer_results[0].global_atoms
    if direction == "bottom-up":
        torch.testing.assert_close(r.layers[0][0], first[:, :6].to(r.layers[0][0].dtype))
    assert r.hidden_sizes == [lr.num_atoms for lr in r.layer_results]


def test_one_hidden_layer_is_the_same_in_both_directions():
    nets = [random_net([8, 6, 3], seed) for seed in range(4)]
    counts = np.random.default_rng(0).integers(1, 20, size=(4, 3))
    a = match_networks(nets, counts, sigma2=0.3, sigma0_2=1.0, gamma0=2.0, seed=1, direction="bottom-up")
    b = match_networks(nets, counts, sigma2=0.3, sigma0_2=1.0, gamma0=2.0, seed=1, direction="top-down")
    for (wa, ba), (wb, bb) in zip(a.layers, b.layers):
        torch.testing.assert_close(wa, wb)
        torch.testing.assert_close(ba, bb)


@pytest.mark.parametrize("direction", ["bottom-up", "top-down"])
def test_single_client_gets_its_own_network_shrunk_towards_the_prior(direction):
    """J = 1: every neuron is its own atom; each weight is the posterior mean (mu/sigma0_2 + s w/sigma2) /
    (1/sigma0_2 + s/sigma2) with s = 1, prior mean 0 for weights and 0.1 for biases, and s = 1 (the client holds all
    of every class) on the output weights and biases."""
    sigma2, sigma0_2 = 0.2, 1.5
    net = random_net([5, 4, 3, 2], 0)
    r = match_networks([net], None, sigma2=sigma2, sigma0_2=sigma0_2, gamma0=1.0, direction=direction)

    def shrink(x, mu):
        return (mu / sigma0_2 + x / sigma2) / (1 / sigma0_2 + 1 / sigma2)

    # undo the matcher's relabelling: the client's neuron l is global neuron assignments[c][0][l]
    aligned = permute_hidden([(w.double(), b.double()) for w, b in r.layers], [a[0] for a in r.assignments])
    for (w, b), (w0, b0) in zip(aligned, net):
        torch.testing.assert_close(w, shrink(w0, 0.0), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b, shrink(b0, 0.1), rtol=1e-6, atol=1e-6)


def test_permuting_a_clients_hidden_neurons_changes_nothing():
    nets = [random_net([7, 5, 4, 3], seed) for seed in range(3)]
    counts = np.ones((3, 3))
    base = match_networks(nets, counts, sigma2=0.3, sigma0_2=1.0, gamma0=1.0, seed=0)
    g = torch.Generator().manual_seed(0)
    shuffled = list(nets)
    shuffled[1] = permute_hidden(nets[1], [torch.randperm(5, generator=g), torch.randperm(4, generator=g)])
    other = match_networks(shuffled, counts, sigma2=0.3, sigma0_2=1.0, gamma0=1.0, seed=0)
    assert other.hidden_sizes == base.hidden_sizes
    x = torch.randn(50, 7)
    torch.testing.assert_close(other.network()(x), base.network()(x), rtol=1e-5, atol=1e-5)


def test_client_slice_is_the_global_neurons_a_client_was_matched_to():
    nets = [random_net([6, 5, 4, 3], seed) for seed in range(3)]
    r = match_networks(nets, np.ones((3, 3)), sigma2=0.5, sigma0_2=1.0, gamma0=1.0, seed=0)
    for j in range(3):
        sl = r.client_slice(j)
        assert [w.shape for w, _ in sl] == [w.shape for w, _ in nets[j]]
        a1, a2 = r.assignments[0][j], r.assignments[1][j]
        torch.testing.assert_close(sl[0][0], r.layers[0][0][a1])
        torch.testing.assert_close(sl[1][0], r.layers[1][0][a2][:, a1])
        torch.testing.assert_close(sl[2][0], r.layers[2][0][:, a2])
        torch.testing.assert_close(sl[2][1], r.layers[2][1])


def test_output_bias_is_the_class_share_weighted_posterior_mean():
    nets = [random_net([4, 3, 2], seed) for seed in range(2)]
    counts = np.array([[30.0, 0.0], [10.0, 5.0]])  # client 0 never saw class 1
    sigma2, sigma0_2 = 0.5, 2.0
    r = match_networks(nets, counts, sigma2=sigma2, sigma0_2=sigma0_2, gamma0=1.0)
    shares = counts / counts.sum(0)
    b = np.stack([net[-1][1].numpy() for net in nets])
    expected = (0.1 / sigma0_2 + (shares * b).sum(0) / sigma2) / (1 / sigma0_2 + shares.sum(0) / sigma2)
    np.testing.assert_allclose(r.layers[-1][1].numpy(), expected, rtol=1e-6)
    # client 0 saw no example of class 1, so class 1's output bias is client 1's, shrunk by the prior
    assert shares[0, 1] == 0


def test_a_class_a_client_never_saw_does_not_pull_its_output_weights():
    """Two identical hidden layers; client 0 never saw class 1 and its class-1 output weights are garbage."""
    net = random_net([4, 3, 2], 0)
    broken = [tuple(t.clone() for t in l) for l in net]
    broken[1][0][1] = 100.0
    r = match_networks([net, broken], np.array([[1.0, 1.0], [1.0, 0.0]]), sigma2=0.01, sigma0_2=1.0, gamma0=1.0,
                       seed=0)
    # client 1 (broken) holds class 0 only: class 1's shares are (1, 0), so the 100s carry no weight
    assert r.hidden_sizes == [3]
    w_out = r.layers[1][0]
    assert w_out[1].abs().max() < 5.0  # class-1 row comes from client 0 alone (no 100s)


def test_mlp_modules_are_accepted_and_layers_round_trip():
    net = mlp(10, [6], 3)
    layers = linear_layers(net)
    rebuilt = network_from_layers(layers)
    x = torch.randn(5, 10)
    torch.testing.assert_close(rebuilt(x), net(x))
    r = match_networks([net, mlp(10, [4], 3)], None, sigma2=1.0, sigma0_2=1.0, gamma0=1.0)
    assert r.network()(x).shape == (5, 3)


@pytest.mark.parametrize(
    "nets, counts, kwargs, match",
    [
        ([], None, {}, "client_layers must be a non-empty"),
        ([[(torch.zeros(3, 4), torch.zeros(3))]], None, {}, "at least one hidden layer"),
        ([random_net([4, 3, 2], 0), random_net([5, 3, 2], 1)], None, {}, r"client_layers\[1\] maps 5 inputs"),
        ([random_net([4, 3, 2], 0), random_net([4, 3, 3, 2], 1)], None, {}, r"client_layers\[1\] has 3 layers"),
        ([random_net([4, 3, 2], 0)], np.ones((1, 3)), {}, "class_counts must have shape"),
        ([random_net([4, 3, 2], 0)], -np.ones((1, 2)), {}, "class_counts must be finite"),
        ([random_net([4, 3, 2], 0)], None, {"direction": "sideways"}, "direction"),
        ([random_net([4, 3, 3, 2], 0)], None, {"sigma2": [1.0]}, "sigma2 must be a scalar or one value per"),
        ([[(torch.full((3, 4), float("nan")), torch.zeros(3)), (torch.zeros(2, 3), torch.zeros(2))]], None, {},
         "NaN"),
    ],
)
def test_bad_input_raises(nets, counts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        match_networks(nets, counts, **kwargs)

"""The server's steps, written once for the in-process federations and the Flower strategies."""


import pytest
import torch
from torch.testing import assert_close

from bnpfed.combine import average_deterministic, fuse_sites
from dataclasses import replace

from bnpfed.federated.clients import batch_norm_moments_step
from bnpfed.federated.config import FusionConfig, PFNMConfig
from bnpfed.federated.server import (average_states, batch_norm_step, client_start, client_weights, clients_per_round,
                                     fedma_group_step, fuse_posteriors, matched_parameters, pfnm_step, sample_clients,
                                     with_statistics)
from bnpfed.matching.permutation import client_slice, derive_spec, match_by_spec, network_from_state
from bnpfed.models import LeNet, mlp, simple_cnn, simple_cnn_bn
from bnpfed.posterior import GaussianPosterior
from bnpfed.seeding import Stream, derive_seed, torch_generator


def test_a_round_samples_floor_of_fraction_times_j_clients_without_replacement():
    draws = [sample_clients(10, 0.3, seed=0, round=t) for t in range(1, 9)]
    for sampled in draws:
        assert len(sampled) == 3 == len(set(sampled)) and sampled == sorted(sampled)
        assert all(0 <= k < 10 for k in sampled)
    assert len({tuple(s) for s in draws}) > 1                          # a new draw each round
    assert draws == [sample_clients(10, 0.3, seed=0, round=t) for t in range(1, 9)]   # the same seed, the same draws
    assert clients_per_round(10, 0.01) == 1 and clients_per_round(10, 0.3) == 3
    assert sample_clients(10, 1.0, seed=0, round=5) == list(range(10))


def test_client_weights_are_normalised_sizes_or_uniform():
    assert client_weights([100, 300], "size") == [0.25, 0.75]
    assert client_weights([100, 300, 600], "uniform") == [1 / 3] * 3
    with pytest.raises(ValueError, match="sizes: expected a positive total"):
        client_weights([0, 0], "size")
    with pytest.raises(ValueError, match="weights: expected one of"):
        client_weights([1], "count")


def _clients(K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    posteriors = [{"w": GaussianPosterior(torch.randn(4, 3, generator=g), torch.rand(4, 3, generator=g) + 0.1),
                   "v": GaussianPosterior(torch.randn(5, generator=g), torch.rand(5, generator=g) + 0.1)}
                  for _ in range(K)]
    states = [{"b": torch.randn(4, generator=g)} for _ in range(K)]
    return posteriors, states


@pytest.mark.parametrize("rule", ["eaa", "gaa", "log_variance", "pooling", "conflation"])
@pytest.mark.parametrize("weights", ["size", "uniform"])
def test_posterior_fusion_is_fuse_sites_with_the_rounds_weights_and_pooling_stream(rule, weights):
    posteriors, states = _clients()
    sizes = [10, 30, 60]
    config = FusionConfig(rule=rule, weights=weights, pooling_samples=50, min_variance=0.0)
    step = fuse_posteriors(posteriors, states, sizes, config, seed=4, round=2)
    b = [0.1, 0.3, 0.6] if weights == "size" else [1 / 3] * 3
    assert step.weights == pytest.approx(b)
    expected = fuse_sites(posteriors, rule, b, num_samples=50, generator=torch_generator(4, Stream.POOLING, 2))
    for site, (loc, variance) in expected.items():
        assert torch.equal(step.posterior[site].loc, loc) and torch.equal(step.posterior[site].variance, variance)
    assert_close(step.deterministic["b"], average_deterministic([s["b"] for s in states], b))
    assert step.floored == 0 and step.min_variance == min(float(v.variance.min()) for v in expected.values())


def test_fused_variances_below_the_floor_are_raised_to_it_and_counted():
    posteriors, states = _clients()
    tiny = [{site: GaussianPosterior(g.loc, g.variance * 1e-20) for site, g in p.items()} for p in posteriors]
    step = fuse_posteriors(tiny, states, [1, 1, 1], FusionConfig(rule="gaa", min_variance=1e-16), seed=0, round=1)
    assert step.floored == 4 * 3 + 5
    assert all(bool((g.variance == 1e-16).all()) for g in step.posterior.values())
    assert step.min_variance == pytest.approx(1e-16)
    unfloored = fuse_posteriors(tiny, states, [1, 1, 1], FusionConfig(rule="gaa", min_variance=0.0), seed=0, round=1)
    assert unfloored.floored == 0 and unfloored.min_variance < 1e-20


def test_fedavg_averages_every_parameter_with_the_weights():
    states = [{"w": torch.full((2,), float(k)), "b": torch.tensor([k * 2.0])} for k in range(3)]
    state, weights = average_states(states, [1, 1, 2])
    assert weights == [0.25, 0.25, 0.5]
    assert_close(state["w"], torch.full((2,), 0.25 * 1 + 0.5 * 2))
    with pytest.raises(ValueError, match=r"states\[1\]: expected the parameters"):
        average_states([{"w": torch.zeros(1)}, {"v": torch.zeros(1)}], [1, 1])


def _nets(J=3, widths=(6, 7, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    nets = []
    for w in widths[:J]:
        net = mlp(4, [w], 2)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        nets.append(net)
    return nets


FIXED = PFNMConfig(hyperparameters="fixed", sigma2=0.5)


def test_a_matched_client_starts_from_its_slice_and_an_unmatched_one_from_the_whole_network():
    nets = _nets()
    counts = torch.ones(3, 2)
    match = pfnm_step(nets, counts, FIXED, seed=0, round=1)
    state, ids = client_start(match, 1)
    assert {k: tuple(v.shape) for k, v in state.items()} == {"1.weight": (7, 4), "1.bias": (7,), "3.weight": (2, 7),
                                                             "3.bias": (2,)}
    assert torch.equal(ids["1"], match.assignments["1"][1])
    assert torch.equal(state["1.weight"], match.state["1.weight"][ids["1"]])
    whole, all_ids = client_start(match, None)
    L = match.hidden_sizes[0]
    assert torch.equal(all_ids["1"], torch.arange(L)) and torch.equal(whole["1.weight"], match.state["1.weight"])


def test_a_warm_started_round_starts_from_the_assignment_the_clients_were_sent():
    nets = _nets()
    counts = torch.ones(3, 2)
    config = replace(FIXED, sweeps=0)
    first = pfnm_step(nets, counts, config, seed=0, round=1)
    starts = [client_start(first, j) for j in range(3)]
    slices = [state for state, _ in starts]
    second = pfnm_step(slices, counts, config, seed=0, round=2, starts=[ids for _, ids in starts], spec=first.spec,
                       template=first.template)
    for j in range(3):   # with no sweeps, the warm start is the answer: every neuron back on its global neuron
        assert torch.equal(second.assignments["1"][j], first.assignments["1"][j])
    cold = pfnm_step(slices, counts, replace(config, warm_start=False), seed=0, round=2,
                     starts=[ids for _, ids in starts], spec=first.spec, template=first.template)
    expected = match_by_spec(slices, counts, first.spec, template=first.template, sweeps=0, sigma2=0.5,
                             sigma0_2=1.0, gamma0=1.0, hyperparameters="fixed",
                             seed=None)   # cold: a greedy pass, whatever the seed of the (absent) sweeps
    assert cold.hidden_sizes == expected.hidden_sizes
    with pytest.raises(ValueError, match="starts: expected the start of each of the 3 clients"):
        pfnm_step(nets, counts, config, seed=0, round=2, starts=[None, None, None])


@pytest.mark.parametrize("direction", ["bottom-up", "top-down"])
def test_pfnm_step_is_match_by_spec_with_the_round_s_seed(direction):
    torch.manual_seed(0)
    nets = [mlp(12, [6 + j, 5], 3) for j in range(3)]
    counts = [[5, 1, 0], [1, 5, 2], [2, 2, 6]]
    config = PFNMConfig(hyperparameters="fixed", sigma2=0.3, sigma0_2=2.0, gamma0=1.5, direction=direction)
    match = pfnm_step(nets, counts, config, seed=3, round=2)
    expected = match_by_spec(nets, counts, seed=derive_seed(3, Stream.MATCH, 2), hyperparameters="fixed", sigma2=0.3,
                             sigma0_2=2.0, gamma0=1.5, objective="map", direction=direction)
    assert match.hidden_sizes == expected.hidden_sizes
    for key, value in expected.state.items():
        assert torch.equal(match.state[key], value), key
    for group in ["1", "3"]:
        assert all(torch.equal(a, b) for a, b in zip(match.assignments[group], expected.assignments[group]))


def test_top_down_matches_a_convolutional_network_too():
    """The published order is the spec with its groups reversed, so it needs no MLP: permuted copies of a CNN matched
    top-down give the network back."""
    torch.manual_seed(0)
    net = simple_cnn(1, 8)
    spec = derive_spec(net, (1, 8, 8))
    g = torch.Generator().manual_seed(1)
    state = net.state_dict()
    perms = {grp.name: torch.randperm(state[grp.axes[0].param].shape[0], generator=g) for grp in spec.groups}
    shuffled = network_from_state(net, client_slice(spec, state, perms))
    config = PFNMConfig(hyperparameters="fixed", sigma2=1e-8, sigma0_2=1.0, gamma0=1.0, direction="top-down")
    match = pfnm_step([net, shuffled], None, config, seed=0, round=1, input_shape=(1, 8, 8))
    assert match.widths == {grp.name: int(state[grp.axes[0].param].shape[0]) for grp in spec.groups}
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(match.network()(x), net(x), atol=1e-4, rtol=0)


def test_a_cnn_is_matched_group_by_group_and_each_client_gets_its_slice():
    torch.manual_seed(0)
    nets = [LeNet(image_size=8) for _ in range(2)]
    match = pfnm_step(nets, torch.ones(2, 10), FIXED, seed=0, round=1, input_shape=(1, 8, 8))
    assert list(match.widths) == ["conv1", "conv2", "fc1", "fc2"] and match.hidden_sizes == list(match.widths.values())
    state, ids = client_start(match, 0)
    assert [len(ids[g]) for g in match.widths] == [6, 16, 120, 84]
    assert tuple(state["fc1.weight"].shape) == (120, 64) and tuple(state["conv2.weight"].shape) == (16, 6, 5, 5)


def test_pooled_batch_norm_moments_are_the_statistics_of_all_the_clients_data():
    torch.manual_seed(0)
    net = simple_cnn_bn(1, 8)
    x = torch.randn(40, 1, 8, 8)
    moments = [batch_norm_moments_step(net, part, 8) for part in (x[:24], x[24:])]
    statistics = batch_norm_step(moments)
    assert sorted(statistics) == ["bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"]
    whole = batch_norm_moments_step(net, x, 8)      # the same batches: the clients' batches of 8 follow each other
    assert_close(statistics["bn1.running_mean"], whole["bn1"].sum / whole["bn1"].count, rtol=1e-12, atol=1e-12)
    pre = net.conv1(x).detach().double().transpose(0, 1).reshape(6, -1)
    assert_close(statistics["bn1.running_var"], pre.var(1), rtol=1e-9, atol=1e-12)
    state = with_statistics(net.state_dict(), statistics)
    assert state["bn1.running_mean"].dtype == torch.float32 and torch.equal(state["bn1.weight"], net.bn1.weight)
    with pytest.raises(ValueError, match=r"moments\[1\]: expected the batch norms \['bn1', 'bn2'\]"):
        batch_norm_step([moments[0], {"bn1": moments[1]["bn1"]}])


def test_fedma_matches_one_group_and_freezes_what_the_matched_groups_own():
    torch.manual_seed(0)
    nets = [simple_cnn_bn(1, 8) for _ in range(2)]
    spec = derive_spec(nets[0], (1, 8, 8))
    match = fedma_group_step([n.state_dict() for n in nets], torch.ones(2, 10), FIXED, spec=spec, group="conv1",
                             seed=0, round=1)
    assert match.group == "conv1" and len(match.assignments) == 2
    assert matched_parameters(spec, ["conv1"]) == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert "bn1.running_mean" in match.values() and "conv2.weight" not in match.values()


@pytest.mark.parametrize("global_weights", [None, "average", "posterior-mean"])
def test_the_configs_global_weights_reach_the_matcher(global_weights):
    torch.manual_seed(0)
    nets = [LeNet(image_size=8) for _ in range(2)]
    config = PFNMConfig(global_weights=global_weights)
    match = pfnm_step(nets, torch.ones(2, 10), config, seed=0, round=1, input_shape=(1, 8, 8))
    expected = match_by_spec(nets, torch.ones(2, 10), input_shape=(1, 8, 8), seed=derive_seed(0, Stream.MATCH, 1),
                             global_weights=global_weights or "average", hyperparameters="empirical-bayes",
                             objective="marginal")
    for key, value in expected.state.items():
        assert torch.equal(match.state[key], value), key
    with pytest.raises(ValueError, match="global_weights: expected one of"):
        PFNMConfig(global_weights="median")

"""The server's steps, written once for the in-process federations and the Flower strategies."""

import math

import pytest
import torch
from torch.testing import assert_close

from bnpfed.combine import average_deterministic, fuse_sites
from bnpfed.federated.config import FusionConfig, PFNMConfig
from bnpfed.federated.server import (average_states, client_start, client_weights, clients_per_round,
                                     fuse_posteriors, pfnm_step, sample_clients)
from bnpfed.inference.multilayer import match_networks
from bnpfed.posterior import GaussianPosterior
from bnpfed.seeding import Stream, torch_generator


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
    return [[(torch.randn(w, 4, generator=g), torch.randn(w, generator=g)),
             (torch.randn(2, w, generator=g), torch.randn(2, generator=g))] for w in widths[:J]]


def test_a_matched_client_starts_from_its_slice_and_an_unmatched_one_from_the_whole_network():
    nets = _nets()
    counts = torch.ones(3, 2)
    match = pfnm_step(nets, counts, PFNMConfig(hyperparameters="fixed", sigma2=0.5), seed=0, round=1)
    layers, ids = client_start(match, 1)
    assert [tuple(w.shape) for w, _ in layers] == [(7, 4), (2, 7)]
    assert torch.equal(ids[0], match.assignments[0][1])
    whole, all_ids = client_start(match, None)
    L = match.hidden_sizes[0]
    assert torch.equal(all_ids[0], torch.arange(L)) and torch.equal(whole[0][0], match.layers[0][0])


def test_a_warm_started_round_starts_from_the_assignment_the_clients_were_sent():
    nets = _nets()
    counts = torch.ones(3, 2)
    config = PFNMConfig(hyperparameters="fixed", sigma2=0.5, sweeps=0)
    first = pfnm_step(nets, counts, config, seed=0, round=1)
    starts = [client_start(first, j) for j in range(3)]
    second = pfnm_step([layers for layers, _ in starts], counts, config, seed=0, round=2,
                       starts=[ids for _, ids in starts])
    for j in range(3):   # with no sweeps, the warm start is the answer: every neuron back on its global neuron
        assert torch.equal(second.assignments[0][j], first.assignments[0][j])
    cold = pfnm_step([layers for layers, _ in starts], counts, PFNMConfig(hyperparameters="fixed", sigma2=0.5, sweeps=0, warm_start=False),
                     seed=0, round=2, starts=[ids for _, ids in starts])
    expected = match_networks([layers for layers, _ in starts], counts, sweeps=0, sigma2=0.5, sigma0_2=1.0, gamma0=1.0,
                              hyperparameters="fixed",
                              seed=None)   # cold: a greedy pass, whatever the seed of the (absent) sweeps
    assert cold.hidden_sizes == expected.hidden_sizes
    with pytest.raises(ValueError, match="starts: expected the start of each of the 3 clients"):
        pfnm_step(nets, counts, config, seed=0, round=2, starts=[None, None, None])

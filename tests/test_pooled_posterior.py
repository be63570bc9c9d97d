"""Matched posterior fusion with the clients' own posterior output layers pooled (bnpfed.matching.PooledPosterior,
methods match-<rule>-pooled): the predictive against a Monte Carlo estimate written out by hand, the point-mass
limit against the pooled network, and the rows and refusals around it."""

import dataclasses

import numpy as np
import pytest
import torch

from bnpfed.data import load_dataset
from bnpfed.federated.config import BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig, TrainingConfig
from bnpfed.federated.matched_fusion import MatchedFusionFederation
from bnpfed.federated.methods import ExperimentConfig, available_methods, method_options, run_experiment
from bnpfed.federated.partition import partition_dirichlet
from bnpfed.matching import PooledPosterior, match_by_spec, pooled_network
from bnpfed.matching.pooled_heads import sample_state
from bnpfed.matching.posteriors import client_posterior


@pytest.fixture(scope="module")
def federation():
    """Three variational clients of a 64-16-10 MLP on label-skewed digits, matched and fused by conflation."""
    ds = load_dataset("digits")
    parts = partition_dirichlet(ds.y_train.numpy(), 3, alpha=0.5, seed=0)
    fed = MatchedFusionFederation(ds, parts, network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=3),
                                  bayesian=BayesianConfig(), fusion=FusionConfig(align="match", heads="pooled"),
                                  seed=0)
    fed.run_round()
    return ds, fed


def _inflated(fed, factor):
    """The federation's match and clients' posteriors with every variance times ``factor`` (so that the draws
    matter: sd 20x the trained one at factor 400)."""
    match = dataclasses.replace(fed.match, variances={k: v * factor for k, v in fed.match.variances.items()})
    posteriors = []
    for c in fed.clients:
        locs, variances = client_posterior(c)
        posteriors.append((locs, {k: v * factor for k, v in variances.items()}))
    return match, posteriors


def _predictive_by_hand(match, posteriors, x, draws, seed):
    """(1/S) sum_s softmax_k(sum_j omega_jk log softmax(W_j^s h^s(x) + b_j)), h^s = relu(W1^s x + b1), every weight
    drawn from its Gaussian with numpy, client j's head columns placed at match.assignments by index."""
    rng = np.random.default_rng(seed)
    loc1, var1 = match.locs["1.weight"].numpy(), match.variances["1.weight"].numpy()
    b1 = match.locs["1.bias"].numpy()
    L, C = loc1.shape[0], match.locs["3.weight"].shape[0]
    shares = match.class_shares.numpy()
    omega = np.where(shares.sum(0) > 0, shares, 1.0 / len(posteriors))
    x = x.double().flatten(1).numpy()
    total = np.zeros((x.shape[0], C))
    for _ in range(draws):
        W1 = loc1 + np.sqrt(var1) * rng.standard_normal(loc1.shape)
        h = np.maximum(x @ W1.T + b1, 0.0)
        pooled = np.zeros((x.shape[0], C))
        for j, (locs, variances) in enumerate(posteriors):
            w = locs["3.weight"].double().numpy()
            w = w + np.sqrt(variances["3.weight"].double().numpy()) * rng.standard_normal(w.shape)
            head = np.zeros((C, L))
            for own, glob in enumerate(match.assignments["1"][j].tolist()):
                head[:, glob] = w[:, own]
            z = h @ head.T + locs["3.bias"].double().numpy()
            z = z - z.max(1, keepdims=True)
            pooled += omega[j] * (z - np.log(np.exp(z).sum(1, keepdims=True)))
        p = np.exp(pooled - pooled.max(1, keepdims=True))
        total += p / p.sum(1, keepdims=True)
    return torch.as_tensor(total / draws)


def test_predictive_is_the_mean_over_draws_of_the_pool_inside_each_draw(federation):
    ds, fed = federation
    match, posteriors = _inflated(fed, 400.0)
    assert sorted(match.variances) == ["1.weight", "3.weight"]     # biases are point masses in these clients
    x = ds.x_test[:12]
    got = PooledPosterior.of_match(match, posteriors).predict_proba(x.double(), num_samples=3000, seed=0)
    want = _predictive_by_hand(match, posteriors, x, draws=20000, seed=1)
    mean = PooledPosterior.of_match(match, posteriors).mean_network().double()(x.double()).softmax(-1)
    # Monte Carlo: each probability's sd is at most 0.5 / sqrt(S); with S = 3000 and 20000 the difference's sd is at
    # most 0.0098, so 0.04 is four of them; the posterior-mean network is farther than that: the draws matter
    assert (got - want).abs().max() < 0.04
    assert (mean - want).abs().max() > 0.1
    torch.testing.assert_close(got.sum(-1), torch.ones(12, dtype=torch.float64))


def test_point_mass_posteriors_give_the_pooled_networks_probabilities(federation):
    ds, fed = federation
    match, posteriors = _inflated(fed, 0.0)
    pooled = PooledPosterior.of_match(match, posteriors)
    x = ds.x_test[:50].double()
    net = pooled_network(match, [p[0] for p in posteriors]).double()
    with torch.no_grad():
        torch.testing.assert_close(pooled.predict_proba(x, num_samples=3, seed=5), net(x).softmax(-1), rtol=0,
                                   atol=1e-12)


def test_same_seed_same_draws_and_the_heads_are_drawn(federation):
    ds, fed = federation
    x = ds.x_test[:30]
    a = fed.pooled.predict_proba(x, num_samples=4, seed=3)
    torch.testing.assert_close(a, fed.pooled.predict_proba(x, num_samples=4, seed=3), rtol=0, atol=0)
    assert not torch.equal(a, fed.pooled.predict_proba(x, num_samples=4, seed=4))
    # only the heads uncertain: the body at its means still gives a predictive that moves with the seed
    match = dataclasses.replace(fed.match, variances={k: torch.zeros_like(v) for k, v in fed.match.variances.items()})
    heads_only = PooledPosterior.of_match(match, [client_posterior(c) for c in fed.clients])
    assert not torch.equal(heads_only.predict_proba(x, 2, seed=0), heads_only.predict_proba(x, 2, seed=1))


def test_sample_state_draws_loc_plus_sd_times_standard_normal():
    locs = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    variances = {"w": torch.tensor([4.0, 0.25])}
    draws = torch.stack([sample_state(locs, variances, torch.Generator().manual_seed(s))["w"] for s in range(4000)])
    # mean within 4 standard errors, sd within 5 % (4000 draws)
    assert ((draws.mean(0) - locs["w"]).abs() < 4 * torch.tensor([2.0, 0.5]) / 4000 ** 0.5).all()
    torch.testing.assert_close(draws.std(0), torch.tensor([2.0, 0.5]), rtol=0.05, atol=0)
    assert sample_state(locs, variances, torch.Generator().manual_seed(0))["b"] is locs["b"]


def test_federation_predicts_with_the_pool_and_counts_its_heads(federation):
    ds, fed = federation
    assert fed.method == "match-conflation-pooled"
    x = ds.x_test[:20]
    torch.testing.assert_close(fed.predict_mean(x), fed.pooled.mean_network().float()(x).softmax(-1))
    posteriors = [client_posterior(c) for c in fed.clients]
    from bnpfed.seeding import Stream, derive_seed
    want = PooledPosterior.of_match(fed.match, posteriors).predict_proba(x, num_samples=fed.predictive_samples,
                                                                seed=derive_seed(fed.seed, Stream.PREDICT, 1))
    torch.testing.assert_close(fed.predict_proba(x), want)


def test_pooled_rows_beside_the_fused_ones_on_the_same_match():
    ds = load_dataset("digits")
    result = run_experiment(ds, partition=PartitionConfig(clients=3, partition="dirichlet"),
                            network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=2),
                            bayesian=BayesianConfig(), fusion=FusionConfig(align="match", heads="fused"),
                            config=ExperimentConfig(methods=("match:rule=conflation",
                                                             "match:rule=conflation:heads=pooled",
                                                             "match:rule=eaa:heads=pooled"), seed=0))
    fused, pooled, eaa = result.rows
    assert (pooled.method, eaa.method) == ("match-conflation-pooled", "match-eaa-pooled")
    assert pooled.hidden == fused.hidden                       # the same clients, the same match
    L, C, J = fused.hidden[0], 10, 3
    assert pooled.parameters == fused.parameters + (J - 1) * C * (L + 1)
    assert "pooled" in pooled.note and 0.0 <= pooled.accuracy <= 1.0
    # every row's global model is kept for a file: the pooled ones as their PooledPosterior
    assert set(result.global_models) == {"match-conflation", "match-conflation-pooled", "match-eaa-pooled"}
    assert isinstance(result.global_models["match-conflation-pooled"]["network"], PooledPosterior)
    assert "match" in available_methods() and method_options("match")["heads"].values() == ["auto", "fused", "pooled"]
    assert "atom-posterior" in method_options("match")["rule"].values()


def test_bad_input_is_refused_naming_the_argument(federation):
    ds, fed = federation
    posteriors = [client_posterior(c) for c in fed.clients]
    with pytest.raises(ValueError, match="client_posteriors"):
        PooledPosterior.of_match(fed.match, posteriors[:2])
    with pytest.raises(ValueError, match=r"client_posteriors\[1\]"):
        PooledPosterior.of_match(fed.match, [posteriors[0], posteriors[1][0], posteriors[2]])
    with pytest.raises(ValueError, match="class shares"):
        PooledPosterior.of_match(dataclasses.replace(fed.match, class_shares=None), posteriors)
    nets = [c.mean_network() for c in fed.clients]
    spec_match = match_by_spec(nets, fed.class_counts, seed=0)
    with pytest.raises(ValueError, match="PosteriorMatch"):
        PooledPosterior.of_match(spec_match, posteriors)
    with pytest.raises(ValueError, match="num_samples"):
        fed.pooled.predict_proba(ds.x_test[:2], num_samples=0)
    with pytest.raises(ValueError, match="heads: expected one of"):
        FusionConfig(align="match", heads="mean")
    with pytest.raises(ValueError, match="heads: the output layer of matched fusion"):
        FusionConfig(heads="pooled")

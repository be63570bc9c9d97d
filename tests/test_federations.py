"""The in-process federations: posterior fusion, FedAvg and PFNM round by round (bnpfed.federated.fusion, .pfnm)."""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from bnpfed.combine import available_rules, average_deterministic, fuse_sites
from bnpfed.data import Dataset, load_dataset
from bnpfed.federated.config import (BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig, PFNMConfig,
                                     TrainingConfig)
from bnpfed.federated.fusion import FedAvgFederation, FusionFederation
from bnpfed.federated.pfnm import PFNMFederation
from bnpfed.clients import BayesianClient, DeterministicClient
from bnpfed.seeding import Stream, derive_seed, torch_generator
from bnpfed.experimental import ExperimentalOptions

METRICS = ("accuracy", "nll", "ece", "brier")
NET = NetworkConfig(hidden=(16,))
TRAIN = TrainingConfig(epochs=1)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def pixels():
    return load_dataset("digits", standardize=False)


def unequal_parts(sizes=(40, 80, 120, 160), seed=0):
    """Disjoint client index sets of the given sizes from the digits train split (1347 examples)."""
    order = np.random.default_rng(seed).permutation(1347)
    bounds = np.cumsum((0, *sizes))
    return [np.sort(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def fusion(ds, parts, rule="eaa", *, fraction=1.0, weights="size", bayesian=BayesianConfig(), min_variance=1e-16,
           seed=0, training=TRAIN):
    return FusionFederation(ds, parts, network=NET, training=training, bayesian=bayesian,
                            fusion=FusionConfig(rule=rule, weights=weights, fraction=fraction, pooling_samples=100,
                                                min_variance=min_variance),
                            seed=seed, predictive_samples=2)


@pytest.mark.parametrize("rule", ["eaa", "pooling", "conflation"])
@pytest.mark.parametrize("weights", ["uniform", "size"])
def test_the_global_posterior_is_fuse_sites_of_the_sampled_clients_with_their_weights(digits, rule, weights):
    parts = unequal_parts()
    federation = fusion(digits, parts, rule, fraction=0.75, weights=weights, min_variance=0.0)
    record = federation.run_round()
    assert len(record.sampled) == 3
    sizes = [len(parts[k]) for k in record.sampled]
    expected_b = [1 / 3] * 3 if weights == "uniform" else [n / sum(sizes) for n in sizes]
    assert_close(torch.tensor(record.weights), torch.tensor(expected_b), rtol=1e-12, atol=0)
    clients = [federation.clients[k] for k in record.sampled]
    expected = fuse_sites([c.posterior() for c in clients], rule, expected_b, num_samples=100,
                          generator=torch_generator(0, Stream.POOLING, 1))
    assert list(federation.global_posterior) == list(expected) == ["1.weight", "3.weight"]
    for name, (loc, variance) in expected.items():
        assert torch.equal(federation.global_posterior[name].loc, loc)
        assert torch.equal(federation.global_posterior[name].variance, variance)
    states = [c.deterministic_state() for c in clients]
    assert list(federation.global_deterministic) == ["1.bias", "3.bias"]
    for name, value in federation.global_deterministic.items():
        assert_close(value, average_deterministic([s[name] for s in states], expected_b))


def test_every_sampled_client_starts_its_round_from_the_global_model(digits, monkeypatch):
    parts = PartitionConfig(clients=4).split(digits.y_train.numpy(), seed=0)
    federation = fusion(digits, parts, "conflation", fraction=0.5)
    federation.run_round()
    fused, averaged = federation.global_posterior, federation.global_deterministic
    for name, (loc, variance) in federation.global_model.posterior().items():   # the server's copy holds it
        assert torch.equal(loc, fused[name].loc)
        assert_close(variance, fused[name].variance, rtol=1e-5, atol=0)
    starts = {}
    original_fit = BayesianClient.fit

    def recording_fit(client, *args, **kwargs):
        starts[federation.clients.index(client)] = (client.posterior(), client.deterministic_state())
        return original_fit(client, *args, **kwargs)

    monkeypatch.setattr(BayesianClient, "fit", recording_fit)
    second = federation.run_round()
    assert sorted(starts) == second.sampled and len(second.sampled) == 2
    for posterior, state in starts.values():
        for name, (loc, variance) in posterior.items():
            assert torch.equal(loc, fused[name].loc)
            assert_close(variance, fused[name].variance, rtol=1e-5, atol=0)   # through softplus and back
        for name, value in state.items():
            assert torch.equal(value, averaged[name])


@pytest.mark.parametrize("round_prior", [None, "posterior"])
def test_a_client_of_round_two_trains_under_the_configured_prior_unless_told_to_take_the_posterior(
        digits, monkeypatch, round_prior):
    """Round 1 always under N(0, 1); from round 2 the configured prior again by default (the global posterior is
    where SVI starts, not a prior: nothing is counted twice), or with ``round_prior="posterior"`` the global
    posterior it starts from."""
    parts = PartitionConfig(clients=3).split(digits.y_train.numpy(), seed=0)
    federation = fusion(digits, parts, "conflation",
                        bayesian=BayesianConfig(experimental=ExperimentalOptions(round_prior=round_prior)))
    priors = {}
    original_fit = BayesianClient.fit

    def recording_fit(client, *args, **kwargs):
        priors.setdefault(federation.round + 1, []).append(
            {k: (d.mean.clone(), d.variance.clone()) for k, d in client.bnn.prior_distributions().items()})
        return original_fit(client, *args, **kwargs)

    monkeypatch.setattr(BayesianClient, "fit", recording_fit)
    federation.run_round()
    fused = federation.global_model.posterior()
    federation.run_round()
    for prior in priors[1]:
        for mean, variance in prior.values():
            assert torch.equal(mean, torch.zeros_like(mean)) and torch.equal(variance, torch.ones_like(variance))
    assert len(priors[2]) == 3
    for prior in priors[2]:
        for name, (mean, variance) in prior.items():
            if round_prior == "posterior":
                assert torch.equal(mean, fused[name].loc)
                assert_close(variance, fused[name].variance, rtol=1e-5, atol=0)
            else:
                assert torch.equal(mean, torch.zeros_like(mean)) and torch.equal(variance, torch.ones_like(variance))


def test_each_local_fit_draws_from_its_own_seed_of_seed_round_and_client(digits, monkeypatch):
    parts = PartitionConfig(clients=3).split(digits.y_train.numpy(), seed=0)
    seeds = []
    original_fit = DeterministicClient.fit

    def recording_fit(client, *args, seed, **kwargs):
        seeds.append(seed)
        return original_fit(client, *args, seed=seed, **kwargs)

    monkeypatch.setattr(DeterministicClient, "fit", recording_fit)
    FedAvgFederation(digits, parts, network=NET, training=TRAIN, seed=5).run(2)
    assert seeds == [derive_seed(5, Stream.FIT, t, k) for t in (1, 2) for k in range(3)]
    assert len(set(seeds)) == 6


def test_the_same_seed_gives_identical_rounds_and_another_seed_differs(digits):
    parts = PartitionConfig(clients=3).split(digits.y_train.numpy(), seed=0)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)

    def run(seed):
        f = fusion(digits, parts, "pooling", fraction=0.67, seed=seed)
        f.run(2)
        return [{k: v for k, v in r.metrics.items() if "seconds" not in k} for r in f.history], f.global_posterior

    (a, pa), (b, pb), (c, _) = run(0), run(0), run(1)
    assert torch.equal(torch.rand(3), expected_draw)   # torch's global random state is left alone
    assert a == b and all(torch.equal(pa[s].loc, pb[s].loc) for s in pa)
    assert a != c


def test_fedavg_improves_over_rounds_on_digits(digits):
    parts = PartitionConfig(clients=5).split(digits.y_train.numpy(), seed=0)
    federation = FedAvgFederation(digits, parts, network=NetworkConfig(hidden=(32,)), training=TrainingConfig(),
                                  seed=0)
    history = [r.metrics for r in federation.run(3)]
    assert history[-1]["accuracy"] > history[0]["accuracy"] and history[-1]["nll"] < history[0]["nll"]
    assert history[-1]["accuracy"] > 0.9   # chance is 0.1


def test_with_the_defaults_a_bayesian_rule_keeps_up_with_fedavg_on_digits(digits):
    parts = PartitionConfig(clients=10).split(digits.y_train.numpy(), seed=0)
    network = NetworkConfig()
    bayes = FusionFederation(digits, parts, network=network, training=TrainingConfig(), bayesian=BayesianConfig(),
                             fusion=FusionConfig(rule="conflation"), seed=0)
    fedavg = FedAvgFederation(digits, parts, network=network, training=TrainingConfig(), seed=0)
    b, f = (x.run(3)[-1].metrics["accuracy"] for x in (bayes, fedavg))
    assert b > 0.9 and b > f - 0.03


def test_with_every_parameter_bayesian_nothing_is_averaged(digits):
    parts = PartitionConfig(clients=2).split(digits.y_train.numpy(), seed=0)
    federation = fusion(digits, parts, "gaa", bayesian=BayesianConfig(prior="all"))
    record = federation.run_round()
    assert federation.global_deterministic == {}
    assert list(federation.global_posterior) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert math.isfinite(record.metrics["accuracy"])


def test_sixty_rounds_of_every_rule_finish_with_finite_numbers(digits):
    """GAA and conflation divide the variance by about J a round: 60 rounds of 10 clients take it from 1e-4 far
    below float32's range (without a floor this run diverges at round 37: the KL gradient overflows). The fused
    variances are floored at ``min_variance`` (1e-16 by default) instead, and every weight at the floor is
    counted."""
    small = [p[:24] for p in PartitionConfig(clients=10).split(digits.y_train.numpy(), seed=0)]
    for rule in available_rules():
        federation = fusion(digits, small, rule, weights="uniform", training=TrainingConfig(epochs=1, batch_size=24))
        records = federation.run(60)
        for r in records:
            assert all(math.isfinite(r.metrics[m]) for m in (*METRICS, "train_loss", "mean_sigma")), (rule, r)
        assert records[-1].metrics["min_variance"] >= 1e-16
        if rule in ("gaa", "conflation"):
            assert records[-1].metrics["floored"] > 0, rule   # they do reach the floor


def test_bad_partitions_and_architectures_are_named(digits):
    with pytest.raises(ValueError, match=r"parts\[1\]: expected indices in \[0, 1346\]"):
        FedAvgFederation(digits, [np.arange(5), np.array([1, 5000])], network=NET, training=TRAIN, seed=0)
    with pytest.raises(ValueError, match="square images"):
        FedAvgFederation(digits.flat(), [np.arange(50)], network=NetworkConfig(arch="lenet"), training=TRAIN, seed=0)
    with pytest.raises(ValueError, match=r"arch: expected an architecture that fits images of shape \(1, 6, 6\), "
                                         r"got 'simple-cnn'"):
        tiny = Dataset(digits.x_train[:, :, :6, :6], digits.y_train, digits.x_test[:, :, :6, :6], digits.y_test,
                       name="tiny", num_classes=10, input_shape=(1, 6, 6))
        PFNMFederation(tiny, [np.arange(50)], network=NetworkConfig(arch="simple-cnn"), training=TRAIN,
                       pfnm=PFNMConfig(), seed=0)


# ---------------------------------------------------------------- PFNM


def pfnm(ds, parts, **kwargs):
    config = dict(hyperparameters="fixed", sigma2=0.3, warm_start=True)
    config.update(kwargs)
    return PFNMFederation(ds, parts, network=NetworkConfig(hidden=(32,), init="reference"),
                          training=TrainingConfig(epochs=5, round_epochs=2, amsgrad=True), pfnm=PFNMConfig(**config),
                          seed=0)


def test_pfnm_rounds_record_accuracy_and_a_width_that_may_change(pixels):
    parts = PartitionConfig(clients=4).split(pixels.y_train.numpy(), seed=0)
    federation = pfnm(pixels, parts)
    records = federation.run(3)
    for r in records:
        assert r.metrics["accuracy"] > 0.85 and r.metrics["hidden"] == federation.history[r.round - 1].metrics["hidden"]
        assert r.metrics["parameters"] > 0 and r.metrics["server_seconds"] > 0
    assert records[0].metrics["hidden"][0] >= 32   # at least one client's width
    assert federation.matched == [0, 1, 2, 3]


def test_clients_start_later_rounds_from_their_slice_and_unmatched_ones_from_the_whole_network(pixels, monkeypatch):
    parts = PartitionConfig(clients=4).split(pixels.y_train.numpy(), seed=0)
    federation = pfnm(pixels, parts, fraction=0.5)
    federation.run_round()
    first, matched = federation.match, list(federation.matched)
    widths = {}
    original_fit = DeterministicClient.fit

    def recording_fit(client, x, y, **kwargs):
        widths[len(widths)] = [m.out_features for m in client.net.modules() if isinstance(m, torch.nn.Linear)][0]
        return original_fit(client, x, y, **kwargs)

    monkeypatch.setattr(DeterministicClient, "fit", recording_fit)
    second = federation.run_round()
    for position, j in enumerate(second.sampled):
        expected = len(first.assignments["1"][matched.index(j)]) if j in matched else first.hidden_sizes[0]
        assert widths[position] == expected


def test_warm_and_cold_matching_both_keep_pfnm_accurate(pixels):
    parts = PartitionConfig(clients=4).split(pixels.y_train.numpy(), seed=0)
    warm, cold = pfnm(pixels, parts), pfnm(pixels, parts, warm_start=False)
    w, c = warm.run(2)[-1], cold.run(2)[-1]
    assert warm.history[0].metrics["hidden"] == cold.history[0].metrics["hidden"]   # round 1 is the same
    assert w.metrics["accuracy"] > 0.85 and c.metrics["accuracy"] > 0.85


def test_posterior_fusion_refuses_a_network_with_batch_norm(digits):
    with pytest.raises(ValueError, match="arch: posterior fusion expected one of"):
        FusionFederation(digits, [np.arange(50)], network=NetworkConfig(arch="simple-cnn-bn"), training=TRAIN,
                         bayesian=BayesianConfig(), fusion=FusionConfig(), seed=0)

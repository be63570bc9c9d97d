"""Federated rounds of Bayesian clients fused on a server (bnpfed.federated.fusion); ``bnpfed fuse`` is tested in
test_commands.py."""

import json
import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from bnpfed import combine
from bnpfed.combine import available_rules, average_deterministic, fuse, fuse_sites
from bnpfed.data import load_dataset
from bnpfed.federated import partition_homogeneous
from bnpfed.federated.fusion import (FEDAVG, FIT, POOLING, FedAvgFederation, FusionConfig, FusionFederation,
                                     derive_seed, run_fusion_experiment)
from bnpfed.inference import BayesianClient, DeterministicClient

METRICS = ("accuracy", "nll", "ece", "brier")


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def unequal_parts(sizes=(40, 80, 120, 160), seed=0):
    """Disjoint client index sets of the given sizes from the digits train split (1347 examples)."""
    order = np.random.default_rng(seed).permutation(1347)
    bounds = np.cumsum((0, *sizes))
    return [np.sort(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def tiny(**kwargs):
    """A configuration that runs in about a second per method on digits."""
    settings = dict(hidden=(16,), rounds=1, local_epochs=1, batch_size=32, num_predictive_samples=2,
                    pooling_samples=100)
    settings.update(kwargs)
    return FusionConfig(**settings)


def without_timings(experiment):
    result = experiment.to_dict()
    for history in result["histories"].values():
        for r in history["rounds"]:
            r.pop("seconds")
    return result


# ---------------------------------------------------------------- the experiment


def test_a_short_run_gives_finite_metrics_for_every_rule_and_fedavg(digits):
    parts = partition_homogeneous(digits.y_train.numpy(), 3, seed=0)
    experiment = run_fusion_experiment(digits, parts, tiny(rounds=2))
    assert list(experiment.histories) == [*available_rules(), FEDAVG]
    for method, history in experiment.histories.items():
        assert [r["round"] for r in history.rounds] == [1, 2]
        for r in history.rounds:
            assert all(math.isfinite(r[m]) for m in (*METRICS, "train_loss")), (method, r)
            assert 0 <= r["accuracy"] <= 1 and r["nll"] > 0 and 0 <= r["ece"] <= 1 and 0 <= r["brier"] <= 2
            if method == FEDAVG:
                assert "mean_sigma" not in r
            else:
                assert math.isfinite(r["mean_sigma"]) and r["mean_sigma"] > 0
    rows = experiment.summary_rows()
    assert [row["method"] for row in rows] == [*available_rules(), FEDAVG]
    assert math.isnan(rows[-1]["mean_sigma"])
    assert experiment.client_sizes == [len(p) for p in parts]
    json.dumps(experiment.to_dict(), allow_nan=False)  # JSON-ready, NaN written as null


@pytest.mark.parametrize("rule", ["eaa", "pooling", "conflation"])
@pytest.mark.parametrize("weights", ["uniform", "size"])
def test_the_global_posterior_is_fuse_sites_of_the_sampled_clients_with_their_weights(digits, rule, weights):
    parts = unequal_parts()
    federation = FusionFederation(digits, parts, tiny(fraction=0.75, weights=weights), rule=rule)
    record = federation.run_round()
    assert len(record.sampled) == 3
    sizes = [len(parts[k]) for k in record.sampled]
    expected_b = [1 / 3] * 3 if weights == "uniform" else [n / sum(sizes) for n in sizes]
    assert_close(torch.tensor(record.weights), torch.tensor(expected_b), rtol=1e-12, atol=0)

    clients = [federation.clients[k] for k in record.sampled]
    raw_b = [1.0, 1.0, 1.0] if weights == "uniform" else sizes  # fuse normalises
    generator = torch.Generator().manual_seed(derive_seed(0, POOLING, 1))  # seed 0, round 1
    expected = fuse_sites([c.posterior() for c in clients], rule, raw_b, num_samples=100, generator=generator)
    assert list(federation.global_posterior) == list(expected) == ["1.weight", "3.weight"]
    for name, (loc, variance) in expected.items():
        assert_close(federation.global_posterior[name].loc, loc, rtol=1e-6, atol=1e-9)
        assert_close(federation.global_posterior[name].variance, variance, rtol=1e-6, atol=1e-12)
    states = [c.deterministic_state() for c in clients]
    assert list(federation.global_deterministic) == ["1.bias", "3.bias"]
    for name, value in federation.global_deterministic.items():
        assert_close(value, average_deterministic([s[name] for s in states], raw_b), rtol=1e-6, atol=1e-9)


def test_size_and_uniform_weights_give_different_global_posteriors(digits):
    parts = unequal_parts()
    fused = [FusionFederation(digits, parts, tiny(weights=w), rule="eaa") for w in ("uniform", "size")]
    for federation in fused:
        federation.run_round()
    a, b = (f.global_posterior["1.weight"].loc for f in fused)
    assert not torch.allclose(a, b, atol=1e-6)


def test_every_client_starts_the_next_round_from_the_fused_posterior(digits, monkeypatch):
    parts = partition_homogeneous(digits.y_train.numpy(), 4, seed=0)
    federation = FusionFederation(digits, parts, tiny(fraction=0.5), rule="conflation")
    first = federation.run_round()
    fused, averaged = federation.global_posterior, federation.global_deterministic
    # the server's evaluation model holds the global model
    for name, (loc, variance) in federation.global_model.posterior().items():
        assert_close(loc, fused[name].loc, rtol=0, atol=0)
        assert_close(variance, fused[name].variance, rtol=1e-5, atol=0)

    starts = {}
    original_fit = BayesianClient.fit

    def recording_fit(client, *args, **kwargs):
        starts[federation.clients.index(client)] = (client.posterior(), client.deterministic_state())
        return original_fit(client, *args, **kwargs)

    monkeypatch.setattr(BayesianClient, "fit", recording_fit)
    second = federation.run_round()
    assert sorted(starts) == second.sampled
    idle = [k for k in range(4) if k not in second.sampled]
    assert len(first.sampled) == len(second.sampled) == len(idle) == 2
    holdings = [starts[k] for k in second.sampled]
    holdings += [(federation.clients[k].posterior(), federation.clients[k].deterministic_state()) for k in idle]
    for posterior, state in holdings:
        for name, (loc, variance) in posterior.items():
            assert_close(loc, fused[name].loc, rtol=0, atol=0)
            assert_close(variance, fused[name].variance, rtol=1e-5, atol=0)  # through softplus and back
        for name, value in state.items():
            assert torch.equal(value, averaged[name])


def test_a_fraction_of_the_clients_is_sampled_each_round(digits):
    parts = partition_homogeneous(digits.y_train.numpy(), 10, seed=0)
    federation = FedAvgFederation(digits, parts, tiny(fraction=0.3))
    draws = [federation.sample_clients(t) for t in range(1, 9)]
    for sampled in draws:
        assert len(sampled) == 3 and len(set(sampled)) == 3 and sampled == sorted(sampled)
        assert all(0 <= k < 10 for k in sampled)
    assert len({tuple(s) for s in draws}) > 1  # a new draw each round
    assert FedAvgFederation(digits, parts, tiny(fraction=0.01)).clients_per_round == 1
    assert FedAvgFederation(digits, parts, tiny(fraction=1.0)).sample_clients(3) == list(range(10))
    experiment = run_fusion_experiment(digits, parts, tiny(rules=(), fraction=0.3, rounds=2))
    assert experiment.histories[FEDAVG].sampled == draws[:2]  # FedAvg and every rule see the same clients


def test_the_same_seed_gives_identical_results_and_another_seed_differs(digits):
    parts = partition_homogeneous(digits.y_train.numpy(), 3, seed=0)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    runs = [run_fusion_experiment(digits, parts, tiny(rules=("pooling", "eaa"), fraction=0.67, seed=seed))
            for seed in (0, 0, 1)]
    assert torch.equal(torch.rand(3), expected_draw)  # torch's global random state is left alone
    a, b, c = map(without_timings, runs)
    assert a == b
    for method in ("pooling", "eaa", FEDAVG):
        assert a["histories"][method] != c["histories"][method]


def test_each_local_fit_has_its_own_seed_derived_from_seed_round_and_client(digits, monkeypatch):
    parts = partition_homogeneous(digits.y_train.numpy(), 3, seed=0)
    seeds = []
    original_fit = DeterministicClient.fit

    def recording_fit(client, *args, seed, **kwargs):
        seeds.append(seed)
        return original_fit(client, *args, seed=seed, **kwargs)

    monkeypatch.setattr(DeterministicClient, "fit", recording_fit)
    run_fusion_experiment(digits, parts, tiny(rules=(), rounds=2, seed=5))
    assert seeds == [derive_seed(5, FIT, t, k) for t in (1, 2) for k in range(3)]
    assert len(set(seeds)) == 6


def test_fedavg_improves_over_rounds_on_digits(digits):
    parts = partition_homogeneous(digits.y_train.numpy(), 5, seed=0)
    history = run_fusion_experiment(digits, parts, FusionConfig(rules=(), hidden=(32,), rounds=3)).histories[FEDAVG]
    accuracy, nll = history.metric("accuracy"), history.metric("nll")
    assert accuracy[-1] > accuracy[0] and nll[-1] < nll[0]
    assert accuracy[-1] > 0.9  # chance is 0.1


def test_with_the_defaults_a_bayesian_rule_keeps_up_with_fedavg_on_digits(digits):
    parts = partition_homogeneous(digits.y_train.numpy(), 10, seed=0)
    experiment = run_fusion_experiment(digits, parts, FusionConfig(rules=("conflation",), rounds=3))
    bayes, fedavg = (experiment.histories[m].final["accuracy"] for m in ("conflation", FEDAVG))
    assert bayes > 0.9 and bayes > fedavg - 0.03


def test_with_every_parameter_bayesian_nothing_is_averaged(digits):
    parts = partition_homogeneous(digits.y_train.numpy(), 2, seed=0)
    federation = FusionFederation(digits, parts, tiny(prior="all"), rule="gaa")
    record = federation.run_round()
    assert federation.global_deterministic == {}
    assert list(federation.global_posterior) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert math.isfinite(record.metrics["accuracy"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(rules=("eaa", "median")), "rules: unknown rule 'median'"),
    (dict(rules="eaa"), "rules: expected a sequence"),
    (dict(rules=(), fedavg=False), "nothing to run"),
    (dict(fraction=0.0), "fraction"),
    (dict(weights="count"), "weights: expected one of"),
    (dict(arch="resnet"), "arch: expected one of"),
    (dict(prior="conv"), "prior: expected one of"),
    (dict(lr=-1.0), "lr: expected a positive"),
    (dict(rounds=0), "rounds: expected an int >= 1"),
    (dict(seed=-1), "seed: expected an int >= 0"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusionConfig(**kwargs)


def test_bad_partitions_and_architectures_are_named(digits):
    with pytest.raises(ValueError, match=r"parts\[1\]: indices must lie in \[0, 1346\]"):
        FedAvgFederation(digits, [np.arange(5), np.array([1, 5000])], tiny())
    with pytest.raises(ValueError, match="square images"):
        FedAvgFederation(digits.flat(), [np.arange(50)], tiny(arch="lenet"))


# ---------------------------------------------------------------- the fusion rules on large layers
# bnpfed.combine works through large layers in column blocks (BLOCK_ELEMENTS) for the throughput this experiment's
# benchmark asks of it; these check the blocked paths against closed forms.


def test_every_deterministic_rule_gives_its_closed_form_in_column_blocks(monkeypatch):
    g = torch.Generator().manual_seed(0)
    locs = torch.randn(5, 7, 13, generator=g, dtype=torch.float64)
    variances = torch.exp(2 * torch.randn(5, 7, 13, generator=g, dtype=torch.float64))
    b = torch.tensor([1.0, 2.0, 3.0, 0.0, 4.0], dtype=torch.float64) / 10
    precision = b[:, None, None] / variances
    closed_forms = {
        "eaa": ((b[:, None, None] * locs).sum(0), (b[:, None, None] * variances).sum(0)),
        "gaa": ((b[:, None, None] * locs).sum(0), (b[:, None, None] ** 2 * variances).sum(0)),
        "log_variance": ((b[:, None, None] * locs).sum(0), torch.exp((b[:, None, None] * variances.log()).sum(0))),
        "conflation": ((precision * locs).sum(0) / precision.sum(0), b.max() / precision.sum(0)),
    }
    monkeypatch.setattr(combine, "BLOCK_ELEMENTS", 5 * 8)  # blocks of 8 of the 91 columns, the last one of 3
    for rule, (loc, variance) in closed_forms.items():
        fused = fuse(locs, variances, rule, 10 * b)
        assert_close(fused.loc, loc, rtol=1e-12, atol=1e-12)
        assert_close(fused.variance, variance, rtol=1e-12, atol=0)


def test_conflation_of_subnormal_variances_falls_back_to_log_precisions_and_stays_accurate():
    locs = torch.tensor([[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0]])
    variances = torch.tensor([[1e-40, 2e-41], [3e-40, 1e-40], [1.0, 5e-41]])  # 1 / variance overflows float32
    loc, variance = fuse(locs, variances, "conflation")
    precision = 1 / variances.double()
    assert_close(loc.double(), (precision * locs.double()).sum(0) / precision.sum(0), rtol=1e-4, atol=0)
    assert_close(variance.double(), (1 / 3) / (precision / 3).sum(0), rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match=r"locs must be finite, got nan at index \(1, 0\)"):
        fuse(torch.tensor([[0.0, 0.0], [math.nan, 0.0], [0.0, 0.0]]), variances, "conflation")

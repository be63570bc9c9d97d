"""bnpfed.flower: matched posterior fusion (``method = "fusion"``, ``align = "match"``) as a Flower strategy.

As in ``test_flower.py``, with its harness (``flower_harness.py``): the protocol in-process through
:class:`bnpfed.flower.local.LocalGrid` (messages go through Flower's wire format), then one Flower simulation (Ray);
each compares the global posterior, array by array, with
:class:`~bnpfed.federated.matched_fusion.MatchedFusionFederation` run with the same configs and seed.
"""

import re

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")

from flower_harness import (CLIENTS, FRACTION, assert_refused_before_any_node_is_asked,  # noqa: E402
                            assert_same_as_in_process, in_process, matched_arrays, nan_at_0, recording, set_array,
                            simulate, tampered)

from bnpfed.federated.config import FusionConfig  # noqa: E402
from bnpfed.flower.client import app as client_app  # noqa: E402
from bnpfed.flower.local import LocalGrid  # noqa: E402
from bnpfed.flower.server import run_federation  # noqa: E402
from bnpfed.flower.strategies import MatchedFusionStrategy  # noqa: E402

#: Tiny settings: one epoch of a 16-unit Bayesian MLP per client and round, two rounds (the second one from the
#: clients' slices of the global posterior, warm-started).
MATCHED = {"method": "fusion", "align": "match", "rule": "eaa", "rounds": 2, "hidden": "16", "epochs": 1,
           "pooling-samples": 100}


def test_matched_fusion_on_flower_is_the_in_process_federation_bit_for_bit():
    result = run_federation(LocalGrid(client_app, CLIENTS), MATCHED)
    reference = assert_same_as_in_process(result, MATCHED)
    assert result.history[-1]["hidden"] == list(reference.match.widths.values())
    # the clients score the global Bayesian network on their shards: together the test split
    assert [r["evaluated"] for r in result.history] == [[0, 1, 2]] * 2
    assert all(r["test_examples"] == 450 and 0.5 < r["accuracy"] <= 1 for r in result.history)


def test_fixed_later_rounds_on_flower_are_the_in_process_federation_bit_for_bit():
    # round 2: every client trains the whole global posterior, the server fuses it unit by unit (no matching)
    config = {**MATCHED, "rule": "conflation", "experimental": "later-rounds=fixed", "rounds": 3}
    result = run_federation(LocalGrid(client_app, CLIENTS), config)
    reference = assert_same_as_in_process(result, config)
    assert len({tuple(r["hidden"]) for r in result.history}) == 1   # the width of round 1, kept
    assert all(torch.equal(a, torch.arange(a.numel())) for a in reference.match.assignments["1"])


def test_matched_fusion_with_empirical_bayes_priors_on_flower_is_the_in_process_federation_bit_for_bit():
    # round 1: each client's own prior variance per weight matrix; round 2: its slice of the posterior as prior
    # (round-prior "posterior"; by default the configured prior, the test above); every unit fused by the matching
    # model's own atom posterior
    config = {**MATCHED, "prior-variance": "empirical-bayes", "kl-weight": 0.1, "scale-lr-factor": 1.0,
              "rule": "atom-posterior", "experimental": "round-prior=posterior"}
    assert_same_as_in_process(run_federation(LocalGrid(client_app, CLIENTS), config), config)


@pytest.mark.parametrize("laplace_prior", ["marglik", "held-out"])
def test_matched_fusion_of_laplace_clients_on_flower_is_the_in_process_federation_bit_for_bit(laplace_prior):
    # PFNM's training and a diagonal Laplace posterior on each client; round 2 from the slices' means; held-out: each
    # client holds a tenth of its data out (its seeded split) to choose the prior precision
    pytest.importorskip("laplace")
    config = {**MATCHED, "client": "laplace", "rule": "conflation", "laplace-prior": laplace_prior}
    result = run_federation(LocalGrid(client_app, CLIENTS), config)
    assert_same_as_in_process(result, config)
    assert all(0.5 < r["accuracy"] <= 1 for r in result.history)


def test_pvi_rounds_on_flower_are_the_in_process_federation_bit_for_bit():
    # round 2: each client trains against its cavity (sent beside its slice), the server keeps the factors
    config = {**MATCHED, "rule": "pvi", "rounds": 3}
    sent = {}
    result = run_federation(LocalGrid(recording(sent), CLIENTS), config)
    reference = assert_same_as_in_process(result, config)
    assert reference.pvi is not None and sorted(reference.pvi.factors) == [0, 1, 2]
    assert any(k.startswith("cavity-loc/") for k in sent[2, 0]) and not any(k.startswith("cavity-") for k in
                                                                            sent[1, 0])


@pytest.mark.parametrize("temperature", [1.0, "fit"])
def test_pooled_heads_on_flower_are_the_in_process_federation_bit_for_bit(temperature, tmp_path):
    # the server sends the round's clients' own posterior output layers beside the fused body (with "fit" after
    # asking them for their NLL sums of the predictive at every temperature); the clients score the pooled predictive
    # on their shards: together the in-process federation's evaluation of the test split; the output file holds the
    # pooled posterior (bnpfed.load_global gives it back with the in-process predictive)
    from bnpfed.matching import PooledPosterior
    from bnpfed.saved import read_global

    config = {**MATCHED, "rule": "conflation", "heads": "pooled", "partition": "dirichlet",
              "pool-temperature": temperature}
    result = run_federation(LocalGrid(client_app, CLIENTS), {**config, "output-dir": str(tmp_path)})
    reference = assert_same_as_in_process(result, config)
    saved = read_global(tmp_path / "fusion-global.pt")
    assert saved.kind == "pooled-posterior" and saved.method == "match-conflation-pooled"
    assert isinstance(saved.client, PooledPosterior) and saved.client.temperature == reference.pooled.temperature
    x = torch.randn(20, 64)
    torch.testing.assert_close(saved.client.predict_proba(x, num_samples=3, seed=1),
                               reference.pooled.predict_proba(x, num_samples=3, seed=1), rtol=0, atol=1e-6)
    assert reference.method == "match-conflation-pooled" and reference.pooled is not None
    assert result.arrays["heads/weight"].shape == (CLIENTS, 10, reference.match.widths["1"])
    for flower, own in zip(result.history, reference.history):
        assert flower["accuracy"] == own.metrics["accuracy"]
        assert flower["nll"] == pytest.approx(own.metrics["nll"], rel=1e-5)
    fitted = [r["pool_temperature"] for r in result.history]
    assert fitted == [r.metrics["pool_temperature"] for r in reference.history]
    assert (fitted == [1.0, 1.0]) == (temperature == 1.0)
    if temperature == 1.0:
        fused = in_process({**config, "heads": "fused", "pool-temperature": 1.0})
        assert fused.history[-1].metrics["accuracy"] != reference.history[-1].metrics["accuracy"]


def test_each_client_starts_round_two_from_its_slice_or_else_the_whole_posterior_bit_for_bit():
    # re-matched rounds (later-rounds "rematch"; by default every client gets the whole posterior: the test above)
    config = {**MATCHED, **FRACTION, "rule": "pooling", "fraction-evaluate": 0.0,
              "experimental": "later-rounds=rematch"}
    sent = {}
    assert_same_as_in_process(run_federation(LocalGrid(recording(sent), CLIENTS), config), config)
    first = in_process({**config, "rounds": 1})
    assert sorted(sent) == [(1, 1), (1, 2), (2, 0), (2, 2)]
    assert sent[1, 1] == {} and sent[1, 2] == {}  # round 1: each from its own initialisation
    assert first.matched == [1, 2]
    # client 2 was matched in round 1 (second): its slice; client 0 was not: the whole global posterior
    for j, (locs, variances) in ((2, first.match.client_slice(1)), (0, (first.match.locs, first.match.variances))):
        expected = matched_arrays(locs, variances)
        assert sent[2, j].keys() == expected.keys()
        assert all(np.array_equal(sent[2, j][k], v) for k, v in expected.items()), j
    width = first.match.widths["1"]
    assert sent[2, 0]["loc/1.weight"].shape[0] == width > sent[2, 2]["loc/1.weight"].shape[0] == 16


def test_a_bad_posterior_reply_is_rejected_with_its_reason_and_the_round_goes_on(caplog):
    app = tampered({0: set_array("variance/3.weight", nan_at_0),
                    1: set_array("loc/1.weight", lambda w: w[:-1])})   # a unit fewer than it started with
    with caplog.at_level("WARNING", logger="flwr.bnpfed"):
        result = run_federation(LocalGrid(app, CLIENTS), {**MATCHED, "rounds": 1, "fraction-evaluate": 0.0})
    (record,) = result.history
    assert record["clients"] == [2] and record["missing"] == [] and sorted(record["rejected"]) == [0, 1]
    assert re.search(r"'variance/3.weight': expected finite values, got \d+ NaN", record["rejected"][0]), \
        record["rejected"][0]
    assert re.search(r"'loc/1.weight': expected shape \(16, 64\), got \(15, 64\)", record["rejected"][1])
    assert any("rejected" in r.getMessage() and "client 0" in r.getMessage() for r in caplog.records)
    assert all(np.isfinite(a).all() for a in result.arrays.values())


@pytest.mark.parametrize("config, message", [
    ({**{k: v for k, v in MATCHED.items() if k != "hidden"}, "arch": "simple-cnn-bn"},
     r"arch: posterior fusion expected one of .* \(no batch norm"),
    ({**MATCHED, "arch": "lenet"}, r"hidden: expected only with arch='mlp' \(the widths of lenet are fixed\)"),
    # weight-wise fusion too: the rule of bnpfed fuse (FusionFederation), not only of matching
    ({"method": "fusion", "arch": "simple-cnn-bn"}, r"arch: posterior fusion expected one of .* \(no batch norm"),
    ({"method": "fusion", "own-init": True}, r"own-init: expected false, or align=\"match\", on Flower "
                                             r"\(weight-wise fusion from each client's own initialisation.*got true"),
    ({**MATCHED, "align": "nearest"}, r"align: expected one of \['none', 'match'\]"),
    ({**MATCHED, "tau2": 0}, "tau2: expected a positive"),
    ({"method": "fusion", "client": "laplace"}, r"client: Laplace clients serve matched posterior fusion"),
    ({**MATCHED, "rule": "pvi", "client": "laplace"}, r"fusion.rule: 'pvi' trains variational clients"),
    ({"method": "pfnm", "client": "laplace"}, r"client: Laplace clients serve matched posterior fusion"),
    ({**MATCHED, "client": "laplace", "kl-weight": 0.5}, r"kl-weight: a setting of the variational clients' SVI"),
    ({"method": "fusion", "heads": "pooled"}, r"heads: the output layer of matched fusion"),
    ({"method": "fedavg", "heads": "pooled"}, r"heads: the output layer of PFNM's or matched posterior fusion's"),
    ({**MATCHED, "heads": "pooled", "secure-aggregation": True}, r"heads: the output layer of matched posterior "
                                                                 r"fusion in the clear"),
    ({"method": "fusion", "temperature": "fit"}, r"temperature: the predictive temperature of matched fusion"),
    ({**MATCHED, "secure-aggregation": True, "temperature": 0.5}, r"temperature: the predictive temperature of "
                                                                  r"matched posterior fusion's global posterior "
                                                                  r".*secure-aggregation=true"),
    ({**MATCHED, "heads": "pooled", "temperature": 0.5}, r"temperature: the fused output layer's"),
])
def test_what_matched_fusion_on_flower_does_not_run_is_refused_before_any_node_is_asked(config, message):
    assert_refused_before_any_node_is_asked(config, message)


def test_the_strategy_refuses_weight_wise_fusion_and_batch_norm():
    with pytest.raises(ValueError, match="align: MatchedFusionStrategy expected \"match\", got 'none'"):
        MatchedFusionStrategy(FusionConfig(), seed=0)
    from bnpfed.federated.config import NetworkConfig

    with pytest.raises(ValueError, match="arch: matched posterior fusion"):
        MatchedFusionStrategy(FusionConfig(align="match"), seed=0, network=NetworkConfig(arch="simple-cnn-bn"))


@pytest.mark.slow
def test_a_flower_simulation_gives_the_in_process_global_posterior():
    configs = {"all-clients": MATCHED, "fraction": {**MATCHED, **FRACTION, "fraction-evaluate": 0.0}}
    results = simulate(configs)
    assert sorted(results) == sorted(configs)
    for name, config in configs.items():
        assert_same_as_in_process(results[name], config)


@pytest.mark.parametrize("temperature, client", [(0.5, "variational"), ("fit", "variational"), ("fit", "laplace")])
def test_the_fused_predictives_temperature_on_flower_is_the_in_process_federation_bit_for_bit(temperature, client,
                                                                                                tmp_path):
    # with "fit" the server asks the round's clients for their NLL sums of the global posterior's predictive at every
    # temperature (a query, step "posterior-nll": the same sums as in process, so the same temperature), then sends
    # the temperature beside the global posterior for the clients to score the tempered predictive; the output file's
    # global client holds the temperature (a variational one in its likelihood, a Laplace one for its linearised
    # predictive)
    from bnpfed.saved import read_global

    if client == "laplace":
        pytest.importorskip("laplace")
    config = {**MATCHED, "rule": "conflation", "temperature": temperature, "client": client}
    result = run_federation(LocalGrid(client_app, CLIENTS), {**config, "output-dir": str(tmp_path)})
    reference = assert_same_as_in_process(result, config)
    chosen = [r["temperature"] for r in result.history]
    assert chosen == [r.metrics["temperature"] for r in reference.history]
    assert (chosen == [0.5, 0.5]) == (temperature == 0.5)
    saved = read_global(tmp_path / "fusion-global.pt")
    held = saved.client.temperature if client == "laplace" else saved.client.bnn.likelihood.temperature
    assert held == chosen[-1] and saved.kind == ("laplace" if client == "laplace" else "bayesian")
    x = torch.randn(20, 64)
    torch.testing.assert_close(saved.client.predict_proba(x, num_samples=3, seed=1),
                               reference.global_model.predict_proba(x, num_samples=3, seed=1), rtol=0, atol=1e-6)

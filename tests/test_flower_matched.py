"""bnpfed.flower: matched posterior fusion (``method = "fusion"``, ``align = "match"``) as a Flower strategy.

As in ``test_flower.py``: the protocol in-process through :class:`bnpfed.flower.local.LocalGrid` (messages go through
Flower's wire format), then one Flower simulation (Ray); each compares the global posterior, array by array, with
:class:`~bnpfed.federated.matched_fusion.MatchedFusionFederation` run with the same configs and seed.
"""

import functools
import re

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")

from flwr.app import Array, MessageType  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402

from bnpfed.data import load_dataset  # noqa: E402
from bnpfed.federated.config import FusionConfig  # noqa: E402
from bnpfed.federated.matched_fusion import MatchedFusionFederation  # noqa: E402
from bnpfed.flower.client import app as client_app  # noqa: E402
from bnpfed.flower.config import parse_run_config  # noqa: E402
from bnpfed.flower.local import LocalGrid  # noqa: E402
from bnpfed.flower.records import from_array_record, matched_posterior_to_record  # noqa: E402
from bnpfed.flower.server import run_federation  # noqa: E402
from bnpfed.flower.strategies import MatchedFusionStrategy  # noqa: E402

CLIENTS = 3
#: Tiny settings: one epoch of a 16-unit Bayesian MLP per client and round, two rounds (the second one from the
#: clients' slices of the global posterior, warm-started).
MATCHED = {"method": "fusion", "align": "match", "rule": "eaa", "rounds": 2, "hidden": "16", "epochs": 1,
           "pooling-samples": 100}
#: Two of the three clients a round; with seed 1 round 1 trains [1, 2] and round 2 [0, 2], so in round 2 client 0,
#: which was not matched, starts from the whole global posterior and client 2 from its slice.
FRACTION = {"fraction": 0.67, "seed": 1}


@functools.lru_cache(maxsize=None)
def _reference(items: tuple) -> MatchedFusionFederation:
    config = dict(items)
    settings = parse_run_config(config).with_clients(CLIENTS)
    run = settings.run
    ds = load_dataset(run.dataset, standardize=run.standardized)
    parts = settings.partition.split(ds.y_train.numpy(), run.seed)
    federation = MatchedFusionFederation(ds, parts, network=settings.network, training=settings.training,
                                         bayesian=settings.bayesian, fusion=settings.fusion, seed=run.seed,
                                         predictive_samples=run.predictive_samples)
    federation.run(run.rounds)
    return federation


def in_process(config: dict) -> MatchedFusionFederation:
    """The in-process federation with the settings of the run config ``config``, after its rounds."""
    return _reference(tuple(sorted(config.items())))


def as_arrays(locs, variances) -> dict[str, np.ndarray]:
    return from_array_record(matched_posterior_to_record(locs, variances))


def assert_same_posterior(arrays: dict, federation: MatchedFusionFederation) -> None:
    expected = as_arrays(federation.match.locs, federation.match.variances)
    assert sorted(arrays) == sorted(expected)
    for key, value in expected.items():
        assert arrays[key].dtype == value.dtype, key
        assert np.array_equal(arrays[key], value), key


def assert_same_rounds(history: list, federation: MatchedFusionFederation) -> None:
    assert [r["sampled"] for r in history] == [r.sampled for r in federation.history]
    assert [r["clients"] for r in history] == [r.sampled for r in federation.history]
    assert [r["hidden"] for r in history] == [r.metrics["hidden"] for r in federation.history]
    assert [r["mean_sigma"] for r in history] == [r.metrics["mean_sigma"] for r in federation.history]


def test_matched_fusion_on_flower_is_the_in_process_federation_bit_for_bit():
    result = run_federation(LocalGrid(client_app, CLIENTS), MATCHED)
    reference = in_process(MATCHED)
    assert_same_posterior(result.arrays, reference)
    assert_same_rounds(result.history, reference)
    assert result.history[-1]["hidden"] == list(reference.match.widths.values())
    # the clients score the global Bayesian network on their shards: together the test split
    assert [r["evaluated"] for r in result.history] == [[0, 1, 2]] * 2
    assert all(r["test_examples"] == 450 and 0.5 < r["accuracy"] <= 1 for r in result.history)


def test_each_client_starts_round_two_from_its_slice_or_else_the_whole_posterior_bit_for_bit():
    config = {**MATCHED, **FRACTION, "rule": "pooling", "fraction-evaluate": 0.0}
    sent = {}

    def recording(msg, context):
        if msg.metadata.message_type == MessageType.TRAIN:
            round_ = msg.content.config_records["config"]["server-round"]
            sent[round_, context.node_config["partition-id"]] = from_array_record(msg.content.array_records["arrays"])
        return client_app(msg, context)

    result = run_federation(LocalGrid(recording, CLIENTS), config)
    reference = in_process(config)
    assert_same_posterior(result.arrays, reference)
    assert_same_rounds(result.history, reference)
    first = in_process({**config, "rounds": 1})
    assert sorted(sent) == [(1, 1), (1, 2), (2, 0), (2, 2)]
    assert sent[1, 1] == {} and sent[1, 2] == {}  # round 1: each from its own initialisation
    assert first.matched == [1, 2]
    # client 2 was matched in round 1 (second): its slice; client 0 was not: the whole global posterior
    for j, (locs, variances) in ((2, first.match.client_slice(1)), (0, (first.match.locs, first.match.variances))):
        expected = as_arrays(locs, variances)
        assert sent[2, j].keys() == expected.keys()
        assert all(np.array_equal(sent[2, j][k], v) for k, v in expected.items()), j
    width = first.match.widths["1"]
    assert sent[2, 0]["loc/1.weight"].shape[0] == width > sent[2, 2]["loc/1.weight"].shape[0] == 16


def tampered(tampers: dict):
    """The ClientApp, except that the train replies of the partitions in ``tampers`` go through their
    ``tamper(arrays)``."""

    def app(msg, context):
        reply = client_app(msg, context)
        tamper = tampers.get(context.node_config["partition-id"])
        if tamper is not None and msg.metadata.message_type == MessageType.TRAIN:
            tamper(reply.content.array_records["arrays"])
        return reply

    return app


def set_array(key, change):
    def tamper(arrays):
        arrays[key] = Array(np.ascontiguousarray(change(arrays[key].numpy().copy())))
    return tamper


def nan_at_0(x):
    x.flat[0] = np.nan
    return x


def test_a_bad_posterior_reply_is_rejected_with_its_reason_and_the_round_goes_on(caplog):
    app = tampered({0: set_array("variance/3.weight", nan_at_0),
                    1: set_array("loc/1.weight", lambda w: w[:-1])})   # a unit fewer than it started with
    with caplog.at_level("WARNING", logger="flwr.bnpfed"):
        result = run_federation(LocalGrid(app, CLIENTS), {**MATCHED, "rounds": 1, "fraction-evaluate": 0.0})
    (record,) = result.history
    assert record["clients"] == [2] and record["missing"] == [] and sorted(record["rejected"]) == [0, 1]
    assert re.search(r"'variance/3.weight': contains NaN", record["rejected"][0]), record["rejected"][0]
    assert re.search(r"'loc/1.weight': expected shape \(16, 64\), got \(15, 64\)", record["rejected"][1])
    assert any("rejected" in r.getMessage() and "client 0" in r.getMessage() for r in caplog.records)
    assert all(np.isfinite(a).all() for a in result.arrays.values())


@pytest.mark.parametrize("config, message", [
    ({**MATCHED, "arch": "simple-cnn-bn"}, r"arch: matched posterior fusion \(align=\"match\"\) expected a network "
                                            r"without batch norm"),
    ({"method": "fusion", "own-init": True}, "own-init: weight-wise fusion from each client's own initialisation"),
    ({**MATCHED, "align": "nearest"}, r"align: expected one of \['none', 'match'\]"),
    ({**MATCHED, "tau2": 0}, "tau2: expected a positive"),
])
def test_what_matched_fusion_on_flower_does_not_run_is_refused_before_any_node_is_asked(config, message):
    grid = LocalGrid(client_app, CLIENTS)
    with pytest.raises(ValueError, match=message):
        run_federation(grid, config)
    assert grid.calls == []


def test_the_strategy_refuses_weight_wise_fusion_and_batch_norm():
    with pytest.raises(ValueError, match="align: MatchedFusionStrategy expected \"match\", got 'none'"):
        MatchedFusionStrategy(FusionConfig(), seed=0)
    from bnpfed.federated.config import NetworkConfig

    with pytest.raises(ValueError, match="arch: matched posterior fusion"):
        MatchedFusionStrategy(FusionConfig(align="match"), seed=0, network=NetworkConfig(arch="simple-cnn-bn"))


@pytest.mark.slow
def test_a_flower_simulation_gives_the_in_process_global_posterior(monkeypatch):
    from flwr.simulation import run_simulation

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    configs = {"all-clients": MATCHED, "fraction": {**MATCHED, **FRACTION, "fraction-evaluate": 0.0}}
    results = {}
    server_app = ServerApp()

    @server_app.main()
    def every_case(grid, context):  # one Ray start for both
        for name, config in configs.items():
            results[name] = run_federation(grid, config)

    run_simulation(server_app, client_app, num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    assert sorted(results) == sorted(configs)
    for name, config in configs.items():
        assert_same_posterior(results[name].arrays, in_process(config))
        assert_same_rounds(results[name].history, in_process(config))

"""Weight-wise posterior fusion under secure aggregation (SecAgg+) on Flower: the server sees sums and counts, and
the global posterior is the plain run's within the quantisation tolerance; clients that drop out mid-protocol are
left out and the rest renormalised; too few left fails the round with a message saying so.

Runs on the in-process grid (bnpfed.flower.local.LocalGrid): every SecAgg+ stage is a real Flower message through
Flower's own SecAggPlusWorkflow and secaggplus_mod.
"""

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")

from flower_harness import CLIENTS, assert_refused_before_any_node_is_asked, raise_error, tampered  # noqa: E402
from flwr.app import MessageType  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402

from bnpfed.combine import fuse  # noqa: E402
from bnpfed.flower.client import app as client_app  # noqa: E402
from bnpfed.flower.local import LocalGrid  # noqa: E402
from bnpfed.flower.records import from_array_record  # noqa: E402
from bnpfed.flower.secure import POSTERIOR_STATE  # noqa: E402
from bnpfed.flower.server import run_federation  # noqa: E402
from bnpfed.combine.secure import SECURE_RULES  # noqa: E402

FUSION = {"method": "fusion", "rounds": 2, "hidden": "16", "epochs": 1, "fraction-evaluate": 0.0}
SECURE = {"secure-aggregation": True}
#: Relative tolerance of the secure run against the plain one: float32 rounding of the global model, carried through
#: a round of training (the quantisation bound is 1.8e-13 of the global posterior's standard deviation, or of a
#: variance ratio, with 3 clients).
RTOL = 1e-5


def assert_close_to_plain(secure, plain):
    assert sorted(secure.arrays) == sorted(plain.arrays)
    for key, expected in plain.arrays.items():
        got = secure.arrays[key]
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=RTOL * scale, err_msg=key)


def at_stage(stage: str, partitions, app=client_app):
    """``app``, except that the clients of ``partitions`` fail the SecAgg+ stage ``stage`` (a node that goes away
    mid-protocol)."""
    def failing(msg, context):
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if (configs is not None and configs.get(Key.STAGE) == stage
                and context.node_config["partition-id"] in partitions):
            raise RuntimeError("the node went away")
        return app(msg, context)
    return failing


@pytest.mark.parametrize("rule", SECURE_RULES)
def test_under_secure_aggregation_the_global_posterior_is_the_plain_runs(rule):
    config = {**FUSION, "rule": rule}
    plain = run_federation(LocalGrid(client_app, CLIENTS), config)
    secure = run_federation(LocalGrid(client_app, CLIENTS), {**config, **SECURE})
    assert_close_to_plain(secure, plain)
    for record in secure.history:
        assert record["secure_clients"] == [0, 1, 2] and record["secure_failures"] == []
        assert 0 < record["quantisation_bound"] < 1e-12
        assert record["weights"] == plain.history[record["round"] - 1]["weights"]


def test_the_server_receives_counts_and_masked_vectors_never_a_posterior():
    replies = []

    def recording(msg, context):
        reply = client_app(msg, context)
        if msg.metadata.message_type == MessageType.TRAIN:
            replies.append(reply.content)
        return reply

    run_federation(LocalGrid(recording, CLIENTS), {**FUSION, **SECURE, "rounds": 1})
    assert all(len(array_record) == 0 for content in replies for array_record in content.array_records.values())
    stages = [content.config_records[RECORD_KEY_CONFIGS] for content in replies
              if RECORD_KEY_CONFIGS in content.config_records]
    assert len(stages) == 4 * CLIENTS          # the four stages of SecAgg+, from every client
    masked = [np.frombuffer(b, dtype=np.uint8) for configs in stages for b in configs.get(Key.MASKED_PARAMETERS, [])]
    assert len(masked) >= CLIENTS      # one masked vector per client (and array), bytes of uniform-looking integers
    assert all(chunk.std() > 60 for chunk in masked if chunk.size > 1000)   # uniform bytes: std 73.9


def test_a_client_that_drops_out_mid_protocol_is_left_out_and_the_rest_renormalised():
    # client 1 trains, is counted, then goes away before sending its masked vector: SecAgg+ unmasks the sum of the
    # other two, and the global posterior is the plain fusion of clients 0 and 2 (client 1 failing every round)
    config = {**FUSION, "rule": "conflation"}
    secure = run_federation(LocalGrid(at_stage(Stage.COLLECT_MASKED_VECTORS, {1}), CLIENTS), {**config, **SECURE})
    plain = run_federation(LocalGrid(tampered({1: raise_error}), CLIENTS), config)
    assert [r["secure_clients"] for r in secure.history] == [[0, 2], [0, 2]]
    assert all(len(r["secure_failures"]) == 1 and "went away" in r["secure_failures"][0] for r in secure.history)
    assert_close_to_plain(secure, plain)


def test_too_few_clients_left_fails_the_round_naming_the_threshold():
    app = at_stage(Stage.COLLECT_MASKED_VECTORS, {0, 1})
    with pytest.raises(RuntimeError, match=r"round 1: secure aggregation halted: fewer clients remained than its "
                                           r"reconstruction threshold \(secagg-threshold=0.5"):
        run_federation(LocalGrid(app, CLIENTS), {**FUSION, **SECURE})


def test_a_statistic_that_would_be_clipped_fails_the_client_naming_the_range():
    with pytest.raises(RuntimeError, match=r"secagg-clipping-range: expected at least .* to hold statistic "
                                           r"'precision/1.weight' of this client"):
        run_federation(LocalGrid(client_app, CLIENTS), {**FUSION, **SECURE, "secagg-clipping-range": 2.0 ** -7})


def test_matched_fusion_matches_in_the_clear_once_then_fuses_the_aligned_posteriors_under_secagg():
    # the documented compromise: round 1 is matched fusion's round (units in the clear), rounds 2-3 are secure
    # weight-wise rounds at the matched widths, every client starting from the whole matched global posterior
    config = {**FUSION, "align": "match", "rule": "conflation", "rounds": 3}
    grid = LocalGrid(client_app, CLIENTS)
    secure = run_federation(grid, {**config, **SECURE})
    matched = run_federation(LocalGrid(client_app, CLIENTS), {**config, "rounds": 1})
    first = secure.history[0]
    assert first["hidden"] == matched.history[0]["hidden"] and "secure_clients" not in first
    assert [r["hidden"] for r in secure.history] == [first["hidden"]] * 3     # the assignment fixed after round 1
    assert [r["secure_clients"] for r in secure.history[1:]] == [[0, 1, 2], [0, 1, 2]]
    # the last round's global posterior is the rule over the posteriors the clients kept to themselves
    kept = [from_array_record(grid.contexts[grid.node_of[j]].state.array_records[POSTERIOR_STATE])
            for j in range(CLIENTS)]
    counts = secure.history[-1]["num_examples"]
    for key in (k for k in secure.arrays if k.startswith("loc/")):
        site = key.partition("/")[2]
        expected = fuse(np.stack([p[key] for p in kept]), np.stack([p[f"variance/{site}"] for p in kept]),
                        "conflation", weights=counts)
        np.testing.assert_allclose(secure.arrays[key], expected.loc.numpy(), rtol=RTOL,
                                   atol=RTOL * expected.loc.abs().max().item())
        np.testing.assert_allclose(secure.arrays[f"variance/{site}"], expected.variance.numpy(), rtol=RTOL)
    assert secure.arrays["loc/1.weight"].shape[0] == first["hidden"][0]


@pytest.mark.parametrize("config, message", [
    ({**FUSION, **SECURE, "rule": "pooling"}, r"rule: expected one of \['eaa', 'gaa', 'log_variance', 'conflation'\] "
                                             r"with secure-aggregation \(pooling draws"),
    ({"method": "pfnm", **SECURE}, r"secure-aggregation: expected method=\"fusion\" \(weight-wise posterior fusion "
                                   r"needs only sums over clients; with align=\"match\" round 1 matches in the clear"),
    ({**FUSION, "secagg-clipping-range": 8.0}, r"secagg-clipping-range: applies only with secure-aggregation = true"),
    ({**FUSION, **SECURE, "secagg-threshold": 0.0}, r"secagg-threshold: expected"),
    ({**FUSION, **SECURE, "secagg-clipping-range": 1000.0}, r"secagg-clipping-range: expected a power of two"),
])
def test_what_secure_aggregation_does_not_run_is_refused_before_any_node_is_asked(config, message):
    assert_refused_before_any_node_is_asked(config, message)


def test_bnpfed_flower_sim_runs_it_and_says_so(capsys):
    from bnpfed.cli import main

    assert main(["flower", "sim", "--local", "--supernodes", "3", "--run-config",
                 'method="fusion" rule="eaa" rounds=1 hidden="16" epochs=1 secure-aggregation=true']) == 0
    out = capsys.readouterr().out
    assert "bnpfed fusion on Flower (in-process grid, under SecAgg+): 3 clients" in out
    assert "accuracy" in out

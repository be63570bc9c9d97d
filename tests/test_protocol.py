"""A federated method in one file (bnpfed.federated.protocol): a client step, a server step and one registration run
in process, in run_experiment, on the commands' --methods and on Flower, the same global model everywhere. The method
here is FedAvg written as such a method (its clients counting the rounds they trained, in their own state): it must
give the built-in FedAvg's global model bit for bit, which checks the generic loop's sampling, seeding and weights."""

from __future__ import annotations

import json

import pytest
import torch

from registries import restored_registries

from bnpfed.cli import main
from bnpfed.combine import average_deterministic
from bnpfed.data import load_dataset
from bnpfed.federated import (ClientUpdate, ExperimentConfig, FederatedMethod, FedAvgFederation, MethodFederation,
                              NetworkConfig, PartitionConfig, ServerUpdate, TrainingConfig, available_federated_methods,
                              available_methods, federated_method, register_federated_method, run_experiment,
                              train_network, unregister_federated_method)

NAME = "counting-average"


class CountingAverage(FederatedMethod):
    """FedAvg as a method of the protocol; each client counts the rounds it trained (its own state) and reports it."""

    def client_step(self, task):
        net = train_network(task.network, task.x, task.y, task.training, seed=task.seed, round=task.round,
                            client=task.client)
        times = task.client_state.get("times", torch.tensor(0)) + 1
        return ClientUpdate({k: v.detach() for k, v in net.state_dict().items()}, client_state={"times": times},
                            metrics={"times_trained": float(times)})

    def server_step(self, task):
        rounds = task.server_state.get("rounds", torch.tensor(0)) + 1
        return ServerUpdate({k: average_deterministic([u[k] for u in task.updates], list(task.weights))
                             for k in task.state}, server_state={"rounds": rounds},
                            metrics={"server_rounds": float(rounds)})


class Broken(CountingAverage):
    """Returns what ``change`` makes of the honest client update."""

    def __init__(self, change):
        self.change = change

    def client_step(self, task):
        return self.change(super().client_step(task))


@pytest.fixture
def counting():
    with restored_registries():
        register_federated_method(NAME, CountingAverage())
        yield NAME


@pytest.fixture(scope="module")
def data():
    ds = load_dataset("digits")
    return ds, PartitionConfig(clients=3, partition="dirichlet", alpha=0.5).split(ds.y_train.numpy(), seed=1)


NETWORK, TRAINING = NetworkConfig(hidden=(16,)), TrainingConfig(epochs=1)


def test_fedavg_written_as_a_federated_method_is_the_built_in_fedavg_bit_for_bit(counting, data):
    ds, parts = data
    method = MethodFederation(ds, parts, method=counting, network=NETWORK, training=TRAINING, seed=1, fraction=0.67)
    fedavg = FedAvgFederation(ds, parts, network=NETWORK, training=TRAINING, seed=1, fraction=0.67)
    method.run(3)
    fedavg.run(3)
    assert [r.sampled for r in method.history] == [r.sampled for r in fedavg.history] == [[1, 2], [0, 2], [1, 2]]
    assert [r.weights for r in method.history] == [r.weights for r in fedavg.history]
    state = fedavg.global_model.net.state_dict()
    assert sorted(method.global_state) == sorted(state)
    for key, value in state.items():
        assert torch.equal(method.global_state[key], value), key
    assert [r.metrics["accuracy"] for r in method.history] == [r.metrics["accuracy"] for r in fedavg.history]


def test_each_client_keeps_its_state_from_the_last_round_it_trained_and_the_server_its_own(counting, data):
    ds, parts = data
    federation = MethodFederation(ds, parts, method=counting, network=NETWORK, training=TRAINING, seed=1,
                                  fraction=0.67)
    federation.run(3)   # rounds train [1, 2], [0, 2], [1, 2]
    assert {j: int(s["times"]) for j, s in federation.client_states.items()} == {0: 1, 1: 2, 2: 3}
    assert [r.metrics["times_trained"] for r in federation.history] == [1.0, 1.5, 2.5]   # means over the round
    assert [r.metrics["server_rounds"] for r in federation.history] == [1.0, 2.0, 3.0]


def drop_key(update):
    update.update.pop("1.bias")
    return update


def nan_at_0(update):
    update.update["1.weight"][0, 0] = float("nan")
    return update


@pytest.mark.parametrize("change, message", [
    (lambda u: {"not": "an update"}, r"Broken.client_step: expected a ClientUpdate, got dict"),
    (drop_key, r"Broken.client_step update: expected exactly the entries .* missing \['1.bias'\]"),
    (lambda u: ClientUpdate({**u.update, "1.weight": u.update["1.weight"][:, :3]}),
     r"Broken.client_step update\['1.weight'\]: expected shape \(16, 64\) and dtype torch.float32, got shape "
     r"\(16, 3\)"),
    (lambda u: ClientUpdate({**u.update, "1.bias": u.update["1.bias"].double()}),
     r"update\['1.bias'\]: expected shape \(16,\) and dtype torch.float32, got shape \(16,\) and dtype torch.float64"),
    (nan_at_0, r"update\['1.weight'\]: expected finite values, got 1 NaN or infinite"),
    (lambda u: ClientUpdate(u.update, metrics={"num-examples": 3}), r"metric names \(strings other than"),
    (lambda u: ClientUpdate(u.update, client_state={"times": 3}), r"client_state: expected a dict of name -> tensor"),
])
def test_a_step_that_returns_something_malformed_is_named(data, change, message):
    ds, parts = data
    with restored_registries():
        register_federated_method("broken", Broken(change))
        federation = MethodFederation(ds, parts, method="broken", network=NETWORK, training=TRAINING, seed=1)
        with pytest.raises(ValueError, match=message):
            federation.run_round()


def test_a_server_step_must_keep_the_states_layout(data):
    class Growing(CountingAverage):
        def server_step(self, task):
            return ServerUpdate({**task.state, "extra": torch.zeros(1)})

    ds, parts = data
    with restored_registries():
        register_federated_method("growing", Growing())
        federation = MethodFederation(ds, parts, method="growing", network=NETWORK, training=TRAINING, seed=1)
        with pytest.raises(ValueError, match=r"Growing.server_step state: expected exactly the entries .* extra "
                                             r"\['extra'\]"):
            federation.run_round()


def test_registration_checks_its_arguments_and_undoes_cleanly():
    with restored_registries():
        with pytest.raises(ValueError, match="name: expected a non-empty method name without commas"):
            register_federated_method("a,b", CountingAverage())
        with pytest.raises(ValueError, match="method: expected a bnpfed.federated.FederatedMethod"):
            register_federated_method("x", CountingAverage)
        for taken in ("pfnm", "eaa"):   # a method's or a fusion rule's name already
            with pytest.raises(ValueError, match="name: expected a method name not registered yet"):
                register_federated_method(taken, CountingAverage())
        method = register_federated_method(NAME, CountingAverage())
        assert federated_method(NAME) is method and NAME in available_methods()
        assert unregister_federated_method(NAME) is method
        assert NAME not in available_methods() and NAME not in available_federated_methods()
        with pytest.raises(ValueError, match="method: expected a registered federated method"):
            federated_method(NAME)
        with pytest.raises(ValueError, match="name: expected a registered federated method"):
            unregister_federated_method(NAME)


def test_run_experiment_runs_a_federated_method_as_one_row_of_its_table(counting, data):
    ds, _ = data
    result = run_experiment(ds, partition=PartitionConfig(clients=3), network=NETWORK, training=TRAINING,
                            config=ExperimentConfig(methods=(counting, "fedavg"), rounds=2, seed=0))
    row, fedavg = result.row(counting), result.row("fedavg")
    assert (row.rounds, row.hidden, row.parameters) == (2, [16], fedavg.parameters)
    assert row.accuracy == fedavg.accuracy and len(row.history) == 2
    assert counting in result.global_models


def test_the_pfnm_commands_methods_flag_takes_a_registered_federated_method(counting, tmp_path):
    out = tmp_path / "out.json"
    assert main(["pfnm", "--methods", f"{counting},fedavg", "--clients", "3", "--hidden", "16", "--epochs", "1",
                 "--rounds", "2", "--no-progress", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["runs"][0]["rows"]
    assert [r["method"] for r in rows] == [counting, "fedavg"]
    assert rows[0]["accuracy"] == rows[1]["accuracy"]


# ------------------------------------------------------------------------------------------------ Flower


def test_on_flower_a_federated_method_is_the_in_process_federation_bit_for_bit(counting):
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import CLIENTS, FRACTION, assert_same_as_in_process

    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    config = {"method": counting, "rounds": 3, "epochs": 1, "hidden": "16", **FRACTION}
    result = run_federation(LocalGrid(client_app, CLIENTS), config)
    reference = assert_same_as_in_process(result, config)
    # the clients' own state lives in their nodes' context.state; the server's in the strategy
    for key in ("times_trained", "server_rounds", "accuracy"):
        assert [r[key] for r in result.history] == [r.metrics[key] for r in reference.history], key


def test_on_flower_a_malformed_update_is_rejected_with_its_reason_and_the_round_goes_on(counting, caplog):
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import CLIENTS, nan_at_0 as nan_array, set_array, tampered

    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    grid = LocalGrid(tampered({1: set_array("1.weight", nan_array), 2: set_array("1.bias", lambda b: b[:3])}),
                     CLIENTS)
    result = run_federation(grid, {"method": counting, "rounds": 1, "epochs": 1, "hidden": "16"})
    (record,) = result.history
    assert record["clients"] == [0]
    assert "update['1.weight']: expected finite values" in record["rejected"][1]
    assert "update['1.bias']: expected shape (16,) and dtype torch.float32, got shape (3,)" in record["rejected"][2]


def test_on_flower_the_global_network_of_a_federated_method_is_written_as_bnpfed_loads_it(counting, tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import CLIENTS

    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation
    from bnpfed.saved import load_global

    result = run_federation(LocalGrid(client_app, CLIENTS), {"method": counting, "rounds": 1, "epochs": 1,
                                                             "hidden": "16", "output-dir": str(tmp_path)})
    net = load_global(tmp_path / f"{counting}-global.pt")
    for key, value in net.state_dict().items():
        assert torch.equal(value, torch.from_numpy(result.arrays[key])), key
    summary = json.loads((tmp_path / f"{counting}-summary.json").read_text())
    assert summary["settings"]["run"]["method"] == counting


def test_on_flower_an_unknown_method_is_refused_before_any_node_is_asked():
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import assert_refused_before_any_node_is_asked

    assert_refused_before_any_node_is_asked({"method": "no-such-method"},
                                            r"method: expected one of \['pfnm', 'fusion', 'fedavg'.*got 'no-such")

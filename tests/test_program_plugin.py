"""A Pyro user's program by name: register_program, the plugin examples/pyro_program.py, bnpfed fuse --program and
the Flower key program, which gives the in-process federation's global posterior bit for bit."""

import json

import pytest
from pyro.infer.autoguide import AutoNormal
from torch import nn

from bnpfed.combine import available_rules
from bnpfed.cli import main
from bnpfed.federated import BayesianConfig
from bnpfed.models import available_programs, build_program, register_program, unregister_program
from registries import restored_registries
from test_program_federation import Net, regression_program

PLUGIN = "examples.pyro_program"


def test_a_registered_program_is_a_name_in_a_config_and_is_refused_when_unknown():
    before = available_programs()
    with restored_registries([PLUGIN]):
        __import__(PLUGIN)
        assert "digits-net" in available_programs()
        model, guide = BayesianConfig(program="digits-net").build_program()
        assert type(model).__name__ == "Net" and guide is None
        with pytest.raises(ValueError, match="name: expected a program name not registered yet"):
            register_program("digits-net", Net)
        with pytest.raises(ValueError, match="factory: expected a callable"):
            register_program("other", 3)
        register_program("pair", lambda: (regression_program, AutoNormal(regression_program)))
        assert build_program("pair")[0] is regression_program
        assert unregister_program("pair") is not None
        with pytest.raises(ValueError, match="program: expected the factory to return a fresh Pyro program"):
            build_program(lambda: nn.Linear(2, 2))
        with pytest.raises(ValueError, match="program: expected a factory that takes no arguments"):
            build_program(regression_program)
    assert available_programs() == before   # what the plugin and the test registered is undone


def test_bnpfed_fuse_runs_a_programs_clients_by_every_rule_from_the_plugin(tmp_path):
    out = tmp_path / "out.json"
    with restored_registries([PLUGIN]):
        assert main(["fuse", "--plugin", PLUGIN, "--program", "digits-net", "--rule", "all", "--clients", "3",
                     "--epochs", "5", "--lr", "0.01", "--no-progress", "--json", str(out)]) == 0
        rules = available_rules()
    record = json.loads(out.read_text())
    rows = record["results"]["runs"][0]["rows"]
    assert [r["method"] for r in rows] == rules   # no FedAvg row: a program is no network
    assert all(r["accuracy"] > 0.2 for r in rows), [(r["method"], r["accuracy"]) for r in rows]
    assert record["settings"]["bayesian"]["program"] == "digits-net"


def test_bnpfed_fuse_refuses_what_does_not_apply_to_a_program_before_training(capsys):
    with restored_registries([PLUGIN]):
        for flags, message in ((["--hidden", "16"], "--hidden: a setting of the network that a Pyro program"),
                               (["--align", "match"], "align: matched fusion lines up"),
                               (["--save-global", "out"], "--save-global: writes a global network"),
                               (["--prior", "all"], "--prior: a setting of a network's clients")):
            assert main(["fuse", "--plugin", PLUGIN, "--program", "digits-net", "--epochs", "1", "--no-progress",
                         *flags]) == 2, flags
            assert message in capsys.readouterr().err, flags


def test_the_flower_app_federates_the_program_from_the_plugins_key_as_in_process():
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import CLIENTS, FRACTION, assert_same_as_in_process
    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    config = {"method": "fusion", "rule": "conflation", "program": "digits-net", "plugins": PLUGIN, "rounds": 2,
              "epochs": 2, "lr": 0.01, **FRACTION}
    with restored_registries([PLUGIN]):
        result = run_federation(LocalGrid(client_app, CLIENTS), config)
        assert result.settings.bayesian.program == "digits-net"
        assert "loc/tau" in result.arrays
        reference = assert_same_as_in_process(result, config)   # the global posterior, bit for bit
        assert reference.history[-1].metrics["accuracy"] > 0.2


def test_a_flower_run_of_a_program_writes_its_arrays_and_says_that_no_network_file_is_written(tmp_path, caplog):
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import CLIENTS

    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    config = {"method": "fusion", "program": "digits-net", "plugins": PLUGIN, "rounds": 1, "epochs": 1,
              "output-dir": str(tmp_path)}
    with restored_registries([PLUGIN]):
        run_federation(LocalGrid(client_app, CLIENTS), config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fusion-global.npz", "fusion-summary.json"]
    assert "saved as its arrays only" in caplog.text
    summary = json.loads((tmp_path / "fusion-summary.json").read_text())
    assert summary["settings"]["bayesian"]["program"] == "digits-net"

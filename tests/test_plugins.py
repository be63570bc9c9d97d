"""Plugins reach every command and the Flower apps with no file of bnpfed changed: a user's module (written here under
``tmp_path``) registers a fusion rule, a prior and a likelihood; ``bnpfed fuse --plugin MODULE --rule NAME`` runs
them, the Flower app runs them with the run config key ``plugins``, and the entry points of the group
``bnpfed.plugins`` are loaded with no flag at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from registries import restored_registries

from bnpfed.cli import build_parser, main, plugin_modules
from bnpfed.combine import available_rules
from bnpfed.federated import BayesianConfig
from bnpfed.models import available_likelihoods, available_priors, build_prior
from bnpfed.plugins import ENTRY_POINT_GROUP, PluginError, load_entry_points, load_plugins, plugin_names

ROOT = Path(__file__).resolve().parents[1]

#: A user's plugin: a fusion rule (every coordinate from the client of largest weight), a prior (N(0, (3 scale)^2) on
#: the linear weights, with no empirical-Bayes form) and a likelihood (a tempered categorical), each with its
#: registration line, nothing else.
PLUGIN = '''
import pyro.distributions as dist

from bnpfed.combine import register_rule
from bnpfed.models import Categorical, only_linear_weights, register_likelihood, register_prior


def heaviest(locs, variances, weights, *, num_samples, generator):
    k = int(weights.argmax())
    return locs[k], variances[k]


def wide(scale, variance):
    if variance != "fixed":
        raise ValueError(f"prior_variance: the wide prior is fixed only, got {variance!r}")
    return only_linear_weights(dist.Normal(0.0, 3.0 * scale))


register_rule("heaviest", heaviest)
register_prior("wide", wide)
register_likelihood("cold", lambda: Categorical(temperature=0.5))
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The name of a fresh plugin module (importable from ``tmp_path``); what it registers is undone afterwards."""
    name = f"bnpfed_test_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with restored_registries([name]):
        yield name


# ------------------------------------------------------------------------------------------------ loading


def test_a_plugin_module_registers_when_loaded_and_not_before(plugin):
    assert "heaviest" not in available_rules()
    assert load_plugins([plugin]) == [plugin]
    assert "heaviest" in available_rules() and "wide" in available_priors() and "cold" in available_likelihoods()
    assert load_plugins(f" {plugin} , {plugin}") == [plugin]   # a run config's string; imported once
    config = BayesianConfig(prior="wide", prior_scale=0.5, likelihood="cold")
    linear = torch.nn.Linear(2, 3)
    assert config.build_prior().distribution("weight", linear, linear.weight).scale == pytest.approx(1.5)
    assert config.build_likelihood().temperature == 0.5


def test_a_plugin_prior_without_an_empirical_bayes_form_is_refused_before_any_work(plugin):
    load_plugins([plugin])
    with pytest.raises(ValueError, match="prior_variance: the wide prior is fixed only"):
        BayesianConfig(prior="wide", prior_variance="empirical-bayes")


@pytest.mark.parametrize("source, message", [
    (None, r"plugin '{name}': cannot import it \(ModuleNotFoundError: .*\) \(install it, or put its folder on "
           r"PYTHONPATH"),
    ("import bnpfed_no_such_dependency\n", r"plugin '{name}': cannot import it \(ModuleNotFoundError: No module "
                                           r"named 'bnpfed_no_such_dependency'\)$"),
    ("raise RuntimeError('no GPU here')\n", r"plugin '{name}': cannot import it \(RuntimeError: no GPU here\)"),
])
def test_a_plugin_that_cannot_be_imported_is_named_with_why(tmp_path, monkeypatch, source, message):
    name = f"bnpfed_test_broken_{uuid.uuid4().hex[:8]}"
    if source is not None:
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with restored_registries([name]), pytest.raises(PluginError, match=message.format(name=name)):
        load_plugins([name])


def test_a_path_is_not_a_module_name():
    with pytest.raises(PluginError, match="expected a module name .* not a path"):
        load_plugins(["plugins/my_rules.py"])
    with pytest.raises(PluginError, match="expected module names"):
        plugin_names(["ok", 3])


def test_the_entry_points_of_the_group_load_once_per_process_with_no_flag(tmp_path, monkeypatch):
    """A distribution installed in ``tmp_path`` (its ``.dist-info`` with ``entry_points.txt``) declares a module and
    a function; both load with the first call, neither again."""
    name = f"bnpfed_test_entry_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN + "\nCALLS = []\n\ndef register():\n    CALLS.append(1)\n")
    info = tmp_path / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nrules = {name}\nhook = {name}:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with restored_registries([name]):
        load_entry_points.cache_clear()
        assert "heaviest" not in available_rules()
        assert load_plugins() == []
        assert "heaviest" in available_rules()
        assert sys.modules[name].CALLS == [1]
        load_plugins()
        assert sys.modules[name].CALLS == [1]


def test_a_broken_entry_point_is_named():
    class Broken:
        name, value = "broken", "bnpfed_no_such_module:register"

        def load(self):
            raise ModuleNotFoundError("No module named 'bnpfed_no_such_module'")

    from unittest import mock

    load_entry_points.cache_clear()
    with mock.patch("importlib.metadata.entry_points", return_value=[Broken()]):
        with pytest.raises(PluginError, match=f"entry point 'broken' .* of group '{ENTRY_POINT_GROUP}': cannot load"):
            load_plugins()
    load_entry_points.cache_clear()


# ------------------------------------------------------------------------------------------------ the commands


@pytest.mark.parametrize("argv, modules", [
    (["fuse", "--plugin", "a", "--rule", "x"], ["a"]),
    (["--plugin=a", "pfnm", "--plug", "b.c"], ["a", "b.c"]),
    (["flower", "sim", "--plugin", "a", "--", "--plugin", "b"], ["a"]),
    (["pfnm", "--plot", "p.png", "--pl", "x"], []),   # --pl is --plot's prefix too: argparse refuses it
])
def test_the_plugin_flags_are_read_before_the_parser(argv, modules):
    assert plugin_modules(argv) == modules


def test_every_command_takes_the_plugin_flag():
    parser = build_parser()
    for argv in (["demo"], ["pfnm"], ["fuse"], ["match", "a.pt", "b.pt", "--out", "g.pt"], ["evaluate", "g.pt"],
                 ["flower", "sim"], ["flower", "keys"]):
        assert parser.parse_args([*argv, "--plugin", "m", "--plugin", "n"]).plugin == ["m", "n"], argv


def test_a_plugin_that_does_not_import_stops_the_command_with_one_line(capsys):
    assert main(["fuse", "--plugin", "bnpfed_no_such_plugin", "--rule", "heaviest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bnpfed fuse: error: --plugin: plugin 'bnpfed_no_such_plugin': cannot import it")
    assert "\n" not in err


def test_without_the_plugin_its_rule_is_refused_with_the_registry(capsys):
    assert main(["fuse", "--rule", "heaviest", "--clients", "2", "--no-progress"]) == 2
    assert "--rule: expected one of" in capsys.readouterr().err


def test_the_commands_choices_come_from_the_registry_after_the_plugins_load(plugin):
    load_plugins([plugin])
    parser = build_parser()
    args = parser.parse_args(["match", "a.pt", "b.pt", "--out", "g.pt", "--posteriors", "--rule", "heaviest"])
    assert args.rule == "heaviest"
    args = parser.parse_args(["fuse", "--prior", "wide", "--likelihood", "cold"])
    assert (args.prior, args.likelihood) == ("wide", "cold")


@pytest.mark.slow
def test_bnpfed_fuse_runs_a_users_rule_prior_and_likelihood_from_a_module_under_tmp_path(tmp_path):
    """The command as a user runs it, in its own process: no bnpfed file changed, the module on PYTHONPATH."""
    name = "my_fusion_plugin"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "bnpfed.cli", "fuse", "--plugin", name, "--rule", "heaviest,eaa",
                           "--prior", "wide", "--likelihood", "cold", "--clients", "3", "--epochs", "1", "--rounds",
                           "2", "--hidden", "16", "--no-fedavg", "--threads", "1", "--no-progress", "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    rows = record["results"]["runs"][0]["rows"]
    assert [r["method"] for r in rows] == ["heaviest", "eaa"]
    assert all(r["rounds"] == 2 and 0.1 < r["accuracy"] <= 1 for r in rows)
    assert record["settings"]["bayesian"]["prior"] == "wide" and record["settings"]["bayesian"]["likelihood"] == "cold"
    assert record["arguments"]["plugin"] == [name]


def test_the_in_process_fuse_of_a_plugin_rule_is_the_rule_applied(plugin, digits):
    """The rule is applied as written: every fused coordinate is the heaviest client's, in the federation the
    command runs."""
    load_plugins([plugin])
    from bnpfed.federated import FusionConfig, FusionFederation, NetworkConfig, PartitionConfig, TrainingConfig

    parts = PartitionConfig(clients=3, partition="dirichlet", alpha=0.5).split(digits.y_train.numpy(), seed=0)
    federation = FusionFederation(digits, parts, network=NetworkConfig(hidden=(8,)), training=TrainingConfig(epochs=1),
                                  bayesian=BayesianConfig(prior="wide", likelihood="cold"),
                                  fusion=FusionConfig(rule="heaviest"), seed=0)
    record = federation.run_round()
    heaviest = federation.clients[max(range(3), key=lambda k: record.weights[k])].posterior()
    for site, fused in federation.global_posterior.items():
        assert torch.equal(fused.loc, heaviest[site].loc)
    assert federation.global_model.bnn.likelihood.temperature == 0.5


# ------------------------------------------------------------------------------------------------ Flower


def test_the_flower_app_runs_a_plugins_rule_prior_and_likelihood_with_the_plugins_key(plugin):
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import CLIENTS, FRACTION, assert_same_as_in_process

    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    config = {"method": "fusion", "rule": "heaviest", "prior": "wide", "likelihood": "cold", "plugins": plugin,
              "rounds": 2, "epochs": 1, "hidden": "8", **FRACTION}
    grid = LocalGrid(client_app, CLIENTS)
    result = run_federation(grid, config)   # the ServerApp loads the plugin from the run config
    assert result.settings.fusion.rule == "heaviest" and result.settings.bayesian.prior == "wide"
    assert_same_as_in_process(result, config)


def test_a_run_config_naming_a_plugin_the_server_cannot_import_is_refused_before_any_node_is_asked():
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import assert_refused_before_any_node_is_asked

    assert_refused_before_any_node_is_asked({"method": "fusion", "plugins": "bnpfed_no_such_plugin"},
                                            r"plugins: plugin 'bnpfed_no_such_plugin': cannot import it")


def test_a_node_that_cannot_import_a_plugin_answers_with_an_error_naming_it_and_is_refused(plugin, caplog):
    """The server has the plugin, the SuperNode does not: every message it gets is answered with an error reply
    naming the plugin (no crash); the server refuses the node and says why when too few nodes remain."""
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    grid = LocalGrid(client_app, 2)
    message = Message(RecordDict({"config": ConfigRecord({"plugins": ["bnpfed_no_such_plugin"], "dataset": "digits",
                                                           "standardize": True, "seed": 0})}),
                      dst_node_id=grid.node_ids[0], message_type=MessageType.QUERY, group_id="q")
    (reply,) = grid.send_and_receive([message], timeout=1)
    assert reply.has_error()
    assert "this node cannot load the run's plugins: plugin 'bnpfed_no_such_plugin': cannot import it" in \
        reply.error.reason

    def without_the_plugin(msg, context):   # a node where the plugin module is missing
        if context.node_config["partition-id"] == 1:
            config = msg.content.config_records["config"]
            config["plugins"] = ["bnpfed_no_such_plugin"]
        return client_app(msg, context)

    load_plugins([plugin])
    with pytest.raises(RuntimeError, match="refused: .*cannot load the run's plugins: plugin 'bnpfed_no_such_plugin'"):
        run_federation(LocalGrid(without_the_plugin, 2), {"method": "fusion", "rule": "heaviest", "plugins": plugin,
                                                          "node-timeout": 1.0, "epochs": 1, "hidden": "8"})

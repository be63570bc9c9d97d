"""bnpfed.flower: PFNM and posterior fusion as Flower strategies and client apps.

Three layers, cheapest first: the protocol in-process through :class:`bnpfed.flower.local.LocalGrid` (messages
go through Flower's wire format, no extra processes); one Flower simulation (``run_simulation``, Ray); one real
deployment on 127.0.0.1 (a SuperLink and three SuperNodes as separate processes, ``flwr run``). Each compares the
global model with the in-process run (:mod:`bnpfed.federated`) for the same settings and seed.
"""

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")

from flwr.app import Array, MessageType  # noqa: E402
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402

from bnpfed.cli import main  # noqa: E402
from bnpfed.combine import available_rules  # noqa: E402
from bnpfed.data import load_dataset  # noqa: E402
from bnpfed.federated import partition_homogeneous  # noqa: E402
from bnpfed.federated.fusion import FusionConfig, FusionFederation  # noqa: E402
from bnpfed.federated.pfnm import PFNMSettings, run_pfnm_experiment  # noqa: E402
from bnpfed.flower.client import app as client_app  # noqa: E402
from bnpfed.flower.config import config_from_dataclass, dataclass_from_config  # noqa: E402
from bnpfed.flower.local import LocalGrid  # noqa: E402
from bnpfed.flower.records import (ReplyError, network_from_arrays, network_to_record,  # noqa: E402
                                   posterior_from_arrays, from_array_record)
from bnpfed.flower.server import run_federation  # noqa: E402

APP_DIR = Path(__file__).resolve().parents[1] / "examples" / "flower_app"
CLIENTS = 3
#: Tiny settings: one epoch of a 16-unit MLP per client and round.
PFNM = {"method": "pfnm", "rounds": 2, "hidden": "16", "epochs": 1, "round-epochs": 1, "sigma2": 0.3,
        "min-nodes": CLIENTS}
PFNM_SETTINGS = PFNMSettings(clients=CLIENTS, rounds=2, hidden=(16,), epochs=1, round_epochs=1, sigma2=0.3,
                             methods=("pfnm", "pfnm-rounds"))
FUSION = {"method": "fusion", "rounds": 2, "hidden": "16", "local-epochs": 1, "pooling-samples": 100,
          "min-nodes": CLIENTS}
#: Seconds the whole deployment test may take before it is stopped (processes included).
DEPLOYMENT_TIMEOUT = 300


@pytest.fixture(scope="module")
def pfnm_reference():
    """The in-process PFNM run: the global layers after round 1 and after round 2, and the widths per round."""
    run = run_pfnm_experiment(load_dataset("digits", standardize=False), PFNM_SETTINGS, progress=False)
    return {1: run.global_layers["pfnm"], 2: run.global_layers["pfnm-rounds"],
            "hidden": [h["hidden"] for h in run.history["pfnm"]]}


def fusion_reference(rule: str, rounds: int = 2) -> dict:
    """The in-process fusion loop for ``FUSION`` with ``rule``: ``{round: (posterior, parameters)}``."""
    ds = load_dataset("digits")
    parts = partition_homogeneous(ds.y_train.numpy(), CLIENTS, seed=0)
    config = FusionConfig(rules=(rule,), fedavg=False, rounds=rounds, hidden=(16,), local_epochs=1,
                          pooling_samples=100)
    federation = FusionFederation(ds, parts, config, rule=rule)
    out = {}
    for t in range(1, rounds + 1):
        federation.run_round()
        out[t] = (dict(federation.global_posterior), dict(federation.global_deterministic))
    return out


@pytest.fixture(scope="module")
def gaa_reference():
    return fusion_reference("gaa")


def assert_same_network(arrays, layers):
    assert sorted(arrays) == sorted(f"{c}.{k}" for c in range(len(layers)) for k in ("weight", "bias"))
    for c, (w, b) in enumerate(layers):
        np.testing.assert_array_equal(arrays[f"{c}.weight"], w.numpy())
        np.testing.assert_array_equal(arrays[f"{c}.bias"], b.numpy())


def assert_same_posterior(arrays, reference):
    posterior, params = reference
    assert len(arrays) == 2 * len(posterior) + len(params)
    for site, fused in posterior.items():
        np.testing.assert_array_equal(arrays[f"loc/{site}"], fused.loc.numpy())
        np.testing.assert_array_equal(arrays[f"variance/{site}"], fused.variance.numpy())
    for name, value in params.items():
        np.testing.assert_array_equal(arrays[f"param/{name}"], value.numpy())


# ------------------------------------------------------------------------------------------------ in-process grid


def test_pfnm_on_flower_gives_the_in_process_global_network_and_its_changing_width(pfnm_reference):
    result = run_federation(LocalGrid(client_app, CLIENTS), PFNM)
    assert_same_network(result.arrays, pfnm_reference[2])
    assert [r["hidden_sizes"] for r in result.rounds] == pfnm_reference["hidden"]
    assert pfnm_reference["hidden"][0] != pfnm_reference["hidden"][1]  # the global width changed between rounds
    assert [r["partition_ids"] for r in result.rounds] == [[0, 1, 2]] * 2


def test_in_round_two_each_pfnm_client_gets_its_own_slice_of_the_global_network(pfnm_reference):
    sent = {}

    def recording(msg, context):
        if msg.content.config_records["config"]["server-round"] == 2:
            sent[context.node_config["partition-id"]] = from_array_record(msg.content.array_records["arrays"])
        return client_app(msg, context)

    run_federation(LocalGrid(recording, CLIENTS), PFNM)
    (global_width,) = pfnm_reference["hidden"][0]
    w_global = pfnm_reference[1][0][0].numpy()
    for j in range(CLIENTS):
        assert sent[j]["0.weight"].shape == (16, 64) and sent[j]["1.weight"].shape == (10, 16)
        rows = [int(np.flatnonzero((w_global == row).all(1))[0]) for row in sent[j]["0.weight"]]
        assert len(set(rows)) == 16 and max(rows) < global_width  # 16 distinct global neurons of the 1st round
        np.testing.assert_array_equal(sent[j]["1.weight"], pfnm_reference[1][1][0].numpy()[:, rows])


@pytest.mark.parametrize("rule", available_rules())
def test_fusion_on_flower_gives_the_in_process_global_posterior(rule, gaa_reference):
    reference = gaa_reference if rule == "gaa" else fusion_reference(rule)
    result = run_federation(LocalGrid(client_app, CLIENTS), {**FUSION, "rule": rule})
    assert_same_posterior(result.arrays, reference[2])
    assert result.rounds[-1]["weights"] == pytest.approx([449 / 1347] * 3)


def test_clients_can_score_the_global_model_on_their_test_shards():
    result = run_federation(LocalGrid(client_app, CLIENTS), {**PFNM, "rounds": 1, "fraction-evaluate": 1.0})
    assert result.evaluation[1]["num-examples"] == 450
    assert 0.5 < result.rounds[0]["accuracy"] <= 1 and math.isfinite(result.rounds[0]["nll"])


# ------------------------------------------------------------------------------------------------ faults


def tampered(partition: int, tamper):
    """The ClientApp, except that client ``partition``'s training reply goes through ``tamper(content)``."""

    def app(msg, context):
        reply = client_app(msg, context)
        if context.node_config["partition-id"] == partition and msg.metadata.message_type == MessageType.TRAIN:
            tamper(reply.content)
        return reply

    return app


def set_array(key, change):
    def tamper(content):
        arrays = content.array_records["arrays"]
        arrays[key] = Array(np.ascontiguousarray(change(arrays[key].numpy().copy())))
    return tamper


def set_metric(key, value):
    def tamper(content):
        content.metric_records["metrics"][key] = value
    return tamper


def nan_at_0(x):
    x.flat[0] = np.nan
    return x


def raise_error(content):
    raise RuntimeError("the client's disk is full")


@pytest.mark.parametrize("method, tamper, reason", [
    ("pfnm", set_array("0.weight", lambda w: w[:, :-1]), r"'0.weight': expected shape \(16, 64\), got \(16, 63\)"),
    ("pfnm", set_array("1.bias", nan_at_0), "'1.bias': contains NaN"),
    ("pfnm", set_metric("class-counts", [1, 2]), "'class-counts': expected a list of 10 class counts"),
    ("pfnm", set_metric("num-examples", 0), "'num-examples': expected a positive integer"),
    ("fusion", set_array("loc/1.weight", nan_at_0), "'loc/1.weight': contains NaN"),
    ("fusion", set_array("variance/3.weight", lambda v: 0 * v), r"'variance/3.weight': every variance must be > 0"),
    ("fusion", set_array("variance/1.weight", lambda v: -v), r"every variance must be > 0, got minimum -"),
    ("fusion", set_array("param/1.bias", lambda b: b[None]), r"'param/1.bias': expected shape \(16,\)"),
    ("fusion", raise_error, "error reply .*the client's disk is full"),
])
def test_a_malformed_reply_is_rejected_with_its_reason_and_the_round_goes_on(method, tamper, reason, caplog):
    grid = LocalGrid(tampered(1, tamper), CLIENTS)
    config = {**(PFNM if method == "pfnm" else FUSION), "rounds": 1}
    with caplog.at_level("WARNING", logger="flwr.bnpfed"):
        result = run_federation(grid, config)
    (record,) = result.rounds
    assert record["partition_ids"] == [0, 2] and record["missing"] == []
    (why,) = record["rejected"].values()
    assert list(record["rejected"]) == [grid.node_ids[1]]
    assert re.search(reason, why), why
    assert any("rejected" in r.getMessage() and str(grid.node_ids[1]) in r.getMessage() for r in caplog.records)
    assert all(np.isfinite(a).all() for a in result.arrays.values())


def test_a_missing_key_in_a_posterior_reply_is_named():
    def drop(content):
        del content.array_records["arrays"]["loc/3.weight"]

    result = run_federation(LocalGrid(tampered(0, drop), CLIENTS), {**FUSION, "rounds": 1})
    (why,) = result.rounds[0]["rejected"].values()
    assert "missing array(s) ['loc/3.weight']" in why
    assert result.rounds[0]["partition_ids"] == [1, 2]


def test_a_silent_supernode_is_left_out_after_the_round_timeout(caplog):
    grid = LocalGrid(client_app, CLIENTS, silent=[2])
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="flwr.bnpfed"):
        result = run_federation(grid, {**PFNM, "round-timeout": 1.0})
    assert time.perf_counter() - start < 30
    assert [r["partition_ids"] for r in result.rounds] == [[0, 1], [0, 1]]
    assert [r["missing"] for r in result.rounds] == [[grid.node_ids[2]]] * 2
    assert any("no train reply from node(s)" in r.getMessage() for r in caplog.records)


def test_a_round_without_enough_usable_replies_stops_with_a_message_naming_the_missing_clients():
    grid = LocalGrid(client_app, CLIENTS, silent=[1, 2])
    with pytest.raises(RuntimeError, match=r"round 1: 1 usable replies, fewer than min_replies=2; rejected: none; "
                       rf"missing \(no reply before the deadline\): \[{grid.node_ids[1]}, {grid.node_ids[2]}\]"):
        run_federation(grid, {**FUSION, "min-replies": 2, "round-timeout": 0.5})


def test_waiting_for_supernodes_has_a_deadline():
    with pytest.raises(RuntimeError, match="waited 1 s for 4 nodes, only 3 connected"):
        run_federation(LocalGrid(client_app, CLIENTS), {**PFNM, "min-nodes": 4, "node-timeout": 1.0})


def test_an_unknown_run_config_key_is_named():
    with pytest.raises(ValueError, match=r"unknown run config key\(s\) \['sigma'\]"):
        run_federation(LocalGrid(client_app, CLIENTS), {"sigma": 1.0})
    with pytest.raises(ValueError, match="config key 'epochs': expected a value like 10"):
        run_federation(LocalGrid(client_app, CLIENTS), {"epochs": "ten"})


# ------------------------------------------------------------------------------------------------ records, config


def over_the_wire(record):
    return recorddict_from_proto(recorddict_to_proto(flwr.app.RecordDict({"a": record}))).array_records["a"]


def test_networks_of_any_widths_survive_the_wire():
    layers = [(torch.randn(5, 4), torch.randn(5)), (torch.randn(7, 5), torch.randn(7)), (torch.randn(3, 7),
                                                                                        torch.randn(3))]
    back = network_from_arrays(from_array_record(over_the_wire(network_to_record(layers))), in_features=4,
                               num_classes=3)
    for (w, b), (w2, b2) in zip(layers, back):
        assert torch.equal(w, w2) and torch.equal(b, b2)


@pytest.mark.parametrize("arrays, message", [
    ({"0.weight": np.ones((2, 3), np.float32), "1.weight": np.ones((1, 2), np.float32),
      "1.bias": np.ones(1, np.float32)}, r"missing array\(s\) \['0.bias'\]"),
    ({"0.weight": np.ones(3, np.float32), "0.bias": np.ones(3, np.float32), "1.weight": np.ones((1, 3), np.float32),
      "1.bias": np.ones(1, np.float32)}, r"'0.weight': expected an \(out, in\) matrix"),
    ({"0.weight": np.ones((2, 3), np.int64), "0.bias": np.ones(2, np.float32), "1.weight": np.ones((1, 2),
      np.float32), "1.bias": np.ones(1, np.float32)}, "expected a floating-point tensor"),
    ({"0.weight": np.ones((2, 3), np.float32), "0.bias": np.ones(2, np.float32)}, "at least one hidden layer"),
    ({"w": np.ones(2)}, "unexpected array 'w'"),
])
def test_malformed_networks_are_named(arrays, message):
    with pytest.raises(ReplyError, match=message):
        network_from_arrays(arrays)


def test_a_posterior_reply_must_match_the_global_shapes():
    expected = {"loc/w": (2, 3), "variance/w": (2, 3), "param/b": (2,)}
    good = {"loc/w": np.zeros((2, 3), np.float32), "variance/w": np.ones((2, 3), np.float32),
            "param/b": np.zeros(2, np.float32)}
    posterior, params = posterior_from_arrays(good, expected)
    assert list(posterior) == ["w"] and list(params) == ["b"]
    with pytest.raises(ReplyError, match=r"unknown array\(s\) \['loc/v'\]"):
        posterior_from_arrays({**good, "loc/v": np.zeros(1)}, expected)


def test_settings_travel_as_flat_flower_config_and_back():
    settings = PFNMSettings(hidden=(100, 50), grid_sigma2=(0.1, 1.0), shared_init=True, sigma0_2=2.0)
    assert dataclass_from_config(PFNMSettings, config_from_dataclass(settings)) == settings
    from_toml = dataclass_from_config(PFNMSettings, {"hidden": "100,50", "shared-init": "true", "sigma0-2": 2,
                                                     "grid-sigma2": "0.1, 1"})
    assert from_toml == settings


def test_the_example_apps_run_config_lists_the_keys_bnpfed_reads_with_its_defaults():
    import tomllib
    from dataclasses import fields

    from bnpfed.flower.server import FlowerRun

    app_config = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    differs = {"fraction-evaluate", "min-nodes", "min-replies", "round-timeout", "rounds"}  # commented there
    unsupported = {"clients", "select", "grid-sigma2", "grid-sigma0-2", "grid-gamma0", "holdout", "methods",
                   "rules", "fedavg", "fraction", "ece-bins"}  # chosen by Flower or not used over Flower
    for cls in (FlowerRun, PFNMSettings, FusionConfig):
        parsed = dataclass_from_config(cls, app_config)
        for f in fields(cls):
            key = f.name.replace("_", "-")
            if key in differs or key in unsupported:
                continue
            assert key in app_config, key
            assert getattr(parsed, f.name) == f.default, key
    assert set(app_config) - {f.name.replace("_", "-") for c in (FlowerRun, PFNMSettings, FusionConfig)
                              for f in fields(c)} == set()


# ------------------------------------------------------------------------------------------------ command


def test_bnpfed_flower_help_explains_how_to_start_the_pieces(capsys):
    assert main(["flower"]) == 0
    text = capsys.readouterr().out
    for needle in ("flower-superlink", "flower-supernode", "partition-id=0 num-partitions=3", "flwr run",
                   "--insecure", "--ssl-certfile", "--root-certificates", "root-certificates =",
                   "--disable-runtime-dependency-installation", "finished:completed"):
        assert needle in text, needle


def test_bnpfed_flower_sim_local_prints_a_row_per_round(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["flower", "sim", "--local", "--run-config", 'method="pfnm" rounds=2 hidden="8" epochs=1 '
                 'round-epochs=1', "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bnpfed pfnm on Flower: 3 clients (in-process grid)" in text and "hidden_sizes" in text
    assert [r["round"] for r in json.loads(out.read_text())["rounds"]] == [1, 2]


# ------------------------------------------------------------------------------------------------ simulation


@pytest.mark.slow
def test_a_flower_simulation_gives_the_in_process_global_models(pfnm_reference, gaa_reference, monkeypatch):
    from flwr.simulation import run_simulation

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    results = {}
    server_app = ServerApp()

    @server_app.main()
    def both(grid, context):  # one Ray start for both strategies
        for config in (PFNM, {**FUSION, "rule": "gaa"}):
            results[config["method"]] = run_federation(grid, config)

    run_simulation(server_app, client_app, num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    assert_same_network(results["pfnm"].arrays, pfnm_reference[2])
    assert [r["hidden_sizes"] for r in results["pfnm"].rounds] == pfnm_reference["hidden"]
    assert_same_posterior(results["fusion"].arrays, gaa_reference[2])


# ------------------------------------------------------------------------------------------------ deployment


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports on 127.0.0.1 that could be bound just now (held together while choosing)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise ``TimeoutError`` in the test after ``seconds`` (SIGALRM; pytest runs tests on the main thread)."""
    def expire(signum, frame):
        raise TimeoutError(f"the deployment test ran over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Processes:
    """The SuperLink and SuperNodes this test starts, each in its own session (process group) with its own
    FLWR_HOME and log file; stopped by PID, SuperNodes first."""

    def __init__(self, root: Path, env: dict):
        self.root, self.env, self.started = root, env, []

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        home = self.root / name
        home.mkdir()
        log = open(self.root / f"{name}.log", "w")
        proc = subprocess.Popen(argv, env={**self.env, "FLWR_HOME": str(home)}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root,
                                start_new_session=True)
        self.started.append((name, proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {name} (exit {p.poll()}):\n" + (self.root / f"{name}.log").read_text()[-3000:]
                         for name, p, _ in self.started)

    def stop(self) -> None:
        for _, proc, _ in reversed(self.started):  # SuperNodes, then the SuperLink, each with what it spawned
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # its session: SuperExec, ClientApp / ServerApp processes
        for _, proc, log in reversed(self.started):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for _ in range(50):  # until its process group is empty
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            log.close()


def flwr_cli(env: dict, *args: str, timeout: float = 60) -> str:
    done = subprocess.run([str(Path(sys.executable).parent / "flwr"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"flwr {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def json_of(text: str) -> dict:
    """The JSON document ``flwr ... --format json`` prints (after any log lines)."""
    start = text.find("\n{") + 1 if not text.startswith("{") else 0
    return json.loads(text[start:])


@pytest.mark.slow
def test_a_superlink_and_three_supernodes_on_loopback_run_one_round_of_each_strategy(tmp_path, pfnm_reference,
                                                                                      gaa_reference):
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    link_port, *node_ports = free_ports(1 + CLIENTS)
    cli_home = tmp_path / "cli"
    cli_home.mkdir()
    (cli_home / "config.toml").write_text(f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
                                          f'address = "127.0.0.1:{link_port}"\ninsecure = true\n')
    cli_env = {**env, "FLWR_HOME": str(cli_home)}
    processes = Processes(tmp_path, env)
    with deadline(DEPLOYMENT_TIMEOUT):
        try:
            processes.start("superlink", str(bin_dir / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                            "--port", str(link_port), "--disable-runtime-dependency-installation")
            for j, port in enumerate(node_ports):
                processes.start(f"supernode{j}", str(bin_dir / "flower-supernode"), "--insecure", "--superlink",
                                f"127.0.0.1:{link_port}", "--host", "127.0.0.1", "--port", str(port),
                                "--max-wait-time", "120", "--node-config",
                                f"partition-id={j} num-partitions={CLIENTS}")
            for _ in range(240):
                with contextlib.suppress(OSError):
                    if urllib.request.urlopen(f"http://127.0.0.1:{link_port}/health", timeout=2).status == 200:
                        break
                assert all(p.poll() is None for _, p, _ in processes.started), processes.logs()
                time.sleep(0.5)
            else:
                pytest.fail("the SuperLink never answered /health\n" + processes.logs())

            runs = {}  # both runs at once: the SuperLink and SuperNodes serve them side by side
            for config in ({**PFNM, "rounds": 1}, {**FUSION, "rounds": 1, "rule": "gaa"}):
                out = tmp_path / f"out-{config['method']}"
                overrides = {**config, "output-dir": str(out), "fraction-evaluate": 0.0, "round-timeout": 120.0}
                run_config = " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())
                started = json_of(flwr_cli(cli_env, "run", str(APP_DIR), "loopback", "--format", "json",
                                           "--run-config", run_config))
                assert started.get("success") and "run-id" in started, started
                runs[config["method"]] = (str(started["run-id"]), out)
            for method, (run_id, out) in runs.items():
                status = ""
                while not status.startswith("finished:"):  # each `flwr` call costs a second of CPU: poll gently
                    time.sleep(3)
                    listing = json_of(flwr_cli(cli_env, "ls", "loopback", "--run-id", run_id, "--format", "json"))
                    status = listing["runs"][0]["status"]
                if status != "finished:completed":
                    log = subprocess.run([str(bin_dir / "flwr"), "log", run_id, "loopback", "--show"], env=cli_env,
                                         capture_output=True, text=True, timeout=60).stdout
                    pytest.fail(f"{method} run {run_id} ended {status}\n{log[-5000:]}\n{processes.logs()}")
                summary = json.loads((out / f"{method}-summary.json").read_text())
                assert summary["rounds"][0]["partition_ids"] == [0, 1, 2]
                arrays = dict(np.load(out / f"{method}-global.npz"))
                if method == "pfnm":
                    assert_same_network(arrays, pfnm_reference[1])
                else:
                    assert_same_posterior(arrays, gaa_reference[1])
        except TimeoutError as error:
            pytest.fail(f"{error}\n{processes.logs()}")
        finally:
            processes.stop()
    assert all(p.poll() is not None for _, p, _ in processes.started)

"""The Flower test harness of ``test_flower.py`` and ``test_flower_matched.py``: one set of helpers for the three
strategies (:class:`PFNMStrategy`, :class:`PosteriorFusionStrategy`, :class:`MatchedFusionStrategy`).

* **In-process references.** :func:`in_process` runs (once per config) the in-process federation the strategy a run
  config picks is the Flower form of, with the same settings and seed; :func:`assert_same_model` and
  :func:`assert_same_rounds` compare a Flower run's global model (array by array, dtypes included) and per-round
  record with it, and :func:`assert_same_as_in_process` does both. What differs between the strategies lives in one
  table, :data:`METHODS`. :func:`assert_refused_before_any_node_is_asked` checks that a run config is refused up
  front.
* **Message plumbing.** ClientApps wrapped for the in-process grid (:class:`bnpfed.flower.local.LocalGrid`):
  :func:`recording` keeps what every train message carried, :func:`tampered` passes some clients' replies through
  faults (:func:`set_array`, :func:`set_metric`, :func:`set_identity`, :func:`nan_at_0`, :func:`raise_error`).
* **Simulation.** :func:`simulate` runs several configs in one Flower simulation (one Ray start).
* **Loopback deployment.** :func:`loopback` starts a SuperLink and :data:`CLIENTS` SuperNodes on 127.0.0.1 as
  separate processes and stops them again; :meth:`Loopback.run` runs configs on them with ``flwr run``.

Not a test module (its name does not start with ``test_``); the test files import it after their
``pytest.importorskip("flwr")``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
import pytest

flwr = pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")

from flwr.app import Array, MessageType  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402

from bnpfed.data import load_dataset  # noqa: E402
from bnpfed.federated import MethodFederation  # noqa: E402
from bnpfed.federated.federation import Federation, RoundRecord  # noqa: E402
from bnpfed.federated.fusion import FedAvgFederation, FusionFederation  # noqa: E402
from bnpfed.federated.matched_fusion import MatchedFusionFederation  # noqa: E402
from bnpfed.federated.pfnm import PFNMFederation  # noqa: E402
from bnpfed.flower.client import app as client_app  # noqa: E402
from bnpfed.flower.config import FlowerSettings, parse_run_config  # noqa: E402
from bnpfed.flower.local import LocalGrid  # noqa: E402
from bnpfed.flower.method_strategy import MethodStrategy  # noqa: E402
from bnpfed.flower.records import (from_array_record, matched_posterior_to_record, posterior_to_record,  # noqa: E402
                                   state_to_record, to_array_record, with_heads, with_temperature)
from bnpfed.flower.server import FederationResult, run_federation  # noqa: E402
from bnpfed.matching.pooled_heads import pooled_heads_of  # noqa: E402
from bnpfed.flower.strategies import (FedAvgStrategy, MatchedFusionStrategy, PFNMStrategy,  # noqa: E402
                                      PosteriorFusionStrategy)

#: The example Flower app ``flwr run`` installs on the loopback deployment.
APP_DIR = Path(__file__).resolve().parents[1] / "examples" / "flower_app"
CLIENTS = 3
#: Two of the three clients a round; with seed 1 round 1 trains [1, 2] and round 2 [0, 2], so in round 2 client 0,
#: which was not matched, starts from the whole global model (PFNM's network, matched fusion's posterior) and
#: client 2 from its slice.
FRACTION = {"fraction": 0.67, "seed": 1}
#: Seconds a whole loopback deployment may take before it is stopped (processes included).
DEPLOYMENT_TIMEOUT = 600


# ------------------------------------------------------------------------------------------------ in process


def matched_arrays(locs, variances, pooled=None, temperature=None) -> dict[str, np.ndarray]:
    """Matched posterior fusion's ``(locs, variances)`` in the layout of :mod:`bnpfed.flower.records` (with the
    heads of ``pooled``, a PooledPosterior, beside them when given, or the fused predictive's ``temperature``)."""
    record = matched_posterior_to_record(locs, variances)
    if temperature is not None:
        record = with_temperature(record, temperature)
    return from_array_record(record if pooled is None else with_heads(record, pooled.heads()))


def pfnm_arrays(federation) -> dict[str, np.ndarray]:
    """PFNM's global network in the layout of :mod:`bnpfed.flower.records` (with the matched clients' pooled heads
    beside it under ``pfnm.heads = "pooled"``)."""
    record = state_to_record(federation.match.state)
    if federation.pfnm.heads == "pooled":
        heads = pooled_heads_of(federation.match, federation.matched_states)
        temperature = federation.history[-1].metrics["pool_temperature"]
        record = with_heads(record, {**heads, "temperature": torch.tensor(temperature, dtype=torch.float64)})
    return from_array_record(record)


def _metric(key: str) -> Callable[[RoundRecord], Any]:
    return lambda record: record.metrics[key]


def _pfnm_options(settings: FlowerSettings) -> dict:
    return dict(network=settings.network, training=settings.training, pfnm=settings.pfnm, seed=settings.run.seed)


def _fedavg_options(settings: FlowerSettings) -> dict:
    return dict(network=settings.network, training=settings.training, seed=settings.run.seed,
                weights=settings.fusion.weights, fraction=settings.fusion.fraction)


def _method_options(settings: FlowerSettings) -> dict:
    return dict(method=settings.run.method, network=settings.network, training=settings.training,
                seed=settings.run.seed, weights=settings.fusion.weights, fraction=settings.fusion.fraction)


def _fusion_options(settings: FlowerSettings) -> dict:
    return dict(network=settings.network, training=settings.training, bayesian=settings.bayesian,
                fusion=settings.fusion, seed=settings.run.seed, predictive_samples=settings.run.predictive_samples)


@dataclass(frozen=True)
class Method:
    """What the harness needs to know of one strategy.

    :param federation: the in-process federation the strategy's rounds are.
    :param options: its keyword arguments (besides dataset and partitions) from the run's settings.
    :param global_arrays: its global model after the rounds, in the layout of :mod:`bnpfed.flower.records`.
    :param rounds: the strategy's own per-round fields (besides ``sampled`` and ``clients``), each with how to read
        the in-process round record's value of it.
    """

    federation: type[Federation]
    options: Callable[[FlowerSettings], dict]
    global_arrays: Callable[[Any], dict[str, np.ndarray]]
    rounds: Mapping[str, Callable[[RoundRecord], Any]]


#: ``{strategy: Method}``: everything in the harness that differs between the strategies.
METHODS: dict[type, Method] = {
    PFNMStrategy: Method(PFNMFederation, _pfnm_options, pfnm_arrays, {"hidden": _metric("hidden")}),
    PosteriorFusionStrategy: Method(
        FusionFederation, _fusion_options,
        lambda f: from_array_record(posterior_to_record(f.global_posterior, f.global_deterministic)),
        {"weights": attrgetter("weights")}),
    FedAvgStrategy: Method(FedAvgFederation, _fedavg_options,
                           lambda f: from_array_record(state_to_record(f.global_model.net.state_dict())),
                           {"weights": attrgetter("weights")}),
    MatchedFusionStrategy: Method(MatchedFusionFederation, _fusion_options,
                                  lambda f: matched_arrays(f.match.locs, f.match.variances, f.pooled,
                                                           f.history[-1].metrics.get("temperature")),
                                  {"hidden": _metric("hidden"), "mean_sigma": _metric("mean_sigma")}),
    MethodStrategy: Method(MethodFederation, _method_options,
                           lambda f: from_array_record(to_array_record(f.global_state)),
                           {"weights": attrgetter("weights")}),
}


def strategy_of(settings: FlowerSettings) -> type:
    """The strategy :func:`~bnpfed.flower.server.run_federation` runs for ``settings``."""
    if settings.run.federated:   # a registered federated method
        return MethodStrategy
    if settings.run.method == "pfnm":
        return PFNMStrategy
    if settings.run.method == "fedavg":
        return FedAvgStrategy
    return MatchedFusionStrategy if settings.fusion.align == "match" else PosteriorFusionStrategy


def method_of(federation: Federation) -> Method:
    """The :class:`Method` whose in-process federation ``federation`` is."""
    (method,) = [m for m in METHODS.values() if type(federation) is m.federation]
    return method


@functools.lru_cache(maxsize=None)
def _reference(items: tuple, data_dir: str | None = None) -> Federation:
    settings = parse_run_config(dict(items)).with_clients(CLIENTS)
    run = settings.run
    ds = load_dataset(run.dataset, standardize=run.standardized, data_dir=data_dir)
    parts = settings.partition.split(ds.y_train.numpy(), run.seed)
    method = METHODS[strategy_of(settings)]
    federation = method.federation(ds, parts, **method.options(settings))
    federation.run(run.rounds)
    return federation


def in_process(config: dict, data_dir: str | None = None) -> Federation:
    """The in-process federation with the settings of the run config ``config`` (the data read from ``data_dir``, as
    a SuperNode's ``data-dir``), after its rounds (computed once per config and kept)."""
    return _reference(tuple(sorted(config.items())), data_dir)


def global_arrays(federation: Federation) -> dict[str, np.ndarray]:
    """The in-process global model in the layout of :mod:`bnpfed.flower.records`."""
    return method_of(federation).global_arrays(federation)


def assert_same_model(arrays: dict, federation: Federation) -> None:
    """The Flower run's global ``arrays`` are the in-process federation's global model, key by key, bit for bit."""
    expected = global_arrays(federation)
    assert sorted(arrays) == sorted(expected)
    for key, value in expected.items():
        assert arrays[key].dtype == value.dtype, key
        assert np.array_equal(arrays[key], value), key


def assert_same_rounds(history: list, federation: Federation) -> None:
    """The Flower run's per-round ``history`` sampled, trained and (per strategy) recorded what the in-process
    federation's did."""
    assert [r["sampled"] for r in history] == [r.sampled for r in federation.history]
    assert [r["clients"] for r in history] == [r.sampled for r in federation.history]
    for key, read in method_of(federation).rounds.items():
        assert [r[key] for r in history] == [read(r) for r in federation.history], key


def assert_same_as_in_process(result: FederationResult, config: dict) -> Federation:
    """:func:`assert_same_model` and :func:`assert_same_rounds` of a Flower run of ``config`` against
    ``in_process(config)``, which it returns."""
    reference = in_process(config)
    assert_same_model(result.arrays, reference)
    assert_same_rounds(result.history, reference)
    return reference


def assert_refused_before_any_node_is_asked(config: dict, message: str) -> None:
    """:func:`~bnpfed.flower.server.run_federation` of ``config`` on the in-process grid raises a ``ValueError``
    matching ``message`` before it sends any node a message."""
    grid = LocalGrid(client_app, CLIENTS)
    with pytest.raises(ValueError, match=message):
        run_federation(grid, config)
    assert grid.calls == []


# ------------------------------------------------------------------------------------------------ message plumbing


def recording(sent: dict, app=client_app):
    """``app``, except that it first keeps the arrays of every train message in ``sent[server round, partition]``."""

    def recorder(msg, context):
        if msg.metadata.message_type == MessageType.TRAIN:
            round_ = msg.content.config_records["config"]["server-round"]
            sent[round_, context.node_config["partition-id"]] = from_array_record(msg.content.array_records["arrays"])
        return app(msg, context)

    return recorder


def tampered(tampers: Mapping[int, Callable], kind: str = MessageType.TRAIN, app=client_app):
    """``app``, except that the replies of type ``kind`` of each partition in ``tampers`` go through its
    ``tamper(content)`` (the reply's ``RecordDict``)."""

    def tampering(msg, context):
        reply = app(msg, context)
        tamper = tampers.get(context.node_config["partition-id"])
        if tamper is not None and msg.metadata.message_type == kind:
            tamper(reply.content)
        return reply

    return tampering


def set_array(key: str, change: Callable[[np.ndarray], np.ndarray]):
    """A tamper: the reply's array ``key`` becomes ``change(a copy of it)``."""
    def tamper(content):
        arrays = content.array_records["arrays"]
        arrays[key] = Array(np.ascontiguousarray(change(arrays[key].numpy().copy())))
    return tamper


def set_metric(key: str, value):
    """A tamper: the reply's metric ``key`` becomes ``value``."""
    def tamper(content):
        content.metric_records["metrics"][key] = value
    return tamper


def set_identity(key: str, value):
    """A tamper: what the client says of itself (its ``client`` ConfigRecord) has ``key`` = ``value``."""
    def tamper(content):
        content.config_records["client"][key] = value
    return tamper


def nan_at_0(x: np.ndarray) -> np.ndarray:
    """For :func:`set_array`: the first entry NaN."""
    x.flat[0] = np.nan
    return x


def raise_error(content):
    """A tamper that fails, as a client whose disk is full."""
    raise RuntimeError("the client's disk is full")


# ------------------------------------------------------------------------------------------------ simulation


def simulate(configs: Mapping[str, dict]) -> dict[str, FederationResult]:
    """``{name: result}`` of every run config of ``configs``, run one after the other by one ServerApp in one Flower
    simulation (``run_simulation``: one Ray start, :data:`CLIENTS` SuperNodes running the ClientApp, one CPU each)."""
    from flwr.simulation import run_simulation

    results = {}
    server_app = ServerApp()

    @server_app.main()
    def every_case(grid, context):  # one Ray start for all of them
        for name, config in configs.items():
            results[name] = run_federation(grid, config)

    with mock.patch.dict(os.environ, {"FLWR_TELEMETRY_ENABLED": "0"}):
        run_simulation(server_app, client_app, num_supernodes=CLIENTS,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    return results


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
    """The SuperLink and SuperNodes a test starts, each in its own session (process group) with its own
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
    """The output of the ``flwr`` command ``args``, which must succeed."""
    done = subprocess.run([str(Path(sys.executable).parent / "flwr"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"flwr {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def json_of(text: str) -> dict:
    """The JSON document ``flwr ... --format json`` prints (after any log lines)."""
    start = text.find("\n{") + 1 if not text.startswith("{") else 0
    return json.loads(text[start:])


class Loopback:
    """A running loopback deployment (see :func:`loopback`): its ``processes`` and the ``flwr`` CLI's environment
    ``cli_env`` (a connection ``loopback`` to its SuperLink)."""

    def __init__(self, root: Path, processes: Processes, cli_env: dict, link_argv: tuple = (),
                 health: Callable[[], None] | None = None):
        self.root, self.processes, self.cli_env = root, processes, cli_env
        self.link_argv, self.health = link_argv, health

    def start(self, name: str, config: dict, *, evaluate: bool = False) -> tuple[str, Path]:
        """``flwr run`` of the example app with ``config`` (its summary and global model written to a folder of its
        own; no evaluation unless ``evaluate``); returns ``(run id, that folder)`` at once."""
        out = self.root / f"out-{name}"
        overrides = {**({} if evaluate else {"fraction-evaluate": 0.0}), "round-timeout": 180.0, **config,
                     "output-dir": str(out)}
        run_config = " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())
        started = json_of(flwr_cli(self.cli_env, "run", str(APP_DIR), "loopback", "--format", "json",
                                   "--run-config", run_config))
        assert started.get("success") and "run-id" in started, started
        return str(started["run-id"]), out

    def status(self, run_id: str) -> str:
        """The run's status as ``flwr ls`` says it (``pending``, ``running``, ``finished:completed``, ...)."""
        listing = json_of(flwr_cli(self.cli_env, "ls", "loopback", "--run-id", run_id, "--format", "json"))
        return listing["runs"][0]["status"]

    def wait(self, run_id: str, until: str = "finished:") -> str:
        """Poll the run's status (gently: each `flwr` call costs a second of CPU) until it starts with ``until``."""
        status = ""
        while not status.startswith(until):
            time.sleep(3)
            status = self.status(run_id)
        return status

    def log(self, run_id: str) -> str:
        """The run's log (``flwr log --show``)."""
        return subprocess.run([str(Path(sys.executable).parent / "flwr"), "log", run_id, "loopback", "--show"],
                              env=self.cli_env, capture_output=True, text=True, timeout=60).stdout

    def kill(self, name: str) -> None:
        """SIGKILL the process ``name`` and everything it spawned (a machine that loses power), and wait for it."""
        _, proc, _ = next(entry for entry in self.processes.started if entry[0] == name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)

    def restart_superlink(self, name: str) -> None:
        """Start the SuperLink again, as ``name``, with its first arguments (the same port and ``--database``), and
        wait until it answers ``/health``."""
        self.processes.start(name, *self.link_argv)
        self.health()

    def run(self, configs: Mapping[str, dict]) -> Iterator[tuple[str, dict, dict[str, np.ndarray]]]:
        """Start a ``flwr run`` of the example app for every run config of ``configs`` at once (no evaluation, the
        summary and global model written to a folder of its own), then yield ``(name, summary JSON, global
        arrays)`` of each as it finishes, in the order of ``configs``; fail the test, with the run's log and the
        processes', on a run that does not complete."""
        runs = {name: self.start(name, config) for name, config in configs.items()}   # side by side
        for name, (run_id, out) in runs.items():
            method = configs[name]["method"]
            status = self.wait(run_id)
            if status != "finished:completed":
                pytest.fail(f"{name} run {run_id} ended {status}\n{self.log(run_id)[-5000:]}\n{self.processes.logs()}")
            summary = json.loads((out / f"{method}-summary.json").read_text())
            yield name, summary, dict(np.load(out / f"{method}-global.npz"))


def tls_material(root: Path, num_nodes: int) -> dict:
    """What a TLS deployment with SuperNode authentication needs, made here (``cryptography``, a Flower dependency):
    a CA and a server certificate for 127.0.0.1 / localhost signed by it (PEM), and one EC (NIST P-384) key pair per
    SuperNode in OpenSSH format, as ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register``
    read them. Returns the paths: ``ca``, ``cert``, ``key``, ``node_keys`` (private), ``node_public_keys``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5), not_valid_after=now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder(subject_name=name("bnpfed test CA"), issuer_name=name("bnpfed test CA"),
                                  public_key=ca_key.public_key(), serial_number=x509.random_serial_number(), **valid)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server = (x509.CertificateBuilder(subject_name=name("127.0.0.1"), issuer_name=ca.subject,
                                      public_key=server_key.public_key(), serial_number=x509.random_serial_number(),
                                      **valid)
              .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
              .sign(ca_key, hashes.SHA256()))
    tls = root / "tls"
    tls.mkdir()
    paths = {"ca": tls / "ca.crt", "cert": tls / "server.pem", "key": tls / "server.key", "node_keys": [],
             "node_public_keys": []}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(pem_key(server_key))
    for j in range(num_nodes):
        node_key = ec.generate_private_key(ec.SECP384R1())
        private, public = tls / f"supernode{j}", tls / f"supernode{j}.pub"
        private.write_bytes(node_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                   serialization.NoEncryption()))
        public.write_bytes(node_key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                              serialization.PublicFormat.OpenSSH))
        paths["node_keys"].append(private)
        paths["node_public_keys"].append(public)
    return paths


@contextlib.contextmanager
def loopback(root: Path, seconds: int = DEPLOYMENT_TIMEOUT, *, secure: bool = False, num_nodes: int = CLIENTS,
             database: bool = False) -> Iterator[Loopback]:
    """A SuperLink and ``num_nodes`` SuperNodes (default :data:`CLIENTS`; partition-ids 0, 1, ...) on free ports of
    127.0.0.1, separate processes with their own FLWR_HOME under ``root`` (no runtime dependency installation, no telemetry), ready once
    the SuperLink answers ``/health``. Insecure by default; with ``secure``, as a real federation runs: the SuperLink
    serves HTTPS with a certificate of a CA made for the test (:func:`tls_material`), the SuperNodes and the CLI
    verify it, and SuperNode authentication is on (``--enable-supernode-auth``): every SuperNode's public key is
    registered with ``flwr supernode register`` before it starts and it signs its requests with its private key.
    With ``database`` the SuperLink keeps its state in ``root/state.db`` (``--database``), which a restart reads.
    The whole ``with`` block may take ``seconds``: then, or on a process that dies while starting, the test fails
    with the processes' logs. On leaving it the processes are stopped (SuperNodes first)."""
    import ssl

    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    link_port, *node_ports = free_ports(1 + num_nodes)
    tls = tls_material(root, num_nodes) if secure else None
    cli_home = root / "cli"
    cli_home.mkdir()
    transport = f'root-certificates = "{tls["ca"]}"\n' if secure else "insecure = true\n"
    (cli_home / "config.toml").write_text(f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
                                          f'address = "127.0.0.1:{link_port}"\n{transport}')
    cli_env = {**env, "FLWR_HOME": str(cli_home)}
    link_security = (["--ssl-ca-certfile", str(tls["ca"]), "--ssl-certfile", str(tls["cert"]), "--ssl-keyfile",
                      str(tls["key"]), "--enable-supernode-auth"] if secure else ["--insecure"])
    scheme, context = ("https", ssl.create_default_context(cafile=str(tls["ca"]))) if secure else ("http", None)
    processes = Processes(root, env)
    link_argv = (str(bin_dir / "flower-superlink"), *link_security, "--host", "127.0.0.1", "--port", str(link_port),
                 "--disable-runtime-dependency-installation",
                 *(["--database", str(root / "state.db")] if database else []))

    def healthy() -> None:
        for _ in range(240):
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{scheme}://127.0.0.1:{link_port}/health", timeout=2,
                                          context=context).status == 200:
                    return
            assert processes.started[-1][1].poll() is None, processes.logs()
            time.sleep(0.5)
        pytest.fail("the SuperLink never answered /health\n" + processes.logs())

    with deadline(seconds):
        try:
            processes.start("superlink", *link_argv)
            healthy()
            for j, port in enumerate(node_ports):
                node_security = ["--insecure"]
                if secure:
                    flwr_cli(cli_env, "supernode", "register", str(tls["node_public_keys"][j]), "loopback")
                    node_security = ["--root-certificates", str(tls["ca"]), "--auth-supernode-private-key",
                                     str(tls["node_keys"][j])]
                processes.start(f"supernode{j}", str(bin_dir / "flower-supernode"), *node_security, "--superlink",
                                f"127.0.0.1:{link_port}", "--host", "127.0.0.1", "--port", str(port),
                                "--max-wait-time", "120", "--node-config",
                                f"partition-id={j} num-partitions={num_nodes}")
            yield Loopback(root, processes, cli_env, link_argv, healthy)
        except TimeoutError as error:
            pytest.fail(f"{error}\n{processes.logs()}")
        finally:
            processes.stop()

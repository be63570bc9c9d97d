"""``bnpfed flower``: how to run PFNM and posterior fusion on Flower across machines, and a simulation helper.

``bnpfed pfnm`` and ``bnpfed fuse`` stay the way to run everything on one machine; this command is about the
Flower app of :mod:`bnpfed.flower` (extra ``bnpfed[flower]``). Flower is imported only when an action needs it,
so ``bnpfed --help`` works without it.

Examples::

    bnpfed flower --help                                   # how to start a SuperLink, SuperNodes and a run
    bnpfed flower keys                                     # every run config key and its default
    bnpfed flower keys --toml                              # the [tool.flwr.app.config] table of an app
    bnpfed flower sim --supernodes 3 --run-config 'method="fusion" rule="gaa" rounds=3'
    bnpfed flower sim --local --run-config 'method="pfnm" rounds=2 hidden="50"' --json out.json
    bnpfed flower sim --local --run-config 'method="fusion" align="match" rule="eaa" rounds=2'
    bnpfed flower sim --local --run-config 'method="fedavg" rounds=3'
    bnpfed flower sim --plugin examples.fedpa --run-config 'method="fedpa" optimizer="sgd" lr=0.05 rounds=3'
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from bnpfed.commands._args import UsageError, check_output_path, notices, positive_float, positive_int, warn
from bnpfed.report import command_record, format_table, write_json

LOOPBACK = """\
trying it on one machine: a SuperLink and three SuperNodes on 127.0.0.1 (plain HTTP: loopback only), from the
repository root, with bnpfed[flower] installed in the active environment:

  export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 OMP_NUM_THREADS=1
  D=/tmp/bnpfed-flower; mkdir -p $D/link $D/cli $D/sn0 $D/sn1 $D/sn2
  FLWR_HOME=$D/link flower-superlink --insecure --host 127.0.0.1 --port 18000 \\
      --disable-runtime-dependency-installation > $D/superlink.log 2>&1 & echo $! > $D/superlink.pid
  for i in 0 1 2; do
    FLWR_HOME=$D/sn$i flower-supernode --insecure --superlink 127.0.0.1:18000 \\
        --host 127.0.0.1 --port $((19094 + i)) --node-config "partition-id=$i num-partitions=3" \\
        > $D/supernode$i.log 2>&1 & echo $! > $D/supernode$i.pid
  done
  printf '[superlink]\\ndefault = "loopback"\\n\\n[superlink.loopback]\\naddress = "127.0.0.1:18000"\\ninsecure = true\\n' \\
      > $D/cli/config.toml
  until curl -sf http://127.0.0.1:18000/health > /dev/null; do sleep 1; done
  FLWR_HOME=$D/cli flwr supernode ls loopback     # the SuperNodes, "online" within ~10 s
  FLWR_HOME=$D/cli flwr run examples/flower_app loopback --stream \\
      --run-config 'method="fusion" rule="pooling" rounds=2 fraction=0.67 output-dir="/tmp/bnpfed-out"'
  FLWR_HOME=$D/cli flwr ls loopback --format json | grep '"status"'    # "finished:completed"
  for f in supernode0 supernode1 supernode2 superlink; do kill -TERM $(cat $D/$f.pid); done

`flwr run` exits 0 even when the run fails: check the status with `flwr ls` (and the ServerApp's log with
`flwr log RUN_ID loopback --show`). Killing `flwr run` does not stop the run: `flwr stop RUN_ID loopback` does. The
SuperNodes' partition-id / num-partitions are the clients j / J of the in-process run: the same settings and seed
give the same global model, bit for bit (here /tmp/bnpfed-out/fusion-global.npz).
"""

TLS = """\
running on several machines (Flower 1.42; install bnpfed[flower] on every machine first):

  1. one SuperLink, on the server host (Fleet, Control and Runtime API on one HTTPS port; only SuperNodes
     with a registered public key may join):
       flower-superlink --host 0.0.0.0 --port 9092 --disable-runtime-dependency-installation \\
           --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key --enable-supernode-auth
  2. the connection, on any machine holding the app directory examples/flower_app, in
     $FLWR_HOME/config.toml (default ~/.flwr):
       [superlink.prod]
       address = "SERVER:9092"
       root-certificates = "ca.crt"
  3. one SuperNode per client host, each with its own key pair and partition of the data:
       ssh-keygen -t ecdsa -b 384 -N "" -f supernode0            (writes supernode0, supernode0.pub)
       flwr supernode register supernode0.pub prod                (on the CLI machine, once per SuperNode)
       flower-supernode --superlink SERVER:9092 --root-certificates ca.crt \\
           --auth-supernode-private-key supernode0 \\
           --node-config "partition-id=0 num-partitions=3"         (1, 2, ... on the other hosts)
  4. a run:
       flwr run examples/flower_app prod --stream --run-config 'method="fusion" rule="conflation" rounds=5'
       flwr ls prod --run-id RUN_ID --format json     (status finished:completed, or :failed / :stopped)
     `flwr run` exits 0 even when the run fails: check the status, and `flwr log RUN_ID prod --show`.

TLS: the SuperLink serves HTTPS with --ssl-certfile/--ssl-keyfile (its certificate and key) and
--ssl-ca-certfile (the CA that signed it); SuperNodes and the CLI verify it against that CA
(--root-certificates, and root-certificates = "..." in the connection). --enable-supernode-auth (TLS only)
refuses a SuperNode whose public key was not registered. --insecure on SuperLink and
SuperNode, and insecure = true in the connection, turn TLS off: model updates then travel as plain HTTP that
anyone on the network can read or alter. Use it only on 127.0.0.1 (tests, trying things out).
"""

NOTES = """\
Also: --disable-runtime-dependency-installation stops the SuperLink from resolving the app's dependencies into a
fresh environment (it would download torch); FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 keep Flower
from calling flower.ai; OMP_NUM_THREADS=1 suits SuperNodes on small machines (every message runs in a fresh
process). The run config keys are the configs' fields (`bnpfed flower keys`); J is the SuperNodes'
num-partitions. A SuperNode that dies mid-run is left out (once the SuperLink says it is unavailable, it is sent
nothing more); a round with fewer than min-replies usable replies stops the run with a message naming the missing
clients. A SuperLink restarted mid-run (with --database) marks the run finished:failed: `flwr run` it again (the
same seed gives the same global model).
"""

GUIDE = LOOPBACK + "\n" + TLS + "\n" + NOTES

#: ``KEY=VALUE`` as ``flwr run --run-config`` reads it (flwr.common.config.parse_config_args).
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def add_parser(sub):
    p = sub.add_parser(
        "flower",
        help="PFNM, posterior fusion and FedAvg on Flower: how to start SuperLink, SuperNodes and a run; simulations",
        description="PFNM and posterior fusion as a Flower app (bnpfed.flower, examples/flower_app): method=\"pfnm\", "
        "or method=\"fusion\" with align=\"none\" (weight by weight, one shared initialisation) or align=\"match\" "
        "(matched posterior fusion: each client from its own initialisation, hidden units matched, then fused), or "
        "method=\"fedavg\" (the FedAvg baseline, the in-process fedavg method's server step), or the name of a "
        "registered federated method (one a plugin registers: --plugin MODULE, or the run config's plugins). "
        "`bnpfed pfnm` and `bnpfed fuse` run everything on one machine; this runs the same servers and clients as "
        "Flower strategies and client apps.",
        epilog=GUIDE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="flower_action", metavar="ACTION")
    sim = actions.add_parser(
        "sim", help="run the app in a Flower simulation on this machine (Ray), or in-process with --local",
        description="Run the Flower app on this machine: Flower's simulation runtime (Ray; one virtual SuperNode "
        "per client), or with --local in this process through an in-process grid. Prints one row per round; "
        "accuracy and NLL are the clients' evaluation of the global model on their test shards (together the "
        "test split; fraction-evaluate=0 turns it off).")
    sim.add_argument("--supernodes", type=positive_int, default=3, help="number of clients J (SuperNodes)")
    sim.add_argument("--run-config", default="", metavar="'KEY=VALUE ...'",
                     help="run config as for `flwr run --run-config`, e.g. 'method=\"pfnm\" rounds=2 hidden=\"50\"'; "
                     "`bnpfed flower keys` lists the keys")
    sim.add_argument("--local", action="store_true", help="in-process grid instead of Ray (quick, for debugging)")
    sim.add_argument("--cpus-per-client", type=positive_float, default=1.0, help="Ray CPUs per virtual SuperNode")
    sim.add_argument("--json", metavar="PATH", help="write the per-round record as JSON")
    keys = actions.add_parser("keys", help="list every run config key with its default",
                              description="Every key of [tool.flwr.app.config] / --run-config with its default, "
                              "generated from the config dataclasses.")
    keys.add_argument("--toml", action="store_true",
                      help="print the [tool.flwr.app.config] table of an app instead (every key, its default and "
                      "its help as a comment): what examples/flower_app/pyproject.toml holds")
    p.set_defaults(func=run, flower_parser=p)


def run(args) -> int:
    if args.flower_action is None:
        args.flower_parser.print_help()
        return 0
    try:
        import bnpfed.flower as flower_config   # its face: the run config's names load on first use
    except ImportError as error:
        return _fail(str(error))
    if args.flower_action == "keys":
        return _keys(flower_config, args.toml)
    return _sim(args, flower_config)


def _fail(message: str, status: int = 2) -> int:
    """``bnpfed flower: error: <message>`` on one line of stderr; returns ``status``."""
    print(f"bnpfed flower: error: {' '.join(message.split())}", file=sys.stderr)
    return status


def _keys(flower_config, toml: bool = False) -> int:
    print(flower_config.app_config_toml() if toml else format_table(flower_config.describe_keys()),
          end="" if toml else "\n")
    return 0


def _run_config(text: str) -> dict:
    """``--run-config`` as ``flwr run`` reads it; ``ValueError`` with one line if it cannot be read."""
    from flwr.common.config import parse_config_args

    text = text.strip()
    if not text:
        return {}
    leftover = _PAIR.sub("", text).strip()
    if leftover and not text.endswith(".toml"):
        raise ValueError(f"expected KEY=VALUE pairs, strings in double quotes (method=\"pfnm\" rounds=2), got "
                         f"{leftover!r}, which does not read as one")
    try:
        return parse_config_args([text])
    except Exception as error:  # click.ClickException (bad TOML), OSError (a .toml file): one line either way
        message = getattr(error, "message", None) or str(error)
        raise ValueError("expected KEY=VALUE pairs, strings in double quotes (method=\"pfnm\"), got text that does "
                         f"not read ({message.splitlines()[0] if message else type(error).__name__})") from None


def simulation_failure(error: Exception) -> str:
    """One line for a simulated run that could not go on, with how to retry: under load (other processes on the
    cores, Ray starting its workers) the simulated SuperNodes may start after ``node-timeout``."""
    text = " ".join(str(error).split())
    if "SuperNode" in text and "waited" in text:
        return (f"the simulated SuperNodes did not all start in time: {text}. On a loaded machine they can take "
                f"longer; retry, or give them more time (--run-config 'node-timeout=600') or fewer cores each "
                f"(--cpus-per-client)")
    return f"the run stopped: {text}"


def _sim(args, flower_config) -> int:
    # every key and value is checked before anything starts (Ray, the grid)
    try:
        check_output_path(args.json, "--json")
    except UsageError as error:
        return _fail(str(error))
    try:
        config = _run_config(args.run_config)
        given = config.get("plugins", "")
        if getattr(args, "plugin", None) and isinstance(given, str):
            # --plugin's modules are the run's plugins too, so that every (simulated) node imports them
            modules = dict.fromkeys([*args.plugin, *(p.strip() for p in given.split(","))])
            config["plugins"] = ",".join(m for m in modules if m)
        with notices("bnpfed flower"):   # a run-config key of bnpfed 0.1 says its new form
            settings = flower_config.parse_run_config(config)
    except ValueError as error:
        return _fail(f"--run-config: {error}")
    if settings.run.min_nodes > args.supernodes:
        return _fail(f"--run-config: min-nodes: expected at most the {args.supernodes} SuperNodes (--supernodes), "
                     f"got {settings.run.min_nodes}")
    from bnpfed.flower import server
    from bnpfed.flower.client import app as client_app

    results = []
    if args.local:
        from bnpfed.flower import LocalGrid

        results.append(server.run_federation(LocalGrid(client_app, args.supernodes), config))
    else:
        os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
        from flwr.simulation import run_simulation

        errors = []
        run_simulation(server.make_server_app(config, on_result=results.append, on_error=errors.append), client_app,
                       num_supernodes=args.supernodes,
                       backend_config={"client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0}})
        if errors:
            return _fail(simulation_failure(errors[0]), 1)
        if not results:
            return _fail("the simulation ended without a result (see the log above)", 1)
    result = results[0]
    history = result.history
    own = [c for c in ("hidden", "mean_sigma") if any(c in r for r in history)]  # matched fusion has both
    columns = ["round", "clients", "rejected", "missing", *own]
    columns += [c for c in ("accuracy", "nll", "ece", "ece15", "brier") if any(c in r for r in history)]
    rows = [{**r, "rejected": len(r["rejected"]), "missing": len(r["missing"])} for r in history]
    run_ = result.settings.run
    where = ("in-process grid" if args.local else "simulation") + (
        ", under SecAgg+" if result.settings.secure.secure_aggregation else "")
    print(f"bnpfed {result.method} on Flower ({where}): {args.supernodes} clients, {run_.dataset}, seed {run_.seed}"
          + ("" if "accuracy" in columns else "; no evaluation (fraction-evaluate=0)"))
    print(format_table(rows, columns))
    if "accuracy" in columns:
        print("accuracy, nll, ece (100 bins), ece15, brier: the global model on the clients' test shards together "
              "(client-side evaluation; the ECE from the shards' summed per-bin gaps)")
    for message in result.warnings:   # as bnpfed pfnm and bnpfed fuse say them
        warn(message)
    if args.json:
        arguments = {"supernodes": args.supernodes, "run_config": config, "local": args.local,
                     "cpus_per_client": args.cpus_per_client}
        write_json(args.json, command_record("flower sim", arguments, result.settings.as_dict(),
                                                   result.results()))
    return 0

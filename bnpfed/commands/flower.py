"""``bnpfed flower``: how to run PFNM and posterior fusion on Flower across machines, and a simulation helper.

``bnpfed pfnm`` and ``bnpfed fuse`` stay the way to run everything on one machine; this command is about the
Flower app of :mod:`bnpfed.flower` (extra ``bnpfed[flower]``). Flower is imported only when an action needs it,
so ``bnpfed --help`` works without it.

Examples::

    bnpfed flower --help                                   # how to start a SuperLink, SuperNodes and a run
    bnpfed flower keys                                     # every run config key and its default
    bnpfed flower sim --supernodes 3 --run-config 'method="fusion" rule="gaa" rounds=3'
    bnpfed flower sim --local --run-config 'method="pfnm" rounds=2 hidden="50"' --json out.json
"""

from __future__ import annotations

import argparse
import os

from bnpfed.report import format_table, write_json

GUIDE = """\
running on several machines (Flower 1.42; install bnpfed[flower] on every machine first):

  1. one SuperLink, on the server host (Fleet, Control and Runtime API on one HTTPS port):
       flower-superlink --host 0.0.0.0 --port 9092 --disable-runtime-dependency-installation \\
           --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key
  2. one SuperNode per client host, each with its own partition of the data:
       flower-supernode --superlink SERVER:9092 --root-certificates ca.crt \\
           --node-config "partition-id=0 num-partitions=3"         (1, 2, ... on the other hosts)
  3. a run, from any machine holding the app directory examples/flower_app; the connection lives in
     $FLWR_HOME/config.toml (default ~/.flwr):
       [superlink.prod]
       address = "SERVER:9092"
       root-certificates = "ca.crt"
     then
       flwr run examples/flower_app prod --stream --run-config 'method="fusion" rule="conflation" rounds=5'
       flwr ls prod --run-id RUN_ID --format json     (status finished:completed, or :failed / :stopped)
     `flwr run` exits 0 even when the run fails: check the status, and `flwr log RUN_ID prod --show`.

TLS: the SuperLink serves HTTPS with --ssl-certfile/--ssl-keyfile (its certificate and key) and
--ssl-ca-certfile (the CA that signed it); SuperNodes and the CLI verify it against that CA
(--root-certificates, and root-certificates = "..." in the connection). --insecure on SuperLink and
SuperNode, and insecure = true in the connection, turn TLS off: model updates then travel as plain HTTP that
anyone on the network can read or alter. Use it only on 127.0.0.1 (tests, trying things out).

Also: --disable-runtime-dependency-installation stops the SuperLink from resolving the app's dependencies into a
fresh environment (it would download torch); FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 keep Flower
from calling flower.ai; OMP_NUM_THREADS=1 suits SuperNodes on small machines (every message runs in a fresh
process). A SuperNode that dies mid-run is left out after round-timeout seconds; a round with fewer than
min-replies usable replies stops the run with a message naming the missing clients.
"""


def add_parser(sub):
    p = sub.add_parser(
        "flower",
        help="PFNM and posterior fusion on Flower: how to start SuperLink, SuperNodes and a run; simulations",
        description="PFNM and posterior fusion as a Flower app (bnpfed.flower, examples/flower_app). `bnpfed pfnm` "
        "and `bnpfed fuse` run everything on one machine; this runs the same servers and clients as Flower "
        "strategies and client apps.",
        epilog=GUIDE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="flower_action", metavar="ACTION")
    sim = actions.add_parser(
        "sim", help="run the app in a Flower simulation on this machine (Ray), or in-process with --local",
        description="Run the Flower app on this machine: Flower's simulation runtime (Ray; one virtual SuperNode "
        "per client), or with --local in this process through an in-process grid. Prints one row per round.")
    sim.add_argument("--supernodes", type=int, default=3, help="number of clients (SuperNodes)")
    sim.add_argument("--run-config", default="", metavar="'KEY=VALUE ...'",
                     help="run config as for `flwr run --run-config`, e.g. 'method=\"pfnm\" rounds=2 hidden=\"50\"'; "
                     "`bnpfed flower keys` lists the keys")
    sim.add_argument("--local", action="store_true", help="in-process grid instead of Ray (quick, for debugging)")
    sim.add_argument("--cpus-per-client", type=float, default=1.0, help="Ray CPUs per virtual SuperNode")
    sim.add_argument("--json", metavar="PATH", help="write the per-round record as JSON")
    actions.add_parser("keys", help="list every run config key with its default",
                       description="Every key of [tool.flwr.app.config] / --run-config with its default.")
    p.set_defaults(func=run, flower_parser=p)


def run(args) -> int:
    if args.flower_action is None:
        args.flower_parser.print_help()
        return 0
    try:
        from bnpfed.flower import server
    except ImportError as error:
        print(f"error: {error}")
        return 2
    if args.flower_action == "keys":
        return _keys(server)
    return _sim(args, server)


def _keys(server) -> int:
    from dataclasses import fields

    from bnpfed.federated.fusion import FusionConfig
    from bnpfed.federated.pfnm import PFNMSettings
    from bnpfed.flower.config import config_key

    rows = []
    for scope, cls in (("all", server.FlowerRun), ("pfnm", PFNMSettings), ("fusion", FusionConfig)):
        for f in fields(cls):
            default = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
            rows.append({"key": config_key(f.name), "method": scope, "default": str(default)})
    print(format_table(rows))
    return 0


def _sim(args, server) -> int:
    from flwr.common.config import parse_config_args

    if args.supernodes < 1:
        print(f"error: --supernodes must be >= 1, got {args.supernodes}")
        return 2
    config = parse_config_args([args.run_config]) if args.run_config.strip() else {}
    config.setdefault("min-nodes", args.supernodes)
    results = []
    if args.local:
        from bnpfed.flower.client import app as client_app
        from bnpfed.flower.local import LocalGrid

        results.append(server.run_federation(LocalGrid(client_app, args.supernodes), config))
    else:
        os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
        from flwr.simulation import run_simulation

        from bnpfed.flower.client import app as client_app

        run_simulation(server.make_server_app(config, on_result=results.append), client_app,
                       num_supernodes=args.supernodes,
                       backend_config={"client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0}})
        if not results:
            print("error: the simulation ended without a result (see the log above)")
            return 1
    result = results[0]
    columns = ["round", "partition_ids", "rejected", "missing"]
    columns += [c for c in ("hidden_sizes", "accuracy", "nll") if any(c in r for r in result.rounds)]
    rows = [{**r, "rejected": len(r["rejected"]), "missing": len(r["missing"])} for r in result.rounds]
    print(f"bnpfed {result.method} on Flower: {args.supernodes} clients "
          f"({'in-process grid' if args.local else 'simulation'})")
    print(format_table(rows, columns))
    if args.json:
        write_json(args.json, {"command": "flower sim", **result.as_dict()})
    return 0

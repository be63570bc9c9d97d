"""The ``bnpfed`` command: each subcommand parses its arguments, calls the library and prints / writes results."""

from __future__ import annotations

import argparse
import sys

from bnpfed import __version__


def _add_demo(sub):
    p = sub.add_parser(
        "demo",
        help="sample a federated layer from the Beta-Bernoulli model, match it, print recovery",
        description="Sample J clients' neurons from the Beta-Bernoulli (IBP) model of PFNM, match them with the "
        "Hungarian MAP matcher, and print true vs found number of global neurons, the adjusted Rand index of the "
        "assignments, the objective and the seconds taken.",
    )
    p.add_argument("--clients", type=int, default=10, help="number of clients J (default 10)")
    p.add_argument("--dim", type=int, default=50, help="neuron dimension D (default 50)")
    p.add_argument("--gamma0", type=float, default=20.0, help="IBP mass (default 20)")
    p.add_argument("--noise", type=float, default=0.01, help="true local noise variance (default 0.01)")
    p.add_argument("--sigma0-2", type=float, default=1.0, help="atom prior variance (default 1)")
    p.add_argument("--sweeps", type=int, default=5, help="matching sweeps after the greedy pass (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from bnpfed.demo import matching_demo, rows_as_dicts
    from bnpfed.report import format_table, write_json

    rows = rows_as_dicts(matching_demo(clients=args.clients, dim=args.dim, gamma0=args.gamma0, noise=args.noise,
                                       sigma0_2=args.sigma0_2, sweeps=args.sweeps, seed=args.seed))
    print(f"Beta-Bernoulli layer: J={args.clients} clients, D={args.dim}, gamma0={args.gamma0}, "
          f"noise variance {args.noise}, seed {args.seed}")
    print(format_table(rows))
    if args.json:
        write_json(args.json, {"command": "demo", "arguments": vars(args) | {"func": None}, "rows": rows})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bnpfed",
        description="Probabilistic federated learning in Pyro: Bayesian nonparametric neuron matching (PFNM) and "
        "posterior fusion of variational Bayesian networks.",
    )
    parser.add_argument("--version", action="version", version=f"bnpfed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

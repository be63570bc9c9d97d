"""The ``bnpfed`` command. Each subcommand lives in :mod:`bnpfed.commands`; this file only wires them up."""

from __future__ import annotations

import argparse
import sys

from bnpfed import __version__
from bnpfed.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bnpfed",
        description="Probabilistic federated learning in Pyro: Bayesian nonparametric neuron matching (PFNM) and "
        "posterior fusion of variational Bayesian networks.",
    )
    parser.add_argument("--version", action="version", version=f"bnpfed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
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

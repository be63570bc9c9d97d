"""The ``bnpfed`` command. Each subcommand lives in :mod:`bnpfed.commands`; this file only wires them up.

Usage::

    >>> main(["demo", "--clients", "3", "--dim", "10", "--gamma0", "0"])
    2
"""

from __future__ import annotations

import argparse
import sys

from bnpfed import __version__
from bnpfed.commands import COMMANDS


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``bnpfed pfnm: error: argument --lr: ...``, and exit 2 (the
    full usage of a command with forty options would bury the message; ``--help`` shows it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="bnpfed",
        description="Probabilistic federated learning in Pyro: Bayesian nonparametric neuron matching (PFNM) and "
        "posterior fusion of variational Bayesian networks.",
        epilog="Every command checks all its arguments and input files before it trains anything: a bad one exits "
        "with status 2 and a message naming the flag; a run that fails while training exits with status 1.",
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

"""The ``bnpfed`` command. Each subcommand lives in :mod:`bnpfed.commands`; this file only wires them up.

Plugins (:mod:`bnpfed.plugins`): every command takes ``--plugin MODULE`` (repeatable). The modules, and the entry
points of the group ``bnpfed.plugins``, are imported before the parser is built, so that the flags that take a
registered name (``--rule``, ``--methods``, ``--prior``, ``--likelihood``) see what they register.

Usage::

    >>> main(["demo", "--clients", "3", "--dim", "10", "--gamma0", "0"])
    2
"""

from __future__ import annotations

import argparse
import sys

from bnpfed import __version__
from bnpfed.commands import COMMANDS
from bnpfed.plugins import PluginError, load_plugins

#: The flag that names a plugin module, on every command.
PLUGIN_FLAG = "--plugin"
PLUGIN_HELP = ("import MODULE first (repeatable): the rules, priors, likelihoods and methods it registers "
               "become names every flag accepts")


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``bnpfed pfnm: error: argument --lr: ...``, and exit 2 (the
    full usage of a command with forty options would bury the message; ``--help`` shows it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def plugin_modules(argv) -> list[str]:
    """The modules of every ``--plugin MODULE`` (or ``--plugin=MODULE``, or an abbreviation argparse would take,
    ``--plu`` and longer) in ``argv``, up to a ``--``: read before the parser exists, since the parser's choices
    depend on what the plugins register.

    >>> plugin_modules(["fuse", "--plugin", "my_rules", "--rule", "mine", "--plugin=more.rules"])
    ['my_rules', 'more.rules']
    """
    modules, args = [], list(argv)
    for i, arg in enumerate(args):
        if arg == "--":
            break
        flag, equals, value = arg.partition("=")
        if len(flag) < len("--plu") or not PLUGIN_FLAG.startswith(flag):
            continue
        if equals:
            modules.append(value)
        elif i + 1 < len(args):
            modules.append(args[i + 1])
    return modules


def _add_plugin_flag(parser: argparse.ArgumentParser) -> None:
    """``--plugin`` on ``parser`` and on every subcommand under it (``bnpfed flower sim`` too)."""
    parser.add_argument(PLUGIN_FLAG, action="append", metavar="MODULE", help=PLUGIN_HELP)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):   # aliases name one parser more than once
                _add_plugin_flag(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="bnpfed",
        description="Probabilistic federated learning in Pyro: Bayesian nonparametric neuron matching (PFNM) and "
        "posterior fusion of variational Bayesian networks.",
        epilog="Every command checks all its arguments and input files before it trains anything: a bad one exits "
        "with status 2 and a message naming the flag; a run that fails while training exits with status 1. Every "
        "command takes --plugin MODULE: a module whose import registers fusion rules, priors, likelihoods or "
        "federated methods (bnpfed.plugins).",
    )
    parser.add_argument("--version", action="version", version=f"bnpfed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    _add_plugin_flag(parser)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    modules = plugin_modules(argv)
    try:
        load_plugins(modules)
    except PluginError as error:
        command = next((a for a in argv if not a.startswith("-")), None)
        prog = "bnpfed" + (f" {command}" if command in {c.__name__.rpartition('.')[2] for c in COMMANDS} else "")
        print(f"{prog}: error: {PLUGIN_FLAG}: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    args.plugin = modules   # what was loaded (a subcommand's default would hide a --plugin given before it)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

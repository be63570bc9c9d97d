"""Subcommands of ``bnpfed``: each module has ``add_parser(subparsers)`` and a ``run(args)`` it registers.

A command parses arguments, calls the library, and prints / plots / writes results; it adds no math of its own.
"""

from bnpfed.commands import demo, evaluate, flower, fuse, match, mixture, pfnm

__all__ = ["COMMANDS"]

COMMANDS = [demo, pfnm, fuse, match, mixture, evaluate, flower]

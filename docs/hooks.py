"""MkDocs hooks of bnpfed's docs site (``hooks:`` in ``mkdocs.yml``).

* The tutorials: the executed notebooks of ``tutorials/`` are added to the site as ``tutorials/<name>.ipynb``
  pages from where they are stored (mkdocs-jupyter renders them as stored, without running them), so the
  repository holds each notebook once.
* The command line: a page holding ``<!-- bnpfed-cli-help -->`` gets, in its place, the ``--help`` of ``bnpfed``
  and of every subcommand, written by argparse from the parser of ``bnpfed.cli`` when the site is built, so the
  page is always the command line of the code it documents.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import mkdocs.plugins
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"
CLI_MARKER = "<!-- bnpfed-cli-help -->"
HELP_COLUMNS = 100  # argparse wraps --help at the terminal's width; a fixed one makes the page the same everywhere


@mkdocs.plugins.event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files: Files, config) -> Files:
    notebooks = sorted(TUTORIALS.glob("*.ipynb"))
    if not notebooks:
        raise mkdocs.plugins.PluginError(f"no tutorial notebooks found in {TUTORIALS}")
    for path in notebooks:
        files.append(File(f"tutorials/{path.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CLI_MARKER not in markdown:
        return markdown
    return markdown.replace(CLI_MARKER, cli_reference())


def cli_reference() -> str:
    """Markdown: one section per command, ``bnpfed`` first, each with its ``--help`` as argparse prints it."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bnpfed.cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_COLUMNS)
    try:
        sections = []
        for words, parser in commands(build_parser(), ["bnpfed"]):
            level = "#" * min(len(words) + 1, 4)
            sections.append(f"{level} `{' '.join(words)}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
        return "\n".join(sections)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def commands(parser: argparse.ArgumentParser, words: list[str]):
    """``(words, parser)`` for a parser and, depth first, each of its subcommands in the order they were added."""
    yield words, parser
    for action in parser._actions:  # argparse keeps its subcommands only here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias of a subcommand maps to the same parser: listed once
                    seen.add(id(sub))
                    yield from commands(sub, [*words, name])

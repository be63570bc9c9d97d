"""The ``bnpfed`` command line: the entry point, ``--help`` (short) and ``--help-all``, and ``bnpfed demo``."""

import json
import re
import subprocess
import sys

import pytest

from bnpfed.cli import main


def test_help_lists_the_commands(capsys):
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "pfnm", "fuse", "flower"):
        assert command in out


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "bnpfed.cli", "--help"], capture_output=True, text=True, check=True)
    assert "usage: bnpfed" in out.stdout


def test_demo_prints_recovery_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--clients", "4", "--dim", "20", "--gamma0", "5", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "true_atoms" in out and "adjusted_rand" in out and "marginal" in out
    assert f"wrote results to {path}" in out
    payload = json.loads(path.read_text())
    assert payload["command"] == "demo" and payload["settings"]["clients"] == 4
    rows = payload["results"]["runs"][0]["rows"]
    assert len(rows) == 4 and rows[2]["objective"] == "marginal" and rows[3]["objective"] == "empirical-bayes"
    assert rows[2]["adjusted_rand"] > 0.9 and rows[3]["adjusted_rand"] > 0.9


def test_demo_noise_is_an_alias_of_sigma2(tmp_path):
    path = tmp_path / "demo.json"
    assert main(["demo", "--clients", "3", "--dim", "10", "--noise", "0.05", "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert payload["settings"]["sigma2"] == 0.05 and payload["results"]["runs"][0]["rows"][1]["sigma2"] == 0.1


@pytest.mark.parametrize("command", ["pfnm", "fuse"])
def test_the_default_help_shows_what_a_user_needs_in_at_most_120_lines_and_help_all_every_flag(command, capsys,
                                                                                               monkeypatch):
    import argparse

    from bnpfed.cli import build_parser
    from bnpfed.commands import _args

    monkeypatch.setattr(_args, "help_width", lambda: 100)   # a terminal of 102 columns
    for flag in ("--help", "--help-all"):
        with pytest.raises(SystemExit) as stop:
            main([command, flag])
        assert stop.value.code == 0
    short, whole = capsys.readouterr().out.split(f"usage: bnpfed {command}")[1:]
    assert len(short.splitlines()) <= 120 < len(whole.splitlines())
    parser = build_parser()._subparsers._group_actions[0].choices[command]
    hidden = [a for a in parser._actions if getattr(a, "full_help", None) is not None]
    assert hidden and all(a.full_help for a in hidden)
    for action in parser._actions:
        if action.help is argparse.SUPPRESS and getattr(action, "full_help", None) is None:
            continue   # a flag of bnpfed 0.1 that keeps working for one release (--starts: --experimental)
        for option in action.option_strings:
            assert re.search(rf"(^|\s|, ){re.escape(option)}\b", whole, re.M), option
            shown = action.help is not argparse.SUPPRESS
            assert bool(re.search(rf"(^|\s|, ){re.escape(option)}[ ,\n]", short.split("examples:")[0], re.M)) \
                or not shown, option
    assert "--experimental KEY=VALUE" in whole and "--experimental" not in short

"""The ``bnpfed`` command line."""

import json
import subprocess
import sys

from bnpfed.cli import main


def test_help_lists_the_commands(capsys):
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "demo" in out


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "bnpfed.cli", "--help"], capture_output=True, text=True, check=True)
    assert "usage: bnpfed" in out.stdout


def test_demo_prints_recovery_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--clients", "4", "--dim", "20", "--gamma0", "5", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "true_atoms" in out and "adjusted_rand" in out and "marginal" in out
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 3 and rows[2]["objective"] == "marginal"
    assert rows[2]["adjusted_rand"] > 0.9

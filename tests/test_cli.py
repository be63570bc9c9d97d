"""The ``bnpfed`` command line: the entry point, ``--help``, and ``bnpfed demo``."""

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

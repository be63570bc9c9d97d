"""Every tutorial notebook is stored with the outputs of a full-size run, and runs top to bottom (in a reduced size:
BNPFED_TUTORIAL_QUICK=1)."""

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("*.ipynb"))


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_is_stored_with_its_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "not executed once, top to bottom"
    outputs = [o for c in code for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure stored"
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"], "a warning was stored"
    stored = json.dumps([c.outputs for c in code] + [c.metadata for c in nb.cells])
    for machine_path in {str(ROOT.resolve()), sys.prefix, str(Path.home())} - {"", "/"}:
        assert machine_path not in stored, f"the stored outputs name a path of this machine: {machine_path}"


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path, monkeypatch, tmp_path):
    monkeypatch.setenv("BNPFED_TUTORIAL_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors

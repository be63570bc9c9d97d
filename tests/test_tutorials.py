"""Every tutorial notebook runs top to bottom (in a reduced size: BNPFED_TUTORIAL_QUICK=1)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

TUTORIALS = sorted((Path(__file__).parent.parent / "tutorials").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path, monkeypatch, tmp_path):
    monkeypatch.setenv("BNPFED_TUTORIAL_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors

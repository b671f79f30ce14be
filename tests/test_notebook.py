"""examples/quickstart.ipynb runs top to bottom (a few steps, RDP accounting to keep it quick)."""

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("tokenizers")

NOTEBOOK = Path(__file__).parents[1] / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("DPZERO_QUICKSTART_STEPS", "4")
    monkeypatch.setenv("DPZERO_QUICKSTART_ACCOUNTANT", "rdp")
    root = str(Path(__file__).parents[1])                  # the kernel imports this checkout's dpzero_jax
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")  # stored clean
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)                 # the loss / epsilon figure
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "test perplexity" in printed
    before, after, epsilon = map(float, re.search(r"held-out loss (\S+) -> (\S+) at epsilon (\S+)", printed).groups())
    assert after < before and 0 < epsilon <= 3.0
    reported, reloaded = map(float, re.search(r"reported (\S+), reloaded (\S+)", printed).groups())
    assert reloaded == pytest.approx(reported, abs=2e-4)                          # the export is the trained model

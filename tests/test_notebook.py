"""The example notebooks run top to bottom: examples/quickstart.ipynb (a few steps, RDP accounting to keep it quick)
and examples/custom_loop.ipynb (a user's nnx model trained through clipped_grad + gaussian_privatizer)."""

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).parents[1] / "examples" / "quickstart.ipynb"
CUSTOM_LOOP = Path(__file__).parents[1] / "examples" / "custom_loop.ipynb"


def _execute(path, tmp_path, monkeypatch):
    root = str(Path(__file__).parents[1])                  # the kernel imports this checkout's dpzero_jax
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    notebook = nbformat.read(path, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")  # stored clean
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    return outputs, "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


def test_custom_loop_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("DPZERO_CUSTOM_LOOP_STEPS", "40")
    _, printed = _execute(CUSTOM_LOOP, tmp_path, monkeypatch)
    assert "front end: program, mode: bk" in printed and "hidden/kernel" in printed      # the plan, explained
    assert "first update equals private_value_and_grad's: True (max abs difference 0)" in printed
    before, after, epsilon = map(float, re.search(r"test loss (\S+) -> (\S+), test accuracy \S+ at epsilon (\S+)",
                                                  printed).groups())
    assert after < before and 0 < epsilon <= 3.0 + 1e-6


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("DPZERO_QUICKSTART_STEPS", "4")
    monkeypatch.setenv("DPZERO_QUICKSTART_ACCOUNTANT", "rdp")
    outputs, printed = _execute(NOTEBOOK, tmp_path, monkeypatch)
    assert any("image/png" in o.get("data", {}) for o in outputs)                 # the loss / epsilon figure
    assert "test perplexity" in printed
    before, after, epsilon = map(float, re.search(r"held-out loss (\S+) -> (\S+) at epsilon (\S+)", printed).groups())
    assert after < before and 0 < epsilon <= 3.0
    reported, reloaded = map(float, re.search(r"reported (\S+), reloaded (\S+)", printed).groups())
    assert reloaded == pytest.approx(reported, abs=2e-4)                          # the export is the trained model

"""The README's and docs' Python examples run as written, each block on its own."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[1]
BLOCKS = [(path.relative_to(ROOT).as_posix(), i, code)
          for path in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]
          if path.exists()
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))]


def test_readme_python_example_runs():
    readme = (ROOT / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, re.S)[:1]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["losses"].shape == (8,) and namespace["norms"].shape == (8,)
    assert int(namespace["stats"].num_included) == 8


@pytest.mark.slow   # compiles a ViT and an RMM model: about a minute on a busy 2-core CPU
@pytest.mark.parametrize("name, index, code", BLOCKS[1:] if BLOCKS and BLOCKS[0][:2] == ("README.md", 0) else BLOCKS,
                         ids=lambda v: str(v)[:20])
def test_every_python_block_runs_on_its_own(name, index, code, tmp_path, monkeypatch):
    # in a fresh directory: blocks that train write their run directory (e.g. runs/audit) relative to it, and a
    # second run of the suite would otherwise find the first one's outputs there and refuse to start anew
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, f"{name} block {index}", "exec"), namespace)   # a fresh namespace: no block relies on another

"""The README's Python example runs as written."""

import pathlib
import re


def test_readme_python_example_runs():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, re.S)[:1]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["losses"].shape == (8,) and namespace["norms"].shape == (8,)
    assert int(namespace["stats"].num_included) == 8

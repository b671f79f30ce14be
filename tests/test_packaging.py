"""Packaging: the top-level ``kernels/`` folder is installed as ``dpzero_jax_kernels`` (a bare ``kernels`` would shadow
PyPI's ``kernels``, the Hugging Face kernel hub that ``transformers`` looks for), pyproject.toml lists every package,
and no code or document still imports the bare name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_kernels_are_installed_as_dpzero_jax_kernels_and_bare_kernels_is_not_this_repo(tmp_path):
    """In a fresh interpreter started outside the checkout (the working directory is not on sys.path), as a user's
    script would be: ``dpzero_jax_kernels`` imports, ``kernels`` is absent or someone else's package."""
    code = ("import importlib.util, json, dpzero_jax_kernels.ghost_norm as g; "
            "spec = importlib.util.find_spec('kernels'); "
            "print(json.dumps({'ghost_norm': g.__file__, 'kernels': None if spec is None else "
            "(spec.origin or '') + ' ' + ' '.join(spec.submodule_search_locations or [])}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["ghost_norm"]).name == "__init__.py"
    assert found["kernels"] is None or str(ROOT / "kernels") not in found["kernels"], found["kernels"]


def test_dpzero_jax_kernels_is_the_engines_kernels():
    from dpzero_jax import engine, pergrad
    from dpzero_jax_kernels import ghost_norm
    from dpzero_jax_kernels.ghost_norm import api, reference

    assert engine.ghost_norm is ghost_norm and pergrad.ghost_norm is ghost_norm
    assert api.reference is reference and "xla" in ghost_norm.NORM_KERNELS


def test_pyproject_lists_every_package():
    """Packages are listed, not found (the kernels folder is renamed): a new subpackage must be added by hand."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]
    assert package_dir == {"dpzero_jax_kernels": "kernels"}
    on_disk = set()
    for top, name in (("dpzero_jax", "dpzero_jax"), ("kernels", "dpzero_jax_kernels")):
        for init in (ROOT / top).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                on_disk.add(".".join([name, *init.parent.relative_to(ROOT / top).parts]))
    assert set(setuptools["packages"]) == on_disk


def test_no_bare_kernels_imports_left():
    pattern = re.compile(r"^\s*(from\s+kernels[\s.]|import\s+kernels\b)|\bkernels\.ghost_norm\b", re.M)
    offenders = []
    for folder in ("dpzero_jax", "kernels", "tests", "experiments", "examples", "docs", "."):
        for path in (ROOT / folder).glob("*" if folder == "." else "**/*"):
            if path.suffix in (".py", ".md", ".ipynb") and path.is_file():
                text = path.read_text()
                offenders += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in pattern.finditer(text)]
    assert not offenders, offenders


def test_one_source_of_truth_for_dependencies():
    assert not (ROOT / "setup.cfg").exists() and not (ROOT / "setup.py").exists()
    assert not (ROOT / "requirements.txt").exists()
    project = PYPROJECT["project"]
    names = {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}
    # a lean core (scipy and etils are required by jax and orbax anyway; the library imports them directly)
    assert names == {"jax", "flax", "optax", "numpy", "scipy", "dp-accounting", "orbax-checkpoint", "etils",
                     "safetensors"}
    extras = project["optional-dependencies"]
    train = {re.split(r"[<>=; ]", r, maxsplit=1)[0].lower() for r in extras["train"]}
    assert train == {"dpzero_jax[plot]", "scikit-learn", "tqdm", "pyyaml"}   # `dpzero train` as the quick start runs it
    assert any(r.startswith("matplotlib") for r in extras["plot"])
    # tests/test_docs.py builds the docs; tests/test_metric_writers.py reads TensorBoard event files
    assert "dpzero_jax[train,hf,docs,tensorboard]" in extras["test"]
    assert [r.split(">")[0] for r in extras["tensorboard"]] == ["tensorboardX"]
    assert {re.split(r"[<>=\[]", r, maxsplit=1)[0] for r in project["optional-dependencies"]["docs"]} == {
        "mkdocs", "mkdocstrings"}


def _uninstalled(monkeypatch, *modules):
    for name in modules:   # None in sys.modules: importing it raises ModuleNotFoundError, as when not installed
        monkeypatch.setitem(sys.modules, name, None)


def test_without_the_train_extra_the_digits_and_yaml_configs_say_what_to_install(monkeypatch, tmp_path, capsys):
    from dpzero_jax import data, train  # noqa: F401 -- flax (imported by train) needs yaml itself: loaded before
    from dpzero_jax.cli import main

    _uninstalled(monkeypatch, "sklearn", "sklearn.datasets", "sklearn.model_selection", "yaml")
    with pytest.raises(ModuleNotFoundError, match=r"the digits data set needs 'sklearn'.*dpzero_jax\[train\]"):
        data.load_digits()
    config = tmp_path / "run.yaml"
    config.write_text("steps: 2\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    assert "a YAML --config file needs 'yaml', which is not installed: pip install 'dpzero_jax[train]'" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_without_tqdm_training_runs_without_a_bar(monkeypatch, tmp_path, capsys):
    from dpzero_jax.train import TrainConfig, Trainer

    _uninstalled(monkeypatch, "tqdm", "tqdm.auto")
    result = Trainer(TrainConfig(out=str(tmp_path), steps=2, batch_size=32, log_every=1, checkpoint_every=0,
                                 plot=False, progress=True, noise_multiplier=1.0)).run()
    assert result.steps == 2
    assert "no progress bar: tqdm is not installed (pip install 'dpzero_jax[train]')" in capsys.readouterr().err



def test_the_suite_fails_fast_instead_of_hanging(pytestconfig):
    """The guards of ``tests/conftest.py`` and ``pyproject.toml`` against a CI run that hangs: XLA:CPU's collectives
    wait at least 600 s (not 40) before aborting the process, a test stuck for 10 minutes has its stacks printed and its
    process ended, and under pytest-xdist a dead worker is not replaced (its ``loadfile`` scheduler can then wait
    forever) unless the command line asks for restarts."""
    import types

    import conftest

    terminate = [f for f in os.environ["XLA_FLAGS"].split()
                 if f.startswith("--xla_cpu_collective_call_terminate_timeout_seconds=")]
    assert terminate and int(terminate[-1].split("=")[1]) >= 600, terminate   # a flag the environment sets is kept
    assert float(pytestconfig.getini("faulthandler_timeout")) == 600
    assert pytestconfig.getini("faulthandler_exit_on_timeout") is True
    for given, expected in ((None, "0"), ("2", "2")):
        config = types.SimpleNamespace(option=types.SimpleNamespace(maxworkerrestart=given))
        conftest.pytest_configure(config)
        assert config.option.maxworkerrestart == expected
    without_xdist = types.SimpleNamespace(option=types.SimpleNamespace())
    conftest.pytest_configure(without_xdist)
    assert not hasattr(without_xdist.option, "maxworkerrestart")


def test_a_simulated_cpu_mesh_raises_xla_collective_timeouts():
    """``dpzero train --mesh`` on a CPU asks for virtual devices (``train_setup.request_cpu_device_count``) and, as
    the test suite does, raises XLA:CPU's 40 s collective abort to 600 s through ``XLA_FLAGS`` -- each flag unless
    the environment sets it already."""
    from dpzero_jax.train_setup import CPU_COLLECTIVE_TIMEOUTS, relax_cpu_collective_timeouts

    environ = {}
    relax_cpu_collective_timeouts(environ)
    assert environ["XLA_FLAGS"].split() == [f"{flag}={value}" for flag, value in CPU_COLLECTIVE_TIMEOUTS.items()]
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                            "--xla_cpu_collective_call_terminate_timeout_seconds=30"}
    relax_cpu_collective_timeouts(environ)
    assert environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4",
                                            "--xla_cpu_collective_call_terminate_timeout_seconds=30",
                                            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120"]
    relax_cpu_collective_timeouts(environ)   # nothing twice
    assert len(environ["XLA_FLAGS"].split()) == 3
    for flag, value in CPU_COLLECTIVE_TIMEOUTS.items():   # the suite's own guard sets the same values
        assert f"{flag}={value}" in os.environ["XLA_FLAGS"]

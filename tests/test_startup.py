"""Start-up: ``import dpzero_jax`` imports no heavy dependency (submodules load on first use, PEP 562), and every
exported name still works."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

HEAVY = ("jax", "flax", "optax", "dp_accounting", "numpy", "scipy", "matplotlib", "orbax", "safetensors")


def test_import_is_lazy():
    code = ("import sys, dpzero_jax; print(dpzero_jax.__file__); "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules) or 'none'); "
            "print(','.join(sorted(m for m in sys.modules if m.startswith('dpzero_jax.'))) or 'none')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    import dpzero_jax

    assert out == [dpzero_jax.__file__, "none", "none"], out


def test_exported_names_resolve_and_are_listed():
    import dpzero_jax as dz
    from dpzero_jax import config, engine

    listed = dir(dz)
    for name in dz.__all__:
        assert name in listed
        value = getattr(dz, name)
        if name[0].islower() and not callable(value):
            assert isinstance(value, types.ModuleType) and value.__name__ == f"dpzero_jax.{name}"
    assert dz.DPConfig is config.DPConfig and dz.private_value_and_grad is engine.private_value_and_grad
    assert dz.engine is engine and "engine" in listed and dz.tape.__name__ == "dpzero_jax.tape"
    namespace: dict = {}
    exec("from dpzero_jax import *", namespace)
    assert set(dz.__all__) <= set(namespace) and namespace["make_plan"] is engine.make_plan
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = dz.no_such_name


@pytest.mark.parametrize("command", ["plan", "privacy"])
def test_help_of_jax_free_commands_imports_no_jax(command):
    """``dpzero plan --help`` and ``dpzero privacy --help`` build the parser without ``train``'s flags (which come from
    TrainConfig and import JAX)."""
    code = (f"import sys, runpy; sys.argv = ['dpzero', {command!r}, '--help']\n"
            "try:\n    runpy.run_module('dpzero_jax', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            f"print('heavy:', ','.join(m for m in {HEAVY!r} if m in sys.modules) or 'none')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"dpzero {command}" in out and out.strip().splitlines()[-1] == "heavy: none", out

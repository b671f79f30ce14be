"""Test setup: 8 virtual CPU devices (must happen before jax initialises its backends), and XLA:CPU's code generator
without LLVM's optimisations.

The suite is bound by XLA compiles of small programs: ``--xla_backend_optimization_level=0`` lowers only LLVM's
optimisation of the generated machine code (XLA's own HLO passes, fusion and buffer assignment are unchanged; float32
results can differ in their last bits, as between two CPUs: a jitted loss against the same loss run eagerly by
1.5e-6 relative), which took the training tests from 346 to 231 s on two cores and the suite from 31 to 22.5
minutes. Both flags are set in ``XLA_FLAGS``, so the command-line runs the tests start inherit them; a flag the
environment already sets is kept. Left out where libtpu is installed, so that the libtpu-gated tests compile for TPU
topologies with that compiler's defaults.

A third pair of flags gives the 8 devices' collectives 600 s, not XLA's 40, to meet before XLA aborts the process:
on an overloaded two-core host (two workers' 8 device threads each), a device thread can be descheduled past 40 s,
and the abort took a worker down in CI (``Fatal Python error: Aborted`` in an eager sum over sharded arrays) --
after which pytest-xdist's ``loadfile`` scheduler waited forever on the replaced worker (pytest-xdist issue 784):
a dead worker now fails the run (:func:`pytest_configure`) and ``pyproject.toml`` ends a test stuck for 10 minutes.
"""

import importlib.util
import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"] and importlib.util.find_spec("libtpu") is None:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# XLA reads XLA_FLAGS when its backend starts, not at import: importing the library here is early enough
from dpzero_jax.train_setup import relax_cpu_collective_timeouts  # noqa: E402

relax_cpu_collective_timeouts()   # the same 600 s / 120 s that `dpzero train --mesh` sets on a CPU

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_configure(config):
    """Under pytest-xdist, a worker that dies fails the run instead of being replaced (``--max-worker-restart 0``
    unless the command line says otherwise): after replacing a crashed worker, the ``loadfile`` scheduler of
    ``.ci/run`` can wait forever (pytest-xdist issue 784). Runs before xdist's own ``pytest_configure`` (``trylast``),
    which reads the option."""
    if getattr(config.option, "maxworkerrestart", False) is None:
        config.option.maxworkerrestart = "0"


@pytest.fixture
def fake_gcs(monkeypatch, tmp_path):
    """A fake ``gs://`` bucket in memory (``tests/fake_gcs.py``): ``fake_gcs.url`` is its root URL, ``files()`` its
    objects, ``local_leak()`` any local ``gs:`` folder created by mistake (the test runs in ``tmp_path / "cwd"``)."""
    import fake_gcs as fake

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return fake.install(monkeypatch, cwd)

"""Test setup: 8 virtual CPU devices (must happen before jax initialises its backends)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def fake_gcs(monkeypatch, tmp_path):
    """A fake ``gs://`` bucket in memory (``tests/fake_gcs.py``): ``fake_gcs.url`` is its root URL, ``files()`` its
    objects, ``local_leak()`` any local ``gs:`` folder created by mistake (the test runs in ``tmp_path / "cwd"``)."""
    import fake_gcs as fake

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return fake.install(monkeypatch, cwd)

"""An in-memory stand-in for Google Cloud Storage, reached through ``gs://`` URLs by ``etils.epath`` (no network).

``etils.epath`` sends a ``gs://`` path to the backend in ``etils.epath.gpath._PREFIX_TO_BACKEND["gs"]`` (its fsspec
backend, which would load ``gcsfs``). :func:`install` puts there, for one test (``monkeypatch``), an fsspec backend
whose filesystem is :class:`FakeGCS`: fsspec's ``MemoryFileSystem`` with its own store, answering for ``gs://``.
Everything written through ``epath`` -- by this package, or by orbax's own ``epath`` calls -- lands in that store;
code that bypasses ``epath`` (``open``, ``os``, ``shutil``, ``pathlib``) would instead create a local ``gs:``
folder, which the fixture's ``local_leak`` reports (the test runs in its own temporary working directory).
Orbax's ``CheckpointManager`` works on it (directories, JSON items, its ``commit_success.txt`` protocol for GCS);
tensorstore (orbax's array writer for ``jax.Array`` leaves) has its own ``gs://`` driver and does not see this store.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from etils import epath
from etils.epath import backend, gpath
from fsspec.implementations.memory import MemoryFileSystem


class FakeGCS(MemoryFileSystem):
    """``MemoryFileSystem`` answering for ``gs://bucket/key`` (stored as ``/bucket/key``)."""

    protocol = ("gs", "gcs")

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        for prefix in ("gs://", "gcs://"):
            path = path.removeprefix(prefix)
        return MemoryFileSystem._strip_protocol("/" + path.lstrip("/"))


class _FakeBackend(backend._FileSystemSpecBackend):   # noqa: SLF001 -- epath's fsspec backend, one filesystem
    def __init__(self, fs: FakeGCS):
        self._fake = fs

    def fs(self, path):
        return self._fake

    def glob(self, path):
        return ["gs://" + p.lstrip("/") for p in self._fake.glob(path)]


@dataclasses.dataclass
class FakeBucket:
    """``url``: the root of the test's bucket (``gs://fake-bucket``); ``fs``: the store; ``cwd``: the local
    working directory of the test (where a path wrongly taken as local would appear)."""

    url: str
    fs: FakeGCS
    cwd: Path

    def path(self, *parts: str) -> epath.Path:
        return epath.Path(self.url, *parts)

    def files(self) -> dict[str, bytes]:
        """Every object in the store: ``gs://`` URL -> content."""
        return {"gs:/" + key: bytes(f.getbuffer()) for key, f in self.fs.store.items()}

    def local_leak(self) -> list[str]:
        """Local paths created by code that treated a ``gs://`` URL as a local path (should be empty)."""
        return sorted(str(p) for p in self.cwd.glob("gs:*"))


def install(monkeypatch, cwd: Path) -> FakeBucket:
    """Route ``gs://`` to a fresh in-memory store for the duration of a test; ``cwd`` becomes the working directory."""
    fs = FakeGCS(global_store=False, skip_instance_cache=True)
    monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", _FakeBackend(fs))   # noqa: SLF001
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)   # TensorFlow's gfile would bypass the table
    # orbax asks Google's storage API whether a gs:// bucket has a hierarchical namespace (google-cloud-storage,
    # network): the fake bucket has a flat one, as a plain GCS bucket (orbax then commits with commit_success.txt)
    try:   # a private module of orbax: if it moves, only tests that use orbax on the bucket are affected
        from orbax.checkpoint._src.path import gcs_utils
    except ImportError:
        gcs_utils = None
    if hasattr(gcs_utils, "is_hierarchical_namespace_enabled"):
        monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    monkeypatch.chdir(cwd)
    return FakeBucket(url="gs://fake-bucket", fs=fs, cwd=cwd)

"""A training run's output directory treated as a transaction.

Paths are :class:`etils.epath.Path` (:func:`as_path`): a local path, or a ``gs://`` / ``s3://`` / ``az://`` / ``hf://``
URL written through fsspec (``gcsfs`` for ``gs://`` must be installed; ``Path("gs://b/run")`` of ``pathlib`` would be
the local folder ``./gs:/b/run``). Local paths behave exactly as with ``pathlib``. Other ``scheme://`` URLs are
refused (:func:`check_url`).

* :func:`check_output_paths`: ``out`` (and ``export``) are usable -- a directory or creatable, and writable -- before
  any work starts; ``export`` is never the checkpoint being fine-tuned (:func:`check_export_target`).
* :class:`RunLock`: one run per directory. The lock file ``out/.dpzero.lock`` names the process holding it; a second
  run is refused with that PID, and a lock left by a process that no longer exists (same host) is taken over. On an
  object store the lock is advisory (no atomic create; see :class:`RunLock`).
* :class:`MetricsFile`: ``metrics.jsonl`` streamed row by row (locally), or staged and uploaded (object stores).
* :func:`check_fresh`: a new run never starts in a directory holding another run's checkpoints, metrics or summary
  (its privacy ledger would be lost); resume it or choose another directory.
* :func:`set_aside`: a checkpoint that fails to restore is renamed ``STEP.unreadable-TIME`` with the reason in
  ``SET_ASIDE_REASON.txt`` -- only once a good checkpoint was found and the resume accepted; a refused resume never
  renames, moves or deletes anything.
* :func:`copy_hf_extras`: an export carries the source checkpoint's tokenizer files and generation config;
  :func:`upload_directory` copies a locally written directory (an export) to a remote one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

from etils import epath

LOCK_NAME = ".dpzero.lock"
# files of a Hugging Face checkpoint directory that an export copies when the source has them (the weights and
# config.json are written by the export itself)
HF_EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "vocab.txt",
                  "merges.txt", "added_tokens.json", "generation_config.json", "preprocessor_config.json")

REMOTE_SCHEMES = ("gs", "s3", "az", "hf")   # the URL schemes of etils.epath (through fsspec)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

log = logging.getLogger(__name__)


def check_url(path: str, what: str) -> None:
    """A ``scheme://`` path must use one of :data:`REMOTE_SCHEMES` (anything else would silently be a local folder
    named ``scheme:``)."""
    match = _URL.match(str(path))
    if match and match.group(1) not in REMOTE_SCHEMES:
        raise ValueError(f"{what}={path!r}: URLs {match.group(1)}:// are not supported; use a local path or one of "
                         + ", ".join(f"{s}://" for s in REMOTE_SCHEMES))


def is_remote(path) -> bool:
    """``path`` is a ``gs://`` / ``s3://`` / ``az://`` / ``hf://`` URL (or an epath of one)."""
    return str(path).startswith(tuple(f"{s}://" for s in REMOTE_SCHEMES))


def as_path(path) -> epath.Path:
    """``path`` (str, ``pathlib.Path`` or ``epath.Path``) as an ``epath.Path``: local, or remote for a URL."""
    return path if isinstance(path, epath.Path) else epath.Path(path)


def resume_mode(resume) -> bool | str:
    if resume is False or resume is True or resume == "or-start":
        return resume
    raise ValueError(f"resume must be False, True or 'or-start', got {resume!r}")


def check_export_target(export: str, source: str | None) -> None:
    """``export`` must not be the Hugging Face checkpoint directory that the run starts from."""
    if source is not None and not is_remote(export) and os.path.realpath(export) == os.path.realpath(source):
        raise ValueError(f"TrainConfig.export={export!r} is the source checkpoint of model='hf:{source}'; exporting "
                         "there would overwrite the pretrained weights -- choose another --export directory")


def check_directory(path, what: str) -> None:
    """``path`` is a writable directory or can be created as one (the nearest existing parent is writable).

    Remote (an object store, where a directory is a name prefix): ``path`` is not an object itself, and a probe
    object written below it and deleted again succeeds (credentials, bucket and permissions; a missing ``gcsfs`` is
    named). Nothing is left behind."""
    if is_remote(path):
        _check_remote_directory(as_path(path), what)
        return
    path = Path(os.fspath(path))
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {str(path)!r} exists and is not a directory")
    probe_dir = path
    while not probe_dir.exists():
        parent = probe_dir.parent
        if parent == probe_dir:
            break
        probe_dir = parent
    if not probe_dir.is_dir():
        raise ValueError(f"{what} {str(path)!r} cannot be created: {str(probe_dir)!r} is not a directory")
    try:   # a real write (os.access is wrong for root and for read-only mounts)
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".dpzero-probe-"):
            pass
    except OSError as error:
        raise ValueError(f"{what} {str(path)!r} is not writable ({str(probe_dir)!r}: "
                         f"{error.strerror or error})") from None


def _check_remote_directory(path: epath.Path, what: str) -> None:
    try:
        if path.exists() and not path.is_dir():
            raise ValueError(f"{what} {str(path)!r} exists and is not a directory")
        probe = path / f".dpzero-probe-{uuid.uuid4().hex}"
        probe.write_text("")
        probe.unlink()
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 -- a missing fsspec driver, credentials, permissions: one message
        raise ValueError(f"{what} {str(path)!r} is not writable ({type(error).__name__}: {error})") from None


def check_output_paths(out, export: str | None) -> None:
    check_directory(out, "--out")
    if export is not None:
        check_directory(export, "--export")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``out/.dpzero.lock`` held while a run writes to ``out`` (``acquire`` / ``release``, or a ``with`` block).

    Locally the lock file is created atomically (``O_EXCL``). On an object store (``gs://`` ...) there is no atomic
    create and no way to see another host's processes: the lock is checked, written, then read back (a run that
    started at the same moment and overwrote it is detected by one of the two), and a lock from another host is
    never taken over -- its run is refused with the holder's host and PID until the lock object is deleted by hand.
    A lock from this host whose process is gone is taken over, as locally.
    """

    def __init__(self, out):
        self.path = as_path(out) / LOCK_NAME
        self.held = False

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        if is_remote(self.path):
            return self._acquire_remote(record)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._check_holder()   # raises unless the holder is gone (then its lock was removed)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(record)
            self.held = True
            return self
        raise RuntimeError(f"could not take the run lock {self.path} (it keeps reappearing: another run is starting "
                           "in the same directory)")

    def _acquire_remote(self, record: str) -> RunLock:
        if self.path.exists():
            self._check_holder()   # raises unless the holder is gone (then its lock was removed)
        self.path.write_text(record)
        self.held = True
        try:
            if self.path.read_text() != record:   # overwritten by a run that started at the same moment
                self.held = False
                raise RuntimeError(f"{self.path.parent} is in use by another dpzero run, which took the lock "
                                   f"{self.path} while this run was starting; choose another --out")
        except FileNotFoundError:
            self.held = False
            raise RuntimeError(f"could not take the run lock {self.path} (it disappeared while this run was "
                               "starting: another run is using the same directory)") from None
        return self

    def _check_holder(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
            pid, host = int(holder["pid"]), str(holder["host"])
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, OSError):
            # a lock being written right now, or damaged: refuse rather than guess
            raise RuntimeError(f"{self.path.parent} is locked by another dpzero run (unreadable lock file "
                               f"{self.path}; delete it if no run uses this directory)") from None
        if host == socket.gethostname() and not _alive(pid):
            log.warning("taking over the stale lock of process %d (no longer running) in %s", pid, self.path.parent)
            self.path.unlink(missing_ok=True)
            return
        where = "" if host == socket.gethostname() else f" on host {host}"
        raise RuntimeError(f"{self.path.parent} is in use by another dpzero run (PID {pid}{where}); wait for it to "
                           f"finish or choose another --out (if that process is gone, delete {self.path})")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def prior_state(out) -> list[str]:
    """What in ``out`` belongs to an earlier run: a non-empty ``checkpoints/``, ``metrics.jsonl``, ``summary.json``."""
    out = as_path(out)
    found = []
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append("checkpoints/")
    for name in ("metrics.jsonl", "summary.json"):
        if (out / name).is_file() and (out / name).stat().length > 0:
            found.append(name)
    return found


def check_fresh(out, resume) -> None:
    """A new run (no checkpoint to resume from) must not overwrite another run's outputs and privacy ledger."""
    found = prior_state(out)
    if found:
        how = ("it holds no checkpoint to resume from" if resume else
               "resume it with resume=True (--resume)")
        raise FileExistsError(f"{out} already holds the outputs of another run ({', '.join(found)}); starting anew "
                              f"would overwrite them and forget the privacy already spent -- {how}, or choose "
                              f"another output directory (--out)")


def set_aside(directory, step: int, reason: str) -> epath.Path | None:
    """Rename the unrestorable checkpoint ``directory/step`` to ``step.unreadable-TIME`` and record why (on an
    object store a rename is a copy and a delete of every object of the checkpoint)."""
    directory = as_path(directory)
    path = directory / str(step)
    if not path.exists():
        return None
    target = directory / f"{step}.unreadable-{int(time.time())}"
    path.rename(target)
    try:
        (target / "SET_ASIDE_REASON.txt").write_text(f"checkpoint {step} could not be restored: {reason}\n")
    except OSError:
        pass
    log.warning("set aside checkpoint %d as %s: %s", step, target.name, reason)
    return target


def copy_file(source, target) -> None:
    """Copy one file, streamed, between any two filesystems (local or remote, in either direction)."""
    with as_path(source).open("rb") as src, as_path(target).open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)


def copy_hf_extras(source: str | None, export) -> list[str]:
    """Copy the tokenizer files and generation config of ``source`` (a checkpoint directory) into ``export``."""
    if source is None or not as_path(source).is_dir():
        return []
    copied = []
    export = as_path(export)
    for name in HF_EXTRA_FILES:
        src = as_path(source) / name
        if src.is_file() and not (export / name).exists():
            copy_file(src, export / name)
            copied.append(name)
    return copied


def upload_directory(local: Path, target) -> epath.Path:
    """Copy the files of the local directory ``local`` (not its subdirectories) into ``target``."""
    target = as_path(target)
    target.mkdir(parents=True, exist_ok=True)
    for file in sorted(Path(local).iterdir()):
        if file.is_file():
            copy_file(file, target / file.name)
    return target


class MetricsFile:
    """``metrics.jsonl``: the rows kept from a resumed run (``earlier``), then one JSON object per ``write``.

    Local ``path``: the file is rewritten with ``earlier`` and each row is appended and flushed at once (as a plain
    file always was). Remote ``path``: an object store can neither append nor show a file before it is closed, so
    rows go to a local temporary file that :meth:`sync` uploads whole (the trainer syncs after every checkpoint, so
    the rows on the store reach at least the newest checkpoint's step) and :meth:`close` uploads a last time.
    ``path=None``: rows are discarded (processes other than the first)."""

    def __init__(self, path, earlier: list[dict] = ()):
        self.path = None if path is None else as_path(path)
        self._staged = None
        if self.path is None:
            self._file = open(os.devnull, "w")
        elif is_remote(self.path):
            self._staged = tempfile.NamedTemporaryFile("w+", prefix="dpzero-metrics-", suffix=".jsonl")
            self._file = self._staged
        else:
            self._file = open(self.path, "w")
        self._file.writelines(json.dumps(row) + "\n" for row in earlier)
        self._file.flush()
        self.sync()

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def sync(self) -> None:
        """Remote: upload the rows written so far (local files are always up to date)."""
        if self._staged is not None:
            self._staged.flush()
            copy_file(self._staged.name, self.path)

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self.sync()
        finally:
            self._file.close()

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

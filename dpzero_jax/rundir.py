"""A training run's output directory treated as a transaction.

* :func:`check_output_paths`: ``out`` (and ``export``) are usable -- a directory or creatable, and writable -- before
  any work starts; ``export`` is never the checkpoint being fine-tuned (:func:`check_export_target`).
* :class:`RunLock`: one run per directory. The lock file ``out/.dpzero.lock`` names the process holding it; a second
  run is refused with that PID, and a lock left by a process that no longer exists (same host) is taken over.
* :func:`check_fresh`: a new run never starts in a directory holding another run's checkpoints, metrics or summary
  (its privacy ledger would be lost); resume it or choose another directory.
* :func:`set_aside`: a checkpoint that fails to restore is renamed ``STEP.unreadable-TIME`` with the reason in
  ``SET_ASIDE_REASON.txt`` -- only once a good checkpoint was found and the resume accepted; a refused resume never
  renames, moves or deletes anything.
* :func:`copy_hf_extras`: an export carries the source checkpoint's tokenizer files and generation config.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

LOCK_NAME = ".dpzero.lock"
# files of a Hugging Face checkpoint directory that an export copies when the source has them (the weights and
# config.json are written by the export itself)
HF_EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "vocab.txt",
                  "merges.txt", "added_tokens.json", "generation_config.json", "preprocessor_config.json")

log = logging.getLogger(__name__)


def resume_mode(resume) -> bool | str:
    if resume is False or resume is True or resume == "or-start":
        return resume
    raise ValueError(f"resume must be False, True or 'or-start', got {resume!r}")


def check_export_target(export: str, source: str | None) -> None:
    """``export`` must not be the Hugging Face checkpoint directory that the run starts from."""
    if source is not None and os.path.realpath(export) == os.path.realpath(source):
        raise ValueError(f"TrainConfig.export={export!r} is the source checkpoint of model='hf:{source}'; exporting "
                         "there would overwrite the pretrained weights -- choose another --export directory")


def check_directory(path, what: str) -> None:
    """``path`` is a writable directory or can be created as one (the nearest existing parent is writable)."""
    path = Path(path)
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
    """``out/.dpzero.lock`` held while a run writes to ``out`` (``acquire`` / ``release``, or a ``with`` block)."""

    def __init__(self, out):
        self.path = Path(out) / LOCK_NAME
        self.held = False

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
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
    out = Path(out)
    found = []
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append("checkpoints/")
    for name in ("metrics.jsonl", "summary.json"):
        if (out / name).is_file() and (out / name).stat().st_size > 0:
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


def set_aside(directory: Path, step: int, reason: str) -> Path | None:
    """Rename the unrestorable checkpoint ``directory/step`` to ``step.unreadable-TIME`` and record why."""
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


def copy_hf_extras(source: str | None, export: str) -> list[str]:
    """Copy the tokenizer files and generation config of ``source`` (a checkpoint directory) into ``export``."""
    if source is None or not Path(source).is_dir():
        return []
    copied = []
    for name in HF_EXTRA_FILES:
        src = Path(source) / name
        if src.is_file() and not (Path(export) / name).exists():
            shutil.copyfile(src, Path(export) / name)
            copied.append(name)
    return copied

"""Issue 21, part 2: a run directory is a transaction -- no lost checkpoints, no reset privacy ledger."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from dpzero_jax import rundir
from dpzero_jax.cli import main
from dpzero_jax.train import TrainConfig, Trainer

RUN = dict(steps=2, batch_size=32, hidden=(8,), log_every=1, checkpoint_every=1, keep_checkpoints=3, progress=False,
           plot=False, noise_multiplier=1.0, eval_every=0)


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("B")
    result = Trainer(TrainConfig(out=str(out), **RUN)).run()
    return out, result


@pytest.fixture
def copy(finished, tmp_path):
    out = tmp_path / "B"
    shutil.copytree(finished[0], out)
    return out


def test_refused_resume_touches_nothing(copy):
    before = _tree(copy)
    with pytest.raises(ValueError, match=r"seed: 0 -> 7"):
        Trainer(TrainConfig(out=str(copy), **{**RUN, "seed": 7})).run(resume=True)
    with pytest.raises(ValueError, match=r"hidden"):   # other shapes: refused from the metadata, not "unreadable"
        Trainer(TrainConfig(out=str(copy), **{**RUN, "hidden": (4,)})).run(resume=True)
    assert _tree(copy) == before and not any("unreadable" in p for p in before)
    assert sorted(os.listdir(copy / "checkpoints")) == ["1", "2"]


def test_resume_without_checkpoint_is_an_error(tmp_path, capsys):
    missing = tmp_path / "typo"
    assert main(["train", "--resume", "--out", str(missing), "--steps", "2", "--no-progress"]) == 2
    assert "no checkpoints/" in capsys.readouterr().err and not missing.exists()


def test_resume_or_start_starts_in_an_empty_directory(tmp_path):
    out = tmp_path / "new"
    result = Trainer(TrainConfig(out=str(out), **{**RUN, "steps": 1})).run(resume="or-start")
    assert result.steps == 1 and (out / "checkpoints" / "1").is_dir()
    assert not (out / rundir.LOCK_NAME).exists()   # released


def test_fresh_run_never_overwrites_another_runs_ledger(copy):
    summary = (copy / "summary.json").read_text()
    with pytest.raises(FileExistsError, match="forget the privacy already spent"):
        Trainer(TrainConfig(out=str(copy), **RUN)).run()
    shutil.rmtree(copy / "checkpoints")   # a run without checkpoints still leaves its summary and metrics
    with pytest.raises(FileExistsError, match="summary.json"):
        Trainer(TrainConfig(out=str(copy), **RUN)).run(resume="or-start")
    assert (copy / "summary.json").read_text() == summary


def test_resume_keeps_the_ledger(copy, finished):
    from dpzero_jax import accounting

    resumed = Trainer(TrainConfig(out=str(copy), **{**RUN, "steps": 3})).run(resume=True)
    # the 2 steps already spent count: epsilon is that of 3 steps, not of the 1 step run after the restart
    q = resumed.sampling_rate
    assert resumed.epsilon == pytest.approx(accounting.epsilon(1.0, q, 3, 1e-5), rel=1e-3)
    assert resumed.epsilon > accounting.epsilon(1.0, q, 2, 1e-5) * 1.05


def test_only_unrestorable_checkpoints_are_set_aside_with_reason(copy):
    for path in (copy / "checkpoints" / "2").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match="skipping unreadable checkpoint at step 2"):
        Trainer(TrainConfig(out=str(copy), **RUN)).run(resume=True)
    aside = [p for p in (copy / "checkpoints").iterdir() if p.name.startswith("2.unreadable-")]
    assert len(aside) == 1 and "could not be restored" in (aside[0] / "SET_ASIDE_REASON.txt").read_text()


def test_lock_names_the_holder_and_stale_locks_are_taken_over(tmp_path):
    with rundir.RunLock(tmp_path):
        with pytest.raises(RuntimeError, match=f"PID {os.getpid()}"):
            rundir.RunLock(tmp_path).acquire()
        with pytest.raises(RuntimeError, match="in use by another dpzero run"):
            Trainer(TrainConfig(out=str(tmp_path), **RUN)).run()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / rundir.LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": __import__("socket").gethostname(),
                                                        "started": 0}))
    lock = rundir.RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / rundir.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_export_never_overwrites_its_source(tmp_path):
    source = tmp_path / "gpt2"
    with pytest.raises(ValueError, match="overwrite the pretrained weights"):
        TrainConfig(model=f"hf:{source}", task="causal-lm", export=str(source) + "/")


@pytest.mark.parametrize("flag", ["--out", "--export"])
def test_unusable_output_paths_fail_before_training(tmp_path, capsys, flag):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = tmp_path / "out"
    bad = str(blocker / "sub")   # below a regular file: cannot be created, whoever runs the test
    argv = ["train", "--steps", "2", "--no-progress", "--out", bad if flag == "--out" else str(out)]
    if flag == "--export":
        argv += ["--export", bad]
    assert main(argv) == 2
    assert flag in capsys.readouterr().err and not out.exists()
    with pytest.raises(ValueError, match="not writable"):
        rundir.check_directory("/proc/dpzero-out", "--out")   # exists-but-read-only ancestor (even for root)
    assert main(["train", "--out", "", "--steps", "2"]) == 2


def test_export_carries_tokenizer_and_generation_config(tmp_path):
    source, export = tmp_path / "src", tmp_path / "export"
    source.mkdir()
    export.mkdir()
    for name in ("tokenizer.json", "merges.txt", "vocab.json", "generation_config.json"):
        (source / name).write_text(f"{{\"{name}\": 1}}")
    (source / "model.safetensors").write_text("weights: not copied")
    copied = rundir.copy_hf_extras(str(source), str(export))
    assert sorted(copied) == ["generation_config.json", "merges.txt", "tokenizer.json", "vocab.json"]
    assert (export / "merges.txt").read_text() == (source / "merges.txt").read_text()
    assert not (export / "model.safetensors").exists()

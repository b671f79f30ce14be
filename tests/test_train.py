"""The training loop: metrics, exact resume from orbax checkpoints, damaged checkpoints, the ``train`` CLI."""

import json
import shutil

import jax
import numpy as np
import pytest

from dpzero_jax.cli import main
from dpzero_jax.train import TrainConfig, Trainer

TINY = dict(steps=20, batch_size=64, log_every=5, checkpoint_every=10, progress=False, plot=False, epsilon=3.0)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return out, Trainer(TrainConfig(out=str(out), **TINY)).run()


def test_metrics_and_epsilon_grow(tmp_path):
    result = Trainer(TrainConfig(out=str(tmp_path), **{**TINY, "steps": 30, "checkpoint_every": 0,
                                                       "plot": True})).run()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert all({"step", "loss", "epsilon", "accuracy"} <= r.keys() for r in rows)
    eps = [r["epsilon"] for r in rows]
    assert all(b > a for a, b in zip(eps, eps[1:]))
    assert eps[-1] == pytest.approx(result.epsilon) and result.epsilon <= 3.0
    assert result.steps == 30 and 0 <= result.test_accuracy <= 1
    assert (tmp_path / "training.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 30


def test_resume_equals_uninterrupted(uninterrupted, tmp_path):
    full_out, full = uninterrupted
    cfg = TrainConfig(out=str(tmp_path), **TINY)
    first = Trainer(cfg).run(stop_at=10)                 # "killed" after the checkpoint at step 10
    assert first.steps == 10
    resumed = Trainer(cfg).run(resume=True)              # a fresh Trainer, as after a restart
    _assert_same_params(resumed.params, full.params)
    assert resumed.epsilon == full.epsilon and resumed.steps == full.steps == 20
    assert _rows(tmp_path) == _rows(full_out)


def test_damaged_latest_checkpoint_falls_back(uninterrupted, tmp_path):
    full_out, full = uninterrupted
    shutil.copytree(full_out / "checkpoints", tmp_path / "checkpoints")
    shutil.copy(full_out / "metrics.jsonl", tmp_path / "metrics.jsonl")
    # an interrupted write (orbax's temporary directory) and a damaged final checkpoint
    (tmp_path / "checkpoints" / "30.orbax-checkpoint-tmp-1234").mkdir()
    latest = tmp_path / "checkpoints" / "20"
    for path in latest.rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match="skipping unreadable checkpoint at step 20"):
        resumed = Trainer(TrainConfig(out=str(tmp_path), **TINY)).run(resume=True)
    _assert_same_params(resumed.params, full.params)     # re-ran steps 10..20 from the step-10 checkpoint
    assert resumed.epsilon == full.epsilon


def test_all_checkpoints_damaged_is_a_clear_error(uninterrupted, tmp_path):
    full_out, _ = uninterrupted
    shutil.copytree(full_out / "checkpoints", tmp_path / "checkpoints")
    for path in (tmp_path / "checkpoints").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no checkpoint .* could be restored"):
        Trainer(TrainConfig(out=str(tmp_path), **TINY)).run(resume=True)


def test_refuses_to_overwrite_checkpoints_without_resume(uninterrupted):
    full_out, _ = uninterrupted
    with pytest.raises(FileExistsError, match="resume"):
        Trainer(TrainConfig(out=str(full_out), **TINY)).run()


def test_no_dp_baseline(tmp_path):
    result = Trainer(TrainConfig(out=str(tmp_path), no_dp=True, **{**TINY, "checkpoint_every": 0})).run()
    assert result.epsilon is None and result.noise_multiplier is None and result.steps == 20
    assert all(r["epsilon"] is None for r in _rows(tmp_path))


def test_micro_batches_change_nothing_but_memory(tmp_path):
    base = dict(TINY, steps=3, checkpoint_every=0, log_every=1, noise_multiplier=1.0, mode="vmap")
    a = Trainer(TrainConfig(out=str(tmp_path / "a"), **base)).run()
    b = Trainer(TrainConfig(out=str(tmp_path / "b"), micro_batch_size=16, **base)).run()
    _assert_same_params(a.params, b.params)


def test_cli_train_with_config_file(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("steps: 4\nbatch-size: 32\nlog_every: 2\ncheckpoint_every: 0\nplot: false\nlr: 0.5\n")
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--lr", "0.01", "--out", str(out), "--no-progress"]) == 0
    assert "test accuracy" in capsys.readouterr().out
    saved = json.loads((out / "summary.json").read_text())
    assert saved["steps"] == 4 and saved["config"]["lr"] == 0.01 and saved["config"]["batch_size"] == 32


@pytest.mark.parametrize("flag, value", [("--batch-size", "0"), ("--lr", "-1"), ("--epsilon", "x"),
                                         ("--groups", "bogus"), ("--steps", "1.5"), ("--optimizer", "rmsprop")])
def test_cli_bad_values_name_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", flag, value])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_bad_config_file_is_one_line_error(tmp_path, capsys):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"stepz": 3}))
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "stepz" in err and len(err.splitlines()) == 1

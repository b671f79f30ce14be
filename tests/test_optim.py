"""Learning-rate schedules (against their textbook formulas) and the trainer's use of them: the learning rate in the
metrics, exact resume mid-schedule, the CLI flags and their errors."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from dpzero_jax import optim
from dpzero_jax.cli import build_parser, main
from dpzero_jax.train import TrainConfig, Trainer


def _expected(lr, schedule, warmup, total, t):
    """The formulas of the module docstring, written out independently."""
    if t < warmup:
        return lr * (t + 1) / warmup
    s = (t - warmup) / (total - warmup)
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        return lr * (1 + math.cos(math.pi * s)) / 2
    return lr * (1 - s)


@pytest.mark.parametrize("schedule", optim.SCHEDULES)
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_schedules_follow_their_formulas(schedule, warmup):
    total = 30
    fn = optim.learning_rate_schedule(0.1, schedule, warmup, total)
    got = [float(fn(t)) for t in range(total + 1)]
    want = [_expected(0.1, schedule, warmup, total, t) for t in range(total + 1)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)   # float32 arithmetic
    if schedule != "constant":
        assert got[-1] == pytest.approx(0.0, abs=1e-9)        # decayed to 0 at the end of the run
    assert max(got) == pytest.approx(0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="step"), "expected one of"),
    (dict(schedule="cosine", total_steps=None), "needs the run's number of steps"),
    (dict(schedule="linear", warmup_steps=10, total_steps=10), "must be below the run's 10 steps"),
    (dict(warmup_steps=-1, total_steps=10), "warmup_steps must be an integer >= 0"),
])
def test_schedule_errors_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        optim.learning_rate_schedule(0.1, **kwargs)


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="optimizer 'lamb'"):
        optim.make_optimizer("lamb", 0.1)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trainer_logs_the_scheduled_rate_and_resumes_mid_schedule(tmp_path):
    """Each metrics row carries the rate of the step it ends; a run killed after its step-10 checkpoint and resumed
    equals the uninterrupted one (the schedule's count is in the optimizer state)."""
    common = dict(steps=20, batch_size=64, log_every=5, checkpoint_every=10, lr=0.02, lr_schedule="cosine",
                  warmup_steps=4, progress=False, plot=False)
    full = Trainer(TrainConfig(out=str(tmp_path / "full"), **common)).run()
    rows = _rows(tmp_path / "full")
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    for r in rows:
        assert r["lr"] == pytest.approx(_expected(0.02, "cosine", 4, 20, r["step"] - 1), rel=1e-5)   # float32

    cfg = TrainConfig(out=str(tmp_path / "resumed"), **common)
    Trainer(cfg).run(stop_at=10)
    resumed = Trainer(cfg).run(resume=True)
    assert _rows(tmp_path / "resumed") == rows
    for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(full.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    assert resumed.epsilon == full.epsilon


def test_cli_flags_reach_the_config():
    args = build_parser().parse_args(["train", "--lr-schedule", "linear", "--warmup-steps", "3"])
    assert (args.lr_schedule, args.warmup_steps) == ("linear", 3)
    assert {"lr_schedule", "warmup_steps"} <= {f.name for f in dataclasses.fields(TrainConfig)}


def test_train_config_refuses_bad_schedule_options(tmp_path):
    with pytest.raises(ValueError, match="TrainConfig.lr_schedule must be one of"):
        TrainConfig(out=str(tmp_path), lr_schedule="exp")
    with pytest.raises(ValueError, match="TrainConfig.warmup_steps must be below steps=5"):
        TrainConfig(out=str(tmp_path), steps=5, warmup_steps=5)
    with pytest.raises(SystemExit):
        main(["train", "--lr-schedule", "exp"])

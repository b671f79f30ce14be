"""Metric rows to TensorBoard event files, to Weights & Biases (a recording stand-in for the ``wandb`` module) and to
callbacks: the same rows as ``metrics.jsonl``, across a kill and a resume."""

import json
import shutil
import struct
import sys
import types

import pytest

from dpzero_jax.cli import build_parser
from dpzero_jax.train import TrainConfig, Trainer

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")


def _events(logdir):
    """Every event of every file in ``logdir``, file by file in creation order, read from the TFRecord framing
    (u64 length, u32 CRC, payload, u32 CRC) with the Event protobuf."""
    files = []
    for path in sorted(logdir.glob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime_ns, p.name)):
        data, events, at = path.read_bytes(), [], 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[at + 12:at + 12 + length])
            events.append(event)
            at += 12 + length + 4
        files.append(events)
    return files


def _scalars_as_tensorboard_shows_them(logdir):
    """``{(tag, step): value}`` after TensorBoard's purge rule: a file starting with a session START at step ``s``
    drops the earlier files' events at steps >= ``s``."""
    shown = {}
    for events in _events(logdir):
        for event in events:
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                shown = {k: v for k, v in shown.items() if k[1] < event.step}
            for value in event.summary.value:
                shown[(value.tag, event.step)] = value.simple_value
    return shown


def _check_with_tensorboards_reader(logdir, rows):
    """TensorBoard's own reader (``EventAccumulator``, what ``tensorboard --logdir`` loads; its orphaned-data purge
    on a restarted session included) shows exactly the rows of ``metrics.jsonl``, once per step."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    reader = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    reader.Reload()
    for key in ("loss", "epsilon", "lr", "accuracy"):
        events = reader.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in rows], key
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows], rel=1e-6)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class _FakeWandb(types.ModuleType):
    """Records ``init`` and ``log`` calls as the real module would receive them."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                fake.logged.append((step, dict(values)))

            def finish(self):
                fake.finished += 1
        return Run()


def test_rows_reach_tensorboard_wandb_and_callbacks_across_a_resume(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    cfg = TrainConfig(out=str(out), steps=10, batch_size=64, log_every=2, checkpoint_every=4, progress=False,
                      plot=False, tensorboard=True, wandb_project="dp-tests")
    seen = []
    Trainer(cfg).run(stop_at=6, callbacks=[seen.append])
    shutil.rmtree(out / "checkpoints" / "6")                   # as if killed after step 6, before its checkpoint
    Trainer(cfg).run(resume=True, callbacks=[seen.append])     # from step 4: recomputes steps 5-6, then 7-10
    rows = _rows(out)
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10]

    shown = _scalars_as_tensorboard_shows_them(out / "tensorboard")
    for row in rows:
        for key in ("loss", "epsilon", "lr", "accuracy"):
            assert shown[(key, row["step"])] == pytest.approx(row[key], rel=1e-6)
    assert {step for _, step in shown} == {2, 4, 6, 8, 10}
    _check_with_tensorboards_reader(out / "tensorboard", rows)

    # W&B: one run id for both processes' runs; the last value logged at each step is the row's
    assert len(fake.inits) == 2 and fake.inits[0]["id"] == fake.inits[1]["id"] == (out / "wandb_run_id").read_text()
    assert fake.inits[0]["project"] == "dp-tests" and fake.inits[0]["config"]["steps"] == 10
    assert fake.finished == 2
    last = {}
    for step, values in fake.logged:
        last[step] = values
    assert sorted(last) == [2, 4, 6, 8, 10]
    for row in rows:
        assert last[row["step"]]["loss"] == pytest.approx(row["loss"]) and "step" not in last[row["step"]]

    # callbacks: every row written, including the recomputed 6
    assert [r["step"] for r in seen] == [2, 4, 6, 6, 8, 10]
    assert seen[-3:] == rows[-3:]


def test_writer_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="local output directory, not gs://bucket/run"):
        TrainConfig(out="gs://bucket/run", tensorboard=True)
    with pytest.raises(ValueError, match="TrainConfig.wandb_project must be a non-empty string"):
        TrainConfig(out=str(tmp_path), wandb_project="")
    monkeypatch.setitem(sys.modules, "wandb", None)            # not installed
    cfg = TrainConfig(out=str(tmp_path / "o"), steps=2, batch_size=32, progress=False, plot=False,
                      wandb_project="p", checkpoint_every=0)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'dpzero_jax\[wandb\]'"):
        Trainer(cfg).run()


def test_cli_flags_reach_the_config():
    args = build_parser().parse_args(["train", "--tensorboard", "--wandb", "proj"])
    assert (args.tensorboard, args.wandb_project) == (True, "proj")
    assert "tensorboard" not in vars(build_parser().parse_args(["train"]))    # unset: TrainConfig's default

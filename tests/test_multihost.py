"""Multi-process training: 2 processes x 2 CPU devices on 127.0.0.1 (gloo collectives) against 1 process x 4
devices, and a checkpoint written collectively by the 2 processes resumed by 1 process."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from dpzero_jax.train import TrainConfig, Trainer

RUN = dict(mesh="fsdp=4", strategy="explicit", zero=3, batch_size=64, optimizer="sgd", lr=0.1, noise_multiplier=1.0,
           log_every=1, checkpoint_every=2, progress=False, plot=False)
FLAGS = ["--mesh", "fsdp=4", "--strategy", "explicit", "--zero", "3", "--batch-size", "64", "--optimizer", "sgd",
         "--lr", "0.1", "--noise-multiplier", "1.0", "--log-every", "1", "--checkpoint-every", "2", "--no-progress"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_processes")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # each process: 2 devices, not the tests' 8
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "dpzero_jax", "train", *FLAGS, "--steps", "4", "--out", str(out),
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return out, logs


def test_two_processes_give_the_losses_of_one_process(two_processes, tmp_path):
    out, logs = two_processes
    single = Trainer(TrainConfig(out=str(tmp_path), steps=4, **RUN)).run()
    np.testing.assert_allclose(_losses(out), [row["loss"] for row in single.history], rtol=1e-5)
    assert all(f"epsilon {single.epsilon:.3f} " in log for log in logs)   # both processes report the same ledger
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


def test_one_process_resumes_a_two_process_checkpoint(two_processes, tmp_path):
    out, _ = two_processes
    resumed_out = tmp_path / "resumed"
    import shutil

    shutil.copytree(out, resumed_out)
    resumed = Trainer(TrainConfig(out=str(resumed_out), steps=6, **RUN)).run(resume=True)
    straight = Trainer(TrainConfig(out=str(tmp_path / "straight"), steps=6, **RUN)).run()
    for a, b in zip(resumed.history, straight.history, strict=True):
        assert a["step"] == b["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert resumed.epsilon == pytest.approx(straight.epsilon, rel=1e-9)


def test_multi_process_options_are_checked():
    with pytest.raises(ValueError, match="go together"):
        TrainConfig(coordinator="127.0.0.1:1234", mesh="fsdp=4")
    with pytest.raises(ValueError, match="process_id"):
        TrainConfig(coordinator="127.0.0.1:1234", num_processes=2, process_id=2, mesh="fsdp=4")
    with pytest.raises(ValueError, match="coordinator"):
        TrainConfig(coordinator="localhost", num_processes=2, process_id=0, mesh="fsdp=4")
    with pytest.raises(ValueError, match="needs a mesh"):
        TrainConfig(coordinator="127.0.0.1:1234", num_processes=2, process_id=0)

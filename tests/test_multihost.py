"""Multi-process training: 2 processes x 2 CPU devices on 127.0.0.1 (gloo collectives) against 1 process x 4
devices, and a checkpoint written collectively by the 2 processes resumed by 1 process."""

import json
import socket
import subprocess
import sys

import damage
import helpers
import jax
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
    env = helpers.subprocess_env()   # each process requests its own 2 devices, not the tests' 8
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


def _resume_damaged(two_processes, tmp_path, select):
    """Bytes flipped in the files of the 2-process (StandardSave, OCDBT) checkpoint at step 4 that ``select``
    picks, 4 places each; one process resumes each case (one Trainer: its compiled step is reused). Every case is
    refused or ends as the uninterrupted run; the digests catch damage that OCDBT reads without error."""
    import shutil
    import warnings

    out, _ = two_processes
    straight = Trainer(TrainConfig(out=str(tmp_path / "straight"), steps=6, **RUN)).run()
    latest = out / "checkpoints" / "4"
    files = sorted(str(p.relative_to(latest)) for p in latest.rglob("*") if p.is_file() and select(p))
    case = tmp_path / "case"
    trainer = Trainer(TrainConfig(out=str(case), steps=6, **RUN))
    outcomes = {}
    for file in files:
        for place in damage.PLACES:
            shutil.rmtree(case, ignore_errors=True)
            shutil.copytree(out, case)
            damage.flip(case / "checkpoints" / "4" / file, place)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    resumed = trainer.run(resume=True)
                except (ValueError, RuntimeError) as error:
                    outcomes[file, place] = f"refused: {error}"
                    continue
            for a, b in zip(resumed.history, straight.history, strict=True):
                assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5), (file, place)
            for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params), strict=True):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6, err_msg=file)
            assert resumed.epsilon == pytest.approx(straight.epsilon, rel=1e-9)
            skipped = [str(w.message) for w in caught if "skipping unreadable checkpoint at step 4" in str(w.message)]
            outcomes[file, place] = skipped[0] if skipped else "intact"
    return files, outcomes


def _largest_data_file(path) -> bool:
    """The largest file of each process's OCDBT data (``state/ocdbt.process_N/d/``): array chunks, which OCDBT's
    b-tree checksums do not cover."""
    if path.parent.name != "d" or not path.parent.parent.name.startswith("ocdbt.process_"):
        return False
    return path.stat().st_size == max(p.stat().st_size for p in path.parent.iterdir())


def test_damaged_array_data_of_a_two_process_checkpoint_is_caught(two_processes, tmp_path):
    files, outcomes = _resume_damaged(two_processes, tmp_path, _largest_data_file)
    assert len(files) == 2
    assert files and len(outcomes) == 4 * len(files)
    assert any("does not match its digest" in text for text in outcomes.values()), \
        {k: v[:300] for k, v in outcomes.items()}


@pytest.mark.slow
def test_damage_in_every_file_of_a_two_process_checkpoint_never_trains(two_processes, tmp_path):
    files, outcomes = _resume_damaged(two_processes, tmp_path, lambda p: True)
    assert len(outcomes) == 4 * len(files) >= 40

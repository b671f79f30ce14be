"""Output paths as ``gs://`` URLs (through ``etils.epath``), on the in-memory bucket of ``tests/fake_gcs.py``: a run's
metrics, summary, plot and Hugging Face export land in the bucket with the same content as a local run's, and
nothing is created under a local ``gs:`` folder; the run lock, the output-path checks, prior-state refusal, setting a
checkpoint aside and the staged metrics file on the bucket; unsupported URL schemes refused."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from dpzero_jax import rundir
from dpzero_jax.cli import main
from dpzero_jax.models import GPT2, GPT2Config, pretrained
from dpzero_jax.train import TrainConfig, Trainer

WORDS = "the a of to and in is it that for on with as by be this are from or at".split()


def test_fake_bucket_is_in_memory(fake_gcs):
    target = fake_gcs.path("dir", "file.txt")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("hello")
    assert fake_gcs.files() == {"gs://fake-bucket/dir/file.txt": b"hello"}
    assert target.read_text() == "hello" and fake_gcs.local_leak() == []
    assert str(target) == "gs://fake-bucket/dir/file.txt"
    assert os.listdir(fake_gcs.cwd) == []


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A Hugging Face GPT-2 directory (1 block, vocabulary 64) with a word-level tokenizer.json, and a small corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("tiny_gpt2")
    source = root / "gpt2"
    pretrained.save(GPT2(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2),
                         rngs=nnx.Rngs(0)), source)
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(source / "tokenizer.json"))
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(WORDS * 40))
    return source, corpus


def _run(source, corpus, out, export):
    config = TrainConfig(model=f"hf:{source}", task="causal-lm", data=str(corpus), max_length=16, steps=2,
                         batch_size=16, log_every=1, progress=False, checkpoint_every=0, noise_multiplier=1.0,
                         out=out, export=export)
    return Trainer(config).run()


def test_run_outputs_and_export_land_in_the_bucket_as_in_a_local_run(fake_gcs, tiny_gpt2, tmp_path):
    source, corpus = tiny_gpt2
    local = _run(source, corpus, str(tmp_path / "run"), str(tmp_path / "export"))
    remote = _run(source, corpus, f"{fake_gcs.url}/run", f"{fake_gcs.url}/export")
    assert remote.out == "gs://fake-bucket/run"
    assert remote.test_loss == local.test_loss
    files = fake_gcs.files()
    assert sorted(files) == sorted(
        [f"gs://fake-bucket/run/{n}" for n in ("metrics.jsonl", "summary.json", "training.png")]
        + [f"gs://fake-bucket/export/{n}" for n in ("config.json", "model.safetensors", "tokenizer.json")])
    assert fake_gcs.local_leak() == [] and os.listdir(fake_gcs.cwd) == []
    # the local run is the reference: same rows, same summary (but timings and place), same export, same plot
    assert files["gs://fake-bucket/run/metrics.jsonl"] == (tmp_path / "run" / "metrics.jsonl").read_bytes()
    summaries = [json.loads(text) for text in (files["gs://fake-bucket/run/summary.json"],
                                               (tmp_path / "run" / "summary.json").read_text())]
    for summary in summaries:
        for key in ("runtime_s", "accounting_s", "out"):
            summary.pop(key)
        summary["config"].pop("out")
        summary["config"].pop("export")
    assert summaries[0] == summaries[1]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert files[f"gs://fake-bucket/export/{name}"] == (tmp_path / "export" / name).read_bytes(), name
    png = files["gs://fake-bucket/run/training.png"]
    assert png.startswith(b"\x89PNG") and len(png) == (tmp_path / "run" / "training.png").stat().st_size


def test_cli_run_on_a_bucket_and_its_refusals(fake_gcs, capsys):
    out = f"{fake_gcs.url}/cli-run"
    flags = ["train", "--steps", "2", "--batch-size", "32", "--no-progress", "--checkpoint-every", "0",
             "--noise-multiplier", "1.0", "--out", out]
    assert main(flags) == 0
    assert f"outputs in {out}" in capsys.readouterr().out
    rows = [json.loads(line) for line in fake_gcs.path("cli-run", "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2]
    assert not fake_gcs.path("cli-run", rundir.LOCK_NAME).exists()   # released
    assert main(flags) == 2   # a second fresh run would overwrite the first one's ledger
    assert "already holds the outputs of another run (metrics.jsonl, summary.json)" in capsys.readouterr().err
    assert main(flags[:-1] + [f"{fake_gcs.url}/elsewhere", "--resume"]) == 2
    assert "holds no checkpoints/ to resume from" in capsys.readouterr().err
    assert fake_gcs.local_leak() == []


def test_run_lock_on_a_bucket(fake_gcs):
    out = fake_gcs.path("locked")
    with rundir.RunLock(out):
        holder = json.loads((out / rundir.LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(RuntimeError, match=f"in use by another dpzero run \\(PID {os.getpid()}\\)"):
            rundir.RunLock(out).acquire()
    assert not (out / rundir.LOCK_NAME).exists()
    # another host's lock: never taken over (its process cannot be seen from here)
    (out / rundir.LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "other-host", "started": 0}))
    with pytest.raises(RuntimeError, match="PID 1 on host other-host"):
        rundir.RunLock(out).acquire()
    # this host's lock whose process is gone: taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / rundir.LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 0}))
    lock = rundir.RunLock(out).acquire()
    assert json.loads((out / rundir.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert fake_gcs.local_leak() == []


def test_output_checks_prior_state_and_set_aside_on_a_bucket(fake_gcs):
    rundir.check_output_paths(f"{fake_gcs.url}/new/run", f"{fake_gcs.url}/new/export")
    assert fake_gcs.files() == {}   # the probe objects are gone
    fake_gcs.path("blocker").write_text("x")
    with pytest.raises(ValueError, match="--out 'gs://fake-bucket/blocker' exists and is not a directory"):
        rundir.check_directory(f"{fake_gcs.url}/blocker", "--out")

    out = fake_gcs.path("run")
    assert rundir.prior_state(out) == []
    (out / "checkpoints" / "4").mkdir(parents=True)
    (out / "checkpoints" / "4" / "data").write_text("damaged")
    (out / "summary.json").write_text("{}")
    assert rundir.prior_state(out) == ["checkpoints/", "summary.json"]
    with pytest.raises(FileExistsError, match="gs://fake-bucket/run already holds the outputs"):
        rundir.check_fresh(out, resume=False)
    moved = rundir.set_aside(out / "checkpoints", 4, "digest mismatch")
    assert moved.name.startswith("4.unreadable-") and not (out / "checkpoints" / "4").exists()
    assert (moved / "data").read_text() == "damaged"
    assert "digest mismatch" in (moved / "SET_ASIDE_REASON.txt").read_text()
    assert fake_gcs.local_leak() == []


def test_metrics_on_a_bucket_are_staged_and_uploaded_at_each_sync(fake_gcs):
    path = fake_gcs.path("run", "metrics.jsonl")
    metrics = rundir.MetricsFile(path, earlier=[{"step": 1}])
    assert path.read_text() == '{"step": 1}\n'   # the kept rows of a resumed run, at once
    metrics.write({"step": 2})
    assert path.read_text() == '{"step": 1}\n'   # not before the next sync (an object is written whole)
    metrics.sync()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    metrics.write({"step": 3})
    metrics.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_export_files_and_extras_written_to_a_bucket(fake_gcs, tmp_path):
    model = GPT2(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2), rngs=nnx.Rngs(1))
    written = pretrained.save(model, f"{fake_gcs.url}/export")
    assert str(written) == "gs://fake-bucket/export"
    pretrained.save(model, tmp_path / "export")   # the local reference
    for name in ("config.json", "model.safetensors"):
        assert (written / name).read_bytes() == (tmp_path / "export" / name).read_bytes()
    source = tmp_path / "source"
    source.mkdir()
    (source / "merges.txt").write_text("a b")
    (source / "vocab.json").write_text("{}")
    assert sorted(rundir.copy_hf_extras(str(source), written)) == ["merges.txt", "vocab.json"]
    assert (written / "merges.txt").read_text() == "a b"
    loaded = pretrained.load(tmp_path / "export")   # the local copy loads: the bytes compared above are a model
    assert np.array_equal(np.asarray(loaded.wte.embedding.get_value()), np.asarray(model.wte.embedding.get_value()))
    assert fake_gcs.local_leak() == []


@pytest.mark.parametrize("field", ["out", "export"])
def test_unsupported_url_schemes_are_refused(field):
    with pytest.raises(ValueError, match=f"TrainConfig.{field}='http://host/run': URLs http:// are not supported"):
        TrainConfig(**{field: "http://host/run"})


def test_orbax_checkpoint_manager_works_on_the_fake_bucket(fake_gcs):
    """What the checkpoint code will need of the fixture: orbax's manager writes and restores JSON items there."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(fake_gcs.path("run", "checkpoints"), options=options) as manager:
        for step in (1, 2, 3):
            manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave({"step": step})), force=True)
        manager.wait_until_finished()
        assert manager.all_steps() == [2, 3]   # max_to_keep deleted step 1 on the bucket
        assert manager.restore(3, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"] == {"step": 3}
    assert "gs://fake-bucket/run/checkpoints/3/meta/metadata" in fake_gcs.files()
    assert fake_gcs.local_leak() == []

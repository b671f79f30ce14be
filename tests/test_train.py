"""The training loop: metrics, exact resume from orbax checkpoints, damaged checkpoints, the ``train`` CLI."""

import json
import shutil
import warnings

import damage
import jax
import numpy as np
import pytest

from dpzero_jax.cli import main
from dpzero_jax.train import TrainConfig, Trainer

TINY = dict(steps=20, batch_size=64, log_every=5, checkpoint_every=10, progress=False, plot=False, epsilon=3.0)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_params(a, b, rtol=1e-6, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


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
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["evaluation_finite"] is True


def test_resume_equals_uninterrupted(uninterrupted, tmp_path):
    full_out, full = uninterrupted
    cfg = TrainConfig(out=str(tmp_path), **TINY)
    first = Trainer(cfg).run(stop_at=10)                 # "killed" after the checkpoint at step 10
    assert first.steps == 10
    resumed = Trainer(cfg).run(resume=True)              # a fresh Trainer, as after a restart
    _assert_same_params(resumed.params, full.params)
    assert resumed.epsilon == full.epsilon and resumed.steps == full.steps == 20
    assert _rows(tmp_path) == _rows(full_out)


def test_run_in_a_gs_bucket_resumes_exactly(uninterrupted, fake_gcs):
    """``--out gs://...`` (the in-memory bucket of tests/fake_gcs.py): killed after the step-10 checkpoint and
    resumed by a fresh Trainer, the run ends with the local uninterrupted run's parameters, epsilon and metrics; its
    checkpoints, metrics and summary are objects in the bucket and nothing is written to a local ``gs:`` folder."""
    full_out, full = uninterrupted
    cfg = TrainConfig(out=f"{fake_gcs.url}/run", **TINY)
    assert Trainer(cfg).run(stop_at=10).steps == 10
    resumed = Trainer(cfg).run(resume=True)
    _assert_same_params(resumed.params, full.params)
    assert resumed.epsilon == full.epsilon and resumed.steps == 20
    rows = [json.loads(line) for line in fake_gcs.path("run", "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in _rows(full_out)]
    assert [r["loss"] for r in rows] == [r["loss"] for r in _rows(full_out)]
    objects = fake_gcs.files()
    assert any("/run/checkpoints/20/" in url for url in objects) and f"{fake_gcs.url}/run/summary.json" in objects
    assert fake_gcs.local_leak() == []


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


def test_flipped_bytes_inside_the_array_data_are_caught(uninterrupted, tmp_path):
    """Damage inside the largest data file of the latest checkpoint (not its metadata): the arrays' CRC-32 catches
    it, the checkpoint is skipped and the run resumes from the previous one (it used to train on the damage)."""
    full_out, full = uninterrupted
    shutil.copytree(full_out / "checkpoints", tmp_path / "checkpoints")
    shutil.copy(full_out / "metrics.jsonl", tmp_path / "metrics.jsonl")
    largest = max((p for p in (tmp_path / "checkpoints" / "20").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 256] = bytes(b ^ 0xFF for b in data[middle:middle + 256])
    largest.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="skipping unreadable checkpoint at step 20.*CRC"):
        resumed = Trainer(TrainConfig(out=str(tmp_path), **TINY)).run(resume=True)
    _assert_same_params(resumed.params, full.params)
    assert resumed.epsilon == full.epsilon


def test_all_checkpoints_damaged_is_a_clear_error(uninterrupted, tmp_path):
    full_out, _ = uninterrupted
    shutil.copytree(full_out / "checkpoints", tmp_path / "checkpoints")
    for path in (tmp_path / "checkpoints").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no checkpoint .* could be restored"):
        Trainer(TrainConfig(out=str(tmp_path), **TINY)).run(resume=True)


def _damage_cases(files):
    return [(f, place) for f in files for place in damage.PLACES]


def _resume_damaged(uninterrupted, tmp_path, cases):
    """Bytes flipped in one file of the latest checkpoint per case, then resume (one Trainer for all cases: its
    compiled step is reused). Every case is refused or ends exactly as the uninterrupted run."""
    full_out, full = uninterrupted
    out = tmp_path / "case"
    trainer = Trainer(TrainConfig(out=str(out), **TINY))
    outcomes = {}
    for file, place in cases:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        shutil.copytree(full_out / "checkpoints", out / "checkpoints")
        shutil.copy(full_out / "metrics.jsonl", out / "metrics.jsonl")
        damage.flip(out / "checkpoints" / "20" / file, place)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                resumed = trainer.run(resume=True)
            except (ValueError, RuntimeError) as error:   # refused
                outcomes[file, place] = f"refused: {error}"
                continue
        for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(full.params), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{file} {place}")
        assert resumed.epsilon == full.epsilon and resumed.steps == 20, (file, place)
        skipped = [str(w.message) for w in caught if "skipping unreadable checkpoint at step 20" in str(w.message)]
        outcomes[file, place] = skipped[0] if skipped else "intact"
    return outcomes


def _checkpoint_files(full_out):
    latest = full_out / "checkpoints" / "20"
    return sorted(str(p.relative_to(latest)) for p in latest.rglob("*") if p.is_file())


def test_flipped_bytes_in_every_file_of_the_latest_checkpoint_never_train(uninterrupted, tmp_path):
    """Issue 17's evidence: bytes flipped in each file of the latest checkpoint, at its start, middle and end and as
    a 256-byte run in the middle (24 cases): every case resumes exactly as the uninterrupted run (from the previous
    checkpoint, or from the latest when its digests show the arrays intact) or is refused."""
    files = _checkpoint_files(uninterrupted[0])
    assert {"host_state/arrays.npz", "meta/metadata"} <= set(files)
    outcomes = _resume_damaged(uninterrupted, tmp_path, _damage_cases(files))
    assert len(outcomes) == 4 * len(files) >= 24
    # damage inside the arrays and anywhere in the meta item is detected (a flip in the zip's trailer may leave
    # every array intact: then the digests match and the checkpoint is rightly used)
    detected = [(f, p) for f in files for p in damage.PLACES
                if f == "meta/metadata" or (f == "host_state/arrays.npz" and p in ("middle", "run256"))]
    assert all(outcomes[case] != "intact" for case in detected), outcomes


def test_a_diverged_run_says_so_and_fails(tmp_path, capsys):
    """A final evaluation that is not finite: Trainer.run raises NonFiniteEvaluationError after writing the
    outputs (summary says evaluation_finite: false), and `dpzero train` exits with status 2 saying why."""
    from dpzero_jax.train import NonFiniteEvaluationError

    diverge = {**{k: v for k, v in TINY.items() if k != "epsilon"}, "steps": 3, "checkpoint_every": 0,
               "no_dp": True, "optimizer": "sgd", "lr": 1e38}
    with pytest.raises(NonFiniteEvaluationError, match="final evaluation is not finite") as error:
        Trainer(TrainConfig(out=str(tmp_path / "api"), **diverge)).run()
    assert not np.isfinite(error.value.result.test_loss) and error.value.result.steps == 3
    assert json.loads((tmp_path / "api" / "summary.json").read_text())["evaluation_finite"] is False
    assert main(["train", "--no-dp", "--optimizer", "sgd", "--lr", "1e38", "--steps", "3", "--checkpoint-every", "0",
                 "--out", str(tmp_path / "cli"), "--no-progress"]) == 2
    assert "final evaluation is not finite" in capsys.readouterr().err


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


def test_data_parallel_devices_match_one_device(tmp_path):
    # SGD: Adam's m / sqrt(v) would amplify the float reordering of cross-device sums on near-zero gradients
    base = dict(TINY, steps=6, checkpoint_every=0, optimizer="sgd", lr=0.1)
    single = Trainer(TrainConfig(out=str(tmp_path / "1"), **base)).run()
    for devices in (2, 4):
        sharded = Trainer(TrainConfig(out=str(tmp_path / str(devices)), devices=devices, **base)).run()
        _assert_same_params(sharded.params, single.params, rtol=1e-5, atol=1e-6)
        assert sharded.epsilon == pytest.approx(single.epsilon, rel=1e-3)  # the capacity is rounded per device
    with pytest.raises(ValueError, match="devices=64 but only"):
        Trainer(TrainConfig(out=str(tmp_path / "x"), devices=64, **TINY))


def test_periodic_evaluation_rows(tmp_path):
    Trainer(TrainConfig(out=str(tmp_path), eval_every=7, **{**TINY, "checkpoint_every": 0})).run()
    rows = {r["step"]: r for r in _rows(tmp_path)}
    assert sorted(rows) == [5, 7, 10, 14, 15, 20]
    assert all(("test_accuracy" in r) == (s in (7, 14, 20)) for s, r in rows.items())
    assert 0 <= rows[20]["test_accuracy"] <= 1


def test_fixed_size_sampling_is_accounted_replace_one(tmp_path):
    import dp_accounting
    from dp_accounting import rdp

    cfg = TrainConfig(out=str(tmp_path), sampling="fixed-size", accountant="rdp", **{**TINY, "checkpoint_every": 0})
    trainer = Trainer(cfg)
    result = trainer.run()
    assert all(r["batch_size"] == 64 for r in _rows(tmp_path))
    a = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    inner = dp_accounting.GaussianDpEvent(result.noise_multiplier / 2)
    a.compose(dp_accounting.SampledWithoutReplacementDpEvent(trainer.dataset_size, 64, inner), 20)
    assert result.epsilon == pytest.approx(a.get_epsilon(cfg.delta), rel=1e-9) and result.epsilon <= 3.0
    with pytest.raises(ValueError, match="accountant must be 'rdp'"):
        TrainConfig(sampling="fixed-size")


def test_shuffled_epochs_warn_and_claim_no_epsilon(tmp_path):
    with pytest.warns(UserWarning, match="no formal DP guarantee"):
        trainer = Trainer(TrainConfig(out=str(tmp_path), sampling="shuffled", **{**TINY, "checkpoint_every": 0}))
    result = trainer.run()
    assert result.epsilon is None and result.noise_multiplier > 0
    assert all(r["epsilon"] is None for r in _rows(tmp_path))
    assert "NO formal guarantee" in result.summary()


def test_truncated_batches_are_recorded_and_charged(tmp_path):
    from dpzero_jax.sampling import PoissonSampler

    trainer = Trainer(TrainConfig(out=str(tmp_path), **{**TINY, "steps": 3, "checkpoint_every": 0}))
    trainer.sampler = PoissonSampler(trainer.dataset_size, trainer.sampling_rate, capacity=40)  # mean batch is 64
    trainer.slots = 40
    with pytest.warns(RuntimeWarning, match="truncated to capacity 40"):
        result = trainer.run()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ledger"]["overflowed_steps"] == [0, 1, 2]
    assert summary["ledger"]["events"][0]["truncation_probability"] > 0.99
    assert result.epsilon == float("inf")  # a mechanism that nearly always truncates certifies nothing


def test_resume_refuses_changed_options(uninterrupted, tmp_path):
    full_out, _ = uninterrupted
    shutil.copytree(full_out / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"different options \(lr: 0.01 -> 0.02\)"):
        Trainer(TrainConfig(out=str(tmp_path), **{**TINY, "lr": 0.02})).run(resume=True)
    # presentation options may change
    resumed = Trainer(TrainConfig(out=str(tmp_path), **{**TINY, "log_every": 4})).run(resume=True)
    assert resumed.steps == 20


def test_vit_model_trains(tmp_path):
    result = Trainer(TrainConfig(out=str(tmp_path), model="vit", **{**TINY, "steps": 3, "checkpoint_every": 0,
                                                                      "lr": 1e-3})).run()
    assert result.steps == 3 and np.isfinite(result.test_loss) and result.epsilon > 0


def test_cli_devices_and_sampling_flags(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--steps", "3", "--batch-size", "32", "--devices", "2", "--sampling", "fixed-size",
                 "--accountant", "rdp", "--checkpoint-every", "0", "--out", str(out), "--no-progress"]) == 0
    saved = json.loads((out / "summary.json").read_text())
    assert saved["config"]["devices"] == 2 and saved["ledger"]["events"][0]["sampling"] == "fixed-size"
    assert main(["train", "--sampling", "fixed-size", "--out", str(tmp_path / "o")]) == 2
    assert "accountant must be 'rdp'" in capsys.readouterr().err


@pytest.mark.parametrize("method, trained", [("linear-probe", {"head/bias", "head/kernel"}),
                                             ("bitfit", {"layers/0/bias", "head/bias", "head/kernel"})])
def test_peft_trains_only_the_selected_parameters(tmp_path, method, trained):
    """PEFT through the trainer: the parameters it optimises are the method's (plus the new head for BiTFiT), the
    frozen hidden kernel is untouched, and the private run still learns (above chance)."""
    cfg = TrainConfig(out=str(tmp_path), peft=method, **{**TINY, "checkpoint_every": 0})
    trainer = Trainer(cfg)
    names = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
             for path, _ in jax.tree_util.tree_leaves_with_path(trainer.init_params)}
    names = {name.removesuffix("/.value") for name in names}
    assert names == trained
    result = trainer.run()
    assert result.test_accuracy > 0.3


def _constants_of_shape(stablehlo: str, shape) -> list[str]:
    """The ``stablehlo.constant`` lines of a lowered program whose type is a tensor of ``shape``."""
    wanted = "tensor<" + "x".join(map(str, shape)) + "x"
    return [line for line in stablehlo.splitlines() if "stablehlo.constant" in line and wanted in line]


@pytest.mark.parametrize("devices, strategy", [(1, "gspmd"), (2, "gspmd"), (2, "explicit")])
def test_frozen_weights_enter_the_step_as_arguments_not_constants(tmp_path, devices, strategy):
    """PEFT's frozen base weights are arguments of the jitted step (sharded like parameters under a mesh; under
    the explicit strategy, arguments of its shard_map too), never constants folded into the program: a large frozen
    model would otherwise be baked into every compiled step."""
    cfg = TrainConfig(out=str(tmp_path), peft="linear-probe", devices=devices, strategy=strategy,
                      **{**TINY, "checkpoint_every": 0})
    trainer = Trainer(cfg)
    frozen_kernel = trainer._frozen["layers"][0]["kernel"][...]
    text = trainer.lower_step().as_text()
    assert not _constants_of_shape(text, frozen_kernel.shape)
    # the detector finds the constant when the same weight is captured instead of passed
    captured = jax.jit(lambda x: x @ frozen_kernel).lower(jax.ShapeDtypeStruct((3, frozen_kernel.shape[0]),
                                                                               frozen_kernel.dtype))
    assert _constants_of_shape(captured.as_text(), frozen_kernel.shape)
    result = trainer.run()   # and the step still trains with them passed in
    assert result.test_accuracy > 0.3


def test_peft_lora_through_the_cli(tmp_path, capsys):
    assert main(["train", "--steps", "10", "--batch-size", "64", "--peft", "lora", "--lora-rank", "2",
                 "--lora-targets", "layers/0", "--peft-also-train", "none", "--out", str(tmp_path),
                 "--no-progress", "--checkpoint-every", "0"]) == 0
    epsilon = float(capsys.readouterr().out.split("epsilon ")[1].split()[0])
    assert 2.9 < epsilon <= 3.0
    with pytest.raises(ValueError, match="lora_targets applies to peft='lora' only"):
        TrainConfig(peft="bitfit", lora_targets=("head",))
    with pytest.raises(ValueError, match="TrainConfig.peft must be"):
        TrainConfig(peft="prefix")

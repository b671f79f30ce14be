"""Issue 21, part 1: no configuration silently weakens privacy (config files, flags and TrainConfig alike)."""

import dataclasses
import json
import random

import pytest

from dpzero_jax.cli import main
from dpzero_jax.train import TrainConfig, TrainResult
from dpzero_jax.train_config import BOOL_OPTIONS


def _train(argv, capsys):
    code = main(["train", *argv, "--no-progress"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("text, suffix, name", [('{"no_dp": "false", "steps": 2}', ".json", "no_dp"),
                                                ('no_dp: "no"\nsteps: 2\n', ".yaml", "no_dp"),
                                                ('{"no_dp": 0, "steps": 2}', ".json", "no_dp"),
                                                ('{"tensorboard": "false", "steps": 2}', ".json", "tensorboard")])
def test_string_boolean_in_a_config_file_is_refused(tmp_path, capsys, text, suffix, name):
    config = tmp_path / f"run{suffix}"
    config.write_text(text)
    code, err = _train(["--config", str(config), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and f"--config {config}: {name} must be true or false" in err   # the file is named
    assert not (tmp_path / "out").exists()


def test_yaml_unquoted_no_is_a_real_boolean():
    # YAML 1.1 reads an unquoted `no` as the boolean False: that is a boolean, and it means False
    import yaml

    assert TrainConfig.from_dict(yaml.safe_load("no_dp: no\n")).no_dp is False


def test_noise_multiplier_and_epsilon_exclusive_in_files(tmp_path, capsys):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"noise_multiplier": 1.0, "epsilon": 3, "steps": 2}))
    code, err = _train(["--config", str(config), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "exclusive" in err and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="exclusive"):
        TrainConfig.from_dict({"noise_multiplier": 1.0, "epsilon": 3.0})
    with pytest.raises(ValueError, match="exclusive"):
        TrainConfig(noise_multiplier=1.0, epsilon=8.0)
    with pytest.raises(ValueError, match="no_dp"):
        TrainConfig.from_dict({"no_dp": True, "epsilon": 1.0})


def test_a_flag_replaces_the_files_privacy_choice(tmp_path):
    from dpzero_jax import cli

    config = tmp_path / "run.json"
    config.write_text(json.dumps({"epsilon": 2.0}))
    args = cli.build_parser().parse_args(["train", "--config", str(config), "--noise-multiplier", "1.5"])
    values = cli._load_config_file(args.config)
    assert values == {"epsilon": 2.0}   # the flag wins below without tripping the exclusivity of the file


def test_delta_above_one_over_n_needs_the_flag(tmp_path, capsys):
    # digits: 1437 training examples, 1/n = 6.96e-4
    code, err = _train(["--delta", "0.01", "--steps", "2", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "above 1/n" in err and "--allow-large-delta" in err
    assert not (tmp_path / "out").exists()
    result = TrainResult(test_accuracy=0.5, train_accuracy=0.5, test_loss=1.0, epsilon=2.0, delta=0.01, steps=2,
                         noise_multiplier=1.0, sampling_rate=0.1, runtime_s=1.0, out="x", large_delta=True)
    assert "allowed by --allow-large-delta" in result.summary()


def test_zero_noise_needs_no_dp(tmp_path, capsys):
    code, err = _train(["--noise-multiplier", "0", "--steps", "2", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "--no-dp" in err and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="no_dp"):
        TrainConfig(noise_multiplier=0.0)


def test_module_in_error_is_short():
    import flax.nnx as nnx

    from dpzero_jax import models

    module = models.MLP(models.MLPConfig(in_features=4, hidden=(3,), num_classes=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError) as info:
        TrainConfig(model=module)
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


# ------------------------------------------------------------------ fuzz
JUNK = [None, True, False, 0, 1, -1, 2, 7, 0.0, 1e-9, 0.5, 3.0, -2.5, 1e300, float("nan"), float("inf"), "", "false",
        "no", "true", "0", "hf:", "mlp", "runs/x", [], [1, 2], ["a"], {}, {"a": 1}, ("uniform", 2), "all-layer", b"x"]


def _draw(rng, default, rate):
    if rng.random() >= rate:
        return default
    return rng.choice(JUNK)


def test_fuzzed_config_files_fail_clearly_or_keep_privacy():
    """Seeded: 400 mappings with random types and values for every TrainConfig field (validation only)."""
    rng = random.Random(21)
    fields = [f for f in dataclasses.fields(TrainConfig)]
    accepted = 0
    for case in range(400):
        rate = (0.01, 0.05, 0.3)[case % 3]   # mostly valid, a few bad values, many bad values
        values = {f.name: _draw(rng, f.default if f.default is not dataclasses.MISSING else f.default_factory(), rate)
                  for f in fields if rng.random() < 0.6}
        try:
            cfg = TrainConfig.from_dict(values)
        except ValueError as error:   # the only error type; one line
            assert "\n" not in str(error) and "Traceback" not in str(error)
            continue
        accepted += 1
        for name in BOOL_OPTIONS:   # a boolean option is exactly what was written, never a coerced string
            assert type(getattr(cfg, name)) is bool
            if name in values:
                assert getattr(cfg, name) is values[name]
        if cfg.no_dp:
            assert values.get("no_dp") is True
        else:
            assert cfg.noise_multiplier is None or cfg.noise_multiplier > 0
            assert values.get("noise_multiplier") is None or values.get("epsilon") is None
            assert 0 < cfg.delta < 1 and cfg.epsilon > 0
    assert accepted > 10   # the fuzz also exercises valid configurations


# ------------------------------------------------------------------ part 4 rough edges
def test_train_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--lr LR the (peak) learning rate (default: 0.01)" in out and "(default: runs/dpzero)" in out \
        and "(default: 512)" in out and "--lr-schedule {constant,cosine,linear}" in out and "(default: constant)" in out


def test_autotune_warns_when_it_falls_back_to_vmap():
    import jax
    import jax.numpy as jnp

    import dpzero_jax as dz

    def loss_fn(p, batch):   # a parameter used outside a dz.layers layer: with front_end="layers" only vmap clips it
        return jnp.sum(jnp.sin(p["w"] * batch["x"]) ** 2, axis=-1)

    with pytest.warns(RuntimeWarning, match="falling back to mode='vmap'"):
        cfg = dz.autotune(loss_fn, dz.DPConfig(front_end="layers"), {"w": jnp.ones((3,))}, {"x": jnp.ones((4, 3))},
                          jax.random.key(0), repeats=1)
    assert cfg.mode == "vmap"


def test_hf_gpt2_without_task_is_causal_lm(tmp_path):
    from dpzero_jax import cli

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    values = {"model": f"hf:{tmp_path}"}
    cli._infer_task(values)
    assert values["task"] == "causal-lm"
    values = {"model": f"hf:{tmp_path}", "task": "classification"}
    cli._infer_task(values)
    assert values["task"] == "classification"   # an explicit task is kept

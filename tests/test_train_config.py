"""TrainConfig as a composition of option groups: one check per option (shared with DPConfig / RMMConfig), errors
naming the option and its group, and `dpzero train` flags generated from the fields."""

import argparse
import dataclasses

import pytest

from dpzero_jax import cli
from dpzero_jax.config import ClippingOptions, DPConfig, PrivacyOptions
from dpzero_jax.options import option_of
from dpzero_jax.peft import PeftOptions
from dpzero_jax.sharding import DistributedOptions, MeshOptions
from dpzero_jax.sketch import RMMConfig, RMMOptions
from dpzero_jax.train_config import GROUPS, PYTHON_ONLY, TrainConfig, TrainingOptions


@pytest.mark.parametrize("changes, option, group", [
    ({"rmm": "gaussian", "rmm_rate": 1.5}, "rmm_rate", RMMOptions),
    ({"lr": 0.0}, "lr", TrainingOptions),
    ({"clip_fn": "hard"}, "clip_fn", ClippingOptions),
    ({"delta": 1.0}, "delta", PrivacyOptions),
    ({"zero": 4}, "zero", MeshOptions),
    ({"lora_rank": 0}, "lora_rank", PeftOptions),
    ({"process_id": -1, "coordinator": "h:1", "num_processes": 2, "devices": 2}, "process_id", DistributedOptions),
    ({"rmm_diagnostics_every": 5}, "rmm_diagnostics_every", RMMOptions),   # a rule between a group's options
])
def test_a_bad_value_is_one_error_naming_the_option_and_its_group(changes, option, group):
    with pytest.raises(ValueError) as error:
        TrainConfig(**changes)
    message = str(error.value)
    assert message.startswith(f"TrainConfig.{option} ")
    assert message.count(f"TrainConfig.{option}") == 1 and "\n" not in message
    assert f"option group {group.GROUP!r}: {group.__module__}.{group.__name__}" in message
    with pytest.raises(ValueError, match=f"^{group.__name__}.{option} "):   # the group alone: the same check
        group(**{k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(group)}})


def test_every_option_has_a_flag_or_is_python_only():
    parser = cli.build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    dests = {action.dest for action in train._actions}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert PYTHON_ONLY == ("plot",)   # adding a Python-only option means listing it here, deliberately
    assert fields - set(PYTHON_ONLY) <= dests
    assert not set(PYTHON_ONLY) & dests
    assert dests - fields == {"help", "config", "resume", "resume_or_start"}
    # every field belongs to exactly one group
    grouped = [f.name for g in GROUPS for f in dataclasses.fields(g)]
    assert sorted(grouped) == sorted(fields) and all(option_of(f) for f in dataclasses.fields(TrainConfig))


def test_flags_build_the_config_their_fields_describe():
    def config(*argv):
        args = cli.build_parser().parse_args(["train", *argv])
        values, _ = cli._train_values(vars(args))
        return TrainConfig.from_dict(values)

    assert config() == TrainConfig()
    cfg = config("--groups", "uniform:3", "--hidden", "64,32", "--peft", "lora", "--lora-targets", "a,b",
                 "--peft-also-train", "none", "--zero", "2", "--devices", "2", "--wandb", "proj", "--no-progress",
                 "--noise-multiplier", "1.5", "--rmm", "dct", "--rmm-rate", "0.25")
    assert cfg == TrainConfig(groups=("uniform", 3), hidden=(64, 32), peft="lora", lora_targets=("a", "b"),
                              peft_also_train=(), zero=2, devices=2, wandb_project="proj", progress=False,
                              noise_multiplier=1.5, rmm="dct", rmm_rate=0.25)
    # flat keys, as in --config files and checkpoints (a file gives noise_multiplier or epsilon, not both)
    assert TrainConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "epsilon"}) == cfg


@pytest.mark.parametrize("argv, message", [
    (["--rmm-rate", "1.5"], "--rmm-rate must be a compression rate in (0, 1], got '1.5'"),
    (["--groups", "uniform:0"], "--groups must be all-layer, layer-wise, param-wise or uniform:K"),
    (["--hidden", "3,0"], "--hidden must be comma-separated positive ints, got '3,0'"),
    (["--epsilon", "1", "--no-dp"], "not allowed with argument"),
    (["--steps", "3", "--epochs", "2"], "not allowed with argument"),
    (["--zero", "4"], "--zero must be one of (1, 2, 3), got '4'"),
])
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", *argv])
    assert message in capsys.readouterr().err


def test_dp_config_and_the_clipping_group_share_their_checks():
    dp = {f.name: option_of(f).check for f in dataclasses.fields(DPConfig)}
    clip = {f.name: option_of(f).check for f in dataclasses.fields(ClippingOptions)}
    for name in ("max_grad_norm", "clip_fn", "mode", "norm_kernel"):
        assert dp[name] is clip[name]
    assert dp["microbatch_size"] is clip["micro_batch_size"]
    for dp_kw, train_kw, text in [({"clip_fn": "hard"}, {"clip_fn": "hard"}, "must be one of ('abadi'"),
                                  ({"max_grad_norm": -1.0}, {"max_grad_norm": -1.0}, "must be a finite number > 0"),
                                  ({"microbatch_size": 0}, {"micro_batch_size": 0}, "must be an integer >= 1 or None")]:
        with pytest.raises(ValueError, match="^DPConfig.*" + text.replace("(", r"\(")):
            DPConfig(**dp_kw)
        with pytest.raises(ValueError, match="^TrainConfig.*" + text.replace("(", r"\(")):
            TrainConfig(**train_kw)
    with pytest.raises(ValueError, match=r"^RMMConfig.rate must be a compression rate in \(0, 1\], got 1.5$"):
        RMMConfig(rate=1.5)


def test_groups_as_objects_and_the_runtime_dp_config():
    cfg = TrainConfig(rmm="dct", rmm_rate=0.5, max_grad_norm=2.0, clip_fn="automatic", groups=["uniform", 2],
                      mode="bk", micro_batch_size=4, norm_kernel="xla", mesh="data=2,fsdp=2")
    assert cfg.groups == ("uniform", 2)   # normalised once, by the field's check
    assert cfg.rmm_options == RMMOptions(rmm="dct", rmm_rate=0.5)
    assert cfg.mesh_options.mesh_shape().size == 4 and cfg.privacy_options == PrivacyOptions()
    assert cfg.dp_config(0.7, expected_batch_size=cfg.batch_size, noise_rng="partitionable") == DPConfig(
        noise_multiplier=0.7, max_grad_norm=2.0, clip_fn="automatic", groups=("uniform", 2), mode="bk",
        expected_batch_size=cfg.batch_size, microbatch_size=4, norm_kernel="xla", noise_rng="partitionable")
    with pytest.raises(ValueError, match="^RMMOptions.rmm_rate applies to RMM layers only"):
        RMMOptions(rmm_rate=0.5)
    with pytest.raises(ValueError, match="rmm='dct' is not supported with strategy='explicit'"):   # across groups
        cfg.replace(strategy="explicit")


@pytest.mark.parametrize("changes", [{}, {"noise_multiplier": 1.3}, {"no_dp": True}, {"epsilon": 8.0, "lr": 0.05},
                                     {"noise_multiplier": 0.9, "clip_quantile": 0.5}])
def test_to_dict_round_trips_through_from_dict(changes):
    """A saved config (checkpoint metadata, a --config file) builds the same config again, also when epsilon is not
    in effect (noise_multiplier or no_dp given: from_dict refuses epsilon next to them)."""
    cfg = TrainConfig(**changes)
    values = cfg.to_dict()
    assert TrainConfig.from_dict(values) == cfg
    assert ("epsilon" in values) == (cfg.noise_multiplier is None and not cfg.no_dp)


def test_a_run_saved_with_the_default_epsilon_listed_resumes(tmp_path):
    """Checkpoints written before to_dict left epsilon out list it next to noise_multiplier: the same run."""
    from dpzero_jax.train_checkpoint import check_same_run, jsonable

    cfg = TrainConfig(noise_multiplier=1.1)
    check_same_run(cfg, {**jsonable(cfg.to_dict()), "epsilon": 3.0}, tmp_path)
    other = TrainConfig(epsilon=5.0)
    with pytest.raises(ValueError, match="epsilon"):
        check_same_run(other, {**jsonable(other.to_dict()), "epsilon": 3.0}, tmp_path)

"""RMM linear layers in the trainer (``dpzero train --rmm SKETCH --rmm-rate RHO``, paper 002): it learns, rejects or
warns about what RMM does not do, draws fresh sketches from each step's key, trains like exact layers with full-rate
orthogonal sketches, resumes bit-identically, and reports the variance diagnostics; scanned layers are refused by
name. The layers themselves and the engine on them: ``test_rmm.py``."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import build

import dpzero_jax as dz
from dpzero_jax import rmm
from dpzero_jax.sketch import SKETCHES, RMMConfig
from dpzero_jax.train import TrainConfig, Trainer

TRAIN = dict(progress=False, plot=False, checkpoint_every=0)


def _assert_same_params(a, b, rtol=1e-6, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _max_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _metric_rows(out):
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cli_train_with_rmm_learns(tmp_path, capsys):
    """``dpzero train --model vit --rmm rademacher --rmm-rate 0.5``: every dense layer of the ViT but the head is an
    RMM layer keeping 9 of 17 tokens (8 of 16 patches) -- the diagnostics of the last step list exactly those --;
    10 private steps finish, reach the target epsilon and learn (accuracy on the 360 test digits well above the 10%
    of chance, whose standard deviation is 1.6 points)."""
    from dpzero_jax.cli import main

    assert main(["train", "--model", "vit", "--rmm", "rademacher", "--rmm-rate", "0.5", "--steps", "10",
                 "--batch-size", "64", "--out", str(tmp_path), "--no-progress", "--checkpoint-every", "0",
                 "--rmm-diagnostics-every", "10", "--log-every", "5"]) == 0
    printed = capsys.readouterr().out
    epsilon = float(printed.split("epsilon ")[1].split()[0])
    accuracy = float(printed.split("test accuracy ")[1].split("%")[0]) / 100
    assert 2.9 < epsilon <= 3.0
    assert accuracy > 0.14, printed
    import json

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["config"]["rmm"] == "rademacher" and saved["config"]["rmm_rate"] == 0.5
    rows = _metric_rows(tmp_path)
    layers = {key.rsplit("/", 1)[0].removeprefix("rmm/") for key in rows[-1] if key.startswith("rmm/")}
    # the blocks' dense layers (the patch embedding is an nnx.Conv, which RMM does not convert)
    assert layers == {f"blocks/{i}/{name}" for i in (0, 1)
                      for name in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")}
    assert all(np.isfinite(rows[-1][f"rmm/{layer}/{field}"]) for layer in layers
               for field in ("d2_sgd", "d2_rmm", "alpha"))
    assert [r["step"] for r in rows] == [5, 10] and not any(key.startswith("rmm/") for key in rows[0])


@pytest.mark.parametrize("changes, match", [
    ({"rmm": "fft"}, r"TrainConfig.rmm must be one of \('none', 'gaussian', 'rademacher', 'dct', 'dft'\)"),
    ({"rmm": "gaussian", "rmm_rate": 0.0}, r"TrainConfig.rmm_rate must be a compression rate in \(0, 1\], got 0.0"),
    ({"rmm": "gaussian", "rmm_rate": 1.5}, r"TrainConfig.rmm_rate must be a compression rate in \(0, 1\], got 1.5"),
    ({"rmm": "gaussian", "rmm_rate": float("nan")}, r"TrainConfig.rmm_rate must be a compression rate"),
    ({"rmm": "gaussian", "rmm_rate": True}, r"TrainConfig.rmm_rate must be a compression rate"),
    ({"rmm": "gaussian", "rmm_rate": "0.5"}, r"TrainConfig.rmm_rate must be a compression rate"),
    ({"rmm_rate": 0.5}, r"TrainConfig.rmm_rate applies to RMM layers only"),
    ({"rmm": "dct", "rmm_diagnostics_every": -1}, r"TrainConfig.rmm_diagnostics_every must be an integer >= 0"),
    ({"rmm_diagnostics_every": 5}, r"TrainConfig.rmm_diagnostics_every applies to RMM layers only"),
    ({"rmm": "dct", "strategy": "explicit", "devices": 2}, r"TrainConfig.rmm='dct' is not supported with "
                                                           r"strategy='explicit'"),
])
def test_train_config_rejects_bad_rmm_options(changes, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**changes)


def test_rmm_options_the_trainer_refuses_or_warns_about(tmp_path, capsys):
    from dpzero_jax import train
    from dpzero_jax.cli import main

    assert train.RMM_SKETCHES == ("none",) + SKETCHES
    for flag, value in (("--rmm-rate", "0"), ("--rmm-rate", "1.5"), ("--rmm", "fft")):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--rmm", "dct", flag, value])
        assert exit_info.value.code == 2 and flag in capsys.readouterr().err
    nothing = r"no dense layer \(dpzero_jax.layers.Linear / DenseGeneral, nnx.Linear / LinearGeneral\) besides the head"
    with pytest.raises(ValueError, match=nothing):
        Trainer(TrainConfig(out=str(tmp_path), rmm="dct", peft="bitfit", steps=2, **TRAIN))
    with pytest.warns(UserWarning, match="the MLP's dense layers see one per example"):
        Trainer(TrainConfig(out=str(tmp_path), rmm="dct", steps=2, **TRAIN))


def _trainer_mlp(rmm_config: RMMConfig | None):
    """The trainer's MLP on digits built here from its definition (init key ``fold_in(key(seed), 0)``), with the
    dense layers but the head converted; ``(exact params, exact loss, params, loss_for_key)``."""
    model = dz.models.MLP(dz.models.MLPConfig(in_features=64, hidden=(128,), num_classes=10),
                          rngs=nnx.Rngs(params=jax.random.fold_in(jax.random.key(0), 0)))
    exact_params, exact_loss = dz.models.classification_objective(model)
    if rmm_config is None:
        return exact_params, exact_loss, exact_params, lambda key: exact_loss
    rmm.convert_to_rmm(model, rmm_config, where=lambda path, _: path != "head")
    return (exact_params, exact_loss) + rmm.keyed_objective(dz.models.classification_objective, model)


def test_trainer_draws_fresh_sketches_from_each_step_key(tmp_path):
    """Non-private RMM (rows layout, Gaussian, rho 0.5) through the trainer equals SGD written out here with the
    sketch key ``fold_in(noise_key_t, 2^31 - 1)`` of each step ``t``, and not the same run with one key for all
    steps (so the test sees the key)."""
    from dpzero_jax.sampling import gather

    cfg = TrainConfig(out=str(tmp_path), no_dp=True, rmm="gaussian", rmm_rate=0.5, steps=3, batch_size=32,
                      optimizer="sgd", lr=0.1, **TRAIN)
    trainer = Trainer(cfg)
    _, _, params, loss_for_key = _trainer_mlp(RMMConfig(sketch="gaussian", rate=0.5, projection="rows"))
    _assert_same_params(params, trainer.init_params, rtol=0, atol=0)
    tx = optax.sgd(0.1, momentum=0.9)

    @functools.partial(jax.jit, static_argnums=4)
    def sgd_step(params, opt_state, batch, mask, key_fn, noise_key):
        def mean_loss(p):
            losses = loss_for_key(key_fn(noise_key))(p, batch)
            return jnp.sum(jnp.where(mask, losses, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
        updates, opt_state = tx.update(jax.grad(mean_loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def by_hand(key_fn):
        p, opt_state = params, tx.init(params)
        for t in range(3):
            batch_info = trainer.sample(t)
            batch = gather(trainer.train_data, batch_info.indices)
            p, opt_state = sgd_step(p, opt_state, batch, batch_info.mask, key_fn, trainer.step_keys(t)[1])
        return p

    result = trainer.run()
    _assert_same_params(result.params, by_hand(lambda noise_key: jax.random.fold_in(noise_key, 2**31 - 1)),
                        rtol=1e-5, atol=1e-6)
    one_key = by_hand(lambda noise_key: jax.random.fold_in(trainer.step_keys(0)[1], 2**31 - 1))
    assert _max_difference(result.params, one_key) > 1e-3


@pytest.mark.parametrize("no_dp, model, sketch", [pytest.param(False, "vit", "dft", marks=pytest.mark.slow),
                                                   (True, "mlp", "dct")])
def test_full_rate_orthogonal_rmm_trains_like_exact_layers(tmp_path, no_dp, model, sketch):
    """At ``rho = 1`` an orthogonal sketch has ``S S^T = I``: the estimates are the exact gradients (up to float
    rounding), so the RMM run's parameters after 3 steps are the exact run's -- under DP (ViT, tokens layout: the
    engine's rule, same noise) and without (MLP, rows layout: the layer's own backward). A Gaussian sketch at
    ``rho = 1`` is still random and gives other parameters (the runs do use the RMM layers)."""
    # a small batch for the ViT: XLA:CPU compiles the FFT-based sketches of its 9 layers slowly (a minute at B = 8)
    base = dict(model=model, no_dp=no_dp, steps=3, batch_size=8 if model == "vit" else 32, optimizer="sgd",
                lr=0.05, noise_multiplier=None if no_dp else 1.0, **TRAIN)
    exact = Trainer(TrainConfig(out=str(tmp_path / "exact"), **base)).run()
    orthogonal = Trainer(TrainConfig(out=str(tmp_path / sketch), rmm=sketch, **base)).run()
    _assert_same_params(orthogonal.params, exact.params, rtol=1e-4, atol=2e-6)
    if no_dp:
        gaussian = Trainer(TrainConfig(out=str(tmp_path / "gaussian"), rmm="gaussian", **base)).run()
        assert _max_difference(gaussian.params, exact.params) > 1e-3


@pytest.mark.filterwarnings("ignore:rmm under DP compresses each example's tokens")
@pytest.mark.slow
def test_resume_of_an_rmm_run_equals_the_uninterrupted_run(tmp_path):
    """A private run with Gaussian RMM layers stopped after the checkpoint at step 2 and resumed by a fresh trainer
    ends with the uninterrupted run's parameters, epsilon and metrics rows. The MLP keeps it cheap; its one-token
    layers still depend on the sketch key (each layer's gradient estimate is scaled by ``s^2``, ``s ~ N(0, 1)``
    drawn per step), so a resumed run that drew other sketches would differ."""
    base = dict(rmm="gaussian", rmm_rate=0.5, steps=6, batch_size=32, noise_multiplier=1.0, log_every=1, progress=False,
                plot=False, checkpoint_every=2)
    full = Trainer(TrainConfig(out=str(tmp_path / "full"), **base)).run()
    cfg = TrainConfig(out=str(tmp_path / "resumed"), **base)
    assert Trainer(cfg).run(stop_at=2).steps == 2
    resumed = Trainer(cfg).run(resume=True)
    _assert_same_params(resumed.params, full.params)
    assert resumed.epsilon == full.epsilon and resumed.steps == 6
    assert _metric_rows(tmp_path / "resumed") == _metric_rows(tmp_path / "full")
    exact = Trainer(TrainConfig(out=str(tmp_path / "exact"), **{**base, "rmm": "none", "rmm_rate": 1.0})).run()
    assert _max_difference(exact.params, full.params) > 1e-3     # the sketches matter in this run
    with pytest.raises(ValueError, match=r"rmm_rate: 0.5 -> 0.25"):
        Trainer(TrainConfig(out=str(tmp_path / "resumed"), **{**base, "rmm_rate": 0.25})).run(resume=True)


def test_rmm_diagnostics_in_the_metrics(tmp_path):
    """``rmm_diagnostics_every=1``: every row has D2_SGD (eq. 9), D2_RMM (eq. 11) and alpha (eq. 13) of the RMM layer
    ``layers/0``; those of step 1 equal the formulas applied here to per-example gradients of the exact MLP
    (``vmap(grad)``) at the initial parameters on the first batch (rows layout: ``B_proj = rho * slots``)."""
    from dpzero_jax.sampling import gather

    cfg = TrainConfig(out=str(tmp_path), no_dp=True, rmm="gaussian", rmm_rate=0.5, steps=2, batch_size=32,
                      log_every=10, rmm_diagnostics_every=1, **TRAIN)
    trainer = Trainer(cfg)
    trainer.run()
    rows = _metric_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    names = {"rmm/layers/0/d2_sgd", "rmm/layers/0/d2_rmm", "rmm/layers/0/alpha"}
    assert all(names == {k for k in r if k.startswith("rmm/")} for r in rows)

    exact_params, exact_loss, _, _ = _trainer_mlp(None)
    batch_info = trainer.sample(0)
    batch = gather(trainer.train_data, batch_info.indices)
    mask = np.asarray(batch_info.mask)
    count = mask.sum()

    def loss_i(p, image, label):
        return exact_loss(p, {"image": image[None], "label": label[None]})[0]

    grads = jax.vmap(jax.grad(loss_i), in_axes=(None, 0, 0))(exact_params, batch["image"], batch["label"])
    kernel = np.asarray(grads["layers"][0]["kernel"][...], np.float64)[mask] / count      # G_i, mean-loss scale
    y = np.where(mask[:, None], np.asarray(grads["layers"][0]["bias"][...], np.float64), 0.0) / count   # dL/dy
    x = np.asarray(batch["image"], np.float64).reshape(len(mask), -1)                     # all slots' inputs
    d2_sgd = (count * np.sum(kernel**2) - np.sum(kernel.sum(0) ** 2)) / (count - 1)
    xty = np.sum((x.T @ y) ** 2)
    k = math.floor(0.5 * len(mask) + 0.5)
    expected = {"d2_sgd": d2_sgd, "d2_rmm": (np.sum(x**2) * np.sum(y**2) - xty) / k,
                "alpha": xty / (np.sum(x**2) * np.sum(y**2))}
    for field, value in expected.items():
        assert rows[0][f"rmm/layers/0/{field}"] == pytest.approx(value, rel=1e-4), field


def test_stacked_layers_are_refused_with_a_clear_error():
    """A scanned GPT-2's dense layers carry a leading [n_layer] axis: RMM refuses them by name instead of failing
    inside the scan."""
    config = dz.models.GPT2Config(vocab_size=20, n_positions=4, n_embd=8, n_layer=2, n_head=2, scan_layers=True)
    model = build(dz.models.GPT2, config, 0)
    with pytest.raises(ValueError, match=r"kernel has shape \(2, 8, 24\) \(stacked for a scan"):
        rmm.convert_to_rmm(model, sketch="gaussian", rate=0.5, private=True)

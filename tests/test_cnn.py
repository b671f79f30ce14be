"""The bundled CNN (standard Flax NNX layers): shapes, its private gradient against a reference written here (clip
and sum of ``jax.vmap(jax.grad(one-example loss))``), and ``dpzero train --model cnn``."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import build

import dpzero_jax as dz
from dpzero_jax.cli import main
from dpzero_jax.models import CNN, CNNConfig, classification_objective
from dpzero_jax.train import TrainConfig

B = 8


def _output(model, images):
    """The model's output shape and dtype, traced abstractly (no op-by-op compilation)."""
    graphdef, state = nnx.split(model)
    return jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, images)


def test_forward_shapes():
    model = build(CNN, CNNConfig(), 0)          # initialisers compiled as one program
    assert _output(model, jnp.zeros((3, 8, 8, 1))).shape == (3, 10)
    # odd size, 3 channels: the stride-2 convolution gives ceil(7 / 2) = 4, so the head sees 4 * 4 * 12 features
    other = build(CNN, CNNConfig(image_size=7, num_channels=3, widths=(6, 12), num_groups=3, num_classes=4), 0)
    assert _output(other, jnp.zeros((2, 7, 7, 3))).shape == (2, 4)
    assert other.conv2.kernel[...].shape == (3, 3, 6, 12) and other.head.kernel[...].shape == (4 * 4 * 12, 4)
    with pytest.raises(ValueError, match=r"images must be \[B, 8, 8, 1\], got \(3, 64\)"):
        model(jnp.zeros((3, 64)))
    with pytest.raises(ValueError, match="num_groups=5 must divide"):
        CNNConfig(num_groups=5)
    half = build(CNN, CNNConfig(dtype=jnp.bfloat16), 0)                 # --precision bf16: bf16 compute
    assert _output(half, jnp.zeros((2, 8, 8, 1), jnp.bfloat16)).dtype == jnp.bfloat16
    assert half.conv1.kernel[...].dtype == jnp.float32                  # fp32 master weights


@pytest.mark.parametrize("mode", ["vmap", "auto", "ghost"])
def test_private_gradient_equals_clipped_sum_of_vmap_grad(mode):
    model = CNN(CNNConfig(), rngs=nnx.Rngs(1))
    params, loss_fn = classification_objective(model)      # what the trainer differentiates
    kx, ky = jax.random.split(jax.random.key(2))
    batch = {"image": jax.random.normal(kx, (B, 8, 8, 1)), "label": jax.random.randint(ky, (B,), 0, 10)}

    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def example_loss(p, image, label):                      # one example, written independently of the objective
        logits = nnx.merge(graphdef, p, rest)(image[None])[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, label)

    grads = jax.jit(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0)))(params, batch["image"], batch["label"])
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(B, -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
    clip_norm = float(jnp.median(norms))                    # about half of the examples are clipped
    factors = jnp.minimum(1.0, clip_norm / norms)
    want = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1) / B, grads)

    cfg = dz.DPConfig(noise_multiplier=0.0, max_grad_norm=clip_norm, mode=mode)
    losses, got, stats = jax.jit(dz.private_value_and_grad(loss_fn, cfg))(params, batch, jax.random.key(0))
    np.testing.assert_allclose(losses, jax.vmap(example_loss, in_axes=(None, 0, 0))(params, batch["image"],
                                                                                     batch["label"]), rtol=1e-5)
    np.testing.assert_allclose(stats.norms, norms, rtol=1e-4)
    assert 0 < int(jnp.sum(stats.clip_factors < 1)) < B
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(w))))


def test_cli_trains_the_cnn_in_vmap_mode(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--model", "cnn", "--mode", "vmap", "--steps", "5", "--batch-size", "64",
                 "--checkpoint-every", "0", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["model"] == "cnn" and summary["config"]["mode"] == "vmap"
    assert summary["steps"] == 5 and 2.5 < summary["epsilon"] <= 3.0 and np.isfinite(summary["test_loss"])
    printed = capsys.readouterr().out
    assert "test accuracy" in printed and f"epsilon {summary['epsilon']:.3f} at delta 1e-05" in printed


def test_bad_model_name_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "cnn2", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "--model must be mlp, vit, cnn or hf:PATH, got 'cnn2'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"TrainConfig.model must be one of \('mlp', 'vit', 'cnn'\)"):
        TrainConfig(model="CNN")

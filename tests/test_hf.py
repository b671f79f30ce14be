"""Hugging Face checkpoints: loading matches ``transformers`` (logits, and per-example gradient norms against
``torch.func``), export round-trips through ``transformers.from_pretrained``, torch-free PyTorch weights, errors."""

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import hf_helpers
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import dpzero_jax as dz

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RTOL = 1e-4


def assert_close(actual, expected, rtol=RTOL):
    """``|a - e| <= rtol * max|e|`` elementwise (logits of different magnitudes in one array)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for name, build in (("gpt2", lambda p: hf_helpers.gpt2(p, tokenizer=False)),
                        ("gpt2-untied", lambda p: hf_helpers.gpt2(p, tied=False, seed=1, tokenizer=False)),
                        ("bert", lambda p: hf_helpers.bert(p, tokenizer=False)),
                        ("roberta", lambda p: hf_helpers.bert(p, roberta=True, seed=2, tokenizer=False)),
                        ("vit", lambda p: hf_helpers.vit(p))):
        made[name] = (root / name, build(root / name))
    return made


def gpt2_logits(torch_model, ids):
    with torch.no_grad():
        return torch_model(torch.tensor(ids)).logits.numpy()


def text_inputs(roberta: bool, seed: int):
    """Token ids with one right-padded row and a second segment in another, and the matching masks."""
    pad = 1 if roberta else 0
    ids = hf_helpers.token_batch(200, 3, 12, seed, low=5)
    mask = np.ones_like(ids)
    mask[0, 7:] = 0
    ids[0, 7:] = pad
    token_types = np.zeros_like(ids)
    if not roberta:
        token_types[1, 6:] = 1
    return ids, mask, token_types


def encoder_logits(torch_model, ids, mask, token_types):
    with torch.no_grad():
        return torch_model(torch.tensor(ids), attention_mask=torch.tensor(mask),
                           token_type_ids=torch.tensor(token_types)).logits.numpy()


@pytest.mark.parametrize("name,scan", [("gpt2", False), ("gpt2-untied", False), ("gpt2", True)])
def test_gpt2_logits_match_transformers_and_export_round_trips(checkpoints, name, scan, tmp_path):
    path, torch_model = checkpoints[name]
    model = dz.models.GPT2.from_pretrained(path, scan_layers=scan)
    assert (model.lm_head is None) == (name == "gpt2")             # tied: the head IS the word embedding
    if scan:    # the blocks' parameters stacked on a leading [n_layer] axis
        assert model.h.mlp.c_fc.kernel[...].shape == (2, 32, 128)
    ids = hf_helpers.token_batch(320, 3, 20, seed=3)
    expected = gpt2_logits(torch_model, ids)
    assert np.std(expected) > 0.1                                   # not a near-zero comparison
    assert_close(model(jnp.asarray(ids, jnp.int32)), expected)

    model.save_pretrained(tmp_path)
    names = set(json.loads(json.dumps(list(dz.hf.read_state_dict(tmp_path)))))
    assert ("lm_head.weight" in names) == (name == "gpt2-untied")   # a tied table is written once
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert_close(gpt2_logits(reloaded, ids), expected)
    if name == "gpt2":
        assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_encoder_logits_match_transformers_and_export_round_trips(checkpoints, name, tmp_path):
    path, torch_model = checkpoints[name]
    model = dz.models.BertEncoder.from_pretrained(path)
    ids, mask, token_types = text_inputs(name == "roberta", seed=4)
    expected = encoder_logits(torch_model, ids, mask, token_types)
    assert np.std(expected) > 0.1
    assert_close(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(token_types)), expected)

    model.save_pretrained(tmp_path)
    cls = transformers.RobertaForSequenceClassification if name == "roberta" else \
        transformers.BertForSequenceClassification
    assert_close(encoder_logits(cls.from_pretrained(tmp_path).eval(), ids, mask, token_types), expected)


def test_vit_logits_match_transformers_and_export_round_trips(checkpoints, tmp_path):
    path, torch_model = checkpoints["vit"]
    model = dz.models.ViT.from_pretrained(path)
    pixels = np.random.default_rng(5).standard_normal((3, 3, 8, 8)).astype(np.float32)   # NCHW, as transformers
    with torch.no_grad():
        expected = torch_model(torch.tensor(pixels)).logits.numpy()
    assert np.std(expected) > 0.1
    assert_close(model(jnp.asarray(pixels.transpose(0, 2, 3, 1))), expected)            # channels last here

    model.save_pretrained(tmp_path)
    reloaded = transformers.ViTForImageClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert_close(reloaded(torch.tensor(pixels)).logits.numpy(), expected)


def torch_per_example_norms(torch_model, ids, mask):
    """``||grad L_i||`` over all parameters by ``torch.func.vmap(grad)`` of one example's mean next-token loss."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in torch_model.named_parameters()}   # the tied table appears once

    def loss(params, ids, mask):
        logits = functional_call(torch_model, params, (ids[None],)).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
        weights = mask[1:].to(nll.dtype)
        return (nll * weights).sum() / weights.sum()

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, torch.tensor(ids), torch.tensor(mask))
    return torch.sqrt(sum(g.pow(2).flatten(1).sum(1) for g in grads.values())).numpy()


@pytest.mark.parametrize("name,scan", [("gpt2", False), ("gpt2-untied", False), ("gpt2", True)])
def test_gpt2_per_example_grad_norms_match_torch_func(checkpoints, name, scan):
    path, torch_model = checkpoints[name]
    ids = hf_helpers.token_batch(320, 4, 16, seed=6)
    mask = np.ones_like(ids)
    mask[1, 10:] = 0                                    # a right-padded example
    expected = torch_per_example_norms(torch_model, ids, mask)
    params, loss_fn = dz.models.lm_objective(dz.models.GPT2.from_pretrained(path, scan_layers=scan))
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "loss_mask": jnp.asarray(mask, jnp.int32)}
    norms = ref.jit(lambda p, b: dz.per_example_grad_norms(loss_fn, p, b))(params, batch)
    np.testing.assert_allclose(np.asarray(norms), expected, rtol=RTOL)


def test_lm_padding_contributes_nothing_to_per_example_gradients(checkpoints):
    """A right-padded example's per-example gradient (engine and ``vmap(grad)``) is that of its unpadded tokens,
    whatever the pad ids."""
    params, loss_fn = dz.models.lm_objective(dz.models.GPT2.from_pretrained(checkpoints["gpt2"][0]))
    ids = hf_helpers.token_batch(320, 3, 14, seed=7)
    mask = np.ones_like(ids)
    mask[0, 9:] = 0
    mask[2, 5:] = 0
    other = ids.copy()
    other[mask == 0] = 17                               # different pad ids
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "loss_mask": jnp.asarray(mask, jnp.int32)}
    grads = ref.per_example_grads(loss_fn, params, batch)
    repadded = ref.per_example_grads(loss_fn, params, {**batch, "input_ids": jnp.asarray(other, jnp.int32)})
    for row, length in ((0, 9), (2, 5)):
        short = ref.per_example_grads(loss_fn, params, {"input_ids": jnp.asarray(ids[row:row + 1, :length],
                                                                                 jnp.int32)})
        for key in grads:
            atol = 1e-5 * np.max(np.abs(short[key][0]))
            np.testing.assert_allclose(grads[key][row], short[key][0], rtol=1e-5, atol=atol, err_msg=key)
            np.testing.assert_allclose(repadded[key][row], grads[key][row], rtol=1e-5, atol=atol, err_msg=key)
    expected = np.sqrt(sum(np.sum(g.reshape(3, -1) ** 2, axis=1) for g in grads.values()))
    norms = ref.jit(lambda p, b: dz.per_example_grad_norms(loss_fn, p, b))(params, batch)
    np.testing.assert_allclose(np.asarray(norms), expected, rtol=1e-5)


def test_pytorch_bin_is_read_without_torch(checkpoints, tmp_path):
    """``pytorch_model.bin`` (torch's zip format, bf16 included) is parsed by numpy alone: torch cannot be imported
    in the subprocess that loads it."""
    path, torch_model = checkpoints["gpt2"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    torch.save(torch_model.state_dict(), tmp_path / "pytorch_model.bin")
    torch.save({"x": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(), "y": torch.tensor(3.5)},
               tmp_path / "extra.bin")
    ids = hf_helpers.token_batch(320, 2, 10, seed=9)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "expected.npy", gpt2_logits(torch_model, ids))
    script = textwrap.dedent(f"""
        import sys

        class NoTorch:                       # any import of torch now fails
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("torch is blocked in this test")

        sys.meta_path.insert(0, NoTorch())
        import numpy as np, jax.numpy as jnp
        import dpzero_jax as dz
        d = {str(tmp_path)!r}
        ids = np.load(d + "/ids.npy")
        out = np.asarray(dz.models.GPT2.from_pretrained(d)(jnp.asarray(ids, jnp.int32)))
        expected = np.load(d + "/expected.npy")
        assert np.max(np.abs(out - expected)) <= 1e-4 * np.max(np.abs(expected)), np.max(np.abs(out - expected))
        extra = dz.hf.read_torch_file(d + "/extra.bin")
        assert str(extra["x"].dtype) == "bfloat16" and extra["x"].shape == (3, 2), extra["x"]
        assert extra["x"].astype(np.float32).tolist() == [[0, 3], [1, 4], [2, 5]], extra["x"]
        assert float(extra["y"]) == 3.5
        assert "torch" not in sys.modules
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_sharded_safetensors_and_fresh_classification_head(checkpoints, tmp_path):
    path, torch_model = checkpoints["bert"]
    torch_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    whole = dz.models.BertEncoder.from_pretrained(path)
    sharded = dz.models.BertEncoder.from_pretrained(tmp_path)
    ids, mask, types = text_inputs(False, seed=10)
    args = (jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    np.testing.assert_array_equal(np.asarray(sharded(*args)), np.asarray(whole(*args)))
    with pytest.warns(UserWarning, match="afresh .*3 labels, 5 asked for"):
        five = dz.models.BertEncoder.from_pretrained(path, num_labels=5, id2label=list("abcde"))
    assert five(*args).shape == (3, 5)
    np.testing.assert_array_equal(np.asarray(five.layers[1].mlp.c_fc.kernel[...]),
                                  np.asarray(whole.layers[1].mlp.c_fc.kernel[...]))
    five.save_pretrained(tmp_path / "five")
    assert json.loads((tmp_path / "five" / "config.json").read_text())["id2label"]["4"] == "e"


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    for file in src.glob("*.safetensors"):
        (dst / file.name).symlink_to(file)
    return dst


def test_bad_checkpoints_get_clear_errors(checkpoints, tmp_path):
    gpt2_path = checkpoints["gpt2"][0]
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        dz.models.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        dz.models.from_pretrained(tmp_path / "empty")
    with pytest.raises(ValueError, match="model_type 't5' is not supported; supported architectures: gpt2"):
        dz.models.from_pretrained(_edit_config(gpt2_path, tmp_path / "t5", model_type="t5"))
    with pytest.raises(ValueError, match=r"shape mismatch: transformer.wte.weight \(320, 32\) .* wte/embedding"):
        dz.models.from_pretrained(_edit_config(gpt2_path, tmp_path / "wide", vocab_size=400))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True"):
        dz.models.from_pretrained(_edit_config(gpt2_path, tmp_path / "scaled", scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ValueError, match=r"lacks tensors .*transformer.h.2.ln_1.weight"):
        dz.models.from_pretrained(_edit_config(gpt2_path, tmp_path / "deep", n_layer=3))
    with pytest.raises(ValueError, match=r"holds a bert checkpoint: load it with dz.models.BertEncoder"):
        dz.models.GPT2.from_pretrained(checkpoints["bert"][0])
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((gpt2_path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        dz.models.from_pretrained(tmp_path / "noweights")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # a complete checkpoint loads without any warning
        dz.models.from_pretrained(gpt2_path)

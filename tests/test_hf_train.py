"""DP fine-tuning of Hugging Face checkpoints through ``dpzero train --model hf:PATH`` and the Python API."""

import json

import helpers
import hf_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dpzero_jax as dz
from dpzero_jax.cli import main
from dpzero_jax.train import TrainConfig, Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAST = ["--accountant", "rdp", "--checkpoint-every", "0", "--no-progress"]


def torch_lm_loss(model, data) -> float:
    """Mean next-token cross-entropy over the target tokens of ``data``, computed by ``transformers``."""
    ids, mask = torch.tensor(data["input_ids"], dtype=torch.long), torch.tensor(data["loss_mask"])
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    weights = mask[:, 1:].flatten().float()
    return float((nll * weights).sum() / weights.sum())


def test_cli_dp_fine_tune_of_gpt2_reduces_held_out_loss(tmp_path, capsys):
    ckpt = tmp_path / "gpt2"
    original = hf_helpers.gpt2(ckpt, n_positions=32, n_layer=1)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(hf_helpers.corpus_sample(40_000)))
    args = ["train", "--model", f"hf:{ckpt}", "--task", "causal-lm", "--data", str(corpus), "--max-length", "32",
            "--steps", "24", "--batch-size", "48", "--lr", "3e-3", "--epsilon", "3", "--eval-every", "12",
            "--log-every", "6", "--out", str(tmp_path / "run"), "--export", str(tmp_path / "export"), *FAST]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "test perplexity" in printed and "Hugging Face checkpoint in" in printed
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("perplexity" in r and "accuracy" not in r for r in rows)
    assert [r["step"] for r in rows if "test_loss" in r] == [12, 24]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0 < summary["epsilon"] <= 3 and summary["task"] == "causal-lm"

    # the held-out windows, rebuilt independently of the trainer; losses by transformers before and after
    _, held_out, _ = dz.text.load_text_dataset(dz.text.load_tokenizer(ckpt), task="causal-lm", max_length=32,
                                               pad_id=0, vocab_size=320, data=str(corpus))
    before = torch_lm_loss(original, held_out)
    after = torch_lm_loss(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval(), held_out)
    assert after == pytest.approx(summary["test_loss"], rel=1e-4)       # the exported model is the trained one
    assert summary["test_perplexity"] == pytest.approx(np.exp(summary["test_loss"]), rel=1e-6)
    assert after < before - 0.3, (before, after)


def test_cli_scanned_gpt2_with_lora_trains_and_exports(tmp_path):
    """``--scan-layers``: the blocks stacked and scanned (private gradient from the traced-program front-end), the
    LoRA adapters stacked with them; the export folds them in, unstacks the blocks, and ``transformers`` computes
    the held-out loss the trainer reported."""
    ckpt = tmp_path / "gpt2"
    original = hf_helpers.gpt2(ckpt, n_positions=16, n_layer=2)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(hf_helpers.corpus_sample(8_000)))
    assert main(["train", "--model", f"hf:{ckpt}", "--task", "causal-lm", "--data", str(corpus), "--max-length",
                 "16", "--scan-layers", "--peft", "lora", "--steps", "3", "--batch-size", "16", "--epsilon", "3",
                 "--eval-every", "3", "--out", str(tmp_path / "run"), "--export", str(tmp_path / "export"),
                 *FAST]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    _, held_out, _ = dz.text.load_text_dataset(dz.text.load_tokenizer(ckpt), task="causal-lm", max_length=16,
                                               pad_id=0, vocab_size=320, data=str(corpus))
    exported = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    assert torch_lm_loss(exported, held_out) == pytest.approx(summary["test_loss"], rel=1e-4)
    assert abs(torch_lm_loss(original, held_out) - summary["test_loss"]) > 1e-3     # the adapters did train


def test_cli_lora_fine_tune_of_llama_reduces_held_out_loss(tmp_path):
    """``--peft lora`` on a tiny Llama (GQA, untied head, layers scanned and rematerialised with ``--remat dots``;
    standard NNX layers): adapters on the attention and MLP projections named as in Hugging Face; the export folds
    them in and ``transformers`` measures the held-out loss going down."""
    ckpt = tmp_path / "llama"
    original = hf_helpers.llama(ckpt, "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(hf_helpers.corpus_sample(40_000)))
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    assert main(["train", "--model", f"hf:{ckpt}", "--task", "causal-lm", "--data", str(corpus), "--max-length",
                 "32", "--remat", "dots", "--peft", "lora", "--lora-targets", targets, "--lora-rank", "4",
                 "--steps", "24", "--batch-size", "48", "--lr", "1e-2", "--epsilon", "3", "--eval-every", "24", "--out",
                 str(tmp_path / "run"), "--export", str(tmp_path / "export"), *FAST]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    _, held_out, _ = dz.text.load_text_dataset(dz.text.load_tokenizer(ckpt), task="causal-lm", max_length=32,
                                               pad_id=0, vocab_size=320, data=str(corpus))
    before = torch_lm_loss(original, held_out)
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    after = torch_lm_loss(exported, held_out)
    assert after == pytest.approx(summary["test_loss"], rel=1e-4)       # the exported model is the trained one
    assert after < before - 0.2, (before, after)
    print(f"held-out loss by transformers: {before:.3f} -> {after:.3f}")


def test_bf16_lora_llama_holds_its_frozen_base_in_bf16(tmp_path):
    """``--precision bf16 --peft lora`` on a Llama: the frozen base matrices are stored in bf16 (norm scales fp32),
    the model's logits are exactly those of the fp32 weights (its layers cast every weight to bf16 at use), and the
    step's argument bytes hold them at 2 bytes each."""
    ckpt = tmp_path / "llama"
    hf_helpers.llama(ckpt, "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(hf_helpers.corpus_sample(4_000)))
    cfg = TrainConfig(model=f"hf:{ckpt}", task="causal-lm", data=str(corpus), max_length=16, peft="lora",
                      lora_rank=2, precision="bf16", steps=2, batch_size=16, epsilon=3.0, out=str(tmp_path / "run"),
                      progress=False, plot=False, checkpoint_every=0)
    trainer = Trainer(cfg)
    frozen = jax.tree.leaves(trainer._frozen)
    assert {x.dtype for x in frozen if x.ndim >= 2} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in frozen if x.ndim == 1} == {jnp.dtype(jnp.float32)}
    _, apply = dz.models.logits_fn(trainer.model, trainable=trainer.trainable)
    ids = jnp.asarray(trainer.test_data["input_ids"][:4])
    fp32 = dz.models.frozen_state(trainer.model, trainer.trainable)
    assert {x.dtype for x in jax.tree.leaves(fp32)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(apply(trainer.init_params, ids, frozen=fp32),
                                  apply(trainer.init_params, ids, frozen=trainer._frozen))
    frozen_bytes = sum(x.size * x.dtype.itemsize for x in frozen)
    assert frozen_bytes < 0.6 * sum(x.size * 4 for x in frozen)
    assert np.isfinite(trainer.run().history[-1]["loss"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma", "gemma2"])
def test_cli_full_fine_tune_of_gemma_exports_what_it_trained(tmp_path, kind):
    """Full fine-tuning (every parameter, the tied embedding included) of a scanned Gemma / Gemma 2 through the CLI:
    ``transformers`` computes on the export the held-out loss the trainer reported, and it went down."""
    ckpt = tmp_path / kind
    original = hf_helpers.llama(ckpt, kind)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(hf_helpers.corpus_sample(20_000)))
    assert main(["train", "--model", f"hf:{ckpt}", "--task", "causal-lm", "--data", str(corpus), "--max-length",
                 "32", "--steps", "8", "--batch-size", "32", "--lr", "3e-3", "--epsilon", "3", "--eval-every", "8",
                 "--out", str(tmp_path / "run"), "--export", str(tmp_path / "export"), *FAST]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    _, held_out, _ = dz.text.load_text_dataset(dz.text.load_tokenizer(ckpt), task="causal-lm", max_length=32,
                                               pad_id=0, vocab_size=320, data=str(corpus))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert torch_lm_loss(exported, held_out) == pytest.approx(summary["test_loss"], rel=1e-4)
    assert summary["test_loss"] < torch_lm_loss(original, held_out)


def test_text_classification_lora_bf16_on_two_devices(tmp_path):
    ckpt = tmp_path / "bert"
    original = hf_helpers.bert(ckpt, num_labels=2, layers=1)
    words = {"pos": "good fine great excellent".split(), "neg": "bad poor awful wrong".split()}
    rng = np.random.default_rng(0)
    records = [{"sentence": " ".join(rng.choice(words[label], 5)), "y": label}
               for label in rng.choice(["neg", "pos"], 300)]
    data = hf_helpers.write_jsonl(tmp_path / "train.jsonl", records)
    cfg = TrainConfig(model=f"hf:{ckpt}", task="classification", data=str(data), text_field="sentence",
                      label_field="y", max_length=12, steps=12, batch_size=32, lr=1e-2, noise_multiplier=0.8,
                      accountant="rdp", peft="lora", lora_rank=2, precision="bf16", devices=2,
                      out=str(tmp_path / "run"), progress=False, plot=False, checkpoint_every=0, log_every=4)
    trainer = Trainer(cfg)
    assert trainer.train_data["input_ids"].shape == (270, 12)
    assert all("lora" in n or n.startswith("head/") for n in trainer.trainable.names)   # adapters + new head
    result = trainer.run()
    assert result.test_accuracy is not None and 0 <= result.test_accuracy <= 1 and result.epsilon > 0
    assert all("accuracy" in r for r in result.history)
    result.save_pretrained(tmp_path / "export")
    reloaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    assert reloaded.config.id2label == {0: "neg", 1: "pos"}
    query = [m.bert.encoder.layer[0].attention.self.query.weight.detach().numpy() for m in (original, reloaded)]
    assert not np.allclose(*query)                      # trained adapters were folded into the frozen weights
    test = trainer.test_data
    with torch.no_grad():
        logits = reloaded(torch.tensor(test["input_ids"], dtype=torch.long),
                          attention_mask=torch.tensor(test["attention_mask"])).logits.numpy()
    # the trained model with its LoRA adapters unmerged, in fp32: export folded them in exactly
    fp32 = nnx.clone(result.model)
    for _, module in nnx.iter_modules(fp32):   # the model's and its Flax layers' compute dtype
        if getattr(module, "dtype", None) is not None:
            module.dtype = None
    ours = np.asarray(jax.jit(fp32.__call__)(jnp.asarray(test["input_ids"]), jnp.asarray(test["attention_mask"])))
    np.testing.assert_allclose(logits, ours, rtol=1e-4, atol=1e-4 * np.max(np.abs(ours)))
    accuracy = float(np.mean(np.argmax(logits, -1) == test["label"]))
    assert accuracy == pytest.approx(result.test_accuracy, abs=0.15)   # the run evaluated in bf16


def test_vit_checkpoint_on_digits(tmp_path):
    """A ViT checkpoint whose images fit the digits data set gets a fresh 10-class head and the image pipeline."""
    hf_helpers.vit(tmp_path / "vit", num_labels=10, num_channels=1)
    trainer = Trainer(TrainConfig(model=f"hf:{tmp_path / 'vit'}", steps=4, batch_size=64, noise_multiplier=1.0,
                                  accountant="rdp", out=str(tmp_path / "run"), progress=False, plot=False,
                                  checkpoint_every=0))
    assert isinstance(trainer.model, dz.models.ViT) and trainer.inputs == "image"
    loss, accuracy = trainer._evaluate_split(trainer.init_params, trainer.test_data)
    assert np.isfinite(loss) and 0 <= accuracy <= 1


def test_bad_hf_options_get_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="causal-lm' needs model='hf:PATH'"):
        TrainConfig(task="causal-lm")
    with pytest.raises(ValueError, match="data applies to model='hf:PATH'"):
        TrainConfig(data="x.txt")
    with pytest.raises(ValueError, match="task must be one of"):
        TrainConfig(model="hf:x", task="translation")
    with pytest.raises(ValueError, match="scan_layers applies to decoders"):
        TrainConfig(scan_layers=True)
    with pytest.raises(ValueError, match="scan_layers must be true or false"):
        TrainConfig(model="hf:x", task="causal-lm", scan_layers="yes")
    assert main(["train", "--model", f"hf:{tmp_path / 'none'}", "--task", "causal-lm", *FAST]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    hf_helpers.vit(tmp_path / "vit")
    assert main(["train", "--model", f"hf:{tmp_path / 'vit'}", "--task", "causal-lm", *FAST]) == 2
    wanted = "gpt2 / llama / mistral / qwen2 / gemma / gemma2"
    assert f"task 'causal-lm' needs a {wanted} checkpoint" in capsys.readouterr().err
    with pytest.raises(ValueError, match="scan_layers and remat apply to decoders only; .* holds a vit checkpoint"):
        dz.models.from_pretrained(tmp_path / "vit", scan_layers=True)
    with pytest.warns(UserWarning, match="afresh .*5 labels, 10 asked for"):   # digits have 10 classes
        assert main(["train", "--model", f"hf:{tmp_path / 'vit'}", "--steps", "1", *FAST]) == 2
    assert "takes 8x8x3 images, the digits dataset has 8x8x1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--model", "bert"])
    assert "--model must be mlp, vit, cnn or hf:PATH" in capsys.readouterr().err


@pytest.mark.slow
def test_two_processes_fine_tune_and_export_like_one(tmp_path):
    """2 processes x 2 CPU devices (gloo) train, evaluate and export a GPT-2 exactly as 1 process x 4 devices."""
    import socket
    import subprocess
    import sys

    from safetensors.numpy import load_file

    hf_helpers.gpt2(tmp_path / "gpt2", n_positions=32, n_layer=1)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(hf_helpers.corpus_sample(20_000)))
    flags = ["train", "--model", f"hf:{tmp_path / 'gpt2'}", "--task", "causal-lm", "--data", str(corpus),
             "--max-length", "32", "--mesh", "fsdp=4", "--batch-size", "32", "--noise-multiplier", "1.0",
             "--steps", "4", "--log-every", "1", "--eval-every", "2", *FAST]
    env = helpers.subprocess_env()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "dpzero_jax", *flags, "--out", str(tmp_path / "two"),
                               "--export", str(tmp_path / "two_export"), "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:]
    four = helpers.subprocess_env(devices=4)
    one = subprocess.run([sys.executable, "-m", "dpzero_jax", *flags, "--out", str(tmp_path / "one"), "--export",
                          str(tmp_path / "one_export")], env=four, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]

    def rows(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    for a, b in zip(rows("two"), rows("one"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a.get("test_loss", 0.0) == pytest.approx(b.get("test_loss", 0.0), rel=1e-5)
    two, single = (load_file(str(tmp_path / f"{n}_export" / "model.safetensors")) for n in ("two", "one"))
    for name in single:
        np.testing.assert_allclose(two[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)

"""Text data: tokenizers from a checkpoint directory, .txt / .jsonl readers, padding masks, the embedded corpus."""

import hf_helpers
import numpy as np
import pytest

from dpzero_jax import text

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2tok")
    hf_helpers.save_gpt2_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def bert_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("berttok")
    hf_helpers.save_bert_tokenizer(path)
    return path


def test_tokenizer_json_matches_transformers(gpt2_tokenizer_dir, bert_tokenizer_dir):
    texts = ["def f(x):\n    return x + 1", "The with statement is used to wrap a block."]
    for path, specials in ((gpt2_tokenizer_dir, False), (bert_tokenizer_dir, True)):
        ours = text.load_tokenizer(path).encode(texts, add_special_tokens=specials)
        theirs = transformers.AutoTokenizer.from_pretrained(str(path))(texts, add_special_tokens=specials)
        assert ours == theirs["input_ids"]
    truncated = text.load_tokenizer(bert_tokenizer_dir).encode(texts, add_special_tokens=True, max_length=5)
    cls, sep = (transformers.AutoTokenizer.from_pretrained(str(bert_tokenizer_dir)).convert_tokens_to_ids(t)
                for t in ("[CLS]", "[SEP]"))
    assert all(len(ids) == 5 and ids[0] == cls and ids[-1] == sep for ids in truncated)


def test_lm_windows_and_masks(gpt2_tokenizer_dir):
    tok = text.load_tokenizer(gpt2_tokenizer_dir)
    corpus = "lambda x: x\n" * 40
    stream = [i for ids in tok.encode(corpus.splitlines(keepends=True), add_special_tokens=False) for i in ids]
    data = text.encode_lm(tok, [corpus], 16, pad_id=0, corpus=True)
    n = len(stream)
    assert data["input_ids"].shape == (-(-n // 16), 16) and data["input_ids"].dtype == np.int32
    np.testing.assert_array_equal(data["input_ids"][data["loss_mask"] == 1], stream)   # windows cover the stream
    last = n - 16 * (len(data["input_ids"]) - 1)
    assert data["loss_mask"][-1].tolist() == [1] * last + [0] * (16 - last)
    per_text = text.encode_lm(tok, ["x", "yield the value", "a" * 200], 8, pad_id=0, corpus=False)
    assert per_text["input_ids"].shape[0] == 2                        # "x" is one token: nothing to predict
    assert per_text["loss_mask"].sum(axis=1).tolist()[1] == 8         # truncated to max_length


def test_jsonl_classification_labels_and_errors(tmp_path, bert_tokenizer_dir):
    records = [{"text": f"sentence number {i}", "label": ["neg", "pos", "mid"][i % 3]} for i in range(30)]
    path = hf_helpers.write_jsonl(tmp_path / "d.jsonl", records)
    texts, labels = text.read_examples(path, task="classification")
    ids, names = text.label_ids(labels)
    assert names == ["mid", "neg", "pos"] and ids[:3].tolist() == [1, 2, 0]
    tok = text.load_tokenizer(bert_tokenizer_dir)
    train, test, names = text.load_text_dataset(tok, task="classification", max_length=12, pad_id=0,
                                                vocab_size=200, data=str(path))
    assert len(train["label"]) == 27 and len(test["label"]) == 3 and names == ["mid", "neg", "pos"]
    assert np.all(train["input_ids"][train["attention_mask"] == 0] == 0)
    with pytest.raises(ValueError, match="produced token id .* vocab_size=50"):
        text.load_text_dataset(tok, task="classification", max_length=12, pad_id=0, vocab_size=50, data=str(path))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a", "label": 1}\n{"body": "b", "label": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no string field 'text' .*fields: \['body', 'label'\]"):
        text.read_examples(bad, task="classification")
    bad.write_text('{"text": "a", "label": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON object"):
        text.read_examples(bad, task="causal-lm")
    (tmp_path / "c.txt").write_text("some text")
    with pytest.raises(ValueError, match="a .txt file has no labels"):
        text.read_examples(tmp_path / "c.txt", task="classification")
    with pytest.raises(FileNotFoundError, match="no such data file"):
        text.read_examples(tmp_path / "missing.jsonl", task="causal-lm")
    with pytest.raises(ValueError, match=r"labels \['other'\] are not among the training classes"):
        text.label_ids(["other"], ["mid", "neg", "pos"])


def test_embedded_default_corpus_ships_with_python():
    (corpus,), labels = text.default_corpus("causal-lm")
    assert labels is None and len(corpus) > 100_000 and "The \"with\" statement" in corpus
    texts, labels = text.default_corpus("classification")
    assert len(set(labels)) == text.DEFAULT_CLASSES and len(texts) == len(labels) > 200
    assert all(len(t) >= text.MIN_PARAGRAPH for t in texts)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        text.load_tokenizer(tmp_path)

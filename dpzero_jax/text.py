"""Text data for fine-tuning: the tokenizer of a checkpoint directory, ``.txt`` / ``.jsonl`` readers, padding with
masks, and an embedded default corpus.

Examples (what one unit of privacy is)
    * ``.jsonl``: one JSON object per line; each line is one example -- its ``text`` field (``text_field``) is
      tokenised, truncated to ``max_length`` tokens and padded; for classification its ``label`` field
      (``label_field``: ints, or strings mapped to ids in sorted order) is the class.
    * ``.txt`` (causal LM only): the file is one corpus, tokenised and cut into consecutive windows of
      ``max_length`` tokens; each window is one example. The DP guarantee is then per window, not per document.

Padding is to ``max_length`` on the right with the model's pad id; a mask (``loss_mask`` for causal LM: which
tokens are targets; ``attention_mask`` for classification: which tokens the encoder may attend to) makes padded
positions contribute nothing to the loss, to the per-example gradients or to their norms.

Default corpus (no download): the Python help topics that ship with CPython (``pydoc_data.topics``: the language and
library reference text behind ``help("topics")``, ~465 kB of English on Python 3.11). Causal LM: all topics in
sorted order as one corpus. Classification: the paragraphs (at least 80 characters) of the four topics with the
most paragraphs (on Python 3.11: ``specialnames``, ``compound``, ``types``, ``string-methods``; 611 paragraphs),
labelled by topic. The held-out set is a fixed 10% (seed 0) unless an evaluation file is given.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from dpzero_jax import hf
from dpzero_jax.validation import read_text

TASKS = ("classification", "causal-lm")
HELD_OUT_FRACTION = 0.1
DEFAULT_CLASSES = 4
MIN_PARAGRAPH = 80

__all__ = ["TASKS", "Tokenizer", "load_tokenizer", "read_examples", "default_corpus", "encode_lm",
           "encode_classification", "load_text_dataset"]


class Tokenizer:
    """The tokenizer saved in a checkpoint directory: ``tokenizer.json`` through the ``tokenizers`` package, or any
    other ``transformers`` tokenizer through ``AutoTokenizer`` (e.g. ``vocab.json`` + ``merges.txt``)."""

    def __init__(self, path):
        directory = hf.checkpoint_dir(path)
        self.path = str(directory)
        self._fast = self._hf = None
        if (directory / "tokenizer.json").is_file():
            try:
                from tokenizers import Tokenizer as Fast
            except ImportError:
                Fast = None
            if Fast is not None:
                self._fast = Fast.from_file(str(directory / "tokenizer.json"))
                self._fast.no_padding()
                return
        names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model")
        if not any((directory / n).is_file() for n in names):
            raise FileNotFoundError(f"{str(path)!r} holds no tokenizer (one of {', '.join(names)}); save the "
                                    f"tokenizer there (tokenizer.save_pretrained) or point --tokenizer at one")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(f"reading the tokenizer in {str(path)!r} needs the 'tokenizers' package (for "
                              f"tokenizer.json) or 'transformers': pip install tokenizers") from None
        self._hf = AutoTokenizer.from_pretrained(str(directory))

    @property
    def pad_token_id(self) -> int | None:
        if self._fast is not None:
            padding = self._fast.padding
            if padding and padding.get("pad_id") is not None:
                return int(padding["pad_id"])
            return None
        return self._hf.pad_token_id

    def encode(self, texts: list[str], *, add_special_tokens: bool, max_length: int | None = None) -> list[list[int]]:
        """Token ids of each text (truncated to ``max_length`` keeping the special tokens, if given)."""
        if self._fast is not None:
            if max_length is None:
                self._fast.no_truncation()
            else:
                self._fast.enable_truncation(max_length)
            return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        kwargs = {"truncation": True, "max_length": max_length} if max_length is not None else {}
        return list(self._hf(list(texts), add_special_tokens=add_special_tokens, **kwargs)["input_ids"])


def load_tokenizer(path) -> Tokenizer:
    return Tokenizer(path)


def read_examples(path, *, task: str, text_field: str = "text", label_field: str = "label"):
    """``(texts, labels)`` of a data file; ``labels`` is None for causal LM. ``.txt``: one corpus (``[text]``);
    ``.jsonl``: one example per non-empty line."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"no such data file: {str(path)!r}")
    if file.suffix == ".txt":
        if task != "causal-lm":
            raise ValueError(f"{file}: a .txt file has no labels; classification needs a .jsonl file with "
                             f"{text_field!r} and {label_field!r} fields")
        text = read_text(file, "data file")
        if not text.strip():
            raise ValueError(f"{file}: empty text file")
        return [text], None
    if file.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{file}: unsupported data file type {file.suffix!r}; expected .txt or .jsonl")
    texts, labels = [], []
    for number, line in enumerate(read_text(file, "data file").split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file}:{number}: not a JSON object ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{file}:{number}: expected a JSON object, got {type(record).__name__}")
        if not isinstance(record.get(text_field), str):
            raise ValueError(f"{file}:{number}: no string field {text_field!r} (the text field; "
                             f"fields: {sorted(record)})")
        texts.append(record[text_field])
        if task == "classification":
            label = record.get(label_field)
            if isinstance(label, bool) or not isinstance(label, (int, str)):
                raise ValueError(f"{file}:{number}: no int or string field {label_field!r} (the label field; "
                                 f"fields: {sorted(record)})")
            labels.append(label)
    if not texts:
        raise ValueError(f"{file}: no examples")
    return texts, (labels if task == "classification" else None)


def default_corpus(task: str):
    """``(texts, labels)`` of the embedded corpus (module docstring); ``labels`` are topic names or None."""
    from pydoc_data.topics import topics

    if task == "causal-lm":
        return ["\n\n".join(topics[k].strip() for k in sorted(topics))], None
    paragraphs = [(k, p.strip()) for k in sorted(topics) for p in re.split(r"\n\s*\n", topics[k])
                  if len(p.strip()) >= MIN_PARAGRAPH]
    counts = Counter(k for k, _ in paragraphs)
    classes = sorted(sorted(counts, key=lambda k: (-counts[k], k))[:DEFAULT_CLASSES])
    chosen = [(k, p) for k, p in paragraphs if k in classes]
    return [p for _, p in chosen], [k for k, _ in chosen]


def label_ids(labels, names: list | None = None):
    """``(ids int32 [N], names)``: ints are kept (names ``"0".."K-1"``), strings numbered in sorted order; with
    ``names`` given (the training set's), every label must be one of them."""
    if all(isinstance(label, int) for label in labels):
        ids = np.asarray(labels, np.int64)
        if ids.min() < 0:
            raise ValueError(f"integer labels must be >= 0, got {int(ids.min())}")
        if names is None:
            names = [str(i) for i in range(int(ids.max()) + 1)]
        elif ids.max() >= len(names):
            raise ValueError(f"label {int(ids.max())} is not one of the {len(names)} training classes")
        return ids.astype(np.int32), names
    if not all(isinstance(label, str) for label in labels):
        raise ValueError("labels must be all ints or all strings")
    if names is None:
        names = sorted(set(labels))
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(labels) - set(index))
    if unknown:
        raise ValueError(f"labels {unknown[:5]} are not among the training classes {names[:10]}")
    return np.asarray([index[label] for label in labels], np.int32), list(names)


def _pad(sequences: list[list[int]], length: int, pad_id: int):
    ids = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = seq
        mask[i, :len(seq)] = 1
    return ids, mask


def encode_lm(tokenizer: Tokenizer, texts: list[str], max_length: int, pad_id: int, *, corpus: bool):
    """``{"input_ids", "loss_mask"}`` int32 ``[N, max_length]``: windows of one corpus (``corpus``) or one example
    per text (truncated). Windows and texts with fewer than 2 tokens (nothing to predict) are dropped."""
    if corpus:
        stream = [i for ids in tokenizer.encode((texts[0]).splitlines(keepends=True), add_special_tokens=False)
                  for i in ids]
        sequences = [stream[s:s + max_length] for s in range(0, len(stream), max_length)]
    else:
        sequences = [ids[:max_length] for ids in tokenizer.encode(texts, add_special_tokens=True)]
    sequences = [s for s in sequences if len(s) >= 2]
    if not sequences:
        raise ValueError("no example has 2 or more tokens: nothing to predict")
    ids, mask = _pad(sequences, max_length, pad_id)
    return {"input_ids": ids, "loss_mask": mask}


def encode_classification(tokenizer: Tokenizer, texts: list[str], labels: np.ndarray, max_length: int, pad_id: int):
    """``{"input_ids", "attention_mask"}`` int32 ``[N, max_length]`` (with the tokenizer's special tokens, truncated)
    and ``"label"`` int32 ``[N]``."""
    ids, mask = _pad(tokenizer.encode(texts, add_special_tokens=True, max_length=max_length), max_length, pad_id)
    return {"input_ids": ids, "attention_mask": mask, "label": np.asarray(labels, np.int32)}


def _split(data: dict[str, np.ndarray], seed: int = 0):
    n = len(next(iter(data.values())))
    if n < 2:
        raise ValueError(f"{n} example(s): too few to hold some out for evaluation")
    held_out = max(1, int(round(HELD_OUT_FRACTION * n)))
    order = np.random.default_rng(seed).permutation(n)
    test, train = np.sort(order[:held_out]), np.sort(order[held_out:])
    return {k: v[train] for k, v in data.items()}, {k: v[test] for k, v in data.items()}


def load_text_dataset(tokenizer: Tokenizer, *, task: str, max_length: int, pad_id: int, vocab_size: int,
                      data: str | None = None, eval_data: str | None = None, text_field: str = "text",
                      label_field: str = "label"):
    """``(train, test, label_names)``: the arrays of ``data`` (None: the embedded corpus) and of ``eval_data`` (None:
    a fixed 10% of ``data`` held out). ``label_names`` is None for causal LM."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")

    def read(path):
        if path is None:
            texts, labels = default_corpus(task)
            return texts, labels, task == "causal-lm"
        texts, labels = read_examples(path, task=task, text_field=text_field, label_field=label_field)
        return texts, labels, Path(path).suffix == ".txt"

    def encode(texts, labels, corpus, names=None):
        if task == "causal-lm":
            return encode_lm(tokenizer, texts, max_length, pad_id, corpus=corpus), None
        ids, names = label_ids(labels, names)
        return encode_classification(tokenizer, texts, ids, max_length, pad_id), names

    train, names = encode(*read(data))
    if eval_data is None:
        train, test = _split(train)
    else:
        test, _ = encode(*read(eval_data), names=names)
    for split in (train, test):
        top = int(split["input_ids"].max())
        if top >= vocab_size:
            raise ValueError(f"the tokenizer in {tokenizer.path} produced token id {top}, but the model has "
                             f"vocab_size={vocab_size}: tokenizer and checkpoint do not belong together")
    return train, test, names

"""What a training run reports (used by :class:`dpzero_jax.train.Trainer`): evaluation of a data split
(:class:`Evaluator`; images: :func:`image_evaluator`; tokenised text in chunks: :func:`text_evaluator`), the metric
names and adaptive
clipping's columns of a ``metrics.jsonl`` row, the rows read back (:func:`read_metrics`), the ``summary.json``
object, the training plot (:func:`plot`) and the progress bar (tqdm when installed)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpzero_jax import rundir
from dpzero_jax.train_step import to_global

EVAL_CHUNK = 64  # examples per compiled evaluation call of text models (the last chunk is padded)


def metric_name(lm: bool, test: bool) -> str:
    """The column of a row's second metric: ``accuracy`` (``perplexity`` for a causal LM), ``test_`` prefixed."""
    return ("test_" if test else "") + ("perplexity" if lm else "accuracy")


def clip_row(groups: list[str], thresholds, fraction) -> dict:
    """Metrics of adaptive clipping: the thresholds ``[M]`` after the step's update (the next step clips with them)
    and the released unclipped fractions ``[M]``, one column each per group (unsuffixed for a single group)."""
    thresholds, fraction = np.asarray(thresholds), np.asarray(fraction)
    if len(groups) == 1:
        return {"clip_threshold": float(thresholds[0]), "unclipped_fraction": float(fraction[0])}
    row = {f"clip_threshold/{g}": float(t) for g, t in zip(groups, thresholds)}
    row.update({f"unclipped_fraction/{g}": float(f) for g, f in zip(groups, fraction)})
    return row


def image_evaluator(apply_fn, compute_dtype):
    """``evaluate(params, images [N, ...], labels [N], frozen) -> (mean loss, accuracy)``, jitted: the whole split
    in one call. ``apply_fn(params, x, frozen) -> logits [N, classes]``; images are cast to ``compute_dtype``, the
    logits to fp32."""
    def evaluate(params, images, labels, frozen):
        logits = apply_fn(params, images.astype(compute_dtype), frozen).astype(jnp.float32)
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
        return loss, jnp.mean(jnp.argmax(logits, -1) == labels)

    return jax.jit(evaluate)


def text_evaluator(apply_fn, task: str):
    """``evaluate(params, data) -> (loss, metric)`` over a tokenised split in chunks of ``EVAL_CHUNK`` examples.

    Classification: mean cross-entropy and accuracy over examples. Causal LM: the mean next-token cross-entropy over
    all target tokens of the split (``loss_mask``) and its exponential, the perplexity."""

    def chunk_sums(params, chunk, weight, frozen):
        if task == "causal-lm":
            ids = chunk["input_ids"]
            logits = apply_fn(params, ids, frozen)[:, :-1].astype(jnp.float32)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
            tokens = chunk["loss_mask"][:, 1:].astype(jnp.float32) * weight[:, None]
            return jnp.sum(nll * tokens), jnp.sum(tokens)
        logits = apply_fn(params, {k: chunk[k] for k in ("input_ids", "attention_mask")}, frozen).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, chunk["label"])
        correct = (jnp.argmax(logits, -1) == chunk["label"]).astype(jnp.float32)
        return jnp.sum(loss * weight), jnp.sum(correct * weight)

    chunk_sums = jax.jit(chunk_sums)

    def evaluate(params, data, place=None, frozen=None):
        """``place``: host array -> global array (under a mesh, so that every process passes the same chunk);
        ``frozen``: the model's frozen variables when ``apply_fn`` takes them as an argument."""
        n = len(next(iter(data.values())))
        size = min(EVAL_CHUNK, n)
        first = second = 0.0
        for start in range(0, n, size):
            chunk = {k: v[start:start + size] for k, v in data.items()}
            real = len(chunk["input_ids"])
            pad = size - real
            if pad:
                chunk = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in chunk.items()}
            weight = (np.arange(size) < real).astype(np.float32)
            if place is not None:
                chunk, weight = {k: place(v) for k, v in chunk.items()}, place(weight)
            a, b = chunk_sums(params, chunk, weight, frozen)
            first, second = first + float(a), second + float(b)
        if task == "causal-lm":
            loss = first / max(second, 1.0)
            return loss, math.exp(min(loss, 700.0))
        return first / n, second / n

    return evaluate


class Evaluator:
    """``evaluator(params, data, inputs=None) -> (loss, accuracy)`` of a data split; causal LM: ``(loss per token,
    perplexity)``.

    ``apply_fn(params, x, frozen) -> logits`` (frozen bound: :func:`dpzero_jax.train_step.bind_frozen`); ``text``:
    whether the run's data is tokenised text (then :func:`text_evaluator`, else :func:`image_evaluator` on images
    in ``compute_dtype``); ``rules``: the mesh's sharding rules (None without a mesh: the inputs are then replicated
    global arrays, valid across processes); ``frozen``: the frozen variables passed to ``apply_fn``."""

    def __init__(self, apply_fn, *, task: str, compute_dtype, text: bool, rules=None, frozen=None):
        self.rules, self.frozen = rules, frozen
        self._images = image_evaluator(apply_fn, compute_dtype)
        self._text = text_evaluator(apply_fn, task) if text else None

    def inputs(self, data: dict):
        """``(images, labels)`` of an image split; replicated global arrays under a mesh."""
        if self.rules is None:
            return data["image"], data["label"]
        return to_global(data["image"], self.rules.replicated), to_global(data["label"], self.rules.replicated)

    def __call__(self, params, data: dict, inputs=None):
        """``inputs``: the split's :meth:`inputs` if already placed (image data)."""
        if "input_ids" not in data:
            return self._images(params, *(inputs if inputs is not None else self.inputs(data)), self.frozen)
        place = None if self.rules is None else functools.partial(to_global, sharding=self.rules.replicated)
        return self._text(params, data, place, self.frozen)


def read_metrics(path, upto: int) -> list[dict]:
    """The rows of ``metrics.jsonl`` at ``path`` up to step ``upto`` (none when there is no file)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def jsonable(value, other=repr):
    """``value`` with dicts (keys as strings), lists and tuples walked and anything that is not a JSON scalar as
    ``other(it)`` (default: its ``repr``)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v, other) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, other) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return other(value)


def summary(result, ledger, finite: bool) -> dict:
    """The ``summary.json`` object of a :class:`~dpzero_jax.train_result.TrainResult` (its arrays, history and model
    left out), with the ledger and whether the final evaluation was finite (the config is added by the caller)."""
    out = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)
           if f.name not in ("params", "opt_state", "history", "model")}
    out["ledger"] = ledger.to_dict()
    out["evaluation_finite"] = finite
    return out


def plot(history: list[dict], path) -> None:
    """Loss and epsilon against the step, as a PNG: matplotlib's object API, so neither the global backend nor
    pyplot's figure registry is touched (safe in notebooks and other users' processes). matplotlib is optional (the
    ``plot`` extra): without it the plot is skipped with a one-line notice on stderr."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "matplotlib":   # installed but broken: show the real error
            raise
        print(f"dpzero: {path} not written: matplotlib is not installed (pip install 'dpzero_jax[plot]')",
              file=sys.stderr)
        return

    steps = [r["step"] for r in history]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_loss, ax_eps = fig.subplots(1, 2)
    ax_loss.plot(steps, [r["loss"] for r in history])
    ax_loss.set(xlabel="step", ylabel="train loss (batch)", title="loss")
    eps = [r["epsilon"] for r in history]
    if all(e is not None for e in eps):
        ax_eps.plot(steps, eps)
        ax_eps.set(xlabel="step", ylabel="epsilon", title="privacy spent")
    else:
        ax_eps.text(0.5, 0.5, "no DP", ha="center", va="center")
        ax_eps.set_axis_off()
    fig.tight_layout()
    with rundir.as_path(path).open("wb") as file:   # local or remote (epath)
        fig.savefig(file, format="png", dpi=100)


def progress_bar_class(wanted: bool):
    """``tqdm.auto.tqdm``; without tqdm (the ``train`` extra), a bar that shows nothing, with a one-line notice on
    stderr when a bar was asked for."""
    try:
        from tqdm.auto import tqdm
        return tqdm
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "tqdm":   # installed but broken: show the real error
            raise
    if wanted:
        print("dpzero: no progress bar: tqdm is not installed (pip install 'dpzero_jax[train]')", file=sys.stderr)

    class NoBar:
        def __init__(self, *args, **kwargs):
            pass

        def update(self, n=1):
            pass

        def set_postfix(self, *args, **kwargs):
            pass

        def close(self):
            pass

    return NoBar

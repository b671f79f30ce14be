"""Data for :class:`dpzero_jax.fit.PrivateTrainer` and :func:`evaluate`: what a user's data is and how it was sampled,
host batches, padding; the check of the user's loss (:func:`check_trainer_loss`); and :class:`FitResult`, what a fit
returns.

Two kinds of training data (:func:`classify`):

* an **indexable dataset** -- a mapping of arrays ``{name: [N, ...]}`` (columns with one leading dimension), or any
  other object with ``__len__`` (N, the number of examples) and ``__getitem__(indices int [k]) -> {name: [k, ...]}``.
  The trainer draws its own Poisson batches from it (:mod:`dpzero_jax.sampling`) and accounts exactly.
* an **iterable of host batches** -- a list, tuple, generator, iterator or any other object with ``__iter__`` only,
  yielding ``{name: [B_t, ...]}`` (numpy arrays; ``B_t`` may vary). The user did the sampling; the trainer only sees
  the batches, so it asks how they were drawn (``PrivateTrainer(sampling=...)``).

A batch is padded to a static number of slots with copies of its first example and a ``[slots]`` bool mask (as the
sampler pads with index 0): the engine gives masked slots exactly zero weight, and one compiled step serves every
batch of at most ``slots`` examples.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpzero_jax.loss_check import CoupledLossError, check_per_example_loss

__all__ = ["SAMPLINGS", "ArrayDataset", "FitResult", "IndexedDataset", "as_host_batch", "classify", "declared_sampling",
           "evaluate", "pad_batch"]


def as_host_batch(batch, where: str) -> dict[str, np.ndarray]:
    """``batch`` as ``{name: np.ndarray [B, ...]}``; a ``TypeError`` / ``ValueError`` naming ``where`` and the bad entry
    when it is not a mapping of arrays with one leading dimension ``B >= 1``."""
    if not isinstance(batch, Mapping) or not batch:
        raise TypeError(f"{where}: a batch must be a non-empty dict of arrays {{name: [B, ...]}}, got "
                        f"{type(batch).__name__}")
    out, sizes = {}, {}
    for name, value in batch.items():
        if not isinstance(name, str):
            raise TypeError(f"{where}: batch keys must be strings, got {name!r}")
        try:
            array = np.asarray(value)
        except Exception as error:  # noqa: BLE001 -- anything numpy cannot read
            raise TypeError(f"{where}: batch[{name!r}] is not an array ({type(value).__name__}: {error})") from None
        if array.dtype == object or array.ndim == 0:
            raise ValueError(f"{where}: batch[{name!r}] must be a numeric array with a leading example axis, got "
                             f"{array.dtype} of shape {array.shape}")
        out[name], sizes[name] = array, array.shape[0]
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{where}: the arrays of a batch must share their leading (example) dimension, got {sizes}")
    if next(iter(sizes.values())) < 1:
        raise ValueError(f"{where}: empty batch (0 examples)")
    return out


def check_trainer_loss(loss: Callable, params, rest, batch: dict, coupling: bool) -> None:
    """For :class:`~dpzero_jax.fit.PrivateTrainer`: ``loss(params, batch, rest)`` must give ``[B]`` floating
    per-example losses on ``batch`` (traced abstractly), and with ``coupling`` must not couple the examples
    (:func:`dpzero_jax.check_per_example_loss` on up to 4 of them: one more compile of the loss at that size)."""
    size = len(next(iter(batch.values())))
    try:
        out = jax.eval_shape(loss, params, batch, rest)
    except Exception as error:
        raise ValueError(f"PrivateTrainer: loss_fn failed on a batch of {size} examples with entries "
                         f"{ {k: (v.shape, str(v.dtype)) for k, v in batch.items()} }: "
                         f"{type(error).__name__}: {error}") from error
    if not hasattr(out, "shape"):
        raise ValueError(f"PrivateTrainer: loss_fn must return one array of per-example losses [B]; it returned "
                         f"{type(out).__name__} (an auxiliary output is not supported here)")
    if out.shape != (size,) or not jnp.issubdtype(out.dtype, jnp.floating):
        hint = " -- return the per-example losses, not their mean" if out.shape == () else ""
        raise ValueError(f"PrivateTrainer: loss_fn must return per-example losses of shape [B] = ({size},), "
                         f"floating point, for a batch of {size} examples; got shape {out.shape} {out.dtype}{hint}")
    if coupling and size > 1:
        try:
            check_per_example_loss(functools.partial(loss, rest=rest), params, {k: v[:4] for k, v in batch.items()})
        except CoupledLossError as error:
            raise ValueError(f"PrivateTrainer: {error} (check_loss=False skips this check)") from None


class ArrayDataset:
    """Columns ``{name: [N, ...]}`` as an indexable dataset: ``len`` is N, ``take(indices [k]) -> {name: [k, ...]}``."""

    def __init__(self, columns: Mapping[str, Any]):
        self.columns = as_host_batch(columns, "dataset")

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {name: column[indices] for name, column in self.columns.items()}


class IndexedDataset:
    """A user's object with ``__len__`` and ``__getitem__(indices)``; ``take`` checks what ``__getitem__`` returns."""

    def __init__(self, data):
        self.data = data
        size = len(data)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"dataset: len(data) must be the number of examples (an int >= 1), got {size!r}")
        self.size = size

    def __len__(self) -> int:
        return self.size

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        where = f"dataset[{type(self.data).__name__}.__getitem__ of {len(indices)} indices]"
        batch = as_host_batch(self.data[np.asarray(indices)], where)
        rows = next(iter(batch.values())).shape[0]
        if rows != len(indices):
            raise ValueError(f"{where}: returned {rows} examples for {len(indices)} indices; __getitem__ must take an "
                             f"int array of indices and return those examples, in order")
        return batch


def classify(data) -> tuple[str, Any]:
    """``("indexable", dataset)`` (``ArrayDataset`` / ``IndexedDataset``) or ``("batches", iterable)``.

    A mapping is columns; a list, tuple, iterator or generator is batches; another object with ``__getitem__`` is an
    indexable dataset and must define ``__len__``; another object with ``__iter__`` only is batches."""
    if isinstance(data, Mapping):
        return "indexable", ArrayDataset(data)
    if isinstance(data, (str, bytes)):
        raise TypeError(f"data must be a dataset or an iterable of batches, got a {type(data).__name__}")
    if isinstance(data, (list, tuple, Iterator)):
        return "batches", data
    if hasattr(data, "__getitem__"):
        if not hasattr(data, "__len__"):
            raise TypeError(f"data: {type(data).__name__} defines __getitem__ but not __len__; an indexable dataset "
                            f"needs len(data), the number of examples N (the sampling rate batch_size / N and the "
                            f"accounting depend on it). Define __len__, or pass an iterable of batches and declare "
                            f"their sampling (sampling='poisson' or 'other', dataset_size=N)")
        return "indexable", IndexedDataset(data)
    if isinstance(data, Iterable):
        return "batches", data
    raise TypeError(f"data must be a dict of arrays [N, ...], an object with __len__ and __getitem__(indices), or an "
                    f"iterable of batches (dicts of arrays); got {type(data).__name__}")


SAMPLINGS = ("poisson", "other")   # what a user declares about an iterable's batches


def declared_sampling(data, sampling: str | None, dataset_size: int | None) -> tuple[str, Any, int, str]:
    """``(kind, source, N, sampling)`` of a trainer's ``data`` (:func:`classify`): an indexable dataset is the
    trainer's to sample (``"poisson"``, ``N = len(data)``); an iterable's sampling must be declared (``"poisson"`` ->
    ``"declared-poisson"``, ``"other"`` -> ``"as-if-poisson"``) with the ``dataset_size`` it was drawn from."""
    kind, source = classify(data)
    if kind == "indexable":
        if sampling is not None or dataset_size is not None:
            raise ValueError(f"PrivateTrainer: sampling={sampling!r} / dataset_size={dataset_size!r} are for an "
                             f"iterable of batches; an indexable dataset is Poisson sampled by the trainer, with "
                             f"N = len(data) = {len(source)}")
        return kind, source, len(source), "poisson"
    if sampling not in SAMPLINGS:
        raise ValueError(f"PrivateTrainer: data is an iterable of batches that you sampled, which the trainer "
                         f"cannot check; declare how with sampling='poisson' (each example joined each batch "
                         f"independently with probability batch_size / dataset_size) or sampling='other' (no "
                         f"formal guarantee), and give dataset_size=N; got sampling={sampling!r}")
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, numbers.Integral) or dataset_size < 1:
        raise ValueError(f"PrivateTrainer: dataset_size (the number of examples the batches are drawn from) must be "
                         f"an int >= 1, got {dataset_size!r}")
    return kind, source, int(dataset_size), "declared-poisson" if sampling == "poisson" else "as-if-poisson"


def warn_about_sampling(sampling: str, dataset_size: int, sampling_rate: float) -> None:
    """The ``UserWarning`` of a run whose batches the trainer did not sample (nothing for ``"poisson"``)."""
    q = f"{sampling_rate:.4g}"
    if sampling == "declared-poisson":
        warnings.warn(f"PrivateTrainer: the batches come from your iterable, so the trainer cannot check how they "
                      f"were drawn; the epsilon accounts them as Poisson sampled (each of the {dataset_size} "
                      f"examples independently with probability {q} per batch), and is a guarantee only if that "
                      f"is true. Pass the dataset itself (a dict of arrays or an object with __len__ / "
                      f"__getitem__) to have the trainer sample it.", UserWarning, stacklevel=3)
    elif sampling == "as-if-poisson":
        warnings.warn(f"PrivateTrainer: sampling='other' has NO formal privacy guarantee: accountants assume "
                      f"Poisson (or uniform) sampling. The number reported as 'epsilon_as_if_poisson' is what "
                      f"Poisson sampling at rate {q} would give, not a guarantee of this run.", UserWarning,
                      stacklevel=3)


def pad_batch(batch: dict[str, np.ndarray], slots: int, mask: np.ndarray | None = None
              ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``(padded {name: [slots, ...]}, mask bool [slots])``: the ``B <= slots`` examples first (``mask``: which of them
    are real, default all), then copies of example 0 with mask False."""
    size = len(next(iter(batch.values())))
    if size > slots:
        raise ValueError(f"a batch of {size} examples does not fit {slots} slots")
    real = np.ones(size, bool) if mask is None else np.asarray(mask, bool)
    if real.shape != (size,):
        raise ValueError(f"mask of shape {real.shape} for a batch of {size} examples")
    if size == slots:
        return batch, real
    take = np.concatenate([np.arange(size), np.zeros(slots - size, np.int64)])
    return {name: value[take] for name, value in batch.items()}, np.concatenate([real, np.zeros(slots - size, bool)])


def chunks(data, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """The examples of ``data`` (indexable or batches, as :func:`classify` takes) in host batches: an indexable
    dataset in order, ``batch_size`` at a time; an iterable's batches as they come."""
    kind, source = classify(data)
    if kind == "batches":
        for i, batch in enumerate(source):
            yield as_host_batch(batch, f"evaluation batch {i}")
        return
    n = len(source)
    for start in range(0, n, batch_size):
        yield source.take(np.arange(start, min(start + batch_size, n)))


def metric_sums(fn: Callable) -> Callable:
    """``sums(target, batch, mask) -> {name: sum over the real examples}`` of ``fn(target, batch)`` (``[B]`` or
    ``{name: [B]}``), to be jitted; ``target`` is a params pytree, or ``(graphdef, state)`` of an NNX model."""
    def sums(target, batch, mask):
        if isinstance(target, tuple) and len(target) == 2 and _is_graphdef(target[0]):
            from flax import nnx

            target = nnx.merge(*target)
        values = fn(target, batch)
        named = values if isinstance(values, Mapping) else {"value": values}
        out = {}
        for name, value in named.items():
            value = jnp.asarray(value)
            if value.shape != mask.shape:
                raise ValueError(f"evaluate: fn must return per-example values of shape [B] = {mask.shape} (or a dict "
                                 f"of them); {name!r} has shape {value.shape}")
            out[name] = jnp.sum(jnp.where(mask, value.astype(jnp.float32), 0.0))
        return out

    return sums


def _is_graphdef(value) -> bool:
    try:
        from flax import nnx
    except ModuleNotFoundError:   # pragma: no cover -- flax is a core dependency
        return False
    return isinstance(value, nnx.GraphDef)


def as_target(model_or_params):
    """What :func:`metric_sums` takes: an NNX model split into ``(graphdef, state)``, a params pytree as it is."""
    from flax import nnx

    return tuple(nnx.split(model_or_params)) if isinstance(model_or_params, nnx.Module) else model_or_params


def run_evaluation(sums, target, data, batch_size: int) -> dict[str, float] | float:
    """Means over every example of ``data`` of the compiled ``sums`` (:func:`metric_sums` under ``jax.jit``); batches
    are padded to ``batch_size`` slots (larger ones to a multiple), so one compile serves them all."""
    totals: dict[str, float] = {}
    count = 0
    for batch in chunks(data, batch_size):
        size = len(next(iter(batch.values())))
        padded, mask = pad_batch(batch, -(-size // batch_size) * batch_size)
        for name, value in sums(target, padded, mask).items():
            totals[name] = totals.get(name, 0.0) + float(value)
        count += size
    if count == 0:
        raise ValueError("evaluate: data holds no examples")
    means = {name: total / count for name, total in totals.items()}
    return means["value"] if list(means) == ["value"] else means


def evaluate(fn: Callable, model_or_params, data, *, batch_size: int = 256) -> dict[str, float] | float:
    """Mean of per-example metrics over a data set (no privacy: evaluation data is not trained on).

    ``fn(model_or_params, batch) -> [B]`` (one metric: a float is returned) or ``{name: [B]}`` (a dict of floats),
    computed under ``jax.jit``; ``model_or_params``: a ``flax.nnx`` model or a params pytree (what ``fn`` takes);
    ``data``: a dict of arrays ``[N, ...]``, an object with ``__len__`` / ``__getitem__(indices)``, or an iterable of
    batches. Batches are padded to ``batch_size`` slots (masked out of the mean). Each call compiles ``fn`` anew;
    :meth:`dpzero_jax.fit.PrivateTrainer.evaluate` keeps the compiled function across calls.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be an int >= 1, got {batch_size!r}")
    return run_evaluation(jax.jit(metric_sums(fn)), as_target(model_or_params), data, batch_size)


@dataclasses.dataclass
class FitResult:
    """What :meth:`PrivateTrainer.fit` returns.

    params / opt_state: the trained pytrees; model: an NNX model with the trained parameters (None for a params
    pytree); ledger: the :class:`~dpzero_jax.accounting.PrivacyLedger` of every step; epsilon: the ledger's epsilon of
    record at ``delta``; sampling: ``"poisson"`` (sampled by the trainer), ``"declared-poisson"`` (the user's
    declaration) or ``"as-if-poisson"`` (no formal guarantee); formal_guarantee: False only for ``as-if-poisson``;
    history: the logged rows (as ``metrics.jsonl`` holds them)."""

    params: Any
    opt_state: Any
    model: Any
    ledger: Any   # accounting.PrivacyLedger
    epsilon: float
    delta: float
    noise_multiplier: float
    sampling_rate: float
    steps: int
    sampling: str
    formal_guarantee: bool
    history: list

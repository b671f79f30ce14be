"""A training run's checkpoints: writing them, and reading back the newest intact one.

A checkpoint ``DIR/STEP`` (orbax ``CheckpointManager``; written to a temporary directory, then committed) holds

* the state as **named trees**: ``params`` and ``opt_state`` as ``{name: array}`` with ``name`` the leaf's pytree
  path (:func:`jax.tree_util.keystr`, e.g. ``['linear']['kernel']`` or ``[0].mu['linear']['kernel']``), plus
  ``key`` (the run's key data, ``uint32[2]``) and ``step`` (``int64[]``). One process writes host copies with numpy
  into one ``.npz`` (item :data:`HOST_ITEM`; orbax's tensorstore handlers leak on every save in tensorstore 0.1.86,
  issue 20); several processes write their shards collectively (item ``state``, orbax ``StandardSave``, OCDBT);
* the JSON item ``meta``: ``format`` (:data:`FORMAT`), ``step``, the privacy ledger, the run's config, and per
  array its shape, dtype and **digest**, the whole item sealed by a SHA-256 of its own content (``meta_sha256``).

Digest of an array (:func:`array_digest`): the sum modulo 2^64 of a 64-bit hash of every machine word of the array
mixed with its position in the whole array (``mix(word ^ (position * M + C))``, ``mix`` splitmix64's finaliser, a
bijection). A sum, so that
every process hashes only the shards it holds (replicas once) and the partial sums add up: no process ever gathers
a sharded array, and the digest does not depend on the mesh that wrote or reads it. SHA-256 or CRC-32C of a whole
array would need the array in one place and one order. It guards against damage (a changed word changes the sum
unless 2^-64 bad luck), not against a forger, who could rewrite ``meta`` as well.

Reading (:func:`restore`): newest step first. A checkpoint whose ``meta`` does not parse or fails its seal, whose
arrays cannot be read, or whose arrays do not match their digests is **damaged**: skipped with a
``RuntimeWarning`` naming it, for the next older one; when none is intact, a ``RuntimeError`` lists them all. A
checkpoint that is intact but not this run's -- other options (the caller's ``check_config``), another seed,
another set of names, shapes or dtypes, or the format before named trees -- is **refused** with a ``ValueError``
saying why: nothing is trained on and nothing is moved. Only when a checkpoint is accepted are the damaged newer
ones set aside (:func:`dpzero_jax.rundir.set_aside`).

All file I/O goes through :mod:`etils.epath` (as orbax's own), so ``DIR`` may be a ``gs://`` URL.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath

FORMAT = 2           # named trees + digests; format 1 (no "format" in meta) stored numbered leaves
HOST_ITEM = "host_state"   # one process: params, optimizer state, key and step in one .npz
HOST_FILE = "arrays.npz"
STATE_ITEM = "state"       # several processes: the same tree through orbax StandardSave
META_ITEM = "meta"
TREES = ("params", "opt_state")


# ---------------------------------------------------------------------------------------------------- digests
_POSITION_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)   # odd: position -> position * M + C is a bijection
_POSITION_OFFSET = np.uint64(0xD1B54A32D192ED03)
_CHUNK = 1 << 20   # words hashed at a time (a few 8-byte buffers of this length)


def _mix_inplace(z: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on ``uint64`` in place (a bijection; wraps modulo 2^64)."""
    for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        np.right_shift(z, np.uint64(shift), out=scratch)
        z ^= scratch
        z *= np.uint64(multiplier)
    np.right_shift(z, np.uint64(31), out=scratch)
    z ^= scratch
    return z


def _positions(block_shape: tuple[int, ...], index: tuple, shape: tuple[int, ...]) -> np.ndarray:
    """Row-major positions in the whole array (of ``shape``) of the elements of its part ``index``, flattened."""
    starts = [(index[axis].start or 0) if axis < len(index) else 0 for axis in range(len(shape))]
    if tuple(block_shape) == tuple(shape):   # the whole array
        return np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64)
    flat = np.zeros(block_shape, np.uint64)
    stride = 1
    for axis in reversed(range(len(shape))):
        positions = np.arange(starts[axis], starts[axis] + block_shape[axis], dtype=np.uint64) * np.uint64(stride)
        flat += positions.reshape((-1,) + (1,) * (len(shape) - axis - 1))
        stride *= shape[axis]
    return flat.reshape(-1)


def _block_sum(block: np.ndarray, index: tuple, shape: tuple[int, ...]) -> int:
    """Digest terms of ``block``, the part ``index`` (a tuple of slices) of an array of ``shape``, summed mod 2^64:
    per machine word ``w`` at word position ``p``, ``mix(w ^ (p * M + C))`` (``mix``: splitmix64's finaliser)."""
    block = np.ascontiguousarray(block)
    if block.size == 0:
        return 0
    if block.size > _CHUNK and block.shape[0] > 1:   # large: by slabs of rows, in bounded memory
        start = (index[0].start or 0) if index else 0
        rows = max(1, _CHUNK // (block.size // block.shape[0]))
        total = 0
        for first in range(0, block.shape[0], rows):
            part = block[first:first + rows]
            part_index = (slice(start + first, start + first + part.shape[0]), *tuple(index)[1:])
            total += _block_sum(part, part_index, shape)
        return total % 2**64
    itemsize = block.dtype.itemsize
    word = next(w for w in (8, 4, 2, 1) if itemsize % w == 0)
    per_item = itemsize // word
    z = block.reshape(-1).view(np.dtype(f"u{word}")).astype(np.uint64)
    position = _positions(block.shape, index, shape)
    if per_item > 1:   # several words per element (complex, 16-byte types)
        position = (position[:, None] * np.uint64(per_item) + np.arange(per_item, dtype=np.uint64)).reshape(-1)
    position *= _POSITION_MULTIPLIER
    position += _POSITION_OFFSET
    z ^= position
    return int(_mix_inplace(z, position).sum(dtype=np.uint64))


def _partial_digest(value) -> int:
    """This process's share of :func:`array_digest`: its addressable shards with ``replica_id == 0`` of a
    ``jax.Array``; all of a host array (which every process holds in full) on process 0, nothing elsewhere."""
    if isinstance(value, jax.Array):
        total = 0
        for shard in value.addressable_shards:
            if shard.replica_id == 0:
                total += _block_sum(np.asarray(shard.data), shard.index, value.shape)
        return total % 2**64
    if jax.process_index() != 0:
        return 0
    value = np.asarray(value)
    return _block_sum(value, (), value.shape)


def array_digests(values: list) -> list[str]:
    """:func:`array_digest` of several arrays (host or ``jax.Array``, sharded over processes too) in one exchange
    between processes. Collective: every process calls it with the same arrays."""
    partial = np.array([_partial_digest(v) for v in values], dtype=np.uint64)
    if jax.process_count() > 1:   # uint64 does not survive JAX without x64: exchanged as two uint32 halves
        from jax.experimental import multihost_utils

        halves = np.stack([partial & np.uint64(0xFFFFFFFF), partial >> np.uint64(32)], axis=-1).astype(np.uint32)
        gathered = np.asarray(multihost_utils.process_allgather(halves)).astype(np.uint64)   # [P, n, 2]
        partial = (gathered[..., 0] + (gathered[..., 1] << np.uint64(32))).sum(axis=0, dtype=np.uint64)
    return [f"{int(d):016x}" for d in partial]


def array_digest(value) -> str:
    """Digest of one array's contents (16 hex digits): see the module docstring. Independent of sharding."""
    return array_digests([value])[0]


# ---------------------------------------------------------------------------------------------------- names
def named(tree) -> dict[str, Any]:
    """``{keystr(path): leaf}`` of a pytree, in its flattening order."""
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _flat_items(state: dict) -> dict[str, Any]:
    """``{"params/NAME": ..., "opt_state/NAME": ..., "key": ..., "step": ...}`` of a state dict."""
    items = {f"{tree}/{name}": value for tree in TREES for name, value in state[tree].items()}
    items.update(key=state["key"], step=state["step"])
    return items


def _seal(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------- orbax
def _as_path(directory) -> epath.Path:
    """``directory`` as an ``epath.Path``; a local path made absolute (orbax asks for it), a URL left as it is."""
    text = os.fspath(directory) if not isinstance(directory, epath.Path) else str(directory)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def open_manager(directory, keep: int | None = None, read_only: bool = False):
    """An orbax ``CheckpointManager`` on ``directory`` (synchronous writes, ``keep`` newest kept)."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(_as_path(directory), options=options)


@functools.cache
def _host_arrays_args():
    """``(HostArraysSave, HostArraysRestore)``: orbax args of a handler that writes a checkpoint's host arrays with
    ``numpy.savez`` into one file of the item's (temporary, then committed) directory and reads them back, through
    epath. Defined on first use: orbax is imported lazily."""
    import orbax.checkpoint as ocp

    class HostArraysHandler(ocp.CheckpointHandler):
        # zip needs a seekable file: local files are used as they are, remote objects through memory
        def save(self, directory, args):
            path = epath.Path(directory) / HOST_FILE
            if "://" not in str(path):
                with path.open("wb") as f:
                    np.savez(f, **args.arrays)
                return
            buffer = io.BytesIO()
            np.savez(buffer, **args.arrays)
            with path.open("wb") as f:
                f.write(buffer.getbuffer())

        def restore(self, directory, args=None):
            path = epath.Path(directory) / HOST_FILE
            source = path.open("rb") if "://" not in str(path) else io.BytesIO(path.read_bytes())
            with source, np.load(source, allow_pickle=False) as arrays:
                return {name: arrays[name] for name in arrays.files}

    @ocp.args.register_with_handler(HostArraysHandler, for_save=True)
    @dataclasses.dataclass
    class HostArraysSave(ocp.args.CheckpointArgs):
        arrays: dict

    @ocp.args.register_with_handler(HostArraysHandler, for_restore=True)
    @dataclasses.dataclass
    class HostArraysRestore(ocp.args.CheckpointArgs):
        pass

    return HostArraysSave, HostArraysRestore


# ---------------------------------------------------------------------------------------------------- save
def save(manager, step: int, params, opt_state, key_data, ledger: dict, config: dict,
         host: bool | None = None, train_state: dict | None = None) -> None:
    """Write checkpoint ``step``: the named trees of ``params`` / ``opt_state`` (pytrees of arrays, sharded
    ``jax.Array`` too), ``key_data`` (``uint32[2]``), ``ledger`` and ``config`` (JSON-able dicts), with digests.
    ``train_state``: small JSON-able state of the run besides the arrays (adaptive clipping's thresholds, as
    floats: a float32 value survives JSON exactly), kept in the sealed metadata.

    ``host``: write host copies into one ``.npz`` (default when there is one process) or, ``False``, the shards
    collectively through orbax ``StandardSave`` (needed with several processes). Collective with several processes.
    """
    import orbax.checkpoint as ocp

    host = jax.process_count() == 1 if host is None else host
    state = {"params": named(params), "opt_state": named(opt_state),
             "key": np.asarray(key_data, np.uint32), "step": np.asarray(step, np.int64)}
    if host:
        state = jax.device_get(state)
    items = _flat_items(state)
    digests = array_digests(list(items.values()))
    arrays = {name: {"shape": list(np.shape(v)), "dtype": np.dtype(v.dtype).name, "digest": d}
              for (name, v), d in zip(items.items(), digests, strict=True)}
    meta = {"format": FORMAT, "step": int(step), "ledger": ledger, "config": config, "arrays": arrays}
    if train_state:
        meta["train_state"] = train_state
    meta["meta_sha256"] = _seal(meta)
    if host:
        save_args, _ = _host_arrays_args()
        data = save_args(arrays={name: np.asarray(v) for name, v in items.items()})
        args = ocp.args.Composite(**{HOST_ITEM: data, META_ITEM: ocp.args.JsonSave(meta)})
    else:
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta)})
    manager.save(step, args=args, force=True)
    manager.wait_until_finished()


# ---------------------------------------------------------------------------------------------------- restore
class Restored(NamedTuple):
    step: int
    params: Any
    opt_state: Any
    ledger: dict          # the ledger as saved (``PrivacyLedger.to_dict()``)
    skipped: list         # (step, reason) of the damaged newer checkpoints passed over
    train_state: dict = {}   # the ``train_state`` given to :func:`save` ({} if none)


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be read or does not match its digests (skipped for an older one)."""


def _abstract_state(params, opt_state, shardings) -> dict:
    """``{"params": {name: ShapeDtypeStruct}, "opt_state": {...}, "key": ..., "step": ...}`` with the target
    shardings: ``shardings`` = ``(params', opt_state')`` trees of shardings, or None (the first device)."""
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, (params, opt_state))
    state = {}
    for tree, values, targets in zip(TREES, (params, opt_state), shardings, strict=True):
        state[tree] = {name: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=target)
                       for (name, x), target in zip(named(values).items(), jax.tree.leaves(targets), strict=True)}
    state["key"] = jax.ShapeDtypeStruct((2,), np.uint32)
    state["step"] = jax.ShapeDtypeStruct((), np.int64)
    return state


def _check_layout(where: str, saved: dict, expected: dict) -> None:
    """Names, shapes and dtypes of the saved arrays (meta) against this run's: a ``ValueError`` naming each
    missing, extra or different array."""
    problems = []
    missing = [n for n in expected if n not in saved]
    extra = [n for n in saved if n not in expected]
    if missing:
        problems.append("missing from the checkpoint: " + ", ".join(missing))
    if extra:
        problems.append("not in this run: " + ", ".join(extra))
    for name, spec in expected.items():
        if name in saved:
            shape, dtype = tuple(saved[name]["shape"]), saved[name]["dtype"]
            if shape != tuple(spec.shape) or dtype != np.dtype(spec.dtype).name:
                problems.append(f"{name}: saved {shape} {dtype}, this run has {tuple(spec.shape)} "
                                f"{np.dtype(spec.dtype).name}")
    if problems:
        raise ValueError(f"cannot resume from {where}: its arrays do not match this run's model and optimizer ("
                         + "; ".join(problems) + "); use the original model options or another --out")


def _read_meta(manager, step: int, where: str) -> dict:
    """The checkpoint's ``meta`` item, its seal verified; a refusal for the format before named trees."""
    import orbax.checkpoint as ocp

    try:
        meta = manager.restore(step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
    except Exception as error:  # noqa: BLE001 -- any unreadable item is damage
        raise DamagedCheckpoint(f"{type(error).__name__}: {error}") from None
    if not isinstance(meta, dict):
        raise DamagedCheckpoint("its meta item is not a JSON object")
    if not {"format", "arrays", "meta_sha256"} & meta.keys() and "ledger" in meta:
        raise ValueError(f"cannot resume from {where}: the checkpoint predates named checkpoints (format 1: "
                         f"numbered leaves, no digests); this version reads format {FORMAT} only -- finish that run "
                         f"with the version that wrote it, or start a new run in another --out")
    if meta.get("meta_sha256") != _seal(meta):
        raise DamagedCheckpoint("its meta item does not match its SHA-256 seal")
    if meta.get("format") != FORMAT:
        raise ValueError(f"cannot resume from {where}: checkpoint format {meta.get('format')!r}, this version "
                         f"reads format {FORMAT}")
    return meta


def _read_arrays(manager, step: int, directory: epath.Path, abstract: dict) -> dict:
    """The arrays of checkpoint ``step`` as ``{flat name: array}``, placed with the abstract state's shardings."""
    import orbax.checkpoint as ocp

    specs = _flat_items(abstract)
    if (directory / str(step) / HOST_ITEM).exists():   # one process's host copies
        _, restore_args = _host_arrays_args()
        host = manager.restore(step, args=ocp.args.Composite(**{HOST_ITEM: restore_args()}))[HOST_ITEM]
        if sorted(host) != sorted(specs):
            raise DamagedCheckpoint(f"{HOST_FILE} holds other arrays than its meta item lists")
        values = {}
        for name, spec in specs.items():
            value, dtype = np.asarray(host[name]), np.dtype(spec.dtype)
            if value.dtype != dtype and value.dtype.kind == "V" and value.dtype.itemsize == dtype.itemsize:
                value = value.view(dtype)   # numpy stores extension dtypes (bfloat16) as raw bytes
            if value.shape != tuple(spec.shape) or value.dtype != dtype:
                raise DamagedCheckpoint(f"{name} is {value.shape} {value.dtype} in {HOST_FILE}, its meta item "
                                        f"says {tuple(spec.shape)} {dtype}")
            values[name] = value
        return values
    restored = manager.restore(step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract)}))
    return _flat_items(restored[STATE_ITEM])


def restore(directory, params, opt_state, key_data, shardings=None,
            check_config: Callable[[dict], None] | None = None, set_aside: bool = True) -> Restored | None:
    """The newest intact checkpoint in ``directory`` for a run whose state looks like ``params`` / ``opt_state``
    (pytrees of arrays or ``ShapeDtypeStruct``; ``shardings``: matching trees of target shardings, None for the
    first device) and whose key data is ``key_data``; None when ``directory`` holds no checkpoint.

    Damaged checkpoints are skipped with a ``RuntimeWarning`` naming them (and, once one is accepted, set aside
    when ``set_aside``); none intact -> ``RuntimeError``. ``check_config(saved_config)`` raises to refuse another
    run's checkpoint; other seeds, names, shapes, dtypes and formats are refused here (``ValueError``).
    Collective with several processes.
    """
    from dpzero_jax import rundir

    directory = _as_path(directory)
    if not directory.exists():
        return None
    abstract = _abstract_state(params, opt_state, shardings)
    expected = _flat_items(abstract)
    manager = open_manager(directory, read_only=True)
    skipped, found = [], None
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            where = f"{directory / str(step)}"
            try:
                meta = _read_meta(manager, step, where)
                if check_config is not None:
                    check_config(meta["config"])
                _check_layout(where, meta["arrays"], expected)
                try:
                    values = _read_arrays(manager, step, directory, abstract)
                except DamagedCheckpoint:
                    raise
                except Exception as error:  # noqa: BLE001 -- any unreadable array is damage
                    raise DamagedCheckpoint(f"{type(error).__name__}: {error}") from None
                digests = array_digests(list(values.values()))
                for name, digest in zip(values, digests, strict=True):
                    if digest != meta["arrays"][name]["digest"]:
                        raise DamagedCheckpoint(f"array {name} does not match its digest (saved "
                                                f"{meta['arrays'][name]['digest']}, read {digest})")
                if int(np.asarray(values["step"])) != step or meta["step"] != step:
                    raise DamagedCheckpoint(f"it says step {meta['step']}, its directory step {step}")
            except DamagedCheckpoint as error:
                skipped.append((step, str(error)))
                warnings.warn(f"skipping unreadable checkpoint at step {step} ({where}): {error}", RuntimeWarning,
                              stacklevel=3)
                continue
            if not np.array_equal(np.asarray(values["key"]), np.asarray(key_data, np.uint32)):
                raise ValueError(f"cannot resume from {directory}: checkpoint {step} was written with a different "
                                 f"seed; use the original --seed or another --out")
            trees = []
            for tree, template in zip(TREES, (params, opt_state), strict=True):
                names = named(template)
                leaves = [values[f"{tree}/{name}"] for name in names]
                leaves = [jax.device_put(v, abstract[tree][name].sharding) if isinstance(v, np.ndarray) else v
                          for name, v in zip(names, leaves, strict=True)]   # host copies placed; orbax's are
                trees.append(jax.tree.unflatten(jax.tree.structure(template), leaves))
            found = Restored(step, trees[0], trees[1], meta["ledger"], skipped, meta.get("train_state", {}))
            break
    finally:
        manager.close()
    if found is None:
        if skipped:   # nothing is moved: the user decides what to do with them
            raise RuntimeError(f"no checkpoint in {directory} could be restored: " +
                               "; ".join(f"step {s}: {r}" for s, r in skipped))
        return None
    for bad, reason in skipped if set_aside else ():   # accepted: set aside the damaged newer ones
        rundir.set_aside(directory, bad, reason)
    return found

"""Checkpoints (dpzero_jax.checkpoints): named trees, array digests against a pure-Python reference, refusals that
say why, and damage on orbax's StandardSave path (the multi-process format) caught in one process."""

import json
import shutil
import sys
import warnings

import damage
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpzero_jax import checkpoints as ckpt

KEY = np.array([0, 42], np.uint32)
M64 = 2**64


def _mix_reference(z: int) -> int:
    z ^= z >> 30
    z = z * 0xBF58476D1CE4E5B9 % M64
    z ^= z >> 27
    z = z * 0x94D049BB133111EB % M64
    return z ^ (z >> 31)


def _digest_reference(array: np.ndarray) -> str:
    """The digest written out element by element on the array's bytes, with Python integers."""
    raw = np.ascontiguousarray(array).tobytes()
    width = next(w for w in (8, 4, 2, 1) if array.dtype.itemsize % w == 0)
    total = 0
    for i in range(len(raw) // width):
        word = int.from_bytes(raw[i * width:(i + 1) * width], sys.byteorder)
        total += _mix_reference(word ^ ((i * 0x9E3779B97F4A7C15 + 0xD1B54A32D192ED03) % M64))
    return f"{total % M64:016x}"


@pytest.mark.parametrize("array", [
    np.linspace(-3, 3, 15, dtype=np.float32).reshape(3, 5),
    np.arange(7, dtype=np.float32).astype(ml_dtypes.bfloat16),
    np.arange(-6, 6, dtype=np.int8).reshape(2, 3, 2),
    (np.arange(4) + 1j * np.arange(4)).astype(np.complex64),
    np.array([True, False, True]),
    np.array(123456789012, np.int64),
    np.zeros((0, 3), np.float32),
], ids=["f32", "bf16", "i8", "c64", "bool", "scalar-i64", "empty"])
def test_digest_matches_a_pure_python_reference(array):
    assert ckpt.array_digest(array) == _digest_reference(array)


@pytest.mark.parametrize("chunk", [1 << 20, 5], ids=["whole", "by-slabs"])
def test_digest_does_not_depend_on_the_sharding(chunk, monkeypatch):
    monkeypatch.setattr(ckpt, "_CHUNK", chunk)   # large blocks are hashed by slabs of rows: same digest
    value = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
    expected = _digest_reference(value)
    devices = np.array(jax.devices()[:8])
    for mesh_shape, spec in (((8,), P("a")), ((4, 2), P("a", "b")), ((4, 2), P(None, "b")), ((8,), P())):
        mesh = jax.sharding.Mesh(devices.reshape(mesh_shape), ("a", "b")[:len(mesh_shape)])
        assert ckpt.array_digest(jax.device_put(value, NamedSharding(mesh, spec))) == expected, spec
    changed, swapped = value.copy(), value.copy()
    changed[3, 2] = np.nextafter(changed[3, 2], np.inf)          # one ulp
    swapped[[0, 1]] = swapped[[1, 0]]                               # same values, other places
    assert len({expected, ckpt.array_digest(changed), ckpt.array_digest(swapped)}) == 3


KERNEL = np.random.default_rng(1).normal(size=(64, 128)).astype(np.float32)   # incompressible: zstd keeps it


def _state(scale=1.0):
    params = {"linear": {"kernel": jnp.asarray(KERNEL) * scale, "bias": jnp.ones(128, jnp.bfloat16)}}
    return params, optax.adam(1e-3).init(params)


def _save(directory, steps=(1, 2), host=True, **changes):
    manager = ckpt.open_manager(directory, keep=5)
    saved = {}
    for step in steps:
        params, opt_state = _state(scale=step)
        ckpt.save(manager, step, params, opt_state, KEY, {"events": [step]}, {"seed": 42, **changes}, host=host)
        saved[step] = (params, opt_state)
    manager.close()
    return saved


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_checkpoint_stores_named_trees_with_digests(tmp_path):
    saved = _save(tmp_path / "c")
    with np.load(tmp_path / "c" / "2" / ckpt.HOST_ITEM / ckpt.HOST_FILE) as data:
        arrays = {name: data[name] for name in data.files}
    names = {"params/['linear']['bias']", "params/['linear']['kernel']", "opt_state/[0].count",
             "opt_state/[0].mu['linear']['bias']", "opt_state/[0].mu['linear']['kernel']",
             "opt_state/[0].nu['linear']['bias']", "opt_state/[0].nu['linear']['kernel']", "key", "step"}
    assert set(arrays) == names
    np.testing.assert_array_equal(arrays["params/['linear']['kernel']"], KERNEL * 2)
    meta = json.loads((tmp_path / "c" / "2" / "meta" / "metadata").read_text())
    assert meta["format"] == ckpt.FORMAT and meta["step"] == 2 and meta["ledger"] == {"events": [2]}
    kernel = meta["arrays"]["params/['linear']['kernel']"]
    assert kernel["shape"] == [64, 128] and kernel["dtype"] == "float32"
    assert kernel["digest"] == _digest_reference(KERNEL * 2)
    restored = ckpt.restore(tmp_path / "c", *_state(), KEY)
    assert restored.step == 2 and restored.ledger == {"events": [2]} and restored.skipped == []
    _assert_equal((restored.params, restored.opt_state), saved[2])
    assert restored.params["linear"]["bias"].dtype == jnp.bfloat16


def test_other_names_shapes_and_dtypes_are_refused_naming_them(tmp_path):
    _save(tmp_path / "c")
    params = {"linear": {"kernel": jnp.zeros((64, 5)), "scale": jnp.ones(128, jnp.bfloat16)}}
    with pytest.raises(ValueError) as error:
        ckpt.restore(tmp_path / "c", params, optax.adam(1e-3).init(params), KEY)
    message = str(error.value)
    assert "missing from the checkpoint: params/['linear']['scale']" in message
    assert "not in this run: params/['linear']['bias']" in message
    assert "params/['linear']['kernel']: saved (64, 128) float32, this run has (64, 5) float32" in message
    params = {"linear": {"kernel": jnp.zeros((64, 128)), "bias": jnp.ones(128, jnp.float32)}}
    with pytest.raises(ValueError, match=r"params/\['linear'\]\['bias'\]: saved \(128,\) bfloat16, this run has "
                                         r"\(128,\) float32"):
        ckpt.restore(tmp_path / "c", params, optax.adam(1e-3).init(params), KEY)
    with pytest.raises(ValueError, match="different seed"):
        ckpt.restore(tmp_path / "c", *_state(), np.array([0, 7], np.uint32))
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["1", "2"]   # refusals move nothing


def test_a_damaged_meta_item_fails_its_seal(tmp_path):
    """A change that keeps the JSON valid (the ledger's number) is caught by the meta item's SHA-256 seal."""
    saved = _save(tmp_path / "c")
    path = tmp_path / "c" / "2" / "meta" / "metadata"
    path.write_text(path.read_text().replace('"events": [2]', '"events": [3]'))
    with pytest.warns(RuntimeWarning, match=r"skipping unreadable checkpoint at step 2 .*SHA-256 seal"):
        restored = ckpt.restore(tmp_path / "c", *_state(), KEY, set_aside=False)
    assert restored.step == 1
    _assert_equal((restored.params, restored.opt_state), saved[1])


def test_damage_on_the_standard_save_path_is_never_restored(tmp_path):
    """The multi-process format (orbax StandardSave, OCDBT), written and read by one process over 8 devices: bytes
    flipped in each file of the latest checkpoint, at 4 places. Every case restores the latest checkpoint intact
    (its digests match) or the previous one with a warning; never damaged values."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    sharded = NamedSharding(mesh, P(None, "fsdp"))
    replicated = NamedSharding(mesh, P())
    params, opt_state = _state()
    shardings = jax.tree.map(lambda x: sharded if np.ndim(x) == 2 and np.shape(x)[1] % 8 == 0 else replicated,
                             (params, opt_state))
    original = tmp_path / "original"
    saved = _save(original, host=False)
    files = sorted(p.relative_to(original) for p in (original / "2").rglob("*") if p.is_file())
    assert any("ocdbt" in str(p) for p in files)
    outcomes = {}
    for file in files:
        for place in damage.PLACES:
            case = tmp_path / "case"
            shutil.rmtree(case, ignore_errors=True)
            shutil.copytree(original, case)
            damage.flip(case / file, place)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    restored = ckpt.restore(case, params, opt_state, KEY, shardings)
                except RuntimeError as error:   # refused: none intact
                    outcomes[file, place] = f"refused: {error}"
                    continue
            _assert_equal((restored.params, restored.opt_state), saved[restored.step])
            warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                      and "skipping unreadable checkpoint" in str(w.message)]
            assert (restored.step == 1) == bool(warned), (file, place, warned)
            outcomes[file, place] = warned[0] if warned else "intact"
    assert len(outcomes) == 4 * len(files)
    # the damage OCDBT itself lets through (array data carries no checksum) is caught by the digests
    assert any("does not match its digest" in text for text in outcomes.values()), outcomes


def test_checkpoints_in_a_gs_bucket(fake_gcs):
    """Writing, pruning (keep), falling back from a damaged checkpoint and setting it aside, all through epath on a
    ``gs://`` URL: everything lands in the (in-memory) bucket, nothing on the local disk."""
    url = "gs://bucket/run/checkpoints"
    manager = ckpt.open_manager(url, keep=2)
    saved = {}
    for step in (1, 2, 3):
        params, opt_state = _state(scale=step)
        ckpt.save(manager, step, params, opt_state, KEY, {"events": [step]}, {"seed": 42})
        saved[step] = (params, opt_state)
    manager.close()
    steps = {key.split("/")[4] for key in fake_gcs.fs.store}
    assert steps == {"2", "3"} and fake_gcs.local_leak() == [] and list(fake_gcs.cwd.iterdir()) == []
    restored = ckpt.restore(url, *_state(), KEY)
    assert restored.step == 3
    _assert_equal((restored.params, restored.opt_state), saved[3])
    arrays = f"/bucket/run/checkpoints/3/{ckpt.HOST_ITEM}/{ckpt.HOST_FILE}"
    data = bytearray(fake_gcs.fs.store[arrays].getvalue())
    data[len(data) // 2] ^= 0xFF
    fake_gcs.fs.pipe_file(arrays, bytes(data))
    with pytest.warns(RuntimeWarning, match=f"skipping unreadable checkpoint at step 3 \\({url}/3\\)"):
        restored = ckpt.restore(url, *_state(), KEY)
    assert restored.step == 2
    _assert_equal((restored.params, restored.opt_state), saved[2])
    steps = {key.split("/")[4] for key in fake_gcs.fs.store}
    assert "3" not in steps and any(s.startswith("3.unreadable-") for s in steps)   # set aside in the bucket
    assert fake_gcs.local_leak() == [] and list(fake_gcs.cwd.iterdir()) == []

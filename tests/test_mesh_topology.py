"""Meshes on 8 virtual CPU devices: the plain mesh from ``jax.make_mesh``, the hybrid ICI x DCN mesh of multi-slice
runs (device placement checked against the documented grouping: a slice is a run of consecutive device ids when the
devices carry no ``slice_index``), the errors, and a training run on a hybrid mesh against the one-device run."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from dpzero_jax import sharding
from dpzero_jax.cli import main
from dpzero_jax.train import TrainConfig, Trainer

BASE = dict(steps=4, batch_size=64, log_every=2, progress=False, plot=False, checkpoint_every=0, optimizer="sgd",
            lr=0.1, epsilon=3.0)


def test_plain_mesh_names_shape_and_order():
    mesh = sharding.make_mesh(sharding.MeshShape(2, 4))
    assert mesh.axis_names == ("data", "fsdp")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)   # GSPMD propagation, not explicit sharding
    # CPU devices have no physical topology: jax.make_mesh keeps the device order
    np.testing.assert_array_equal([[d.id for d in row] for row in mesh.devices], np.arange(8).reshape(2, 4))
    smaller = sharding.make_mesh(sharding.MeshShape(1, 2))   # the first devices when fewer are asked for
    assert [d.id for d in smaller.devices.flat] == [0, 1]


@pytest.mark.parametrize("mesh, dcn", [
    ("data=4,fsdp=2", "data=2"),          # two slices side by side along data
    ("data=2,fsdp=4", "fsdp=2"),          # fsdp spans two slices
    ("data=4,fsdp=2", "data=2,fsdp=2"),   # four slices, a 2 x 2 grid of slices
    ("data=8", "data=8"),                 # one device per slice
    ("data=2,fsdp=2", "data=2"),          # fewer devices than exist: the first four, two slices of two
])
def test_hybrid_mesh_places_each_slice_in_its_block(mesh, dcn):
    shape, dcn_shape = sharding.parse_mesh(mesh), sharding.parse_mesh(dcn, "dcn_mesh")
    hybrid = sharding.make_mesh(shape, dcn=dcn_shape)
    assert hybrid.axis_names == ("data", "fsdp") and dict(hybrid.shape) == {"data": shape.data, "fsdp": shape.fsdp}
    assert hybrid.axis_types == (AxisType.Auto, AxisType.Auto)
    ici_data, ici_fsdp = shape.data // dcn_shape.data, shape.fsdp // dcn_shape.fsdp
    per_slice = ici_data * ici_fsdp
    ids = np.array([[d.id for d in row] for row in hybrid.devices])
    assert sorted(ids.flat) == list(range(shape.size))
    for (row, col), device_id in np.ndenumerate(ids):
        # the documented grouping: slice s holds devices s * per_slice ... (s + 1) * per_slice - 1
        slice_index = (row // ici_data) * dcn_shape.fsdp + col // ici_fsdp
        assert device_id // per_slice == slice_index, (row, col, device_id)
        # inside a slice: the slice's devices in order, row-major over the ICI shape (no topology on CPU)
        assert device_id % per_slice == (row % ici_data) * ici_fsdp + col % ici_fsdp
    # every ICI block holds exactly one slice: collectives inside a block never cross the DCN
    for a in range(dcn_shape.data):
        for b in range(dcn_shape.fsdp):
            block = ids[a * ici_data:(a + 1) * ici_data, b * ici_fsdp:(b + 1) * ici_fsdp]
            assert len({i // per_slice for i in block.flat}) == 1


@dataclasses.dataclass(frozen=True)
class FakeDevice:   # what slices_of reads of a TPU device
    id: int
    process_index: int = 0
    slice_index: int | None = None


def test_slices_follow_slice_index_when_devices_have_it():
    devices = [FakeDevice(i, slice_index=i % 2) for i in range(8)]   # interleaved: not consecutive ids
    groups = sharding.slices_of(devices, 2)
    assert [[d.id for d in g] for g in groups] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match="asks for 4 slices but the devices form 2 slices"):
        sharding.slices_of(devices, 4)
    one_slice = [FakeDevice(i, slice_index=0) for i in range(8)]   # one TPU slice: consecutive runs
    assert [[d.id for d in g] for g in sharding.slices_of(one_slice, 4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # without slice_index: consecutive in (process, id) order, so each process's devices stay together
    hosts = [FakeDevice(i, process_index=1 - i // 4) for i in range(8)]
    assert [[d.id for d in g] for g in sharding.slices_of(hosts, 2)] == [[4, 5, 6, 7], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="spans several TPU slices.*--dcn-mesh"):
        sharding.make_mesh(sharding.MeshShape(2, 4), devices)


def test_mesh_errors_name_the_problem():
    shape = sharding.MeshShape(4, 2)
    with pytest.raises(ValueError, match="dcn_mesh data=3 does not divide mesh data=4"):
        sharding.ici_shape(shape, sharding.MeshShape(3, 1))
    with pytest.raises(ValueError, match="asks for 16 slices but mesh data=4,fsdp=2 has only 8 devices"):
        sharding.ici_shape(shape, sharding.MeshShape(4, 4))
    with pytest.raises(ValueError, match="dcn_mesh must look like data=2,fsdp=4"):
        sharding.parse_mesh("model=2", "dcn_mesh")
    with pytest.raises(ValueError, match="dcn_mesh axis 'data' must be an integer >= 1"):
        sharding.parse_mesh("data=0", "dcn_mesh")
    with pytest.raises(ValueError, match="needs exactly 4 devices, got 8"):   # given devices: all of them
        sharding.make_mesh(sharding.MeshShape(2, 2), jax.devices(), dcn=sharding.MeshShape(2, 1))
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(sharding.MeshShape(4, 4), dcn=sharding.MeshShape(2, 1))
    with pytest.raises(ValueError, match="TrainConfig.dcn_mesh='data=2' needs a mesh"):
        TrainConfig(dcn_mesh="data=2")
    with pytest.raises(ValueError, match="TrainConfig.dcn_mesh fsdp=2 does not divide mesh fsdp=1"):
        TrainConfig(mesh="data=4", dcn_mesh="fsdp=2")
    with pytest.raises(ValueError, match="TrainConfig.dcn_mesh must look like"):
        TrainConfig(devices=4, dcn_mesh="slices=2")
    assert TrainConfig(devices=4, dcn_mesh="fsdp=2").dcn_mesh == "fsdp=2"   # devices=N is the mesh fsdp=N


def test_cli_dcn_mesh_flag_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--mesh", "data=4,fsdp=2", "--dcn-mesh", "pods=2"])
    assert exit_info.value.code == 2
    assert "--dcn-mesh must look like data=2,fsdp=4" in capsys.readouterr().err
    # valid flags, inconsistent together: TrainConfig's error, exit status 2 (checked before any training)
    assert main(["train", "--mesh", "data=4,fsdp=2", "--dcn-mesh", "data=3", "--steps", "1"]) == 2
    assert "dcn_mesh data=3 does not divide mesh data=4" in capsys.readouterr().err


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return Trainer(TrainConfig(out=str(tmp_path_factory.mktemp("single")), **BASE)).run()


@pytest.mark.parametrize("mesh, dcn, strategy", [("data=4,fsdp=2", "data=2", "gspmd"),
                                                  ("data=2,fsdp=4", "fsdp=2", "explicit")])
def test_training_on_a_hybrid_mesh_equals_one_device(single, tmp_path, mesh, dcn, strategy):
    trainer = Trainer(TrainConfig(out=str(tmp_path), mesh=mesh, dcn_mesh=dcn, strategy=strategy, **BASE))
    assert trainer.mesh.devices.tolist() == sharding.make_mesh(sharding.parse_mesh(mesh),
                                                               dcn=sharding.parse_mesh(dcn)).devices.tolist()
    result = trainer.run()
    for x, y in zip(jax.tree.leaves(result.params), jax.tree.leaves(single.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert result.epsilon == pytest.approx(single.epsilon, rel=1e-3)

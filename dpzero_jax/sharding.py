"""ZeRO-style sharding of the DP training state over a ``("data", "fsdp")`` device mesh (GSPMD strategy).

Mesh
    ``make_mesh(data, fsdp)``: ``data * fsdp`` devices in a 2-D mesh. The batch is split over BOTH axes (every
    device holds ``B / (data * fsdp)`` examples); model state is split over ``fsdp`` only and replicated over
    ``data``.

Parameter rule (:func:`weight_spec`)
    A weight is split on ONE dimension over ``fsdp``: its largest dimension divisible by the ``fsdp`` size (the
    first of equal ones). Tensors with fewer than ``min_shard_elements`` elements (biases, norm scales) and tensors
    with no divisible dimension stay replicated. The rule depends on the shape only, so optimizer-state leaves
    (Adam's moments have their parameter's shape) follow their parameter by shape; scalar leaves (step counts) are
    replicated.

ZeRO stages (paper 000 §2.2; Rajbhandari et al.)
    ==========  ==================  =====================  =====================
    stage       parameters          gradients              optimizer state
    ==========  ==================  =====================  =====================
    1           replicated          replicated (all-red.)  sharded
    2           replicated          sharded (reduce-scat.) sharded
    3           sharded             sharded (reduce-scat.) sharded
    ==========  ==================  =====================  =====================

    The trainer compiles ONE ``jax.jit`` step with these ``in_shardings`` / ``out_shardings`` (donating the state)
    and constrains the gradient to its stage's layout; XLA's SPMD partitioner inserts the all-gathers and
    reduce-scatters. The private gradient adds its noise to the already-sharded clipped sum with the
    partitionable noise generator (``DPConfig.noise_rng="partitionable"``), so each coordinate is drawn once, by its
    owner, and the same key gives the same noise on any number of devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["MeshShape", "ShardingRules", "make_mesh", "parse_mesh", "weight_spec"]

AXES = ("data", "fsdp")
BATCH_AXES = ("data", "fsdp")
ZERO_STAGES = (1, 2, 3)
DEFAULT_MIN_SHARD_ELEMENTS = 1024


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the ``data`` and ``fsdp`` mesh axes."""

    data: int = 1
    fsdp: int = 1

    def __post_init__(self):
        for name in ("data", "fsdp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh axis {name!r} must be an integer >= 1, got {value!r}")

    @property
    def size(self) -> int:
        return self.data * self.fsdp


def parse_mesh(text: str) -> MeshShape:
    """``"data=2,fsdp=4"`` (either axis may be omitted: size 1) -> :class:`MeshShape`."""
    sizes = {}
    for part in str(text).split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in AXES or name in sizes:
            raise ValueError(f"mesh must look like data=2,fsdp=4 (axes {AXES}, each at most once), got {text!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {name!r} needs an integer size, got {value!r}") from None
    return MeshShape(**sizes)


def make_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "fsdp")`` mesh over the first ``shape.size`` devices (default: ``jax.devices()``)."""
    devices = list(jax.devices() if devices is None else devices)
    if shape.size > len(devices):
        raise ValueError(f"mesh data={shape.data} x fsdp={shape.fsdp} needs {shape.size} devices, "
                         f"only {len(devices)} {devices[0].platform} device(s) exist")
    return Mesh(np.asarray(devices[: shape.size]).reshape(shape.data, shape.fsdp), AXES)


def weight_spec(shape: tuple[int, ...], fsdp: int, min_shard_elements: int = DEFAULT_MIN_SHARD_ELEMENTS
                ) -> PartitionSpec:
    """The :class:`PartitionSpec` of a parameter of ``shape`` when the ``fsdp`` axis has ``fsdp`` devices."""
    if fsdp == 1 or len(shape) == 0 or math.prod(shape) < min_shard_elements:
        return PartitionSpec()
    divisible = [(size, -axis) for axis, size in enumerate(shape) if size % fsdp == 0]
    if not divisible:
        return PartitionSpec()
    _, neg_axis = max(divisible)
    spec = [None] * len(shape)
    spec[-neg_axis] = "fsdp"
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Shardings of every piece of the training state for one mesh and ZeRO stage."""

    mesh: Mesh
    zero: int = 3
    min_shard_elements: int = DEFAULT_MIN_SHARD_ELEMENTS

    def __post_init__(self):
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero stage must be one of {ZERO_STAGES}, got {self.zero!r}")

    @property
    def fsdp(self) -> int:
        return self.mesh.shape["fsdp"]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def _sharded(self, tree):
        return jax.tree.map(lambda x: NamedSharding(self.mesh, weight_spec(np.shape(x), self.fsdp,
                                                                           self.min_shard_elements)), tree)

    def _replicated(self, tree):
        return jax.tree.map(lambda _: self.replicated, tree)

    def params(self, params):
        """Stage 3: sharded; stages 1-2: replicated."""
        return self._sharded(params) if self.zero == 3 else self._replicated(params)

    def grads(self, params):
        """Stages 2-3: sharded (reduce-scatter to the owner); stage 1: replicated (all-reduce)."""
        return self._sharded(params) if self.zero >= 2 else self._replicated(params)

    def opt_state(self, opt_state):
        """Sharded at every stage; each leaf follows the parameter of its shape, scalars replicated."""
        return self._sharded(opt_state)

    def batch(self, batch):
        """Leading (example) axis split over ``data`` and ``fsdp``."""
        return jax.tree.map(lambda x: NamedSharding(self.mesh, PartitionSpec(BATCH_AXES)), batch)

    def check_batch(self, slots: int) -> None:
        if slots % self.mesh.size:
            raise ValueError(f"batch slots {slots} must be divisible by the mesh's {self.mesh.size} devices")

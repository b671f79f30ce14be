"""The mesh's options, without JAX: ``MeshShape`` and its parser, and the option groups of ``TrainConfig`` that
describe a sharded (``MeshOptions``) and a multi-host (``DistributedOptions``) run. The mesh itself and the ZeRO
layouts are :mod:`dpzero_jax.sharding`'s."""

from __future__ import annotations

import dataclasses

from dpzero_jax.options import INVALID, Check, OptionGroup, boolean, choice, integer, option

AXES = ("data", "fsdp")
BATCH_AXES = ("data", "fsdp")
ZERO_STAGES = (1, 2, 3)
STRATEGIES = ("gspmd", "explicit")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the ``data`` and ``fsdp`` mesh axes (of the whole mesh, or of its DCN factor: :func:`make_mesh`)."""

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

    def __str__(self) -> str:
        return f"data={self.data},fsdp={self.fsdp}"


def parse_mesh(text: str, what: str = "mesh") -> MeshShape:
    """``"data=2,fsdp=4"`` (either axis may be omitted: size 1) -> :class:`MeshShape`; ``what`` names the option
    in the error (``"mesh"``, ``"dcn_mesh"``)."""
    sizes = {}
    for part in str(text).split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in AXES or name in sizes:
            raise ValueError(f"{what} must look like data=2,fsdp=4 (axes {AXES}, each at most once), got {text!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"{what} axis {name!r} needs an integer size, got {value!r}") from None
        if sizes[name] < 1:
            raise ValueError(f"{what} axis {name!r} must be an integer >= 1, got {value!r}")
    return MeshShape(**sizes)


def _accept_mesh(value, name):
    if not isinstance(value, str):
        return INVALID
    parse_mesh(value, name)
    return value


MESH = Check("a string like 'data=2,fsdp=4'", _accept_mesh)


def _accept_address(value, name):
    host, sep, port = str(value).rpartition(":")
    return value if isinstance(value, str) and sep and host and port.isdigit() else INVALID


def ici_shape(shape: MeshShape, dcn: MeshShape) -> MeshShape:
    """The per-slice (ICI) part of a mesh ``shape`` of which ``dcn`` is the DCN part: ``shape / dcn`` axis by
    axis. Errors: more slices than devices, or a DCN size that does not divide its axis."""
    if dcn.size > shape.size:
        raise ValueError(f"dcn_mesh {dcn} asks for {dcn.size} slices but mesh {shape} has only {shape.size} "
                         f"devices")
    for name in AXES:
        whole, across = getattr(shape, name), getattr(dcn, name)
        if whole % across:
            raise ValueError(f"dcn_mesh {name}={across} does not divide mesh {name}={whole}: the mesh is "
                             f"(devices per slice) x (slices) on every axis, so {name} must be a multiple of {across}")
    return MeshShape(shape.data // dcn.data, shape.fsdp // dcn.fsdp)


@dataclasses.dataclass(frozen=True)
class MeshOptions(OptionGroup):
    """A training run's device mesh (a group of ``TrainConfig``): ``mesh`` as ``"data=2,fsdp=4"``
    (:func:`parse_mesh`); ``devices=N`` alone means ``data=1,fsdp=N``; ``dcn_mesh``: a multi-slice run's DCN factor
    (:func:`ici_shape`); ``zero``: the ZeRO stage; ``strategy``: ``"gspmd"`` or ``"explicit"``
    (:func:`explicit_gradient`). None for both ``mesh`` and ``devices``: one device, no mesh."""

    GROUP = "mesh"

    devices: int | None = option(None, integer(1).or_none(),
                                 "train over N devices, ZeRO-sharded (N virtual CPU devices without an accelerator)")
    mesh: str | None = option(None, MESH.or_none(), "device mesh, e.g. data=2,fsdp=4 (default with --devices N: "
                              "fsdp=N)")
    dcn_mesh: str | None = option(None, MESH.or_none(),
                                  "multi-slice runs: slices each --mesh axis spans over the data-centre network, e.g. "
                                  "data=2 (a hybrid ICI x DCN mesh; without a TPU slice_index a slice is a run of "
                                  "consecutive devices)")
    zero: int = option(3, choice(ZERO_STAGES, int), "ZeRO stage (default 3)")
    strategy: str = option("gspmd", choice(STRATEGIES), "gspmd: one jit with shardings (default); explicit: "
                           "shard_map with all-gather / reduce-scatter written out")

    def mesh_shape(self) -> MeshShape | None:
        """The ``(data, fsdp)`` shape of ``mesh`` / ``devices`` (None: one device, no mesh)."""
        if self.mesh is None and self.devices is None:
            return None
        return parse_mesh(self.mesh) if self.mesh is not None else MeshShape(data=1, fsdp=self.devices)

    def _check_group(self, owner: str) -> None:
        if self.mesh is not None and self.devices is not None and self.devices != parse_mesh(self.mesh).size:
            raise ValueError(f"{owner}.devices={self.devices} does not match mesh {self.mesh!r} "
                             f"({parse_mesh(self.mesh).size} devices)")
        if self.dcn_mesh is not None:
            if self.mesh is None and self.devices is None:
                raise ValueError(f"{owner}.dcn_mesh={self.dcn_mesh!r} needs a mesh (mesh= or devices=) to split "
                                 "into slices")
            try:
                ici_shape(MeshOptions.mesh_shape(self), parse_mesh(self.dcn_mesh, "dcn_mesh"))
            except ValueError as error:
                raise ValueError(f"{owner}.{error}") from None


@dataclasses.dataclass(frozen=True)
class DistributedOptions(OptionGroup):
    """A multi-host run (a group of ``TrainConfig``; :func:`dpzero_jax.train.init_distributed`):
    ``distributed=True`` alone lets ``jax.distributed.initialize`` detect SLURM, Open MPI or a TPU pod; a
    ``coordinator`` ``"HOST:PORT"`` with ``num_processes`` and ``process_id`` sets them explicitly."""

    GROUP = "multi-host"
    HELP = "every process runs the same command"

    distributed: bool = option(False, boolean(),
                               "initialise jax.distributed, detecting SLURM / Open MPI / TPU pod settings")
    coordinator: str | None = option(None, Check("'HOST:PORT'", _accept_address).or_none(),
                                     "HOST:PORT of process 0 (with --num-processes and --process-id)")
    num_processes: int | None = option(None, integer(1).or_none())
    process_id: int | None = option(None, integer(0).or_none())

    def _check_group(self, owner: str) -> None:
        explicit = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in explicit):
            if any(v is None for v in explicit):
                raise ValueError(f"{owner}: coordinator, num_processes and process_id go together (set all three, "
                                 "or none and distributed=True to detect them)")
            if self.process_id >= self.num_processes:
                raise ValueError(f"{owner}.process_id must be an integer in [0, {self.num_processes}), got "
                                 f"{self.process_id!r}")

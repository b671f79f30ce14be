"""ZeRO-style sharding of the DP training state over a ``("data", "fsdp")`` device mesh (GSPMD strategy).

Mesh
    ``make_mesh(data, fsdp)``: ``data * fsdp`` devices in a 2-D mesh, placed by :func:`jax.make_mesh` (in the
    order of the physical topology). The batch is split over BOTH axes (every device holds ``B / (data * fsdp)``
    examples); model state is split over ``fsdp`` only and replicated over ``data``. Multi-slice runs (several TPU
    slices, or hosts joined by a slower data-centre network) take a hybrid ICI x DCN mesh: ``dcn`` says how many
    slices each axis spans (``make_mesh(MeshShape(4, 2), dcn=MeshShape(data=2))``: two slices of ``data=2,fsdp=2``
    side by side along ``data``); see :func:`make_mesh` and :func:`slices_of` for the placement.

Parameter rule (:func:`weight_spec`)
    A weight is split on ONE dimension over ``fsdp``: of its dimensions divisible by the ``fsdp`` size, preferably one
    whose shards keep a dimension that fills the TPU's 128 lanes (``[48, 1600, 6400]`` on 64 devices splits ``1600``:
    shards ``[48, 25, 6400]`` pad nothing, ``[48, 1600, 100]`` would pad ``1600`` to ``1664``;
    :mod:`dpzero_jax.shard_layout`), then the largest, then the first. Tensors with fewer than ``min_shard_elements``
    elements (biases, norm scales) and tensors with no divisible dimension stay replicated. The rule depends on the
    shape only, so optimizer-state leaves (Adam's moments have their parameter's shape) follow their parameter by
    shape; scalar leaves (step counts) are replicated.

ZeRO stages (paper 000 §2.2; Rajbhandari et al.)
    ==========  ==================  =====================  =====================
    stage       parameters          gradients              optimizer state
    ==========  ==================  =====================  =====================
    1           replicated          replicated (all-red.)  sharded
    2           replicated          sharded (reduce-scat.) sharded
    3           sharded             sharded (reduce-scat.) sharded
    ==========  ==================  =====================  =====================

    Strategy ``"gspmd"``: the trainer compiles ONE ``jax.jit`` step with these ``in_shardings`` /
    ``out_shardings`` (donating the state) and constrains the gradient to its stage's layout; XLA's SPMD
    partitioner inserts the all-gathers and reduce-scatters (and decides what to communicate).
    The private gradient adds its noise to the already-sharded clipped sum with the
    partitionable noise generator (``DPConfig.noise_rng="partitionable"``), so each coordinate is drawn once, by its
    owner, and the same key gives the same noise on any number of devices.

    Strategy ``"explicit"`` (:func:`explicit_gradient`, paper 003): the gradient is computed inside
    ``jax.shard_map`` with the collectives written out. Each device computes the clipped per-example gradient SUM
    of its own examples with the ordinary engine (no communication for norms and clipping: they are per example).
    At stage 3 the parameters stay shards (:class:`ShardLayout`): each layer all-gathers its weights over ``fsdp``
    just before use, lets the copy go, gathers them again in the backward pass, and reduce-scatters its clipped
    weight gradient to the owner (``psum_scatter`` over ``fsdp``) as soon as the layer's backward has formed it
    (engine modes ``bk``, ``ghost``, ``fused``; ``vmap`` differentiates per example and gathers every weight
    first). ``dpzero_jax`` layers gather in their own ``custom_vjp``; any other model is gathered by the
    traced-program front-end at each use of each leaf (:mod:`dpzero_jax.program.zero3`; inside a scan, one
    iteration's slice at a time). At stages 1-2 parameters are whole on every device and the summed gradients go
    to their owners after the local backward (``psum_scatter`` at stage 2, ``psum`` at stage 1). Everything is
    then summed over ``data``; noise, normalisation and the optax update run on the owner's shard only
    (elementwise; no communication). The collectives are those of non-private ZeRO
    (:func:`explicit_mean_gradient`): the DP step and the non-private step differ only in the local computation
    (``ghost`` mode gathers each weight once more: it has two backward passes).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dpzero_jax import noise, spmd
from dpzero_jax import tape as tape_lib
from dpzero_jax.engine import clipped_grad_sum, leaf_paths, make_plan
from dpzero_jax.frozen_shards import FrozenShards, bind_frozen_shards
from dpzero_jax.layer_plan import used_outside_layers, whole_shapes
from dpzero_jax.mesh_options import (  # noqa: F401  (the mesh's options, re-exported)
    AXES,
    BATCH_AXES,
    MESH,
    STRATEGIES,
    ZERO_STAGES,
    DistributedOptions,
    MeshOptions,
    MeshShape,
    ici_shape,
    parse_mesh,
)
from dpzero_jax.program import gathered as program_gathered
from dpzero_jax.shard_layout import DEFAULT_MIN_SHARD_ELEMENTS, DEFAULT_SUM_CHUNK_BYTES, shard_axis
from dpzero_jax.sketch import finite_zero

__all__ = ["MeshShape", "ShardLayout", "ShardingRules", "explicit_apply", "explicit_gradient",
           "explicit_mean_gradient", "explicit_private_gradient", "ici_shape", "make_mesh", "parse_mesh",
           "slices_of", "weight_spec"]


def _auto_mesh(devices: np.ndarray) -> Mesh:
    # Auto axes: GSPMD propagates the shardings (jax.make_mesh's own default is Explicit)
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def slices_of(devices: Sequence[jax.Device], count: int) -> list[list[jax.Device]]:
    """``devices`` grouped into ``count`` slices (the units joined by the slower DCN network).

    TPU multi-slice devices carry ``slice_index``: when the devices have ``count`` distinct values, those are the
    slices (sorted by index). Otherwise (CPU and GPU devices, which have no ``slice_index``, or one TPU slice) a
    slice is a run of ``len(devices) / count`` consecutive devices in ``(process_index, id)`` order -- on a
    multi-host GPU cluster with one slice per host, each process's devices; on virtual CPU devices, consecutive ids.
    Devices whose ``slice_index`` values form another number of slices are refused.
    """
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    if count < 1 or len(devices) % count:
        raise ValueError(f"{len(devices)} devices cannot form {count} slices of equal size")
    indices = {getattr(d, "slice_index", None) for d in devices}
    if None not in indices and len(indices) > 1:
        if len(indices) != count:
            raise ValueError(f"dcn_mesh asks for {count} slices but the devices form {len(indices)} slices "
                             f"(slice_index {sorted(indices)})")
        return [[d for d in devices if d.slice_index == index] for index in sorted(indices)]
    per_slice = len(devices) // count
    return [devices[i * per_slice:(i + 1) * per_slice] for i in range(count)]


def make_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None, dcn: MeshShape | None = None) -> Mesh:
    """A ``("data", "fsdp")`` mesh of ``shape.size`` devices (default: the first of ``jax.devices()``).

    Without ``dcn``: devices placed by :func:`jax.make_mesh`, which follows the physical topology (TPU torus
    rings; elsewhere the device order), with ``Auto`` axes. Devices spanning several TPU slices need ``dcn``.

    With ``dcn`` (a hybrid ICI x DCN mesh for multi-slice runs): the devices form ``dcn.size`` slices
    (:func:`slices_of`); each slice is an ICI mesh of shape ``ici_shape(shape, dcn)`` (topology-aware inside the
    slice, :func:`jax.experimental.mesh_utils.create_device_mesh`) and the slices are tiled along the axes that
    ``dcn`` splits: ``mesh.devices[a * I_d + i, b * I_f + j]`` is position ``(i, j)`` of slice ``a * dcn.fsdp + b``
    (``I`` = the ICI sizes). So the collectives along an axis stay inside a slice except over the DCN factor, e.g.
    ``dcn=data=2``: the ``fsdp`` all-gathers and reduce-scatters never leave a slice; only the gradient sum over
    ``data`` crosses DCN.
    """
    from jax.experimental import mesh_utils

    default = devices is None
    devices = list(jax.devices() if default else devices)
    if shape.size > len(devices):
        raise ValueError(f"mesh {shape} needs {shape.size} devices, "
                         f"only {len(devices)} {devices[0].platform} device(s) exist")
    if dcn is None:
        if len({getattr(d, "slice_index", 0) for d in devices[: shape.size]}) > 1:
            raise ValueError(f"mesh {shape} spans several TPU slices: give the slices' DCN share with dcn_mesh "
                             f"(--dcn-mesh, e.g. data=2)")
        mesh = jax.make_mesh((shape.data, shape.fsdp), AXES, devices=devices[: shape.size])
        return _auto_mesh(mesh.devices)
    ici = ici_shape(shape, dcn)
    if shape.size != len(devices):
        if not default:
            raise ValueError(f"a hybrid mesh {shape} (dcn_mesh {dcn}) needs exactly {shape.size} devices, "
                             f"got {len(devices)}")
        devices = devices[: shape.size]
    slices = slices_of(devices, dcn.size)
    blocks = [mesh_utils.create_device_mesh((ici.data, ici.fsdp), group, allow_split_physical_axes=True)
              for group in slices]
    tiled = np.block([[blocks[a * dcn.fsdp + b] for b in range(dcn.fsdp)] for a in range(dcn.data)])
    return _auto_mesh(tiled)


def weight_spec(shape: tuple[int, ...], fsdp: int, min_shard_elements: int = DEFAULT_MIN_SHARD_ELEMENTS
                ) -> PartitionSpec:
    """The :class:`PartitionSpec` of a parameter of ``shape`` when the ``fsdp`` axis has ``fsdp`` devices: split on
    :func:`dpzero_jax.shard_layout.shard_axis` (a divisible dimension whose shards fill the TPU's lanes, then the
    largest), or replicated."""
    axis = shard_axis(shape, fsdp, min_shard_elements)
    if axis is None:
        return PartitionSpec()
    spec = [None] * len(shape)
    spec[axis] = "fsdp"
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Shardings of every piece of the training state for one mesh and ZeRO stage."""

    mesh: Mesh
    zero: int = 3
    min_shard_elements: int = DEFAULT_MIN_SHARD_ELEMENTS
    # At stage 3, a lookup table's clipped sum (float32) larger than this is formed and reduce-scattered to its
    # owners in pieces of at most this many bytes (the whole sum and its reduction's output never exist at once:
    # ``docs/benchmarks/tpu_aot.md``, "Why those two layer-wise steps held more"): in ``shard_map`` under the
    # explicit strategy, by constraining each piece to the table's split under GSPMD (:meth:`gspmd_hint`).
    sum_chunk_bytes: int = DEFAULT_SUM_CHUNK_BYTES

    def __post_init__(self):
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero stage must be one of {ZERO_STAGES}, got {self.zero!r}")
        if (isinstance(self.sum_chunk_bytes, bool) or not isinstance(self.sum_chunk_bytes, (int, np.integer))
                or self.sum_chunk_bytes < 1):
            raise ValueError(f"sum_chunk_bytes must be a positive number of bytes, got {self.sum_chunk_bytes!r}")

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

    def gspmd_hint(self):
        """The context a GSPMD step traces its gradient in (:func:`dpzero_jax.spmd.batch_sharded`): activations
        split over the batch and, at stage 3, large lookup tables' clipped sums formed in pieces of at most
        ``sum_chunk_bytes`` (:class:`dpzero_jax.spmd.TableSums`)."""
        tables = spmd.TableSums(self.sum_chunk_bytes, self.min_shard_elements) if self.zero == 3 else None
        return spmd.batch_sharded(self.mesh, BATCH_AXES, tables)

    def batch(self, batch):
        """Leading (example) axis split over ``data`` and ``fsdp``."""
        return jax.tree.map(lambda x: NamedSharding(self.mesh, PartitionSpec(BATCH_AXES)), batch)

    def check_batch(self, slots: int) -> None:
        if slots % self.mesh.size:
            raise ValueError(f"batch slots {slots} must be divisible by the mesh's {self.mesh.size} devices")


def _fsdp_dim(spec: PartitionSpec) -> int | None:
    """The dimension a :func:`weight_spec` splits over ``fsdp`` (None: replicated)."""
    for dim, axis in enumerate(spec):
        if axis == "fsdp":
            return dim
    return None


def _specs(shardings):
    """The ``PartitionSpec`` tree of a tree of ``NamedSharding`` (``shard_map``'s in/out specs)."""
    return jax.tree.map(lambda sharding_: sharding_.spec, shardings)


def _all_gather(shard, dim: int):
    return jax.lax.all_gather(shard, "fsdp", axis=dim, tiled=True)


def _reduce_scatter(grad, dim: int):
    return jax.lax.psum_scatter(grad, "fsdp", scatter_dimension=dim, tiled=True)


class ShardLayout:
    """ZeRO-3 parameters inside ``jax.shard_map``: which leaves arrive as ``fsdp`` shards and how to make them whole
    (the :class:`dpzero_jax.tape.ParamLayout` the engine's tapes use to gather layer by layer).

    ``params``: the whole parameters (arrays or ``ShapeDtypeStruct``), ``rules``: the mesh's rules. A leaf that
    :func:`weight_spec` splits on dimension ``d`` arrives as ``[.., n_d / fsdp, ..]``; ``gather`` is
    ``all_gather(tiled=True)`` over ``fsdp`` on ``d``, ``scatter`` is ``psum_scatter(tiled=True)`` over ``fsdp`` on
    ``d`` (the sum over the ``fsdp`` devices of their whole-weight gradients, each device keeping its shard). Other
    leaves are whole on every device: identity.
    """

    def __init__(self, rules: ShardingRules, params):
        paths = leaf_paths(params)
        leaves = jax.tree.leaves(params)
        self._full = {path: jax.ShapeDtypeStruct(tuple(np.shape(leaf)), jnp.result_type(leaf))
                      for path, leaf in zip(paths, leaves)}
        dims = {path: _fsdp_dim(weight_spec(struct.shape, rules.fsdp, rules.min_shard_elements))
                for path, struct in self._full.items()}
        self._dims = {path: dim for path, dim in dims.items() if dim is not None}
        self.sum_chunk_bytes = rules.sum_chunk_bytes
        self._constants: dict = {}   # id(whole stand-in) -> (stand-in, shard, dim): with_constants

    def with_constants(self, entries) -> ShardLayout:
        """A copy that also knows the whole stand-ins of ``entries`` ``[(stand-in, shard, dim)]``
        (:meth:`constant`)."""
        layout = copy.copy(self)
        layout._constants = {**self._constants, **{id(entry[0]): tuple(entry) for entry in entries}}
        return layout

    def constant(self, value):
        """``(shard, dim)`` when ``value`` is the whole stand-in of a frozen variable's shard
        (:class:`dpzero_jax.frozen_shards.FrozenShards`), which the traced program's interpreter then holds as the
        shard and gathers at its uses; else None."""
        entry = self._constants.get(id(value))
        return None if entry is None or entry[0] is not value else entry[1:]

    def gathers(self, path: str) -> bool:
        return path in self._dims

    def dim(self, path: str) -> int | None:
        """The dimension the leaf is split on over ``fsdp`` (None: whole on every device)."""
        return self._dims.get(path)

    def full(self, path: str) -> jax.ShapeDtypeStruct:
        return self._full[path]

    def gather(self, path: str, shard, after):
        """The whole weight, gathered once ``after`` exists: ``shard + 0`` computed from one entry of ``after``
        (:func:`dpzero_jax.sketch.finite_zero`). Without that data dependency XLA hoists every layer's gather to the
        start of the program, or merges a backward pass's gather with the forward's, keeping whole weights alive
        (``lax.optimization_barrier`` is removed before XLA:CPU's scheduling and common-subexpression passes)."""
        dim = self._dims.get(path)
        if dim is None:
            return shard
        return _all_gather(shard + finite_zero(after).astype(shard.dtype), dim)

    def scatter(self, path: str, grad):
        dim = self._dims.get(path)
        return grad if dim is None else _reduce_scatter(grad, dim)


def explicit_gradient(local_sum, rules: ShardingRules, params, *, gather_by_layer: bool = False,
                      per_example_outputs: int = 0):
    """The ``explicit`` strategy's gradient: ``fn(params, batch, mask, *replicated) -> (losses [B], summed_grads,
    *per_example)``.

    ``replicated``: further inputs every device receives whole (e.g. adaptive clipping's thresholds ``[M]``);
    ``per_example_outputs``: how many further outputs ``local_sum`` returns with the batch as leading axis (e.g.
    the per-example norms), gathered in the batch layout like the losses.

    ``local_sum(params, batch_shard, mask_shard) -> (losses [b], grad_sum)`` computes, on one device, the gradient
    SUM over its own ``b = B / (data * fsdp)`` examples (for DP: the clipped sum, no noise). ``params`` (arrays or
    ``ShapeDtypeStruct``) give the whole shapes. The returned function runs ``local_sum`` in ``jax.shard_map`` over
    ``rules.mesh``:

    * stage 3 with ``gather_by_layer``: ``local_sum`` receives the shards (``[.., d / fsdp, ..]``) and must gather
      each weight where its layer uses it and return each sharded weight's gradient already reduce-scattered over
      ``fsdp`` (the engine does both given a :class:`ShardLayout`); it is then summed over ``data``;
    * otherwise ``local_sum`` receives whole weights: at stage 3 each is all-gathered over ``fsdp`` before the call
      (``all_gather(tiled=True)``); stages 1-2 hold whole copies. After it, each gradient leaf of a weight that the
      stage shards is reduce-scattered to its owner over ``fsdp`` (stages 2-3; ``psum_scatter(tiled=True)`` on the
      weight's sharded dimension) and summed over ``data``; at stage 1 and for replicated tensors it is summed over
      both axes (all-reduce).

    The summed gradient comes out in the stage's gradient layout (:meth:`ShardingRules.grads`); losses keep the
    batch layout. Call it inside ``jax.jit``. ``fn(..., frozen=tree)``: the frozen variables (whole shapes, laid out
    by :meth:`ShardingRules.params`) enter the ``shard_map`` as shards and reach ``local_sum`` as
    ``frozen=FrozenShards`` (without it, ``local_sum`` is called without that keyword).
    """
    mesh = rules.mesh
    param_specs, grad_specs = _specs(rules.params(params)), _specs(rules.grads(params))
    batch_spec = PartitionSpec(BATCH_AXES)
    by_layer = gather_by_layer and rules.zero == 3

    def gather(shard, spec):
        dim = _fsdp_dim(spec)
        return shard if dim is None or by_layer else _all_gather(shard, dim)

    def reduce(grad, spec):
        dim = _fsdp_dim(spec)
        if dim is None:
            return jax.lax.psum(grad, AXES)
        if by_layer:  # already reduce-scattered over fsdp by its layer
            return jax.lax.psum(grad, "data")
        return jax.lax.psum(_reduce_scatter(grad, dim), "data")

    def gradient(params, batch, mask, *replicated, frozen=None):
        batch_specs = jax.tree.map(lambda _: batch_spec, batch)
        frozen_specs, dims = _frozen_specs(rules, frozen)

        def local(params, batch, mask, frozen_shards, *replicated):
            extra = {} if frozen is None else {"frozen": FrozenShards(frozen_shards, dims)}
            losses, grad_sum, *per_example = local_sum(jax.tree.map(gather, params, param_specs), batch, mask,
                                                       *replicated, **extra)
            return (losses, jax.tree.map(reduce, grad_sum, grad_specs), *per_example)

        sharded = jax.shard_map(local, mesh=mesh,
                                in_specs=(param_specs, batch_specs, batch_spec, frozen_specs,
                                          *[PartitionSpec()] * len(replicated)),
                                out_specs=(batch_spec, grad_specs, *[batch_spec] * per_example_outputs),
                                check_vma=False)
        return sharded(params, batch, jnp.asarray(mask), {} if frozen is None else frozen, *replicated)

    return gradient


def _frozen_specs(rules: ShardingRules, frozen) -> tuple:
    """``(in_specs, split dimension per leaf)`` of the frozen variables as they enter a ``shard_map`` (``{}`` and
    ``[]`` for None): laid out as the parameters are."""
    specs = {} if frozen is None else _specs(rules.params(frozen))
    return specs, [_fsdp_dim(spec) for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))]


def explicit_private_gradient(loss_fn, cfg, rules: ShardingRules, params, *, gather_by_layer: bool = True,
                              adaptive: bool = False):
    """The private gradient under the explicit strategy: ``fn(params, batch, key, mask) -> (losses [B], grads)``;
    with ``adaptive``, ``fn(params, batch, key, mask, thresholds [M]) -> (losses [B], grads, norms [B] or [B, M])``
    (adaptive clipping: the thresholds enter every device whole, the per-example norms come back in the batch
    layout, the noise scale is ``cfg.noise_multiplier * ||thresholds||``).

    Each device computes the clipped sum of its examples with the engine (:func:`dpzero_jax.engine.clipped_grad_sum`;
    at stage 3 on the shards, gathering layer by layer through a :class:`ShardLayout` -- except in ``vmap`` mode or
    with ``gather_by_layer=False``, which gather every weight first), :func:`explicit_gradient` brings the sums to
    their owners, and :func:`dpzero_jax.noise.add_noise_and_normalise` with the partitionable generator noises each
    owner's shard -- the same call as the one-device path, so the update is the same on any device count. ``cfg``
    is a :class:`~dpzero_jax.config.DPConfig` with ``expected_batch_size`` set. ``fn(..., frozen=tree)``: the
    frozen variables as the step's (sharded) arguments, for a ``loss_fn(params, batch, frozen=...)``; each device
    receives its shards (:class:`dpzero_jax.frozen_shards.FrozenShards`).
    """
    by_layer = gather_by_layer and rules.zero == 3 and cfg.mode != "vmap"
    layout = ShardLayout(rules, params) if by_layer else None

    def clipped(p, b, m, thresholds=None, frozen=None):
        loss, held = bind_frozen_shards(loss_fn, layout, frozen)
        return clipped_grad_sum(loss, cfg, layout=held)(p, b, m, thresholds=thresholds)

    if adaptive:
        def local_adaptive(p, b, m, thresholds, frozen=None):
            losses, sums, stats = clipped(p, b, m, thresholds, frozen)
            return losses, sums, stats.norms

        summed_adaptive = explicit_gradient(local_adaptive, rules, params, gather_by_layer=by_layer,
                                            per_example_outputs=1)

        def adaptive_gradient(params, batch, key, mask, thresholds, frozen=None):
            losses, sums, norms = summed_adaptive(params, batch, mask, thresholds, frozen=frozen)
            std = noise.noise_std(cfg.noise_multiplier, thresholds)
            return losses, noise.add_noise_and_normalise(sums, key, std, cfg.expected_batch_size,
                                                         "partitionable"), norms

        return adaptive_gradient
    summed = explicit_gradient(lambda p, b, m, frozen=None: clipped(p, b, m, frozen=frozen)[:2], rules, params,
                               gather_by_layer=by_layer)

    def gradient(params, batch, key, mask, frozen=None):
        losses, sums = summed(params, batch, mask, frozen=frozen)
        loss = loss_fn if frozen is None else functools.partial(loss_fn, frozen=frozen)
        thresholds = make_plan(loss, cfg, params, batch, require_supported=False).thresholds  # static
        std = noise.noise_std(cfg.noise_multiplier, thresholds)
        return losses, noise.add_noise_and_normalise(sums, key, std, cfg.expected_batch_size, "partitionable")

    return gradient


def _gathering(layout: ShardLayout | None, params):
    """The tape that gathers the shards ``params`` layer by layer, or a null context without a layout."""
    if layout is None:
        return contextlib.nullcontext()
    ids = {id(leaf): path for leaf, path in zip(jax.tree.leaves(params), leaf_paths(params))}
    return tape_lib.active(tape_lib.GatherTape(ids, layout))


def explicit_mean_gradient(loss_fn, rules: ShardingRules, params, *, gather_by_layer: bool = True):
    """The non-private counterpart of :func:`explicit_private_gradient` (same collectives): the gradient of the
    masked mean loss, ``fn(params, batch, key, mask) -> (losses [B], grads)`` (``key`` unused). At stage 3 each
    layer gathers its weights just before use (:class:`dpzero_jax.tape.GatherTape`) and autodiff reduce-scatters
    their gradients. ``frozen=``: as for :func:`explicit_private_gradient`."""
    layout = ShardLayout(rules, params) if gather_by_layer and rules.zero == 3 else None

    def local_sum(params, batch, mask, frozen=None):
        loss, held = bind_frozen_shards(loss_fn, layout, frozen)
        if held is not None and _uses_outside_layers(loss, params, batch, held):
            return program_gathered.mean_gradient_sum(loss, params, batch, mask, held)

        def total(p):
            with _gathering(held, p):
                losses = loss(p, batch)
            return jnp.sum(losses * mask.astype(losses.dtype)), losses
        (_, losses), grads = jax.value_and_grad(total, has_aux=True)(params)
        return losses, grads

    summed = explicit_gradient(local_sum, rules, params, gather_by_layer=layout is not None)

    def gradient(params, batch, key, mask, frozen=None):
        losses, sums = summed(params, batch, mask, frozen=frozen)
        count = jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
        return losses, jax.tree.map(lambda g: (g.astype(jnp.float32) / count).astype(g.dtype), sums)

    return gradient


def _uses_outside_layers(fn, shards, inputs, layout) -> bool:
    """Whether ``fn(params, inputs)`` uses a leaf outside ``dpzero_jax`` layers (then its traced program is gathered
    use by use instead of layer by layer)."""
    return bool(used_outside_layers(fn, whole_shapes(shards, layout), inputs))


def explicit_apply(apply_fn, rules: ShardingRules, params):
    """``apply_fn(params, inputs) -> outputs [B, ...]`` (a forward pass) on the stage's parameter layout, batch split
    over the mesh: at stage 3 each weight is gathered just before use, as in the training step, instead of every
    weight at once (by its ``dpzero_jax`` layer, or at each use of the traced program for other models).
    ``apply(params, inputs, frozen=tree)`` for an ``apply_fn(params, inputs, frozen=...)``: the frozen variables
    enter as shards and are gathered likewise (:class:`dpzero_jax.frozen_shards.FrozenShards`)."""
    layout = ShardLayout(rules, params) if rules.zero == 3 else None
    param_specs = _specs(rules.params(params))
    batch_spec = PartitionSpec(BATCH_AXES)

    def apply(params, inputs, frozen=None):
        input_specs = jax.tree.map(lambda _: batch_spec, inputs)
        frozen_specs, dims = _frozen_specs(rules, frozen)

        def local(params, inputs, frozen_shards):
            fn, held = bind_frozen_shards(apply_fn, layout, None if frozen is None else FrozenShards(frozen_shards,
                                                                                                     dims))
            if held is not None and _uses_outside_layers(fn, params, inputs, held):
                return program_gathered.gathered_apply(fn, params, inputs, held)
            with _gathering(held, params):
                return fn(params, inputs)

        return jax.shard_map(local, mesh=rules.mesh, in_specs=(param_specs, input_specs, frozen_specs),
                             out_specs=batch_spec, check_vma=False)(params, inputs, {} if frozen is None else frozen)

    return apply

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

    Strategy ``"gspmd"``: the trainer compiles ONE ``jax.jit`` step with these ``in_shardings`` /
    ``out_shardings`` (donating the state) and constrains the gradient to its stage's layout; XLA's SPMD
    partitioner inserts the all-gathers and reduce-scatters (and decides what to communicate).
    The private gradient adds its noise to the already-sharded clipped sum with the
    partitionable noise generator (``DPConfig.noise_rng="partitionable"``), so each coordinate is drawn once, by its
    owner, and the same key gives the same noise on any number of devices.

    Strategy ``"explicit"`` (:func:`explicit_gradient`, paper 003): the gradient is computed inside
    ``jax.shard_map`` with the collectives written out. Each device all-gathers every weight it needs over ``fsdp``
    (stage 3; stages 1-2 hold full copies), computes the clipped per-example gradient SUM of its own examples with
    the ordinary engine (no communication inside: norms and clipping are per example), and sends each weight
    gradient to its owner with ``psum_scatter`` over ``fsdp`` (stages 2-3; a ``psum`` at stage 1 and for replicated
    tensors), summed over ``data``. Noise, normalisation and the optax update then run on the owner's shard only
    (elementwise; no communication). The collectives are exactly those of non-private ZeRO: the DP step and the
    non-private step differ only in the local computation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpzero_jax import noise
from dpzero_jax.engine import make_plan, private_value_and_grad

__all__ = ["MeshShape", "ShardingRules", "explicit_gradient", "explicit_mean_gradient", "explicit_private_gradient",
           "make_mesh", "parse_mesh", "weight_spec"]

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


def _fsdp_dim(spec: PartitionSpec) -> int | None:
    """The dimension a :func:`weight_spec` splits over ``fsdp`` (None: replicated)."""
    for dim, axis in enumerate(spec):
        if axis == "fsdp":
            return dim
    return None


def explicit_gradient(local_sum, rules: ShardingRules, params):
    """The ``explicit`` strategy's gradient: ``fn(params, batch, mask) -> (losses [B], summed_grads)``.

    ``local_sum(full_params, batch_shard, mask_shard) -> (losses [b], grad_sum)`` computes, on one device, the
    gradient SUM over its own ``b = B / (data * fsdp)`` examples (for DP: the clipped sum, no noise) with respect to
    full (unsharded) parameters. ``params`` (arrays or ``ShapeDtypeStruct``) give the shapes. The returned function
    runs ``local_sum`` in ``jax.shard_map`` over ``rules.mesh``:

    * stage 3: each sharded weight ``[.., d, ..]`` arrives as its ``[.., d / fsdp, ..]`` shard and is all-gathered
      over ``fsdp`` (``all_gather(tiled=True)``) before use; stages 1-2: parameters are replicated, no gather;
    * each gradient leaf of a sharded weight is reduce-scattered to its owner over ``fsdp`` (stages 2-3;
      ``psum_scatter(tiled=True)`` on the weight's sharded dimension) and summed over ``data``; at stage 1 and for
      replicated tensors it is summed over both axes (all-reduce).

    The summed gradient comes out in the stage's gradient layout (:meth:`ShardingRules.grads`); losses keep the
    batch layout. Call it inside ``jax.jit``.
    """
    mesh, fsdp = rules.mesh, rules.fsdp
    owner = jax.tree.map(lambda x: weight_spec(tuple(np.shape(x)), fsdp, rules.min_shard_elements), params)
    replicated = jax.tree.map(lambda _: PartitionSpec(), params)
    param_specs = owner if rules.zero == 3 else replicated
    grad_specs = owner if rules.zero >= 2 else replicated
    batch_spec = PartitionSpec(BATCH_AXES)

    def gather(shard, spec):
        dim = _fsdp_dim(spec)
        return shard if dim is None else jax.lax.all_gather(shard, "fsdp", axis=dim, tiled=True)

    def reduce(grad, spec):
        dim = _fsdp_dim(spec)
        if dim is None:
            return jax.lax.psum(grad, AXES)
        return jax.lax.psum(jax.lax.psum_scatter(grad, "fsdp", scatter_dimension=dim, tiled=True), "data")

    def local(params, batch, mask):
        full = jax.tree.map(gather, params, param_specs)
        losses, grad_sum = local_sum(full, batch, mask)
        return losses, jax.tree.map(reduce, grad_sum, grad_specs)

    def gradient(params, batch, mask):
        batch_specs = jax.tree.map(lambda _: batch_spec, batch)
        sharded = jax.shard_map(local, mesh=mesh, in_specs=(param_specs, batch_specs, batch_spec),
                                out_specs=(batch_spec, grad_specs), check_vma=False)
        return sharded(params, batch, jnp.asarray(mask))

    return gradient


def explicit_private_gradient(loss_fn, cfg, rules: ShardingRules, params):
    """The private gradient under the explicit strategy: ``fn(params, batch, key, mask) -> (losses [B], grads)``.

    Each device computes the clipped sum of its examples with the engine (``cfg`` with ``noise_multiplier=0`` and
    ``expected_batch_size=1``), :func:`explicit_gradient` brings the sums to their owners, and
    :func:`dpzero_jax.noise.add_noise_and_normalise` with the partitionable generator noises each owner's shard --
    the same call as the one-device path, so the update is the same on any device count. ``cfg`` is a
    :class:`~dpzero_jax.config.DPConfig` with ``expected_batch_size`` set.
    """
    clipped_sum = private_value_and_grad(loss_fn, cfg.replace(noise_multiplier=0.0, expected_batch_size=1.0))
    summed = explicit_gradient(lambda p, b, m: clipped_sum(p, b, jax.random.key(0), m)[:2],  # key unused: sigma 0
                               rules, params)

    def gradient(params, batch, key, mask):
        losses, sums = summed(params, batch, mask)
        thresholds = make_plan(loss_fn, cfg, params, batch).thresholds  # static: traced abstractly
        std = noise.noise_std(cfg.noise_multiplier, thresholds)
        return losses, noise.add_noise_and_normalise(sums, key, std, cfg.expected_batch_size, "partitionable")

    return gradient


def explicit_mean_gradient(loss_fn, rules: ShardingRules, params):
    """The non-private counterpart of :func:`explicit_private_gradient` (same collectives): the gradient of the
    masked mean loss, ``fn(params, batch, key, mask) -> (losses [B], grads)`` (``key`` unused)."""
    def local_sum(params, batch, mask):
        def total(p):
            losses = loss_fn(p, batch)
            return jnp.sum(losses * mask.astype(losses.dtype)), losses
        (_, losses), grads = jax.value_and_grad(total, has_aux=True)(params)
        return losses, grads

    summed = explicit_gradient(local_sum, rules, params)

    def gradient(params, batch, key, mask):
        losses, sums = summed(params, batch, mask)
        count = jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
        return losses, jax.tree.map(lambda g: (g.astype(jnp.float32) / count).astype(g.dtype), sums)

    return gradient

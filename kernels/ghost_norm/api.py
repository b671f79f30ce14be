"""Per-example norm kernels: one entry point per op, the implementation picked by backend, always behind a
``custom_vjp``.

Ops (shapes as in :mod:`dpzero_jax_kernels.ghost_norm.reference`):

* :func:`gram_sq_norm` -- ghost (Gram) form, dense left factor or int ids (embedding), optional cross term;
* :func:`instantiated_sq_norm` -- ``||left_i^T right_i||_F^2`` without ``[B, rows, cols]``;
* :func:`weighted_sum` -- the clipped sum ``sum_i c_i left_i^T right_i``.

``implementation``:

* ``"xla"`` -- the jnp reference (:mod:`.reference`);
* ``"pallas"`` -- the backend's kernel: Mosaic TPU on TPU; Mosaic GPU on GPU for 16-bit inputs (float32 inputs, and
  ``weighted_sum``, which is one GEMM XLA already runs at cuBLAS speed, stay on XLA there); on CPU the Mosaic TPU
  kernels run in Pallas' interpreter (``interpret=True``) -- slow, for tests;
* ``"pallas_tpu"`` / ``"pallas_gpu"`` -- a specific kernel family (with ``interpret`` to run it on CPU).

:func:`resolve` maps the user-facing choice ``"auto" | "xla" | "pallas"`` (``DPConfig.norm_kernel``) to ``"xla"`` or
``"pallas"``: ``"auto"`` is ``"xla"`` on every backend for now. On CPU the kernels can only be interpreted (slow); on
an H200 the GPU kernels were timed once, op by op (1.05-1.37x faster than XLA at T >= 2048,
``docs/benchmarks/gpu.md``), but not inside a step; on TPU not at all. ``auto`` must pick the faster.
``"pallas"`` is the choice when the ``[B, T, T]`` or ``[B, rows, cols]`` buffers are the memory peak.

Gradients: ``pallas_call`` has no transpose rule, so every kernel call sits behind a ``jax.custom_vjp`` whose backward
differentiates the XLA reference (the engine never differentiates a norm; this keeps ``jax.grad`` of a function of the
norms working). Inside ``jax.shard_map`` the kernels are batch-local: call them on the per-shard arrays.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from dpzero_jax_kernels.ghost_norm import reference

Array = jax.Array

NORM_KERNELS = ("auto", "xla", "pallas")
IMPLEMENTATIONS = ("xla", "pallas", "pallas_tpu", "pallas_gpu")


def resolve(norm_kernel: str, backend: str | None = None) -> str:
    """``"xla"`` or ``"pallas"`` for the user-facing ``norm_kernel`` (see the module docstring)."""
    if norm_kernel not in NORM_KERNELS:
        raise ValueError(f"norm_kernel={norm_kernel!r}: expected one of {NORM_KERNELS}")
    if norm_kernel == "auto":
        return "xla"
    return norm_kernel


def _is_16bit(*arrays) -> bool:
    return all(jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) for x in arrays)


def _family(implementation: str, backend: str | None) -> tuple[str, bool]:
    """``(family, interpret)`` with family ``"xla" | "tpu" | "gpu"``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
    backend = backend or jax.default_backend()
    if implementation == "xla":
        return "xla", False
    if implementation == "pallas_tpu":
        return "tpu", backend != "tpu"
    if implementation == "pallas_gpu":
        return "gpu", backend != "gpu"
    if backend == "tpu":
        return "tpu", False
    if backend == "gpu":
        return "gpu", False
    return "tpu", True


def _kernel_family(op: str, arrays, implementation: str, backend: str | None) -> tuple[str, bool]:
    """``(family, interpret)`` for ``op`` on these (floating) arrays: GPU has no ``weighted_sum`` kernel and its
    kernels take 16-bit inputs only; XLA is the fallback. Asking for ``"pallas"`` on a GPU with wider operands warns
    (once per message): the norms then run as XLA's, which a user who chose the kernels should know."""
    family, interpret = _family(implementation, backend)
    if family == "gpu" and op == "weighted_sum":
        return "xla", False
    if family == "gpu" and not _is_16bit(*arrays):
        dtypes = sorted({jnp.dtype(x.dtype).name for x in arrays})
        warnings.warn(f"norm kernel 'pallas' on a GPU: the Mosaic GPU kernels take 16-bit (bfloat16 / float16) "
                      f"operands, these are {', '.join(dtypes)}, so this per-example norm is computed by XLA instead "
                      "(build the model with a 16-bit compute dtype to use the kernels)", stacklevel=2)
        return "xla", False
    return family, interpret


def has_kernel(op: str, *arrays, implementation: str = "pallas", backend: str | None = None) -> bool:
    """Whether ``op`` (``"gram" | "instantiated" | "weighted_sum"``) on these floating-point arrays runs a Pallas
    kernel (rather than the XLA fallback) for ``implementation`` on ``backend``."""
    return _kernel_family(op, arrays, implementation, backend)[0] != "xla"


def _behind_custom_vjp(kernel, ref_fn, *args):
    """``kernel(*args)`` whose VJP is the VJP of ``ref_fn`` (same signature, pure jnp)."""

    @jax.custom_vjp
    def call(*args):
        return kernel(*args)

    def forward(*args):
        return kernel(*args), args

    def backward(args, cotangent):
        return jax.vjp(ref_fn, *args)[1](cotangent)

    call.defvjp(forward, backward)
    return call(*args)


def gram_sq_norm(left_u: Array, right_u: Array, left_v: Array | None = None, right_v: Array | None = None, *,
                 left_is_ids: bool = False, implementation: str = "pallas", backend: str | None = None,
                 interpret=None, **blocks) -> Array:
    """``[B]`` float32 ``sum_{t,s} <left_u[t], left_v[s]> <right_u[t], right_v[s]>``.

    left ``[B, T, rows]`` or int ids ``[B, T]`` (``left_is_ids``; the Gram is the equality test), right
    ``[B, T, cols]``; ``left_v [B, S, ...]``, ``right_v [B, S, cols]`` default to the ``u`` pair (then this is
    ``||G_i||_F^2``). ``blocks``: block sizes of the TPU kernel (``block_t``, ``block_k``).
    """
    pair = () if left_v is None and right_v is None else (left_v, right_v)
    floating = (right_u, *pair[1:]) if left_is_ids else (left_u, right_u, *pair)
    family, default_interpret = _kernel_family("gram", floating, implementation, backend)
    interpret = default_interpret if interpret is None else interpret
    ref_fn = reference.embed_gram_sq_norm if left_is_ids else reference.gram_sq_norm
    if family == "xla":
        return ref_fn(left_u, right_u, *pair)
    # imported on first use: Pallas is not needed for XLA
    from dpzero_jax_kernels.ghost_norm import pallas_gpu, pallas_tpu

    if family == "tpu":
        kernel = functools.partial(pallas_tpu.gram_sq_norm, left_is_ids=left_is_ids, interpret=interpret, **blocks)
    else:
        kernel = functools.partial(pallas_gpu.gram_sq_norm, left_is_ids=left_is_ids, interpret=interpret)
    return _behind_custom_vjp(kernel, ref_fn, left_u, right_u, *pair)


def instantiated_sq_norm(left: Array, right: Array, *, implementation: str = "pallas", backend: str | None = None,
                         interpret=None, **blocks) -> Array:
    """``[B]`` float32 ``||left_i^T right_i||_F^2``; left ``[B, T, rows]``, right ``[B, T, cols]``. ``blocks``: TPU
    block sizes (``block_rows``, ``block_cols``, ``block_t``)."""
    family, default_interpret = _kernel_family("instantiated", (left, right), implementation, backend)
    interpret = default_interpret if interpret is None else interpret
    if family == "xla":
        return reference.instantiated_sq_norm(left, right)
    from dpzero_jax_kernels.ghost_norm import pallas_gpu, pallas_tpu

    if family == "tpu":
        kernel = functools.partial(pallas_tpu.instantiated_sq_norm, interpret=interpret, **blocks)
    else:
        kernel = functools.partial(pallas_gpu.instantiated_sq_norm, interpret=interpret)
    return _behind_custom_vjp(kernel, reference.instantiated_sq_norm, left, right)


def weighted_sum(left: Array, right: Array, coef: Array, *, implementation: str = "pallas",
                 backend: str | None = None, interpret=None, **blocks) -> Array:
    """``[rows, cols]`` float32 ``sum_i coef_i left_i^T right_i``; examples with ``coef_i == 0`` contribute exactly
    zero (even if NaN). left ``[B, T, rows]``, right ``[B, T, cols]``, coef ``[B]``. On GPU this is XLA's GEMM."""
    family, default_interpret = _kernel_family("weighted_sum", (left, right), implementation, backend)
    interpret = default_interpret if interpret is None else interpret
    if family == "xla":
        return reference.weighted_sum(left, right, coef)
    from dpzero_jax_kernels.ghost_norm import pallas_tpu

    kernel = functools.partial(pallas_tpu.weighted_sum, interpret=interpret, **blocks)
    return _behind_custom_vjp(kernel, reference.weighted_sum, left, right, coef)

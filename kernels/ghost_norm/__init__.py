"""Per-example gradient norms of factored gradients ``G_i = left_i^T right_i`` without ``[T, T]`` or
``[rows, cols]`` buffers: reference (XLA), Mosaic TPU and Mosaic GPU kernels, and :mod:`.api` choosing among them."""

from dpzero_jax_kernels.ghost_norm.api import (
    NORM_KERNELS,
    gram_sq_norm,
    has_kernel,
    instantiated_sq_norm,
    resolve,
    weighted_sum,
)

__all__ = ["NORM_KERNELS", "gram_sq_norm", "has_kernel", "instantiated_sq_norm", "resolve", "weighted_sum"]

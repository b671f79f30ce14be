"""Pure-jnp references of the per-example norm kernels (the oracle the Pallas kernels are tested against).

Every function works on one layer's factored per-example gradient ``G_i = sum_t left[i, t] (x) right[i, t]``
(see :mod:`dpzero_jax.pergrad`) and accumulates in float32 whatever the input dtype.

* :func:`gram_sq_norm` -- the ghost (Gram) form ``sum_{t,s} <l_t, l'_s> <r_t, r'_s>``: builds ``[B, T, T']``.
* :func:`embed_gram_sq_norm` -- the same with an implicit one-hot left factor: ``<onehot(id_t), onehot(id'_s)>`` is
  the equality test ``id_t == id'_s``.
* :func:`instantiated_sq_norm` -- ``||sum_t l_t (x) r_t||_F^2`` by instantiating ``[B, rows, cols]``.
* :func:`weighted_sum` -- the clipped sum ``sum_i c_i G_i`` as ``[rows, cols]``; examples with ``c_i == 0`` are
  selected away before multiplying (a NaN or inf example contributes exactly zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _nt(x: Array, y: Array) -> Array:
    """``[B, T, k] x [B, S, k] -> [B, T, S]`` in float32."""
    return jnp.einsum("btk,bsk->bts", x, y, preferred_element_type=jnp.float32)


def gram_sq_norm(left_u: Array, right_u: Array, left_v: Array | None = None, right_v: Array | None = None) -> Array:
    """``[B]``: ``sum_{t,s} <left_u[t], left_v[s]> <right_u[t], right_v[s]>`` (float32).

    left_u ``[B, T, rows]``, right_u ``[B, T, cols]``; left_v ``[B, S, rows]``, right_v ``[B, S, cols]`` default to
    ``left_u``, ``right_u`` (then the result is the squared Frobenius norm of ``G_i``).
    """
    left_v = left_u if left_v is None else left_v
    right_v = right_u if right_v is None else right_v
    return jnp.sum(_nt(left_u, left_v) * _nt(right_u, right_v), axis=(1, 2))


def embed_gram_sq_norm(ids_u: Array, right_u: Array, ids_v: Array | None = None,
                       right_v: Array | None = None) -> Array:
    """``[B]``: ``sum_{t,s} 1{ids_u[t] == ids_v[s]} <right_u[t], right_v[s]>`` (float32).

    ids_u ``[B, T]`` int, right_u ``[B, T, cols]``; ids_v ``[B, S]``, right_v ``[B, S, cols]`` default to the first
    pair.
    """
    ids_v = ids_u if ids_v is None else ids_v
    right_v = right_u if right_v is None else right_v
    equal = ids_u[:, :, None] == ids_v[:, None, :]
    return jnp.sum(jnp.where(equal, _nt(right_u, right_v), 0.0), axis=(1, 2))


def instantiated_sq_norm(left: Array, right: Array) -> Array:
    """``[B]``: ``||left_i^T right_i||_F^2`` by instantiating ``[B, rows, cols]`` (float32).

    left ``[B, T, rows]``, right ``[B, T, cols]``.
    """
    per_example = jnp.einsum("btr,btc->brc", left, right, preferred_element_type=jnp.float32)
    return jnp.sum(jnp.square(per_example), axis=(1, 2))


def weighted_sum(left: Array, right: Array, coef: Array) -> Array:
    """``[rows, cols]``: ``sum_i coef_i left_i^T right_i`` (float32); rows of examples with ``coef_i == 0`` are
    replaced by zeros first.

    left ``[B, T, rows]``, right ``[B, T, cols]``, coef ``[B]``.
    """
    active = (coef != 0)[:, None, None]
    left = jnp.where(active, left, jnp.zeros((), left.dtype))
    right = jnp.where(active, right, jnp.zeros((), right.dtype))
    scaled = right.astype(jnp.float32) * coef.astype(jnp.float32)[:, None, None]
    return jnp.einsum("btr,btc->rc", left.astype(jnp.float32), scaled)

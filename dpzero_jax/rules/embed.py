"""Rule for embedding lookups (token and positional): ``y = table[ids]``.

``ids [B, *T]`` int, ``table [V, d]``. Per example the gradient is ``onehot(ids_i)^T g_i``; its norm uses the
token-equality Gram ``1{ids_t == ids_s}`` and the clipped sum is a scatter-add: the ``[B, T, V]`` one-hot is never
built.
"""

from __future__ import annotations

import jax.numpy as jnp

from dpzero_jax.pergrad import Outer
from dpzero_jax.rules.base import LayerRule


class EmbedRule(LayerRule):
    name = "embed"
    input_free = frozenset()

    def apply(self, params, ids, spec):
        table = params["table"]
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"embedding lookup needs integer ids, got dtype {ids.dtype}")
        if ids.ndim < 1:
            raise ValueError("embedding ids need a leading batch axis: [B, ...]")
        return jnp.take(table, ids, axis=0)

    def per_example_grads(self, params, ids, g, spec):
        table = params["table"]
        batch = ids.shape[0]
        flat_ids = ids.reshape(batch, -1)
        return {"table": Outer(left=flat_ids, right=g.reshape(batch, flat_ids.shape[1], table.shape[-1]),
                               rows=table.shape[0], shape=tuple(table.shape), left_is_ids=True)}


EMBED = EmbedRule()

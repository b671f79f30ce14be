"""Frozen variables (a PEFT base model) inside the ``explicit`` strategy's ``shard_map``, as shards.

The trainer passes the frozen variables into its jitted step as arguments laid out as the parameters are
(``ShardingRules.params``: split over ``fsdp`` at ZeRO-3), never as constants of the program. Under the explicit
strategy they enter the ``shard_map`` that way too: :class:`FrozenShards` is this device's part, and
:meth:`FrozenShards.held` makes the whole values a loss is called with -- each split leaf's ``all_gather``, a
stand-in of the whole shape -- and, with a ZeRO-3 :class:`~dpzero_jax.sharding.ShardLayout`, a copy of the layout
that maps each stand-in back to its shard (``ShardLayout.constant``). The traced-program front-end finds the
stand-ins among the traced loss's constants (:func:`dpzero_jax.program.zero3.held_consts`), holds each as its shard
and gathers it where the program uses it and again in the backward pass -- one scanned layer's slice at a time --
as it does a parameter (no gradient); the stand-in itself is then unused and XLA drops it. A loss run outside that
interpreter (a ``dpzero_jax.layers`` model, ``mode="vmap"``) reads the stand-ins: every frozen variable gathered
whole first (correct, not layer by layer). At stages 1-2 the frozen variables are replicated: the stand-ins are
the arrays themselves.
"""

from __future__ import annotations

import functools

import jax


class FrozenShards:
    """This device's shards of the frozen variables: ``shards`` (a pytree) and, per leaf in flattening order, the
    dimension it is split on over ``fsdp`` (None: whole on every device)."""

    def __init__(self, shards, dims):
        self.leaves, self.treedef = jax.tree.flatten(shards)
        self.dims = tuple(dims)
        if len(self.dims) != len(self.leaves):
            raise ValueError(f"FrozenShards: {len(self.leaves)} frozen leaves but {len(self.dims)} split dimensions")

    def held(self, layout):
        """``(layout, frozen)``: the tree of whole values (stand-ins) and the layout that knows them (``layout``'s
        copy; None stays None)."""
        wholes = [x if d is None else jax.lax.all_gather(x, "fsdp", axis=d, tiled=True)
                  for x, d in zip(self.leaves, self.dims)]
        if layout is not None:
            layout = layout.with_constants([(w, x, d) for w, x, d in zip(wholes, self.leaves, self.dims)
                                            if d is not None])
        return layout, jax.tree.unflatten(self.treedef, wholes)


def bind_frozen_shards(loss_fn, layout, frozen: FrozenShards | None):
    """``(loss, layout)``: ``loss_fn(params, batch, frozen=...)`` with the frozen variables' stand-ins bound and the
    layout that holds them (:meth:`FrozenShards.held`); ``(loss_fn, layout)`` unchanged without ``frozen``."""
    if frozen is None:
        return loss_fn, layout
    layout, whole = frozen.held(layout)
    return functools.partial(loss_fn, frozen=whole), layout

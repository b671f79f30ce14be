"""The engine's modes on the layers front-end, one file each. Each takes ``(loss_fn, cfg, plan, params, batch,
mask, layout=None)`` and returns the clipped sum (no noise). ``layout`` (a :class:`~dpzero_jax.tape.ParamLayout`;
inside ``jax.shard_map`` only): ``params`` are the device's shards, every layer gathers its weights just before use
(:mod:`dpzero_jax.tape`), and the clipped sum comes back as the owners' shards, summed over the ``fsdp`` axis only
(the caller sums over the data axis). The program front-end's modes are in :mod:`dpzero_jax.program`.
"""

"""Book-keeping's local sites reduced in the backward (``dpzero_jax.program.local_tap``).

A norm's scale and offset, a bias, a layer scale: book-keeping forms each example's gradient of such a parameter in
the backward pass, where the site's output gradient is produced, and keeps that (as small as the parameter) instead
of the site's activation-sized output gradient (a scale's operand stays, as the tap's residual; a bias keeps
nothing). Checked against ``vmap(grad)``: a scanned block with a
LayerNorm, a division by a parameter (whose VJP reads the parameter: the tap keeps its view), a scale passed whole
to every iteration (the iterations' gradients add up) and a NaN example; a scale that records its operand before a
dense layer that reads the same operand (the dense layer then records it itself); and what the pass keeps.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import B, Setup, check_private

import dpzero_jax as dz
from dpzero_jax.layer_plan import leaf_paths
from dpzero_jax.program import local_tap, mode
from dpzero_jax.program import sites as sites_lib

L, T, D = 3, 6, 8


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, gamma):
        x = nn.LayerNorm()(h)
        divisor = self.param("divisor", lambda key, shape: 1.5 + jax.random.uniform(key, shape), (D,))
        y = nn.Dense(D)(x / divisor)
        return h + jnp.tanh(y) * gamma, None


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        gamma = self.param("gamma", lambda key, shape: 1.0 + 0.1 * jax.random.normal(key, shape), (D,))
        scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L,
                          in_axes=nn.broadcast)
        h, _ = scanned()(x, gamma)
        return h


def scanned_setup(nan_example: int | None = None) -> Setup:
    model = Decoder()
    x = np.array(jax.random.normal(jax.random.key(1), (B, T, D)))
    if nan_example is not None:
        x[nan_example, 2] = np.nan
    batch = {"x": jnp.asarray(x)}
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]

    def loss_fn(p, batch):
        return jnp.sum(jnp.square(model.apply({"params": p}, batch["x"])), axis=(1, 2))

    return Setup("scanned local sites", params, loss_fn, batch, ())


@pytest.mark.parametrize("groups", ["all-layer", "param-wise"])
def test_scanned_local_sites_match_vmap_grad(groups):
    check_private(scanned_setup(), clip_fn="abadi", groups=groups, mode="bk",
                  mask=np.array([1, 1, 0, 1, 1], bool), include=[1, 1, 0, 1, 1])


def test_a_nan_example_contributes_nothing():
    check_private(scanned_setup(nan_example=3), clip_fn="automatic", groups="all-layer", mode="bk",
                  include=[1, 1, 1, 0, 1], nonfinite=1)


def test_the_pass_keeps_parameter_sized_gradients_for_local_sites():
    setup = scanned_setup()
    plan = mode.plan_program(setup.loss_fn, dz.DPConfig(mode="bk"), setup.params, setup.batch,
                             leaf_paths(setup.params), B)
    sites = plan.analysis.sites
    leaves, batch_leaves = jax.tree.leaves(setup.params), jax.tree.leaves(setup.batch)
    _, records, probe_ct, _, tapped = mode._pass(plan, leaves, batch_leaves)
    kinds = {plan.paths[s.view.leaf]: (s.kind, path in tapped) for path, s in sites.items()}
    assert kinds["ScanBlock_0/LayerNorm_0/scale"] == ("local", True)
    assert kinds["ScanBlock_0/divisor"] == ("local", True) and kinds["gamma"] == ("local", True)
    assert kinds["ScanBlock_0/Dense_0/kernel"] == ("dot", False)
    for path in tapped:
        site = sites[path]
        assert path not in records
        assert probe_ct[path].shape == tuple(site.lengths) + (B,) + sites_lib.base_shape(site)
        assert probe_ct[path].dtype == jnp.float32
    # the dense kernel keeps its operand and output gradient, [L, B, 1, T, D] (the example's batch of one)
    (dense,) = [p for p, s in sites.items() if plan.paths[s.view.leaf] == "ScanBlock_0/Dense_0/kernel"]
    assert probe_ct[dense].shape[:2] == (L, B) and probe_ct[dense].shape[-2:] == (T, D)
    # gamma is passed whole to every iteration: its per-iteration gradients, [L, B, D], add up to [B, D]
    (gamma,) = [p for p, s in sites.items() if plan.paths[s.view.leaf] == "gamma"]
    assert sites_lib.from_tap(sites[gamma], probe_ct[gamma], len(sites[gamma].lengths)).shape == (B, D)
    # a stacked leaf's per-example gradients are normed and summed as the scan left them, [L, B, D] (examples on
    # axis 1, no transposed copy); gamma's, summed over the iterations, examples first
    terms = mode._leaf_terms(plan, leaves, records, probe_ct, [], example_axis=mode.example_axes(plan),
                             tapped=tapped)
    forms = {plan.paths[leaf]: (form, value.shape, axis) for leaf, (form, value, axis) in terms.items()
             if form == "direct"}
    assert forms["ScanBlock_0/LayerNorm_0/scale"] == ("direct", (L, B, D), 1)
    assert forms["gamma"] == ("direct", (B, D), 0)


def sharing_setup() -> Setup:
    """``x * s`` (a local site) records ``x`` first; ``x @ w`` (a dot) records the same operand."""
    keys = jax.random.split(jax.random.key(3), 3)
    params = {"s": 1.0 + 0.1 * jax.random.normal(keys[0], (D,)), "w": jax.random.normal(keys[1], (D, D)) / 3}
    batch = {"x": jax.random.normal(keys[2], (B, T, D))}

    def loss_fn(p, batch):
        x = batch["x"]
        return jnp.sum(jnp.square(jnp.tanh(x * p["s"] + x @ p["w"])), axis=(1, 2))

    return Setup("scale before dense", params, loss_fn, batch, ())


def test_a_dense_layer_records_what_a_tapped_scale_would_have():
    setup = sharing_setup()
    plan = mode.plan_program(setup.loss_fn, dz.DPConfig(mode="bk"), setup.params, setup.batch,
                             leaf_paths(setup.params), B)
    by_leaf = {plan.paths[s.view.leaf]: path for path, s in plan.analysis.sites.items()}
    assert plan.analysis.shared_records == {by_leaf["w"]: by_leaf["s"]}
    tapped = local_tap.tapped_sites(plan.analysis, None)
    assert tapped == {by_leaf["s"]}
    assert local_tap.sharing(plan.analysis.shared_records, {}, tapped) == ({}, {})
    check_private(setup, clip_fn="abadi", groups="param-wise", mode="bk")


def test_sharing_moves_a_tapped_recorder_to_its_first_reader():
    shared = {("b",): ("a",), ("c",): ("a",), ("e",): ("d",)}
    records, gradient = local_tap.sharing(shared, {("f",): ("a",), ("g",): ("d",)}, frozenset({("a",)}))
    assert records == {("c",): ("b",), ("e",): ("d",)}
    assert gradient == {("g",): ("d",)}

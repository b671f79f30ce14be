"""Variance diagnostics of randomized matmul (paper 002, Section 2.3), for choosing the compression rate.

For a linear layer with input rows ``X [n, N]`` and output gradients ``Y [n, M]`` (``Y = dL/dy`` of the mean
loss of the batch):

* :func:`d2_sgd` -- eq. (9), the a-posteriori variance of the mini-batch gradient ``X^T Y`` caused by sampling the
  batch; generalised to sequences as the variance over *examples* (each example's gradient is ``a_i^T g_i``,
  summed over its positions): ``(B sum_i ||G_i||^2 - ||sum_i G_i||^2) / (B - 1)``. For ``[B, N]`` inputs this is
  eq. (9) exactly.
* :func:`d2_rmm` -- eq. (11) as printed, ``(||X||^2 ||Y||^2 - ||X^T Y||^2) / B_proj``.
* :func:`alpha` -- eq. (13), ``||X^T Y||^2 / (||X||^2 ||Y||^2)``.
* :func:`rmm_variance` -- the exact ``E_S ||X^T S S^T Y - X^T Y||^2`` for each sketch and both layouts.

Eq. (11) is not the variance of the Gaussian sketch: its proof (Appendix A.2, eq. 36) drops the fourth moment
``E[C^4] = 3 / B_proj^2``; the variance is ``(||X||^2 ||Y||^2 + ||X^T Y||^2) / B_proj``, i.e. eq. (11) plus
``2 ||X^T Y||^2 / B_proj`` (for ``n = 1``, eq. (11) gives 0 although ``s^2 x y^T`` with ``s ~ N(0, 1)`` is
random). :func:`rmm_variance` gives the exact values (tested against Monte Carlo); :func:`d2_rmm` keeps the paper's
formula for comparison with its figures. Theorem 2.3's bound ``(B_proj / (B - 1)) D2_RMM / D2_SGD <= (alpha + 1) /
alpha`` does not hold in general either (e.g. rank-one ``x_k y_k^T`` that are all equal while ``||x_k||`` vary:
``D2_SGD = 0 < D2_RMM`` with ``alpha > 0``); :class:`LayerDiagnostics` reports both sides.

Exact variances, with ``S [T, k]`` shared by ``B`` examples ``a_i [T, N]``, ``g_i [T, M]`` (the rows layout of
paper 002 is ``B = 1``, ``T = n``), ``Ka_ij(t, s) = a_it . a_js``, ``Kg_ij(t, s) = g_it . g_js``:

* Gaussian: ``(1/k) sum_ij [<a_i, a_j><g_i, g_j> + sum_ts Ka_ij(t, s) Kg_ij(s, t)]``;
* Rademacher: the Gaussian value minus ``(2/k) sum_ij sum_t Ka_ij(t, t) Kg_ij(t, t)``;
* subsampled orthogonal ``S^T = sqrt(T/k) P H D`` (``k`` of the ``T`` transform rows without replacement, random
  signs ``D``): ``(T/k) ((T-k)/(T-1)) (sum_c E_D ||Z_c||^2 - ||G||^2 / T)`` where ``Z_c = sum_i (a_i^T D h_c)
  (g_i^T D h_c)^T`` and, with ``Q = (H o H)^T (H o H)``, ``sum_c E_D ||Z_c||^2 = sum_ij [sum_tu Q_tu Ka_ij(t, t)
  Kg_ij(u, u) + sum_ts Q_ts Ka_ij(t, s) (Kg_ij(t, s) + Kg_ij(s, t)) - 2 sum_t Q_tt Ka_ij(t, t) Kg_ij(t, t)]``.

Costs: the Gaussian and Rademacher values need ``B^2 T min(T, N M / T)``-ish work per layer (cheap in the rows
layout); the orthogonal ones form ``T x T`` Grams and ``Q`` (``T^3``): fine for a few thousand rows, occasionally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpzero_jax import engine, pergrad
from dpzero_jax import tape as tape_lib
from dpzero_jax.config import DPConfig
from dpzero_jax.rules.linear import LINEAR
from dpzero_jax.rules.rmm import RMM_LINEAR, positions_view
from dpzero_jax.sketch import ORTHOGONAL_SKETCHES, SKETCHES, RMMConfig, orthogonal_transform

Array = jax.Array


def _f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


def _as_examples(a, g):
    """``[B, N]`` -> ``[B, 1, N]``; ``[B, T, N]`` unchanged."""
    a, g = _f32(a), _f32(g)
    if a.ndim != g.ndim or a.ndim not in (2, 3) or a.shape[:-1] != g.shape[:-1]:
        raise ValueError(f"expected a [B, N] / g [B, M] or a [B, T, N] / g [B, T, M]; got {a.shape} and {g.shape}")
    return (a[:, None], g[:, None]) if a.ndim == 2 else (a, g)


def _rows(x, y):
    x, y = _f32(x), _f32(y)
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"expected X [n, N] and Y [n, M] with the same rows; got {x.shape} and {y.shape}")
    return x, y


def d2_sgd(a, g, count=None) -> Array:
    """Eq. (9) over examples: ``a [B, N]`` / ``g [B, M]`` (the paper's case) or ``a [B, T, N]`` / ``g [B, T, M]``.

    ``count``: the number of real examples when some rows are padding (zero ``g``); default ``B``.
    """
    a, g = _as_examples(a, g)
    count = a.shape[0] if count is None else count
    per_example = pergrad.sq_norm([pergrad.Outer(a, g, rows=a.shape[-1], shape=(a.shape[-1], g.shape[-1]))])
    total = jnp.einsum("btn,btm->nm", a, g)
    return (count * jnp.sum(per_example) - jnp.sum(jnp.square(total))) / (count - 1)


def d2_rmm(x, y, b_proj: int) -> Array:
    """Eq. (11) as printed in paper 002: ``(||X||^2 ||Y||^2 - ||X^T Y||^2) / B_proj``; ``X [n, N]``, ``Y [n, M]``.

    Not the variance of any of the sketches (see the module docstring and :func:`rmm_variance`)."""
    x, y = _rows(x, y)
    return (jnp.sum(x * x) * jnp.sum(y * y) - jnp.sum(jnp.square(x.T @ y))) / b_proj


def alpha(x, y) -> Array:
    """Eq. (13): ``||X^T Y||^2 / (||X||^2 ||Y||^2)`` in ``[0, 1]``; ``X [n, N]``, ``Y [n, M]``."""
    x, y = _rows(x, y)
    return jnp.sum(jnp.square(x.T @ y)) / (jnp.sum(x * x) * jnp.sum(y * y))


def _pair_terms(a, g, i, q=None):
    """Sums over ``j`` of the pair terms of example ``i`` (see the module docstring), as a dict of scalars."""
    a_i, g_i = a[i], g[i]
    (_, t, n), m = a.shape, g.shape[-1]
    ga = jnp.einsum("tn,jtn->j", a_i, a)
    gg = jnp.einsum("tm,jtm->j", g_i, g)
    diag = jnp.einsum("tn,jtn->jt", a_i, a) * jnp.einsum("tm,jtm->jt", g_i, g)       # Ka(t,t) Kg(t,t)
    out = {"first": jnp.sum(ga * gg), "diag": jnp.sum(diag)}
    if q is None and n * m <= t * t:      # sum_j <a_i^T g_j, a_j^T g_i> with [B, N, M] products
        c_ij = jnp.einsum("tn,jtm->jnm", a_i, g)
        c_ji = jnp.einsum("jtn,tm->jnm", a, g_i)
        out["second"] = jnp.sum(c_ij * c_ji)
        return out
    ka = jnp.einsum("tn,jsn->jts", a_i, a)                                            # Ka_ij(t, s)
    kg = jnp.einsum("tm,jsm->jts", g_i, g)                                            # Kg_ij(t, s)
    out["second"] = jnp.sum(ka * jnp.swapaxes(kg, 1, 2))
    if q is not None:
        ka_diag, kg_diag = jnp.diagonal(ka, axis1=1, axis2=2), jnp.diagonal(kg, axis1=1, axis2=2)   # [B, T]
        out["orth_first"] = jnp.einsum("jt,tu,ju->", ka_diag, q, kg_diag)
        out["orth_pairs"] = jnp.sum(q[None] * ka * (kg + jnp.swapaxes(kg, 1, 2)))
        out["orth_diag"] = jnp.einsum("t,jt,jt->", jnp.diagonal(q), ka_diag, kg_diag)
    return out


def rmm_variance(a, g, k: int, sketch: str) -> Array:
    """Exact ``E_S ||sum_i a_i^T S S^T g_i - sum_i a_i^T g_i||_F^2`` for the sketch ``S [T, k]`` of
    :func:`dpzero_jax.sketch.project`, shared by the examples.

    ``a [B, T, N]``, ``g [B, T, M]`` (the DP "tokens" layout), or ``X [n, N]``, ``Y [n, M]`` (the "rows" layout of
    paper 002: one sketch over all rows). Formulas in the module docstring.
    """
    if sketch not in SKETCHES:
        raise ValueError(f"unknown sketch {sketch!r}; expected one of {SKETCHES}")
    a, g = _f32(a), _f32(g)
    if a.ndim == 2:
        a, g = _rows(a, g)
        a, g = a[None], g[None]
    if a.ndim != 3 or g.ndim != 3 or a.shape[:2] != g.shape[:2]:
        raise ValueError(f"expected a [B, T, N] and g [B, T, M]; got {a.shape} and {g.shape}")
    batch, positions = a.shape[:2]
    if not 1 <= k <= positions:
        raise ValueError(f"rmm_variance: k={k} must be in [1, T={positions}]")
    orthogonal = sketch in ORTHOGONAL_SKETCHES
    if orthogonal and k == positions:
        return jnp.zeros((), jnp.float32)
    q = None
    if orthogonal:
        h2 = jnp.square(orthogonal_transform(jnp.eye(positions, dtype=jnp.float32), sketch))   # (H o H)
        q = h2.T @ h2
    terms = jax.lax.map(lambda i: _pair_terms(a, g, i, q), jnp.arange(batch))
    terms = {name: jnp.sum(value) for name, value in terms.items()}
    if sketch == "gaussian":
        return (terms["first"] + terms["second"]) / k
    if sketch == "rademacher":
        return (terms["first"] + terms["second"] - 2.0 * terms["diag"]) / k
    total = jnp.einsum("btn,btm->nm", a, g)
    z_sq = terms["orth_first"] + terms["orth_pairs"] - 2.0 * terms["orth_diag"]
    return (positions / k) * ((positions - k) / (positions - 1)) * (z_sq - jnp.sum(jnp.square(total)) / positions)


class LayerDiagnostics(NamedTuple):
    """Variance diagnostics of one layer's weight gradient (scalars).

    d2_sgd: eq. (9) over examples; d2_rmm: eq. (11) on the layer's rows ``X [B*T, N]`` with ``B_proj`` the rows
    kept (``k`` for the rows layout, ``B k`` for tokens); variance: the exact RMM variance of the layer's sketch and
    layout (NaN when not computed); alpha: eq. (13) on the rows; ratio: the left side of eq. (12),
    ``B_proj / (B - 1) * d2_rmm / d2_sgd``; bound: its right side ``(alpha + 1) / alpha``.
    """

    d2_sgd: Array
    d2_rmm: Array
    variance: Array
    alpha: Array
    ratio: Array
    bound: Array


def layer_diagnostics(x, g, config: RMMConfig, *, n_in: int = 1, count=None,
                      exact_variance: bool = True) -> LayerDiagnostics:
    """Diagnostics of a linear layer with input ``x [B, *T, *in]`` and output gradient ``g [B, *T, *out]`` (of the
    mean loss) under the sketch, rate and layout of ``config``. ``count``: real examples (padding has zero ``g``)."""
    a = positions_view(_f32(x), n_in)
    g3 = _f32(g).reshape(a.shape[0], a.shape[1], -1)
    batch, positions = a.shape[:2]
    count = batch if count is None else count
    x_rows, y_rows = a.reshape(-1, a.shape[-1]), g3.reshape(-1, g3.shape[-1])
    if config.projection == "rows":
        k = config.projected_size(x_rows.shape[0])
        kept_rows = k
    else:
        k = config.projected_size(positions)
        kept_rows = count * k
    sgd = d2_sgd(a, g3, count)
    paper = d2_rmm(x_rows, y_rows, kept_rows)
    corr = alpha(x_rows, y_rows)
    if not exact_variance:
        variance = jnp.full((), jnp.nan, jnp.float32)
    elif config.projection == "rows":
        variance = rmm_variance(x_rows, y_rows, k, config.sketch)
    else:
        variance = rmm_variance(a, g3, k, config.sketch)
    return LayerDiagnostics(sgd, paper, variance, corr, kept_rows / (count - 1) * paper / sgd, (corr + 1) / corr)


def capture_fn(loss_fn: Callable, *, config: RMMConfig | None = None,
               layers: Callable[[str], bool] | None = None) -> Callable:
    """``fn(params, batch, mask=None) -> {layer path: (x, g, config, n_in)}``: the exact input ``x [B, *T, *in]``
    and the output gradient ``g [B, *T, *out]`` of the mean loss over the examples with ``mask`` (default all) of
    every RMM layer (with its own config) and, when ``config`` is given, of every plain linear layer. One forward
    and one backward pass; jittable. ``layers(path)`` selects layers by path (e.g. ``"h/0/mlp/c_fc"``)."""

    def selected(record):
        path = record.param_paths[0][1].rsplit("/", 1)[0]
        if layers is not None and not layers(path):
            return None
        if record.rule is RMM_LINEAR:
            return path, record.spec.config, record.spec.n_in
        if record.rule is LINEAR and config is not None and not record.spec.transpose:
            return path, config, record.spec.n_in
        return None

    def fn(params, batch, mask=None):
        plan = engine.make_plan(loss_fn, DPConfig(noise_multiplier=0.0), params, batch, require_supported=False)
        chosen = {r.index: selected(r) for r in plan.records}
        chosen = {index: info for index, info in chosen.items() if info is not None}
        probes = {r.index: jnp.zeros(r.output_shape, r.output_dtype) for r in plan.records if r.index in chosen}
        leaf_ids = {id(leaf): path for leaf, path in zip(jax.tree.leaves(params), plan.paths)}

        def forward(probes):
            capture = tape_lib.CaptureTape(leaf_ids, probes, keep_inputs=True)
            with tape_lib.active(capture):
                losses = loss_fn(params, batch)
            return losses, capture.calls

        weights = jnp.ones((plan.batch_size,), jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
        losses, pullback, calls = jax.vjp(forward, probes, has_aux=True)
        (output_grads,) = pullback((weights / jnp.maximum(jnp.sum(weights), 1.0)).astype(losses.dtype))
        return {path: (calls[index][0], output_grads[index], layer_config, n_in)
                for index, (path, layer_config, n_in) in chosen.items()}

    return fn


def diagnostics_fn(loss_fn: Callable, *, config: RMMConfig | None = None, exact_variance: bool = True,
                   layers: Callable[[str], bool] | None = None) -> Callable:
    """``fn(params, batch, mask=None) -> {layer path: LayerDiagnostics}`` for the RMM layers of ``loss_fn``'s model
    (each with its own config) and, when ``config`` is given, its plain linear layers too (what RMM *would* do to
    them: a way to choose the rate before converting). Jittable; see :func:`capture_fn` for ``layers`` and the
    gradient used (the mean loss over the examples with ``mask``). Masked-out examples have zero output gradients;
    in the tokens layout (each example projected on its own) their inputs are zeroed too, so they take no part in
    ``D2_RMM`` and ``alpha`` either. In the rows layout they stay: ``S`` mixes their rows into the estimate (padding
    rows add variance there).
    """
    capture = capture_fn(loss_fn, config=config, layers=layers)

    def fn(params, batch, mask=None):
        count = None if mask is None else jnp.sum(jnp.asarray(mask, jnp.float32))
        out = {}
        for path, (x, g, layer_config, n_in) in capture(params, batch, mask).items():
            if mask is not None and layer_config.projection == "tokens":
                x = jnp.where(jnp.asarray(mask, bool).reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))
            out[path] = layer_diagnostics(x, g, layer_config, n_in=n_in, count=count, exact_variance=exact_variance)
        return out

    return fn


def as_floats(diagnostics: dict[str, LayerDiagnostics], prefix: str = "rmm") -> dict[str, float]:
    """``{"rmm/<path>/<field>": float}``, for a metrics log."""
    return {f"{prefix}/{path}/{field}": float(value) for path, diag in diagnostics.items()
            for field, value in diag._asdict().items()}

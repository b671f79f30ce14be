"""A one-run privacy audit of a training configuration (Steinke, Nasr and Jagielski 2023, "Privacy Auditing with
One (1) Training Run"): ``audit(TrainConfig(...), AuditConfig(...))`` or ``dpzero audit``.

``m`` canaries are drawn, each included in the run independently with probability 1/2 (``S_i`` in {0, 1}); the
run is an ordinary :class:`dpzero_jax.train.Trainer` run of the user's configuration with the canaries added
through its one seam (``Trainer(config, canaries=...)``). After the run every canary gets a score; the auditor
guesses "included" for the ``k+`` highest scores and "excluded" for the ``k-`` lowest, and counts the correct
guesses. If the run is (epsilon, delta)-DP, the number of correct guesses ``W`` out of ``r = k+ + k-`` satisfies
(the paper's Theorem 5.2, computed by :func:`p_value`)::

    P[W >= v] <= P[Binomial(r, p) >= v] + 2 m delta max_{1<=i<=v} (1/i) P[v - i <= Binomial(r, p) < v],
    p = e^epsilon / (1 + e^epsilon)

so every epsilon whose bound is below ``1 - confidence`` is rejected; the largest one is the *empirical lower
bound* (:func:`epsilon_lower_bound`). Several numbers of guesses are tried (``AuditConfig.guesses``) with a
Bonferroni correction (each at ``1 - (1 - confidence) / len(guesses)``), so the reported maximum keeps the stated
confidence. A lower bound above the accountant's epsilon means the implementation does not do what its accounting
says.

Two kinds of canaries:

* **gradient canaries** (white-box, :class:`GradientCanaries`): canary ``i`` is a per-example gradient along a
  random Gaussian direction with norm ``canary_norm * R_g`` in each clipping group ``g``, clipped by
  :func:`dpzero_jax.clipping.coefficients` (the function the engine applies to the examples) and added to the
  clipped sum of every step that samples it (Poisson, at the run's sampling rate, from ``fold_in(noise_key,
  CANARY_KEY_TAG)``), before the noise (:func:`dpzero_jax.private_value_and_grad`'s ``clipped_sum_hook``). Its
  score is the sum over steps of the inner product of its clipped gradient with the noised gradient the optimiser
  receives (an optax transformation chained before the optimiser keeps the scores in its state). The mechanism
  releases every noised gradient, so the score is a function of what the accountant's composition covers.
* **input canaries** (black-box, :class:`InputCanaries`): held-out test examples with a wrong label drawn at random;
  the included ones join the training set; scored by minus their loss on the final model.

Gradient canaries test the noise, the normalisation and the clip function; they enter at the clipped sum, so a bug
in one mode's per-example gradients is visible only to input canaries (whose bound is far looser).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.stats

from dpzero_jax import clipping

CANARY_KEY_TAG = 0x7FFFFFFE   # step t's canary sampling key: fold_in(noise_key_t, CANARY_KEY_TAG)


# ---------------------------------------------------------------- the bound (paper, Theorem 5.2)
def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on ``P[W >= v]`` under an (epsilon, delta)-DP mechanism: ``W`` correct guesses out of ``r``,
    ``m`` canaries each included with probability 1/2 (see the module docstring); capped at 1."""
    for name, value in (("m", m), ("r", r), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"p_value: {name} must be an integer >= 0, got {value!r}")
    if not v <= r <= m:
        raise ValueError(f"p_value: need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"p_value: epsilon must be finite and >= 0, got {epsilon!r}")
    if not 0 <= delta <= 1:
        raise ValueError(f"p_value: delta must be in [0, 1], got {delta!r}")
    p = 1.0 / (1.0 + math.exp(-epsilon))   # accuracy of epsilon-DP randomised response
    tail = float(scipy.stats.binom.sf(v - 1, r, p))   # P[Binomial(r, p) >= v]
    charge = 0.0
    if v > 0 and delta > 0:
        below = scipy.stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)   # P[B = v-1], P[B = v-2], ..., P[B = 0]
        charge = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * charge)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float, *, tol: float = 1e-6) -> float:
    """The largest epsilon rejected at ``confidence``: ``sup {eps : p_value(m, r, v, eps, delta) <= 1 - confidence}``
    (0 when even epsilon = 0 is not rejected). Bisection: the bound grows with epsilon."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    alpha = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) > alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) <= alpha:
        lo, hi = hi, 2.0 * hi
        if hi > 1e3:   # p_value -> 1 as epsilon grows when v < r; v = r = m = 0 cannot happen here
            return lo
    while hi - lo > tol * max(1.0, lo):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if p_value(m, r, v, mid, delta) <= alpha else (lo, mid)
    return lo


def default_guesses(m: int) -> tuple[int, ...]:
    """The numbers of guesses tried for ``m`` canaries: 2%, 5%, 10%, 20%, 50% and 100% of them (even, >= 2)."""
    counts = sorted({max(2, 2 * round(m * f / 2)) for f in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)})
    return tuple(c for c in counts if c <= m) or (m,)


def guess_and_bound(scores, included, delta: float, confidence: float, guesses: Sequence[int] | None = None) -> dict:
    """Guess from ``scores [m]`` (high: included) against the truth ``included [m]`` (bool) and bound epsilon.

    For each ``r`` in ``guesses`` (default :func:`default_guesses`): "included" for the ``ceil(r/2)`` highest scores,
    "excluded" for the ``floor(r/2)`` lowest; each bound at ``1 - (1 - confidence) / len(guesses)`` (Bonferroni).
    Returns ``{"epsilon_lower_bound", "guesses", "correct", "canaries", "included", "by_guesses": [...]}`` with the
    best ``r``'s numbers at the top level.
    """
    scores = np.asarray(scores, np.float64)
    included = np.asarray(included, bool)
    m = scores.shape[0]
    if scores.shape != (m,) or included.shape != (m,):
        raise ValueError(f"scores and included must both be [m]; got {scores.shape} and {included.shape}")
    if not np.all(np.isfinite(scores)):
        raise ValueError(f"{int(np.sum(~np.isfinite(scores)))} of the {m} canary scores are not finite")
    guesses = tuple(default_guesses(m) if guesses is None else guesses)
    if not guesses or any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 1 <= r <= m
                          for r in guesses):
        raise ValueError(f"guesses must be integers in [1, {m}] (the canaries), got {guesses!r}")
    level = 1.0 - (1.0 - confidence) / len(guesses)
    order = np.argsort(-scores, kind="stable")
    rows = []
    for r in guesses:
        k_plus = (r + 1) // 2
        k_minus = r - k_plus
        correct = int(np.sum(included[order[:k_plus]]) + np.sum(~included[order[m - k_minus:]]))
        rows.append({"guesses": int(r), "correct": correct,
                     "epsilon_lower_bound": epsilon_lower_bound(m, int(r), correct, delta, level)})
    best = max(rows, key=lambda row: row["epsilon_lower_bound"])
    return {"epsilon_lower_bound": best["epsilon_lower_bound"], "guesses": best["guesses"],
            "correct": best["correct"], "canaries": m, "included": int(np.sum(included)),
            "confidence": confidence, "by_guesses": rows}


# ---------------------------------------------------------------- gradient canaries (white-box)
class ScoreState(NamedTuple):
    """The observer's optax state: ``scores [m]`` float32, the running sums of inner products."""
    scores: jax.Array


class GradientCanaries:
    """``count`` gradient canaries for a run with Poisson sampling rate ``sampling_rate`` and expected batch size
    ``expected_batch_size`` (the divisor of the noised sum).

    ``included [count]`` (bool): which take part. At step ``t`` (noise key ``k_t``), canary ``i`` is sampled with
    probability ``sampling_rate`` from ``fold_in(fold_in(k_t, CANARY_KEY_TAG), 0)`` and its gradient on leaf ``j``
    is ``N(0, I)`` from ``fold_in(fold_in(fold_in(fold_in(k_t, CANARY_KEY_TAG), 1), i), j)`` -- a fresh direction
    every step, so that the real examples' gradients do not add up coherently in its score -- scaled in each
    clipping group ``g`` to norm ``canary_norm * R_g`` and clipped by ``clipping.coefficients`` (the engine's
    function). ``chunk``: canaries generated at once (memory: ``chunk`` times the parameters).

    Used through the Trainer's ``canaries`` seam, both calls inside one traced step: :meth:`insert` (the engine's
    ``clipped_sum_hook``) adds the sampled canaries to the clipped sum and keeps, for the observer of the same
    trace, the plan's groups, the step's key and the clipped sum of the real examples; :meth:`observer` scores
    ``<c_i, expected_batch_size * G_t - S_t> / ||R||^2`` (``G_t`` the noised gradient, ``S_t`` the real examples'
    clipped sum), i.e. about the number of steps that sampled canary ``i`` plus noise. Subtracting ``S_t`` is
    sound: ``S_t`` is a function of the earlier outputs and of the real examples' sampling, which is independent
    of the canaries, and the accountant's bound holds for every fixed choice of the other examples of a batch.
    """

    def __init__(self, count: int, sampling_rate: float, expected_batch_size: float, included, *,
                 clip_fn: str = "abadi", gamma: float = 0.01, canary_norm: float = 1.0, chunk: int = 64):
        included = np.asarray(included, bool)
        if included.shape != (count,):
            raise ValueError(f"included must be [{count}] booleans, got shape {included.shape}")
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
        if not (math.isfinite(canary_norm) and canary_norm > 0):
            raise ValueError(f"canary_norm must be a positive number (a multiple of the thresholds), got "
                             f"{canary_norm!r}")
        self.count, self.sampling_rate = count, float(sampling_rate)
        self.expected_batch_size = float(expected_batch_size)
        self.included = included
        self.clip_fn, self.gamma, self.canary_norm = clip_fn, float(gamma), float(canary_norm)
        self.chunk = max(1, min(int(chunk), count))
        self._pending = None   # (groups, thresholds, direction key, real clipped sum) between insert and observer

    def _clipped(self, key: jax.Array, shapes, groups: tuple[int, ...], thresholds: tuple[float, ...]):
        """One canary's clipped gradient from its ``key``: a list of float32 arrays of ``shapes`` (leaf order)."""
        raw = [jax.random.normal(jax.random.fold_in(key, j), shape, jnp.float32) for j, shape in enumerate(shapes)]

        def group_norms(leaves):
            sq = jnp.zeros(len(thresholds), jnp.float32)
            for g, leaf in zip(groups, leaves):
                sq = sq.at[g].add(jnp.sum(leaf * leaf))
            return jnp.sqrt(sq)

        scale = self.canary_norm * jnp.asarray(thresholds, jnp.float32) / group_norms(raw)
        raw = [leaf * scale[g] for g, leaf in zip(groups, raw)]
        coef = clipping.coefficients(group_norms(raw)[None, :], jnp.asarray(thresholds, jnp.float32),
                                     jnp.ones(1, bool), self.clip_fn, self.gamma)[0]
        return [leaf * coef[g] for g, leaf in zip(groups, raw)]

    def _chunks(self):
        """``[n_chunks, chunk]`` canary indices (the last chunk padded with indices >= ``count``)."""
        n = -(-self.count // self.chunk)
        return jnp.arange(n * self.chunk, dtype=jnp.int32).reshape(n, self.chunk)

    def _canaries(self, direction_key, indices, shapes, groups, thresholds):
        return jax.vmap(lambda i: self._clipped(jax.random.fold_in(direction_key, i), shapes, groups,
                                                thresholds))(indices)   # leaf j: [chunk, *shapes[j]]

    def insert(self, clipped_sum, key: jax.Array, plan):
        """``clipped_sum + sum_i s_i c_i`` with ``s_i`` = included and sampled at this step and ``c_i`` canary
        ``i``'s clipped gradient of this step."""
        leaves, treedef = jax.tree.flatten(clipped_sum)
        if len(plan.paths) != len(leaves):
            raise ValueError(f"the plan names {len(plan.paths)} trainable leaves, the clipped sum has {len(leaves)}")
        groups = tuple(int(plan.group_of[path]) for path in plan.paths)
        thresholds = tuple(float(t) for t in plan.thresholds)
        tagged = jax.random.fold_in(key, CANARY_KEY_TAG)
        sampled = jax.random.bernoulli(jax.random.fold_in(tagged, 0), self.sampling_rate, (self.count,))
        direction_key = jax.random.fold_in(tagged, 1)
        weight = jnp.zeros(self._chunks().size, jnp.float32).at[:self.count].set(
            (sampled & jnp.asarray(self.included)).astype(jnp.float32))
        shapes = [leaf.shape for leaf in leaves]

        def add_chunk(acc, indices):
            canaries = self._canaries(direction_key, indices, shapes, groups, thresholds)
            return [a + jnp.tensordot(weight[indices], c, axes=1) for a, c in zip(acc, canaries)], None

        real = [leaf.astype(jnp.float32) for leaf in leaves]
        added, _ = jax.lax.scan(add_chunk, [jnp.zeros(shape, jnp.float32) for shape in shapes], self._chunks())
        self._pending = (groups, thresholds, direction_key, real)
        return jax.tree.unflatten(treedef, [(r + a).astype(leaf.dtype) for r, a, leaf in zip(real, added, leaves)])

    def projections(self, grads) -> jax.Array:
        """``[count]``: ``<c_i, expected_batch_size * grads - S> / ||R||^2`` for this step's canaries (float32)."""
        if self._pending is None:
            raise RuntimeError("GradientCanaries: the observer ran without insert() in the same traced step")
        groups, thresholds, direction_key, real = self._pending
        self._pending = None
        leaves = jax.tree.leaves(grads)
        if len(leaves) != len(real):
            raise ValueError(f"the observer got {len(leaves)} gradient leaves, insert() saw {len(real)}")
        residual = [self.expected_batch_size * g.astype(jnp.float32) - r for g, r in zip(leaves, real)]
        shapes = [leaf.shape for leaf in leaves]

        def chunk_scores(indices):
            canaries = self._canaries(direction_key, indices, shapes, groups, thresholds)
            return sum(jnp.tensordot(c.reshape(c.shape[0], -1), x.reshape(-1), axes=1)
                       for c, x in zip(canaries, residual))

        norm_sq = float(sum(t * t for t in thresholds))
        return jax.lax.map(chunk_scores, self._chunks()).reshape(-1)[:self.count] / norm_sq

    def observer(self) -> optax.GradientTransformation:
        """An optax transformation that passes the gradient on unchanged and adds :meth:`projections` of it to the
        scores in its state (:class:`ScoreState`)."""
        def init(params):
            del params
            return ScoreState(jnp.zeros(self.count, jnp.float32))

        def update(updates, state, params=None):
            del params
            return updates, ScoreState(state.scores + self.projections(updates))

        return optax.GradientTransformation(init, update)


def scores_of(opt_state) -> np.ndarray:
    """The gradient canaries' scores ``[m]`` from a run's optimiser state (the chain's first element)."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScoreState))
             if isinstance(s, ScoreState)]
    if len(found) != 1:
        raise ValueError(f"expected one ScoreState in the optimiser state, found {len(found)}")
    return np.asarray(jax.device_get(found[0].scores), np.float64)


# ---------------------------------------------------------------- input canaries (black-box)
class InputCanaries:
    """``count`` held-out examples (the first ``count`` of a seeded permutation of the test split) with a wrong
    label drawn uniformly from the other classes; those with ``included[i]`` join the training set, all leave the
    test set. Image classification data only (``{"image", "label"}``)."""

    def __init__(self, count: int, key: jax.Array, included):
        included = np.asarray(included, bool)
        if included.shape != (count,):
            raise ValueError(f"included must be [{count}] booleans, got shape {included.shape}")
        self.count, self.key, self.included = count, key, included
        self.examples: dict[str, np.ndarray] | None = None

    def extend(self, train, test):
        if set(train) != {"image", "label"}:
            raise ValueError(f"input canaries need image classification data ({{'image', 'label'}}); the run's "
                             f"training data hold {sorted(train)}")
        n_test = test["label"].shape[0]
        if self.count >= n_test:
            raise ValueError(f"{self.count} input canaries need more held-out examples than the {n_test} of the "
                             f"test split (at least one is kept for evaluation)")
        seed = np.asarray(jax.random.key_data(self.key)).astype(np.uint64)
        rng = np.random.default_rng(seed.tolist())
        order = rng.permutation(n_test)
        chosen, kept = order[:self.count], order[self.count:]
        classes = int(max(train["label"].max(), test["label"].max())) + 1
        labels = (test["label"][chosen] + rng.integers(1, classes, self.count)) % classes
        self.examples = {"image": test["image"][chosen], "label": labels.astype(test["label"].dtype)}
        train = {k: np.concatenate([train[k], self.examples[k][self.included]]) for k in train}
        test = {k: v[kept] for k, v in test.items()}
        return train, test

    def scores(self, apply_fn, params) -> np.ndarray:
        """``[count]``: minus each canary's cross-entropy under ``apply_fn(params, images)``."""
        logits = jnp.asarray(apply_fn(params, jnp.asarray(self.examples["image"])), jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(self.examples["label"]))
        return -np.asarray(losses, np.float64)


class _Both:
    """Both kinds of canaries through the Trainer's one ``canaries`` argument."""

    def __init__(self, gradient: GradientCanaries | None, inputs: InputCanaries | None):
        self.gradient, self.inputs = gradient, inputs

    def extend(self, train, test):
        return (train, test) if self.inputs is None else self.inputs.extend(train, test)

    def insert(self, clipped_sum, key, plan):
        return clipped_sum if self.gradient is None else self.gradient.insert(clipped_sum, key, plan)

    def observer(self):
        return optax.identity() if self.gradient is None else self.gradient.observer()


# ---------------------------------------------------------------- the audit
@dataclasses.dataclass(frozen=True)
class AuditConfig:
    """What the audit adds to a run.

    canaries: gradient (white-box) canaries ``m`` (0: none). input_canaries: black-box canaries (0: none).
    confidence: of the lower bound. guesses: numbers of guesses tried (None: :func:`default_guesses`).
    canary_norm: a gradient canary's norm in each group, in multiples of the group's threshold, before clipping
    (None: 10, so that clipping matters; 0.99 with ``clip_fn="global"``, which drops gradients above the threshold).
    seed: of the canaries' inclusion and of the input canaries' choice (gradient canaries are sampled and drawn from
    each step's noise key). chunk: gradient canaries generated at once.
    """

    canaries: int = 1000
    input_canaries: int = 0
    confidence: float = 0.95
    guesses: tuple[int, ...] | None = None
    canary_norm: float | None = None
    seed: int = 0
    chunk: int = 64

    def __post_init__(self):
        for name in ("canaries", "input_canaries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"AuditConfig.{name} must be an integer >= 0, got {value!r}")
        if self.canaries == 0 and self.input_canaries == 0:
            raise ValueError("AuditConfig: canaries=0 and input_canaries=0: nothing to audit")
        if isinstance(self.confidence, bool) or not 0 < self.confidence < 1:
            raise ValueError(f"AuditConfig.confidence must be in (0, 1), got {self.confidence!r}")
        if self.canary_norm is not None and not (math.isfinite(self.canary_norm) and self.canary_norm > 0):
            raise ValueError(f"AuditConfig.canary_norm must be a positive number, got {self.canary_norm!r}")
        if self.guesses is not None:
            object.__setattr__(self, "guesses", tuple(self.guesses))
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"AuditConfig.chunk must be a positive integer, got {self.chunk!r}")


@dataclasses.dataclass
class AuditReport:
    """The audit's result: the accountant's epsilon of the run and, per kind of canary, the guesses and the bound."""

    epsilon: float
    delta: float
    confidence: float
    steps: int
    noise_multiplier: float
    sampling_rate: float
    results: dict[str, dict]
    test_accuracy: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        head = f"{'canaries':<10} {'m':>6} {'guesses':>8} {'correct':>8} {'eps lower bound':>16} {'accountant eps':>15}"
        lines = [head, "-" * len(head)]
        for kind, res in self.results.items():
            lines.append(f"{kind:<10} {res['canaries']:>6} {res['guesses']:>8} {res['correct']:>8} "
                         f"{res['epsilon_lower_bound']:>16.3f} {self.epsilon:>15.3f}")
        lines.append(f"confidence {self.confidence:g}, delta {self.delta:g}, {self.steps} steps, sigma "
                     f"{self.noise_multiplier:.4g}, q {self.sampling_rate:.4g}")
        return "\n".join(lines)

    @property
    def violated(self) -> bool:
        """True when a lower bound exceeds the accountant's epsilon: the implementation leaks more than it says."""
        return any(res["epsilon_lower_bound"] > self.epsilon for res in self.results.values())


def audit(config, audit_config: AuditConfig | None = None) -> AuditReport:
    """Run ``config`` (a :class:`dpzero_jax.train.TrainConfig`: Poisson sampling, DP on) once with the canaries of
    ``audit_config`` and bound its epsilon from below. Writes ``audit.json`` into the run's ``out``."""
    from dpzero_jax import models
    from dpzero_jax.train import Trainer, _progress_bar_class

    audit_config = AuditConfig() if audit_config is None else audit_config
    if config.no_dp or config.sampling != "poisson":
        raise ValueError(f"an audit needs a private run with Poisson sampling; got no_dp={config.no_dp}, "
                         f"sampling={config.sampling!r}")
    root = jax.random.key(audit_config.seed)
    inclusion = np.random.default_rng([audit_config.seed, 0xA0D17])
    gradient = inputs = None
    if audit_config.input_canaries:
        inputs = InputCanaries(audit_config.input_canaries, jax.random.fold_in(root, 1),
                               inclusion.random(audit_config.input_canaries) < 0.5)
    both = _Both(None, inputs)
    if audit_config.canaries:
        norm = audit_config.canary_norm
        if norm is None:
            norm = 0.99 if config.clip_fn == "global" else 10.0
        # the sampling rate is the trainer's, known once the data (with input canaries) are sized: set below
        gradient = GradientCanaries(audit_config.canaries, 1.0, config.batch_size,
                                    inclusion.random(audit_config.canaries) < 0.5, clip_fn=config.clip_fn,
                                    gamma=0.01, canary_norm=norm, chunk=audit_config.chunk)
        both.gradient = gradient
    trainer = Trainer(config, canaries=both)
    if gradient is not None:   # traced only in run(): the rate is read then
        gradient.sampling_rate = trainer.sampling_rate
    result = trainer.run()   # the trainer's progress bar shows the run
    scores = {}
    if gradient is not None:
        scores["gradient"] = (scores_of(result.opt_state), gradient.included)
    if inputs is not None:
        _, apply_fn = models.logits_fn(trainer.model, trainable=trainer.trainable)
        scores["input"] = (inputs.scores(apply_fn, result.params), inputs.included)
    results = {}
    bar = _progress_bar_class(config.progress)(total=len(scores), desc="audit bounds", disable=not config.progress)
    try:
        for kind, (values, included) in scores.items():
            results[kind] = guess_and_bound(values, included, config.delta, audit_config.confidence,
                                            audit_config.guesses)
            bar.update(1)
    finally:
        bar.close()
    report = AuditReport(epsilon=float(result.epsilon), delta=config.delta, confidence=audit_config.confidence,
                         steps=result.steps, noise_multiplier=float(result.noise_multiplier),
                         sampling_rate=float(result.sampling_rate), results=results,
                         test_accuracy=result.test_accuracy)
    if trainer.is_primary:
        (trainer.out / "audit.json").write_text(report.to_json())
    return report

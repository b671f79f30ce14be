"""The open trainer (dpzero_jax.fit): a user's model, loss, data and optax optimiser.

References are independent of the trainer: dp-accounting's PLD accountant on the Poisson-sampled Gaussian written
out here, a step written by hand from private_value_and_grad and optax, an uninterrupted run for resume."""

import functools
import json
import math
import warnings

import dp_accounting
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpzero_jax as dz
from dpzero_jax import accounting
from dpzero_jax.fit import PrivateTrainer
from dpzero_jax.fit_data import evaluate

N, D, C = 512, 8, 3


class Net(nnx.Module):   # a user's model of standard flax.nnx layers
    def __init__(self, rngs):
        self.hidden = nnx.Linear(D, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, C, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.norm(self.hidden(x))))


def nnx_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def accuracy(model, batch):
    return {"loss": nnx_loss(model, batch), "accuracy": jnp.argmax(model(batch["x"]), -1) == batch["y"]}


def synthetic(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype(np.float32)
    return {"x": x, "y": np.argmax(x @ rng.normal(size=(D, C)), 1).astype(np.int32)}


def shuffled_batches(data, batch_size, epochs, seed=1):
    """A user's own loader: shuffled fixed-size batches (not Poisson)."""
    rng = np.random.default_rng(seed)
    n = len(data["y"])
    batches = []
    for _ in range(epochs):
        order = rng.permutation(n)
        batches += [{k: v[order[i:i + batch_size]] for k, v in data.items()} for i in range(0, n, batch_size)]
    return batches


def test_user_model_iterable_and_optimiser_train_and_say_what_the_epsilon_is():
    data = synthetic()
    batches = shuffled_batches(data, 64, epochs=6)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.03, 5, len(batches))
    rows = []
    with pytest.warns(UserWarning, match="NO formal privacy guarantee"):
        trainer = PrivateTrainer(Net(nnx.Rngs(0)), nnx_loss, optax.adamw(schedule), batches, batch_size=64,
                                 steps=len(batches), noise_multiplier=0.8, sampling="other", dataset_size=N,
                                 delta=1e-4, log_every=12, callbacks=[lambda t, row: rows.append(dict(row))])
    before = evaluate(accuracy, trainer.as_model(), data)
    result = trainer.fit()
    after = trainer.evaluate(accuracy, data, batch_size=100)
    assert after["loss"] < 0.6 * before["loss"] and after["accuracy"] > 0.8, (before, after)
    assert len(rows) == len(batches) == result.steps == 48     # the callback saw every step
    assert not result.formal_guarantee and result.sampling == "as-if-poisson"
    assert "epsilon" not in result.history[-1] and result.history[-1]["epsilon_as_if_poisson"] == result.epsilon
    want = accounting.epsilon(0.8, 64 / N, 48, 1e-4)            # the number reported is Poisson's at q = B / N
    assert result.epsilon == pytest.approx(want, rel=1e-9)
    assert [r["step"] for r in result.history] == [12, 24, 36, 48]
    assert isinstance(result.model, Net) and result.model is not trainer.as_model(trainer.init_params)


def test_indexable_dataset_ledger_epsilon_is_the_poisson_sampled_gaussian_composition():
    data = synthetic()
    sigma, steps, batch, delta = 1.1, 12, 32, 1e-5
    trainer = PrivateTrainer(Net(nnx.Rngs(1)), nnx_loss, optax.sgd(0.1), data, batch_size=batch, steps=steps,
                             noise_multiplier=sigma, delta=delta, log_every=5)
    result = trainer.fit()
    q = batch / N
    assert result.sampling == "poisson" and result.formal_guarantee
    assert [(e["noise_multiplier"], e["sampling_rate"], e["count"]) for e in result.ledger.entries] == [
        (sigma, q, steps)]
    # dp-accounting from scratch: T-fold composition of a Poisson-subsampled Gaussian; the trainer's batch cap
    # reserves 1e-3 of delta for truncated batches (accounting.TRUNCATION_SHARE), so the rest is the mechanism's
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    want = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(delta * (1 - 1e-3))
    assert result.epsilon == pytest.approx(want, rel=1e-12)
    eta = result.ledger.truncation_mass
    assert 0 < eta and eta * (1 + math.exp(want)) <= 1e-3 * delta    # the cap's charge fits the reserved share
    assert result.history[-1]["epsilon"] == result.epsilon
    # the realised batches are the trainer's Poisson draws
    sizes = [trainer.sample(t).realised_size for t in range(steps)]
    assert [r["batch_size"] for r in result.history] == [sizes[4], sizes[9], sizes[11]]


class Examples:
    """A user's dataset object: ``len`` and ``__getitem__`` of an index array (e.g. reading from disk)."""

    def __init__(self, columns, rows_returned=None):
        self.columns, self.rows_returned, self.requests = columns, rows_returned, []

    def __len__(self):
        return len(self.columns["y"])

    def __getitem__(self, indices):
        self.requests.append(np.array(indices))
        return {k: v[indices[:self.rows_returned]] for k, v in self.columns.items()}


def test_epsilon_target_calibrates_sigma_on_a_dataset_object():
    examples = Examples(synthetic())
    trainer = PrivateTrainer(Net(nnx.Rngs(1)), nnx_loss, optax.sgd(0.1), examples, batch_size=32, epochs=1,
                             epsilon=2.0, delta=1e-5)
    assert trainer.steps == N // 32 and trainer.dataset_size == N
    result = trainer.fit()
    assert result.epsilon == pytest.approx(2.0, rel=1e-2) and result.epsilon <= 2.0 + 1e-9
    np.testing.assert_array_equal(examples.requests[-1], trainer.sample(N // 32 - 1).indices)   # the trainer's draw
    with pytest.raises(ValueError, match="returned 1 examples for 2 indices"):
        PrivateTrainer(Net(nnx.Rngs(1)), nnx_loss, optax.sgd(0.1), Examples(synthetic(), rows_returned=1),
                       batch_size=32, steps=2, noise_multiplier=1.0)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(C)(jax.nn.tanh(nn.Dense(16)(x)))


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_one_step_equals_private_value_and_grad_noise_and_optax_by_hand(kind):
    data = synthetic()
    if kind == "nnx":
        model = Net(nnx.Rngs(2))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, batch):
            return nnx_loss(nnx.merge(graphdef, params, rest), batch)
        user_model, user_loss = model, nnx_loss
    else:
        net = LinenNet()
        params = net.init(jax.random.key(2), data["x"][:1])["params"]

        def loss(params, batch):
            return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": params}, batch["x"]),
                                                                   batch["y"])
        user_model, user_loss = params, loss
    tx = optax.sgd(0.5, momentum=0.9)
    trainer = PrivateTrainer(user_model, user_loss, tx, data, batch_size=40, steps=5, noise_multiplier=1.3,
                             max_grad_norm=0.5, seed=7)
    got = trainer.fit(stop_at=1).params

    # by hand: the trainer's documented keys and Poisson batch, the engine's private gradient, optax
    sample_key, noise_key = jax.random.split(jax.random.fold_in(jax.random.fold_in(jax.random.key(7), 1), 0))
    drawn = trainer.sampler.sample(sample_key)
    batch = {k: v[drawn.indices] for k, v in data.items()}
    cfg = dz.DPConfig(noise_multiplier=1.3, max_grad_norm=0.5, expected_batch_size=40.0)

    @functools.partial(jax.jit, static_argnums=1)
    def by_hand(params, noise_multiplier):
        _, grads, _ = dz.private_value_and_grad(loss, cfg.replace(noise_multiplier=noise_multiplier))(
            params, batch, noise_key, jnp.asarray(drawn.mask))
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    # the same computation compiled as another program: equal up to XLA's fusion choices (a few float32 ulps)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), got, by_hand(params, 1.3))
    noiseless = by_hand(params, 0.0)   # the noise is there: sigma * R / B = 0.016 per coordinate, 0.5 the lr
    assert min(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(noiseless))) > 1e-3


def test_accumulation_and_micro_batches_add_the_noise_once_per_logical_step():
    data = synthetic()
    common = dict(batch_size=48, steps=3, noise_multiplier=1.0, seed=3)
    one = dz.PrivateTrainer(Net(nnx.Rngs(3)), nnx_loss, optax.sgd(0.5), data, **common)
    four = dz.PrivateTrainer(Net(nnx.Rngs(3)), nnx_loss, optax.sgd(0.5), data, accumulation_steps=4, **common)
    micro = dz.PrivateTrainer(Net(nnx.Rngs(3)), nnx_loss, optax.sgd(0.5), data, micro_batch_size=16, mode="vmap",
                              **common)
    assert four.slots % 4 == 0 and micro.dp_config.microbatch_size == 16
    a, b, c = one.fit(), four.fit(), micro.fit()
    for other in (b, c):   # the same noise draw (same key) on sums added in another order
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6), a.params, other.params)
        assert other.ledger == a.ledger and a.ledger.steps == 3   # one event per logical step
    assert not jax.tree.leaves(jax.tree.map(np.array_equal, a.params, one.init_params))[0]


def test_declared_poisson_batches_of_any_size_are_padded_never_truncated():
    data = synthetic()
    sizes = [30, 70, 200]   # the last is larger than the slots sized for rate 50 / 512: it gets more slots
    rng = np.random.default_rng(0)
    batches = [{k: v[rng.choice(N, size, replace=False)] for k, v in data.items()} for size in sizes]
    with pytest.warns(UserWarning, match="a guarantee only if that is true"):
        trainer = dz.PrivateTrainer(Net(nnx.Rngs(6)), nnx_loss, optax.sgd(0.1), iter(batches), batch_size=50,
                                    steps=5, noise_multiplier=1.0, sampling="poisson", dataset_size=N, log_every=2)
    assert 50 < trainer.slots < 200
    with pytest.warns(UserWarning, match="the data ended after 3 of 5 steps"):
        result = trainer.fit()
    assert [(r["step"], r["batch_size"]) for r in result.history] == [(2, 70), (3, 200)]   # the last step logged
    assert result.sampling == "declared-poisson"
    assert result.ledger.entries == [{"sampling": "poisson", "noise_multiplier": 1.0, "sampling_rate": 50 / N,
                                      "count": 3}]   # no truncation probability: nothing was cut
    assert result.epsilon == pytest.approx(accounting.epsilon(1.0, 50 / N, 3, 1e-5), rel=1e-12)


@pytest.mark.parametrize("source", ["indexable", "iterable"])
def test_kill_and_resume_is_bit_identical_to_the_uninterrupted_run(tmp_path, source):
    data = synthetic()
    batches = shuffled_batches(data, 50, epochs=1)[:8]

    def trainer(out):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return PrivateTrainer(Net(nnx.Rngs(4)), nnx_loss, optax.adam(optax.linear_schedule(0.02, 0.0, 8)),
                                  data if source == "indexable" else batches, batch_size=50, steps=8,
                                  noise_multiplier=1.0, out=out, checkpoint_every=3, log_every=2, seed=5,
                                  **({} if source == "indexable" else dict(sampling="poisson", dataset_size=N)))

    whole = trainer(tmp_path / "whole").fit()
    first = trainer(tmp_path / "cut").fit(stop_at=4)       # killed after step 4 (checkpoints at 3 and 4)
    assert first.steps == 4
    resumed = trainer(tmp_path / "cut").fit(resume=True)  # a new process: fresh model, optimiser and trainer
    jax.tree.map(np.testing.assert_array_equal, resumed.params, whole.params)
    jax.tree.map(np.testing.assert_array_equal, resumed.opt_state, whole.opt_state)
    assert resumed.ledger == whole.ledger and resumed.epsilon == whole.epsilon
    assert resumed.history == whole.history
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert rows == whole.history
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert accounting.PrivacyLedger.from_dict(summary["ledger"]) == whole.ledger
    with pytest.raises(FileExistsError, match="already holds the outputs"):
        trainer(tmp_path / "cut").fit()


def test_resume_with_other_options_is_refused(tmp_path):
    data = synthetic()
    PrivateTrainer(Net(nnx.Rngs(4)), nnx_loss, optax.sgd(0.1), data, batch_size=50, steps=2, noise_multiplier=1.0,
                   out=tmp_path, checkpoint_every=1).fit()
    other = PrivateTrainer(Net(nnx.Rngs(4)), nnx_loss, optax.sgd(0.1), data, batch_size=50, steps=2,
                           noise_multiplier=1.0, max_grad_norm=2.0, out=tmp_path, checkpoint_every=1)
    with pytest.raises(ValueError, match=r"different options \(max_grad_norm: 1.0 -> 2.0\)"):
        other.fit(resume=True)
    longer = PrivateTrainer(Net(nnx.Rngs(4)), nnx_loss, optax.sgd(0.1), data, batch_size=50, steps=3,
                            noise_multiplier=1.0, out=tmp_path, checkpoint_every=1)   # sigma given: may go on
    assert longer.fit(resume=True).ledger.steps == 3
    calibrated = dict(batch_size=50, epsilon=1.0, out=tmp_path / "eps", checkpoint_every=1)
    PrivateTrainer(Net(nnx.Rngs(4)), nnx_loss, optax.sgd(0.1), data, steps=2, **calibrated).fit()
    with pytest.raises(ValueError, match="steps: 2 -> 3"):   # sigma was calibrated for 2 steps
        PrivateTrainer(Net(nnx.Rngs(4)), nnx_loss, optax.sgd(0.1), data, steps=3, **calibrated).fit(resume=True)


class Writer:
    def __init__(self):
        self.rows, self.synced, self.closed = [], 0, False

    def write(self, row):
        self.rows.append(dict(row))

    def sync(self):
        self.synced += 1

    def close(self):
        self.closed = True


def test_callbacks_add_evaluations_to_logged_rows_and_writers_get_them(tmp_path):
    data, held_out = synthetic(), synthetic(100, seed=9)
    writer = Writer()

    def evaluate_now(trainer, row):
        if row["step"] % 2 == 0:
            row["test_accuracy"] = trainer.evaluate(accuracy, held_out)["accuracy"]

    trainer = PrivateTrainer(Net(nnx.Rngs(5)), nnx_loss, optax.adam(1e-2), data, batch_size=64, steps=4,
                             noise_multiplier=1.0, log_every=2, callbacks=[evaluate_now],
                             metric_writers=[writer, "tensorboard"],
                             out=tmp_path, checkpoint_every=2)
    result = trainer.fit()
    assert [r["step"] for r in writer.rows] == [2, 4] and writer.closed and writer.synced == 2
    assert writer.rows == result.history and all("test_accuracy" in r for r in writer.rows)
    assert writer.rows[-1]["test_accuracy"] == trainer.evaluate(accuracy, held_out)["accuracy"]
    events = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert b"test_accuracy" in events and b"epsilon" in events   # dpzero_jax.metric_writers' TensorBoard files
    with pytest.raises(ValueError, match="write into the output directory"):
        PrivateTrainer(Net(nnx.Rngs(5)), nnx_loss, optax.adam(1e-2), data, batch_size=64, steps=4,
                       noise_multiplier=1.0, metric_writers=["tensorboard"])


class NoLen:
    def __getitem__(self, indices):
        return {"x": np.zeros((len(indices), D), np.float32)}


@pytest.mark.parametrize("change, error, message", [
    (dict(loss_fn=lambda m, b: jnp.mean(nnx_loss(m, b))), ValueError, r"shape \[B\] = \(2,\).*not their mean"),
    (dict(loss_fn=lambda m, b: (nnx_loss(m, b), 0.0)), ValueError, "one array of per-example losses"),
    (dict(loss_fn=lambda m, b: nnx_loss(m, b)[:, None]), ValueError, r"got shape \(2, 1\)"),
    (dict(loss_fn=lambda m, b: m(b["missing"])), ValueError, "loss_fn failed on a batch of 2 examples"),
    (dict(data=NoLen()), TypeError, "defines __getitem__ but not __len__"),
    (dict(data=[{"x": np.zeros((4, D))}]), ValueError, "declare how with sampling='poisson'"),
    (dict(data=[{"x": np.zeros((4, D))}], sampling="poisson"), ValueError, "dataset_size"),
    (dict(data={"x": np.zeros((8, D)), "y": np.zeros(7)}), ValueError, "share their leading"),
    (dict(sampling="poisson"), ValueError, "for an iterable of batches"),
    (dict(steps=None), ValueError, "exactly one of steps and epochs"),
    (dict(epsilon=1.0), ValueError, "exclusive"),
    (dict(noise_multiplier=0.0), ValueError, "0 adds no noise"),
    (dict(delta=0.1), ValueError, "delta=0.1 is above 1/n"),
    (dict(batch_size=N + 1), ValueError, "exceeds the 512 examples"),
    (dict(optimizer=optax.sgd), TypeError, "optax.GradientTransformation"),
    (dict(checkpoint_every=5), ValueError, "needs an output directory"),
    (dict(wrt=nnx.Param, model={"w": jnp.zeros(3)}), ValueError, "wrt selects"),
    (dict(model={"w": jnp.zeros(3, jnp.int32)}), ValueError, r"\['w'\] has dtype int32"),
])
def test_bad_inputs_get_clear_errors(change, error, message):
    kwargs = dict(model=Net(nnx.Rngs(0)), loss_fn=nnx_loss, optimizer=optax.sgd(0.1), data=synthetic(),
                  batch_size=16, steps=3, noise_multiplier=1.0)
    kwargs.update(change)
    with pytest.raises(error, match=message):
        PrivateTrainer(kwargs.pop("model"), kwargs.pop("loss_fn"), kwargs.pop("optimizer"), kwargs.pop("data"),
                       **kwargs)


def test_a_user_batch_of_the_wrong_shape_and_evaluate_errors():
    bad = [{"x": np.zeros((4, D), np.float32), "y": np.zeros(4, np.int32)}, {"x": np.zeros((4, D + 1), np.float32),
                                                                              "y": np.zeros(4, np.int32)}]
    with pytest.warns(UserWarning, match="cannot check how they were drawn"):
        trainer = PrivateTrainer(Net(nnx.Rngs(0)), nnx_loss, optax.sgd(0.1), bad, batch_size=4, steps=2,
                                 noise_multiplier=1.0, sampling="poisson", dataset_size=100, delta=1e-3)
    with pytest.raises(Exception, match="8"):   # the second batch does not fit the model (flax names the sizes)
        trainer.fit()
    with pytest.raises(ValueError, match=r"per-example values of shape \[B\]"):
        evaluate(lambda m, b: jnp.mean(nnx_loss(m, b)), Net(nnx.Rngs(0)), synthetic(10))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        evaluate(nnx_loss, Net(nnx.Rngs(0)), synthetic(10), batch_size=0)


def test_a_loss_that_couples_the_examples_is_refused_before_training():
    """A linen model with a batch norm in training mode (its statistics over the batch): the trainer's loss check
    (dz.check_per_example_loss on the first examples) refuses it; check_loss=False skips the check."""
    class BatchNormNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(C)(jax.nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(16)(x))))

    net, data = BatchNormNet(), synthetic(64)
    variables = net.init(jax.random.key(0), data["x"][:2])

    def loss(params, batch):
        logits, _ = net.apply({"params": params, "batch_stats": variables["batch_stats"]}, batch["x"],
                              mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    options = dict(batch_size=16, steps=2, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"PrivateTrainer: loss_fn couples the examples.*check_loss=False"):
        PrivateTrainer(variables["params"], loss, optax.sgd(0.1), data, **options)
    PrivateTrainer(variables["params"], loss, optax.sgd(0.1), data, check_loss=False, **options)
    with pytest.raises(ValueError, match="check_loss must be true or false"):
        PrivateTrainer(variables["params"], loss, optax.sgd(0.1), data, check_loss="no", **options)

"""The bundled objectives' loss against optax's integer-label cross-entropy (an independent reference)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpzero_jax.models.objectives import token_cross_entropy


def test_token_cross_entropy_equals_optax_in_value_and_gradient():
    logits = 4.0 * jax.random.normal(jax.random.key(0), (3, 5, 11))
    targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 11)
    ours = token_cross_entropy(logits, targets)
    reference = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-6)

    weights = jnp.linspace(0.5, 2.0, 15).reshape(3, 5)
    grad = jax.grad(lambda z: jnp.sum(weights * token_cross_entropy(z, targets)))(logits)
    grad_ref = jax.grad(lambda z: jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(z, targets)))(
        logits)
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-6, atol=1e-7)


def test_token_cross_entropy_has_no_gather_or_scatter():
    logits = jnp.zeros((2, 4, 7))
    targets = jnp.zeros((2, 4), jnp.int32)
    text = jax.jit(jax.grad(lambda z: jnp.sum(token_cross_entropy(z, targets)))).lower(logits).as_text()
    assert "gather" not in text and "scatter" not in text

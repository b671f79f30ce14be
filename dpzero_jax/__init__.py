"""dpzero_jax: differentially private training in JAX at almost the cost of non-private training."""

from dpzero_jax import clipping, models, nn, noise, ops, pergrad, rules
from dpzero_jax.config import DPConfig
from dpzero_jax.engine import (
    DPStats,
    UnsupportedParameterError,
    autotune,
    choose_mode,
    make_plan,
    per_example_grad_norms,
    private_value_and_grad,
)

__all__ = [
    "DPConfig", "DPStats", "UnsupportedParameterError", "autotune", "choose_mode", "make_plan",
    "per_example_grad_norms", "private_value_and_grad", "clipping", "models", "nn", "noise", "ops", "pergrad", "rules",
]
__version__ = "0.1.0"

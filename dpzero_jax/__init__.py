"""dpzero_jax: differentially private training in JAX at almost the cost of non-private training."""

from dpzero_jax import clipping, nn, noise, ops, pergrad, rules  # noqa: F401
from dpzero_jax.config import DPConfig
from dpzero_jax.engine import (
    DPStats,
    UnsupportedParameterError,
    make_plan,
    per_example_grad_norms,
    private_value_and_grad,
)

__all__ = ["DPConfig", "DPStats", "UnsupportedParameterError", "make_plan", "per_example_grad_norms",
           "private_value_and_grad", "models", "nn", "ops"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "models":
        import importlib

        return importlib.import_module("dpzero_jax.models")
    raise AttributeError(name)

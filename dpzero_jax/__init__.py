"""dpzero_jax: differentially private training in JAX at almost the cost of non-private training."""

from dpzero_jax import (
    accounting,
    clipping,
    hf,
    models,
    nn,
    noise,
    ops,
    peft,
    pergrad,
    planner,
    rmm,
    rmm_diagnostics,
    rules,
    sampling,
    sharding,
    sketch,
    text,
    train,
)
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
    "per_example_grad_norms", "private_value_and_grad", "accounting", "clipping", "hf", "models", "nn", "noise",
    "ops", "peft", "pergrad", "planner", "rmm", "rmm_diagnostics", "rules", "sampling", "sharding", "sketch", "text",
    "train",
]
__version__ = "0.1.0"

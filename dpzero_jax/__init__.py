"""dpzero_jax: differentially private training in JAX at almost the cost of non-private training.

Submodules and the names below are imported on first use (PEP 562), so ``import dpzero_jax`` does not import JAX,
flax or dp-accounting; ``dpzero_jax.accounting``, ``dpzero_jax.DPConfig`` etc. work as attributes as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# exported name -> the submodule that defines it
_ATTRIBUTES = {
    "DPConfig": "config",
    "ClippedGrad": "optax_dp",
    "DPStats": "engine",
    "FitResult": "fit_data",
    "GaussianPrivatizerState": "optax_dp",
    "PrivateTrainer": "fit",
    "UnsupportedParameterError": "engine",
    "autotune": "engine",
    "check_per_example_loss": "loss_check",
    "choose_mode": "engine",
    "clipped_grad": "optax_dp",
    "evaluate": "fit_data",
    "explain_plan": "explain",
    "gaussian_privatizer": "optax_dp",
    "make_plan": "engine",
    "nnx_private_step": "optax_dp",
    "per_example_grad_norms": "engine",
    "private_value_and_grad": "engine",
}
_SUBMODULES = (
    "accounting", "adaptive_clipping", "aot", "clipping", "hf", "layers", "models", "nn", "noise", "ops", "peft",
    "pergrad", "planner", "rmm", "rmm_diagnostics", "rules", "sampling", "sharding", "sketch", "text", "train",
)
# importable as attributes too (they were, as side effects of the eager imports), not exported by ``*``
_OTHER_SUBMODULES = ("checkpoints", "cli", "config", "data", "engine", "explain", "fit", "fit_data", "loss_check",
                     "metric_writers", "optax_dp", "optim", "program", "running_accountant", "tape")

__all__ = [*_ATTRIBUTES, *_SUBMODULES]


def __getattr__(name: str):
    if name in _ATTRIBUTES:
        value = getattr(importlib.import_module(f"{__name__}.{_ATTRIBUTES[name]}"), name)
    elif name in _SUBMODULES or name in _OTHER_SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value          # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_OTHER_SUBMODULES})


if TYPE_CHECKING:  # what static tools and IDEs see; nothing is imported at run time
    from dpzero_jax import (  # noqa: F401
        accounting,
        adaptive_clipping,
        aot,
        cli,
        clipping,
        config,
        data,
        engine,
        explain,
        fit,
        fit_data,
        hf,
        loss_check,
        models,
        nn,
        noise,
        ops,
        optax_dp,
        peft,
        pergrad,
        planner,
        program,
        rmm,
        rmm_diagnostics,
        rules,
        sampling,
        sharding,
        sketch,
        tape,
        text,
        train,
    )
    from dpzero_jax.config import DPConfig  # noqa: F401
    from dpzero_jax.engine import (  # noqa: F401
        DPStats,
        UnsupportedParameterError,
        autotune,
        choose_mode,
        make_plan,
        per_example_grad_norms,
        private_value_and_grad,
    )
    from dpzero_jax.explain import explain_plan  # noqa: F401
    from dpzero_jax.fit import PrivateTrainer  # noqa: F401
    from dpzero_jax.fit_data import FitResult, evaluate  # noqa: F401
    from dpzero_jax.loss_check import check_per_example_loss  # noqa: F401
    from dpzero_jax.optax_dp import (  # noqa: F401
        ClippedGrad,
        GaussianPrivatizerState,
        clipped_grad,
        gaussian_privatizer,
        nnx_private_step,
    )

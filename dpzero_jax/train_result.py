"""What a training run returns: :class:`TrainResult`, and :class:`NonFiniteEvaluationError` for a diverged run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dpzero_jax import (
    accounting,
)


@dataclasses.dataclass
class TrainResult:
    test_accuracy: float | None     # None for causal LM
    train_accuracy: float | None
    test_loss: float
    epsilon: float | None          # None without a formal guarantee (no_dp, shuffled epochs)
    delta: float
    steps: int
    noise_multiplier: float | None
    sampling_rate: float
    runtime_s: float
    out: str
    sampling: str = "poisson"
    task: str = "classification"
    test_perplexity: float | None = None   # causal LM: exp(test loss per token)
    batch_cap: int | None = None           # Poisson: static slots per step (batches beyond are truncated)
    truncation_charge: float | None = None  # Poisson: share of delta charged for truncation, mass * (1 + e^eps) / delta
    accounting_s: dict | None = None        # seconds in privacy accounting: plan (calibration), rows, final
    large_delta: bool = False   # delta > 1/n, allowed by allow_large_delta
    clip_thresholds: list | None = None   # adaptive clipping: the final group thresholds
    gradient_noise_multiplier: float | None = None   # adaptive clipping: the gradient's share of sigma
    count_noise_multiplier: float | None = None      # adaptive clipping: the count's, 2 sigma_b / sqrt(M)
    params: Any = dataclasses.field(repr=False, default=None)
    opt_state: Any = dataclasses.field(repr=False, default=None)
    history: list = dataclasses.field(repr=False, default_factory=list)
    model: Any = dataclasses.field(repr=False, default=None)   # the trained NNX model (final params)

    def save_pretrained(self, path) -> Path:
        """Write the trained model as a Hugging Face checkpoint (``config.json`` + ``model.safetensors``; LoRA
        adapters folded in) that ``transformers``' ``from_pretrained`` loads. GPT2, BertEncoder and ViT only."""
        if not hasattr(self.model, "save_pretrained"):
            raise ValueError(f"save_pretrained: the {type(self.model).__name__} model has no Hugging Face format "
                             f"(GPT-2, BERT / RoBERTa and ViT have)")
        from dpzero_jax.models import pretrained

        return pretrained.save(self.model, path)

    def summary(self) -> str:
        if self.noise_multiplier is None:
            privacy = "no privacy guarantee (--no-dp)"
        elif self.epsilon is None:
            privacy = f"sigma {self.noise_multiplier:.4f} but NO formal guarantee ({self.sampling} sampling)"
        else:
            privacy = f"epsilon {self.epsilon:.3f} at delta {self.delta:g} (sigma {self.noise_multiplier:.4f})"
            if self.batch_cap is not None and self.truncation_charge is not None:
                reserved = accounting.TRUNCATION_SHARE
                within = f", within the {reserved:g} reserved" if self.truncation_charge <= reserved else ""
                privacy += (f"  batch cap {self.batch_cap} (truncation charge {self.truncation_charge:.2g} of "
                            f"delta{within})")
        if self.large_delta and self.noise_multiplier is not None:
            privacy += " [delta > 1/n: allowed by --allow-large-delta]"
        if self.clip_thresholds is not None:
            privacy += (f"  adaptive clipping: gradient sigma {self.gradient_noise_multiplier:.4f}, count sigma "
                        f"{self.count_noise_multiplier:.4g}, final thresholds "
                        f"{', '.join(f'{t:.4g}' for t in self.clip_thresholds)}")
        if self.task == "causal-lm":
            quality = f"test loss {self.test_loss:.4f}  test perplexity {self.test_perplexity:.2f}"
        else:
            quality = f"test accuracy {100 * self.test_accuracy:.2f}%  train accuracy {100 * self.train_accuracy:.2f}%"
        return f"{quality}  {privacy}  steps {self.steps}  q {self.sampling_rate:.4f}  time {self.runtime_s:.1f}s"


class NonFiniteEvaluationError(RuntimeError):
    """The run's final evaluation is not finite (NaN or infinite test loss): training diverged. Raised by
    :meth:`Trainer.run` after the run's outputs (metrics, summary with ``evaluation_finite: false``, plot,
    checkpoints) are written, for inspection; no export is written. ``result`` is the run's :class:`TrainResult`.
    ``dpzero train`` prints the message and exits with status 2."""

    def __init__(self, result: TrainResult, test_loss: float):
        super().__init__(f"the final evaluation is not finite (test loss {test_loss}): training diverged after "
                         f"{result.steps} steps; outputs kept in {result.out} for inspection, nothing exported -- "
                         f"try a lower --lr (or --precision fp32)")
        self.result = result

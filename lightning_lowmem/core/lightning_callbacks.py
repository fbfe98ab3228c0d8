"""Lightning's own callbacks that a step inside backward cannot honour (``OptimizerInBackward`` and
``OffloadStrategy(optimizer_in_backward=True)`` both refuse them at setup)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import GradientAccumulationScheduler, StochasticWeightAveraging


def lightning_callback_problems(trainer: L.Trainer, pl_module: L.LightningModule, who: str) -> list[str]:
    """Lightning's callbacks in ``trainer`` that a step inside backward (``who``) cannot honour, each with the fix."""
    problems = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        name = type(callback).__name__
        if isinstance(callback, GradientAccumulationScheduler):
            factors = {e: f for e, f in callback.scheduling.items() if f != 1}
            if factors:
                problems.append(
                    f"`{name}(scheduling={callback.scheduling})` accumulates gradients from epoch {min(factors)}: "
                    f"{who} cannot accumulate (each parameter steps as soon as its gradient is ready); remove the "
                    "scheduler or the step in backward"
                )
        elif isinstance(callback, StochasticWeightAveraging) and callback.pl_module_contains_batch_norm(pl_module):
            problems.append(
                f"`{name}` on a module with BatchNorm: its extra BatchNorm epoch runs no backward and Lightning steps "
                "the optimizer once more with the last step's gradients, which "
                f"{who} has already used and freed, so the weights would differ; remove `{name}` or the step in backward"
            )
    return problems

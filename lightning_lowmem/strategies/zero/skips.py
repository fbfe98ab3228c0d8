"""Optimizer steps DeepSpeed skipped for non-finite gradients: logged and warned (private helper of ``zero.py``).

DeepSpeed's ZeRO optimizers check the gradients before each step and skip a step whose gradients hold inf/nan
(``engine.skipped_steps`` counts them); under fp16 its loss scaler also lowers the scale and logs it, but under
bf16 and fp32 nothing is said, and a run whose every step is skipped does not train. As ``lowmem_offload`` does,
the count is logged as ``lowmem/skipped_steps`` and the first skip of a bf16/fp32 run warns.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_lowmem._internals import lightning as lightning_internals


class SkippedSteps:
    """Reads ``engine.skipped_steps`` around each ``optimizer_step`` of a ``ZeroStrategy``."""

    def __init__(self) -> None:
        self.warned = False

    @staticmethod
    def count(strategy: Any) -> int:
        engine = getattr(strategy, "deepspeed_engine", None)
        return int(getattr(engine, "skipped_steps", 0) or 0)

    def after_step(self, strategy: Any, before: int, model: Any) -> None:
        engine = getattr(strategy, "deepspeed_engine", None)
        if engine is None:
            return
        skipped = self.count(strategy)
        trainer = lightning_internals.attached_trainer(model)
        if skipped > before and not self.warned and not engine.fp16_enabled():
            self.warned = True
            step = trainer.global_step if trainer is not None else "?"
            warnings.warn(
                f"ZeroStrategy: DeepSpeed skipped the optimizer step at global step {step}: the gradients held inf/nan. "
                "The weights and the optimizer state are unchanged. Skips are counted in `lowmem/skipped_steps`; "
                "this warning is shown once. Look for the batch or loss that produced it "
                "(`Trainer(detect_anomaly=True)`), or lower the learning rate if it keeps happening.",
                RuntimeWarning,
                stacklevel=2,
            )
        if trainer is not None and lightning_internals.current_hook(model) is not None:
            # NOTE: only inside a loop hook (`optimizer_step`): `log` refuses elsewhere
            model.log("lowmem/skipped_steps", float(skipped), on_step=True, on_epoch=False, batch_size=1)

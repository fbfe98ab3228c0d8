"""The progress bar under ``AccumulationScheduler``: optimizer steps, as plain Lightning shows them at the effective batch.

The scheduler feeds Lightning micro-batches, so Lightning's bar counts micro-batches (16 per optimizer step with an
effective batch of 16 from micro-batches of 1) against a total that, under ``max_steps``, is counted in optimizer
steps (``min(batches, max_steps - global_step)``): "32/2" after two steps. Plain Lightning at the effective batch (one
batch per optimizer step) shows "2/2". The Trainer's own bar (``TQDMProgressBar`` or ``RichProgressBar``, exactly
those classes) is given a subclass here that counts optimizer steps: the total is the epoch's windows (bounded by
``max_steps`` as Lightning bounds batches) and the bar moves when a window closes. ``RichProgressBar`` also writes
"Epoch 0/-2" when only ``max_steps`` bounds the run (``max_epochs=-1``); the subclass writes "Epoch 0" there, as
``TQDMProgressBar`` does. A user's own progress bar subclass is left alone (its counting is its own).
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override


class _CountsOptimizerSteps:
    """Mixin of the bars below: the total and position in optimizer steps of the scheduler's windows."""

    _lowmem_steps: Any = None  # the AccumulationScheduler whose windows are counted

    @property
    @override
    def total_train_batches(self) -> int | float:
        trainer = self.trainer  # type: ignore[attr-defined]
        steps = steps_in_epoch(self._lowmem_steps, trainer)
        # NOTE: as `ProgressBar.total_train_batches`, with optimizer steps for batches
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            return min(steps, trainer.max_steps - trainer.global_step)
        return steps

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._lowmem_steps._last:  # a window closed: the bar moves to the number of steps done this epoch
            done = trainer.global_step - self._lowmem_steps._epoch_start_step
            super().on_train_batch_end(trainer, pl_module, outputs, batch, done - 1)  # type: ignore[misc]


class _TQDMSteps(_CountsOptimizerSteps, TQDMProgressBar):
    pass


class _RichSteps(_CountsOptimizerSteps, RichProgressBar):
    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if trainer.max_epochs == -1 and self.progress is not None and self.train_progress_bar_id is not None:
            # NOTE: RichProgressBar writes f"Epoch {epoch}/{max_epochs - 1}", "Epoch 0/-2" when max_steps bounds the run
            text = f"Epoch {trainer.current_epoch}"
            text = f"{text:{len(self.validation_description)}}"
            style = self.theme.description
            self.progress.update(self.train_progress_bar_id, description=f"[{style}]{text}" if style else text)


_STEP_BARS: dict[type, type] = {TQDMProgressBar: _TQDMSteps, RichProgressBar: _RichSteps}


def count_optimizer_steps(trainer: L.Trainer, scheduler: Any) -> None:
    """Make the Trainer's progress bar count ``scheduler``'s optimizer steps (undone by :func:`restore`)."""
    bar = trainer.progress_bar_callback
    steps_class = _STEP_BARS.get(type(bar))
    if bar is None or steps_class is None:
        return
    # NOTE: the instance's class is swapped, not the callback replaced: its settings (refresh rate, theme, console)
    # and Lightning's reference to it stay as they are
    bar.__class__ = steps_class
    bar._lowmem_steps = scheduler  # type: ignore[attr-defined]


def restore(trainer: L.Trainer) -> None:
    bar = trainer.progress_bar_callback
    if isinstance(bar, _CountsOptimizerSteps):
        bar.__class__ = next(base for base, steps in _STEP_BARS.items() if isinstance(bar, steps))
        del bar._lowmem_steps


def steps_in_epoch(scheduler: Any, trainer: L.Trainer) -> int | float:
    """Optimizer steps of this epoch: its micro-batches in windows (Lightning steps on a partial last window)."""
    batches = trainer.num_training_batches
    start = scheduler._epoch_start_step
    window = scheduler.effective_batch_at(start, trainer.current_epoch) // (scheduler._micro * trainer.world_size)
    return batches if math.isinf(batches) else math.ceil(batches / max(window, 1))


__all__ = ["count_optimizer_steps", "restore", "steps_in_epoch"]

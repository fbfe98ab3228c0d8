"""``LossLog``: one line per N optimizer steps with the training loss, so a run's progress stays on screen."""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override


class LossLog(L.Callback):
    """Print ``step N  train_loss X  (val_loss Y)`` every ``every_n_steps`` optimizer steps and at the end of fit.

    Example:
        >>> trainer = L.Trainer(callbacks=[LossLog(every_n_steps=1)], max_steps=2, enable_progress_bar=False,
        ...                     enable_model_summary=False)
        >>> trainer.fit(tiny_model(), tiny_data())  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        step 1  train_loss ...
        step 2  train_loss ...
        train_loss ... -> ... over 2 steps
    """

    def __init__(self, every_n_steps: int = 10) -> None:
        if every_n_steps < 1:
            raise ValueError(f"Passed `LossLog(every_n_steps={every_n_steps})`; it must be at least 1.")
        self.every_n_steps = every_n_steps
        self.history: list[tuple[int, float]] = []

    def _line(self, trainer: L.Trainer) -> str | None:
        metrics = trainer.callback_metrics
        if "train_loss" not in metrics:
            return None
        loss = float(metrics["train_loss"])
        self.history.append((trainer.global_step, loss))
        val = f"  val_loss {float(metrics['val_loss']):.4f}" if "val_loss" in metrics else ""
        return f"step {trainer.global_step:>6d}  train_loss {loss:.4f}{val}"

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step and (step == 1 or step % self.every_n_steps == 0) and (not self.history or self.history[-1][0] != step):
            line = self._line(trainer)
            if line and trainer.is_global_zero:
                print(line, flush=True)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.history and trainer.is_global_zero:
            first, last = self.history[0][1], self.history[-1][1]
            print(f"train_loss {first:.4f} -> {last:.4f} over {trainer.global_step} steps", flush=True)

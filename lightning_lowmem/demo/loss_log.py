"""``LossLog``: one line per N optimizer steps with the training loss and the time left, so a run's progress shows."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from typing_extensions import override


class LossLog(L.Callback):
    """Print ``step N/M  train_loss X  (val_loss Y)  S s/step, ~T s left`` every ``every_n_steps`` optimizer steps (and
    after the first), and the loss's first and last values at the end of fit.

    Example:
        >>> trainer = L.Trainer(callbacks=[LossLog(every_n_steps=1)], max_steps=2, enable_progress_bar=False,
        ...                     enable_model_summary=False)
        >>> trainer.fit(tiny_model(), tiny_data())  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        step 1/2  train_loss ...
        step 2/2  train_loss ...
        train_loss ... -> ... over 2 steps
    """

    def __init__(self, every_n_steps: int = 10) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"Passed `LossLog(every_n_steps={every_n_steps!r})`; it must be an integer >= 1.")
        self.every_n_steps = every_n_steps
        self.history: list[tuple[int, float]] = []
        self._start: float | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def _line(self, trainer: L.Trainer) -> str | None:
        metrics = trainer.callback_metrics
        if "train_loss" not in metrics:
            return None
        step, total = trainer.global_step, trainer.max_steps
        loss = float(metrics["train_loss"])
        self.history.append((step, loss))
        val = f"  val_loss {float(metrics['val_loss']):.4f}" if "val_loss" in metrics else ""
        per_step = (time.perf_counter() - self._start) / step if self._start is not None else None
        pace = "" if per_step is None else f"  {per_step:.1f} s/step" + (
            f", ~{per_step * (total - step):.0f} s left" if total > step else "")
        return f"step {step}{f'/{total}' if total > 0 else ''}  train_loss {loss:.4f}{val}{pace}"

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
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

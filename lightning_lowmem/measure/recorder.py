"""``StepMemoryRecorder``: the memory of sampled training steps, by phase, category and role.

One mechanism for every measurement of a training step: ``MemoryReport`` measures the real run with
it, and the dry run measures its fake run with the very same callback, so a prediction and its
measurement cut the step at the same hooks and count the same storages.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_lowmem.core.accounting import CATEGORIES, ROLES, ReportsMemory
from lightning_lowmem.measure.cuda_peak import CudaPeaks, CudaPeakWindow
from lightning_lowmem.measure.tracker import MemoryTracker

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


class StepMemoryRecorder(Callback):
    """Measure each sampled optimizer step (all its micro-batches) with a :class:`MemoryTracker`.

    Phases: ``forward`` from ``on_train_batch_start``, ``backward`` from ``on_before_backward`` to
    ``on_after_backward``, ``optimizer`` from ``on_before_optimizer_step`` to ``on_train_batch_end``. Sampled steps:
    ``global_step % every_n_steps == 0``, and always the second (the first steady-state one); each appends one dict to
    :attr:`steps` (see :meth:`record`), with what strategies and callbacks implementing ``memory_breakdown()`` report.
    On CUDA every step's peaks are also read from CUDA's own statistics.

    Example:
        >>> from lightning_lowmem import StepMemoryRecorder
        >>> recorder = StepMemoryRecorder(every_n_steps=1)
        >>> trainer = L.Trainer(callbacks=[recorder], max_steps=2,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(tiny_model(), tiny_data())
        >>> step = recorder.steps[1]
        >>> step["peak_bytes"] > 0, sorted(step["phases"]["backward"]["device"])
        (True, ['activations', 'gradients', 'optimizer_state', 'other', 'total', 'weights'])
    """

    def __init__(self, every_n_steps: int = 1, timeline: bool = False, bool_masks: bool = False) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise TypeError(f"Passed `every_n_steps={every_n_steps!r}`; expected an integer >= 1 (1 samples every step).")
        if every_n_steps < 1:
            raise ValueError(f"Passed `every_n_steps={every_n_steps!r}`; expected an integer >= 1 (1 samples every step).")
        for name, value in (("timeline", timeline), ("bool_masks", bool_masks)):
            if not isinstance(value, bool):
                raise TypeError(f"Passed `{name}={value!r}`; expected True or False.")
        self.every_n_steps = every_n_steps
        self.timeline_enabled = timeline
        #: count dropout masks at 1 B per element (:class:`MemoryTracker`'s ``bool_masks``: a CPU trace of a CUDA run)
        self.bool_masks = bool_masks
        #: elements of those masks over the sampled steps
        self.mask_elements = 0
        self.steps: list[dict[str, Any]] = []
        #: the first micro-batch of the run, as ``on_train_batch_start`` saw it (what a dry run of this run feeds)
        self.first_batch: Any = None
        self._tracker: MemoryTracker | None = None
        self._window_step = -1
        self._micro_batches = 0
        self._act_after_fwd = 0
        self._cuda_window: CudaPeakWindow | None = None
        self._windows = -1  # optimizer-step windows opened since the fit began

    @property
    def tracker(self) -> MemoryTracker | None:
        """The tracker of the step being sampled (None between sampled steps)."""
        return self._tracker

    def sampled(self, step: int) -> bool:
        # NOTE: the second window, not `global_step == 1`: with two optimizers (a GAN) every batch steps twice
        return step % self.every_n_steps == 0 or self._windows == 1

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        device = trainer.strategy.root_device
        if self.first_batch is None:
            self.first_batch = batch
        if self._window_step != step:  # the first micro-batch of an optimizer step
            self._close(trainer)
            self._window_step = step
            self._windows += 1
            self._micro_batches = 0
            self._act_after_fwd = 0
            if device.type == "cuda" and torch.cuda.is_available():
                if self._cuda_window is None:
                    self._cuda_window = CudaPeakWindow(device)
                else:
                    self._cuda_window.lap()
            if self.sampled(step):
                self._tracker = MemoryTracker(pl_module, trainer.optimizers, device=device, timeline=self.timeline_enabled,
                                              bool_masks=self.bool_masks)
                self._tracker.__enter__()
        self._micro_batches += 1
        if self._tracker is not None:
            self._tracker.track(batch)
            self._tracker.set_phase("forward")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._tracker is not None:
            live = self._tracker.breakdown()
            self._act_after_fwd = max(self._act_after_fwd, live.device["activations"] + live.host["activations"])
            self._tracker.set_phase("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._tracker is not None:
            self._tracker.set_phase(None)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._tracker is not None:
            self._tracker.set_phase("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._tracker is not None:
            self._tracker.set_phase(None)
        if trainer.global_step != self._window_step:  # the optimizer stepped: the window is complete
            self._close(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(trainer)
        self._close_cuda()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(type(exception), exception, None)
            self._tracker = None
        self._close_cuda()

    def _close_cuda(self) -> None:
        if self._cuda_window is not None:
            self._cuda_window.close()
            self._cuda_window = None

    def _close(self, trainer: pl.Trainer) -> None:
        """End the current optimizer step's window: finish tracking (if sampled) and hand over the record."""
        if self._window_step < 0:
            return
        cuda_step = self._cuda_window.read() if self._cuda_window is not None else None
        tracker, self._tracker = self._tracker, None
        record = None
        if tracker is not None:
            tracker.__exit__(None, None, None)
            self.mask_elements += tracker.mask_elements
            record = self.record(trainer, tracker, cuda_step)
            self.steps.append(record)
        self.step_closed(trainer, self._window_step, record, tracker, cuda_step)
        self._window_step = -1

    def step_closed(self, trainer: pl.Trainer, step: int, record: dict[str, Any] | None, tracker: MemoryTracker | None,
                    cuda_step: CudaPeaks | None) -> None:
        """Called once per optimizer step after its window closed (``record`` is None for an unsampled step)."""

    def record(self, trainer: pl.Trainer, tracker: MemoryTracker, cuda_step: CudaPeaks | None) -> dict[str, Any]:
        """The sampled step as a JSON-able dict: peaks overall and per phase (device and host), components."""
        report = tracker.report()
        components = {}
        for name, obj in reporters(trainer, exclude=self):
            try:
                components[name] = obj.memory_breakdown().to_dict()
            except Exception as err:  # noqa: BLE001 - a reporter's bug must not stop training; it is recorded
                components[name] = {"error": f"{type(err).__name__}: {err}"}
        return {
            "step": self._window_step,
            "window": self._windows,
            "micro_batches": self._micro_batches,
            "peak_bytes": report["peak_bytes"],
            "peak_bytes_host": report["peak_bytes_host"],
            "peak_phase": report["peak_phase"],
            "peak": report["peak"],
            "phases": report["phases"],
            "activations_after_forward": self._act_after_fwd,
            "live_at_end": report["live_at_end"],
            "cuda_max_allocated": cuda_step[0] if cuda_step else None,
            "cuda_max_reserved": cuda_step[1] if cuda_step else None,
            "cuda_max_active": cuda_step.active if cuda_step else None,
            "components": components,
            "aten_ops": tracker.num_ops,
            **({"window_events": tracker.window_events} if tracker.window_events else {}),
        }


def phase_maxima(steps: list[dict[str, Any]], scopes: Any = PHASES) -> dict[str, dict[str, dict[str, int]]]:
    """Per phase (or other scope of the records) and role, the bytes by category at the highest total over
    ``steps`` (records of the recorder); a scope no step ran is absent."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for scope in scopes:
        for role in ROLES:
            best: dict[str, int] | None = None
            for record in steps:
                p = record["phases"].get(scope)
                if p is not None and (best is None or p[role]["total"] > best["total"]):
                    best = p[role]
            if best is not None:
                out.setdefault(scope, {})[role] = {c: int(best[c]) for c in (*CATEGORIES, "total")}
    return out


def reporters(trainer: pl.Trainer, exclude: Any = None) -> list[tuple[str, ReportsMemory]]:
    """The strategy, precision plugin and callbacks of ``trainer`` that implement ``memory_breakdown()``."""
    candidates = [trainer.strategy, getattr(trainer.strategy, "precision_plugin", None), *trainer.callbacks]
    unique = {id(obj): obj for obj in candidates if obj is not None and obj is not exclude}  # first seen first
    return [(type(obj).__name__, obj) for obj in unique.values() if isinstance(obj, ReportsMemory)]


__all__ = ["PHASES", "StepMemoryRecorder", "phase_maxima", "reporters"]

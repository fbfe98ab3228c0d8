"""``MemoryReport``: measured peak memory per step phase and category, beside the prediction of the same run."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import HalfPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities import apply_to_collection
from typing_extensions import override

from lightning_lowmem.core.accounting import CATEGORIES
from lightning_lowmem.core.atomic import atomic_write_text
from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.measure.cuda_peak import CudaPeaks
from lightning_lowmem.measure.recorder import PHASES, StepMemoryRecorder
from lightning_lowmem.measure.tracker import MemoryTracker
from lightning_lowmem.predict.dry_run import dry_run
from lightning_lowmem.predict.run_spec import RunSpec
from lightning_lowmem.report import render

_PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")


class MemoryReport(StepMemoryRecorder):
    """Measure peak memory of sampled training steps by phase and category; log, tabulate, save and plot it.

    A :class:`~lightning_lowmem.measure.tracker.MemoryTracker` counts live tensor storage (not process RSS) of every
    sampled optimizer step by category, role and phase. At the end of fit it prints one table: the measured step with
    the highest device peak, the dry-run prediction of the same run and of plain fp32 training, with the saving; it
    writes ``memory_report.json`` and ``memory_step.png`` into ``save_dir`` (docs/techniques/memory-report.md).

    It saves nothing; cost: an unsampled step costs what a step without it costs; a sampled step ~1.3x (~23 µs per
    aten op); the end of fit runs two dry runs (``predict=True``).

    Metric keys logged to every logger of the Trainer, at the sampled step (bytes):
        - ``memory/peak_bytes``: device-role peak of the step.
        - ``memory/peak_bytes_host``: host-role peak of the step.
        - ``memory/peak/<category>``: device-role bytes per category at the device peak, for each of
          ``weights``, ``gradients``, ``optimizer_state``, ``activations``, ``other``.
        - ``memory/peak_host/<category>``: host-role bytes per category at the host peak.
        - ``memory/<phase>/peak_bytes`` and ``memory/<phase>/peak_bytes_host`` for ``phase`` in ``forward``,
          ``backward``, ``optimizer`` (only with ``phases=True``; a phase the step did not run is absent).
        - ``memory/activations_after_forward``: activation bytes (device + host) alive when backward starts
          (the largest over the step's micro-batches).
      On CUDA, every step:
        - ``memory/cuda/max_allocated_bytes``, ``memory/cuda/max_reserved_bytes``: CUDA's peaks over the step.
      On CUDA, sampled steps with ``phases=True``:
        - ``memory/<phase>/cuda_max_allocated_bytes``, ``memory/<phase>/cuda_max_reserved_bytes``.

    Args:
        every_n_steps: sample the optimizer steps whose ``global_step`` is a multiple of this, and the second one
            (step 1, the first steady-state step).
        phases: log and tabulate per-phase peaks (the step peak and categories are always reported).
        plot: draw ``memory_step.png`` (matplotlib, Agg backend) at the end of fit.
        save_dir: where ``memory_report.json`` and the PNG go. Default: ``<trainer.log_dir or
            default_root_dir>/memory_report``.
        predict: add the prediction of this run and the plain fp32 baseline (two dry runs at the end of fit).
        gpu_precision: also predict this run on a CUDA device at this precision (``"bf16-true"``, ...) beside plain
            fp32 training there (two more dry runs): what the recipe saves on a GPU, whatever precision this machine
            trained at (the demo trains in 32-true on a CPU without native bf16).

    Example:
        >>> from lightning_lowmem import MemoryReport
        >>> trainer = L.Trainer(callbacks=[MemoryReport(every_n_steps=100, save_dir="runs/memory")], max_steps=2,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(tiny_model(), tiny_data())  # logs the table at the end
        >>> import os
        >>> sorted(os.listdir("runs/memory"))
        ['memory_report.json', 'memory_step.png']

    Attributes:
        steps: one dict per sampled step (what ``memory_report.json`` holds under ``"steps"``).
        predicted, baseline: the two dry runs as dicts (``MemoryEstimate.to_dict()``), or ``{"error": ...}``.
        gpu: with ``gpu_precision``, ``{"run": ..., "plain_fp32": ...}``: the two GPU predictions, as dicts.
        table: the table printed at the end of fit.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        phases: bool = True,
        plot: bool = True,
        save_dir: str | os.PathLike | None = None,
        predict: bool = True,
        gpu_precision: str | None = None,
    ) -> None:
        problems, wrong_type = [], []
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            wrong_type.append(f"Passed `every_n_steps={every_n_steps!r}`; expected an integer >= 1.")
        elif every_n_steps < 1:
            problems.append(f"Passed `every_n_steps={every_n_steps!r}`; expected an integer >= 1 (1 samples every step).")
        for name, value in (("phases", phases), ("plot", plot), ("predict", predict)):
            if not isinstance(value, bool):
                wrong_type.append(f"Passed `{name}={value!r}`; expected True or False.")
        if gpu_precision is not None and gpu_precision not in _PRECISIONS:
            problems.append(f"Passed `gpu_precision={gpu_precision!r}`; expected one of {', '.join(_PRECISIONS)} or None.")
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            wrong_type.append(f"Passed `save_dir` of type {type(save_dir).__name__}; expected a path (str or os.PathLike).")
        elif save_dir is not None and Path(save_dir).expanduser().is_file():
            problems.append(f"Passed `save_dir={str(save_dir)!r}`, which is a file; give a directory (it is created if missing).")
        if wrong_type:
            raise TypeError(" ".join(wrong_type + problems))
        if problems:
            raise ValueError(" ".join(problems))
        super().__init__(every_n_steps=every_n_steps, timeline=plot)
        self.phases = phases
        self.plot = plot
        self.save_dir: Path | None = Path(save_dir).expanduser() if save_dir is not None else None
        self.predict = predict
        self.gpu_precision = gpu_precision
        self.gpu: dict[str, Any] | None = None
        self.table: str = ""
        self.predicted: dict[str, Any] | None = None
        self.baseline: dict[str, Any] | None = None
        self._timeline: dict[str, Any] | None = None
        self._timeline_peak = -1
        self._fit_ended = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_lightning_object(trainer, "the Trainer of MemoryReport")
        if stage != "fit":
            return
        if self.save_dir is None:
            self.save_dir = Path(trainer.log_dir or trainer.default_root_dir) / "memory_report"
        if trainer.is_global_zero:
            self._check_writable(self.save_dir)
        self.steps, self.first_batch, self._windows = [], None, -1
        self._timeline, self._timeline_peak, self._fit_ended = None, -1, False

    @staticmethod
    def _check_writable(path: Path) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
                pass
        except OSError as err:
            raise ValueError(
                f"Passed `save_dir={str(path)!r}`, which cannot be written ({err.strerror or err}). Give a directory "
                "this process can create and write, e.g. `MemoryReport(save_dir='runs/memory')`."
            ) from err

    @override
    def step_closed(self, trainer: pl.Trainer, step: int, record: dict[str, Any] | None, tracker: MemoryTracker | None,
                    cuda_step: CudaPeaks | None) -> None:
        metrics: dict[str, float] = {}
        if cuda_step is not None:
            metrics["memory/cuda/max_allocated_bytes"] = cuda_step[0]
            metrics["memory/cuda/max_reserved_bytes"] = cuda_step[1]
            metrics["memory/cuda/max_active_bytes"] = cuda_step.active
        if record is not None:
            metrics.update(self._metrics(record))
            if self.plot and tracker is not None and tracker.peak_bytes > self._timeline_peak:
                self._timeline_peak = tracker.peak_bytes
                self._timeline = {"step": record["step"], **render.downsample(tracker.timeline())}
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def _metrics(self, record: dict[str, Any]) -> dict[str, float]:
        m: dict[str, float] = {
            "memory/peak_bytes": record["peak_bytes"],
            "memory/peak_bytes_host": record["peak_bytes_host"],
            "memory/activations_after_forward": record["activations_after_forward"],
        }
        for cat in CATEGORIES:
            m[f"memory/peak/{cat}"] = record["peak"]["device"][cat]
            m[f"memory/peak_host/{cat}"] = record["peak"]["host"][cat]
        if self.phases:
            for phase in PHASES:
                p = record["phases"].get(phase)
                if p is None:
                    continue
                m[f"memory/{phase}/peak_bytes"] = p["device"]["total"]
                m[f"memory/{phase}/peak_bytes_host"] = p["host"]["total"]
                if p["cuda_max_allocated"] is not None:
                    m[f"memory/{phase}/cuda_max_allocated_bytes"] = p["cuda_max_allocated"]
                    m[f"memory/{phase}/cuda_max_reserved_bytes"] = p["cuda_max_reserved"]
        return m

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_end(trainer, pl_module)
        self._fit_ended = True

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # NOTE: after every callback's `on_fit_end`, where the techniques that change the module (checkpointing's and
        # the chunked loss's hooks, activation offload's saved-tensor hooks) take their changes back: the module is as
        # the user built it, so the dry runs copy what a fresh run would start from.
        if stage != "fit" or not self._fit_ended or not self.steps or not trainer.is_global_zero:
            return
        self._fit_ended = False
        if self.predict:
            rank_zero_info("MemoryReport: predicting this run and plain fp32 training (dry runs on fake tensors)"
                           + (f", and both on a GPU at {self.gpu_precision}" if self.gpu_precision else "") + " ...")
            self.predicted, self.baseline, self.gpu = self._dry_runs(trainer, pl_module)
        self.table = render.table(self.steps, self.predicted, self.baseline, self.phases, self.gpu)
        rank_zero_info(self.table)
        if self.save_dir is None:  # setup did not run for "fit" (hooks driven by hand)
            return
        payload = {
            "every_n_steps": self.every_n_steps,
            "device": str(trainer.strategy.root_device),
            "steps": self.steps,
            "worst_step": max(self.steps, key=lambda r: r["peak_bytes"])["step"],
            "predicted": self.predicted,
            "plain_fp32": self.baseline,
            "gpu": self.gpu,
            "timeline": self._timeline,
        }
        atomic_write_text(self.save_dir / "memory_report.json", json.dumps(payload, indent=2, default=str) + "\n")
        if self.plot and self._timeline is not None:
            render.plot(self._timeline, self.save_dir / "memory_step.png")

    def _dry_runs(self, trainer: pl.Trainer, pl_module: pl.LightningModule
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
        """The dry run of this run and of plain fp32 training of the module (and both on a GPU at ``gpu_precision``);
        ``{"error": ...}`` where one fails."""
        batch = apply_to_collection(self.first_batch, torch.Tensor, lambda t: t.detach().to("cpu"))
        target = "cuda" if trainer.strategy.root_device.type == "cuda" else "cpu"
        # NOTE: Lightning's half-precision plugin cast the module's weights in place; the run started from fp32
        upcast = isinstance(trainer.precision_plugin, HalfPrecision)
        out: list[dict[str, Any]] = []
        try:
            run = RunSpec.from_trainer(trainer, exclude=(self,))
        except ValueError as err:
            return {"error": str(err)}, {"error": str(err)}, None
        micro_batches = max(r["micro_batches"] for r in self.steps)
        # NOTE: the window in one batch: every tensor repeated along dim 0 (Lightning's batch dimension)
        window = batch if micro_batches == 1 else apply_to_collection(
            batch, torch.Tensor, lambda t: t.repeat(micro_batches, *[1] * (t.dim() - 1)) if t.dim() else t)
        plain_batch = _fp32_batch(trainer, window)
        runs = [(run, batch, "the run's first batch", target),
                (RunSpec(), plain_batch, f"{micro_batches} micro-batch(es) in one batch", target)]
        if micro_batches > 1:
            # NOTE: the window in one batch prices what accumulation saves too; plain fp32 at the run's own
            # micro-batch prices the other techniques alone (both are shown, each labelled)
            runs.append((RunSpec(), _fp32_batch(trainer, batch), "one micro-batch, as the run", target))
        if self.gpu_precision:
            runs += [(dataclasses.replace(run, precision=self.gpu_precision), batch, "the run's first batch", "cuda"),
                     (RunSpec(), plain_batch, f"{micro_batches} micro-batch(es) in one batch", "cuda")]
        for spec, data, what, where in runs:
            try:
                est = dry_run(pl_module, batch=data, run=spec, target=where, upcast_half=upcast)
            except Exception as err:  # noqa: BLE001 - a failed prediction must not fail a finished fit; it is reported
                rank_zero_warn(f"MemoryReport: no prediction of {spec.describe()} ({type(err).__name__}: {err}).")
                out.append({"error": f"{type(err).__name__}: {err}", "run": spec.describe()})
                continue
            out.append({**est.to_dict(), "batch": what})
        gpu = {"run": out[-2], "plain_fp32": out[-1]} if self.gpu_precision else None
        if micro_batches > 1:
            out[1]["same_micro_batch"] = out[2]
        return out[0], out[1], gpu

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = list(state_dict.get("steps", []))


def _fp32_batch(trainer: pl.Trainer, batch: Any) -> Any:
    """``batch`` as plain fp32 training gets it.

    NOTE: the precision plugin cast the batch's floating tensors (``convert_input``); plain fp32 training gets
    them in fp32 (an LSTM or a conv refuses a bf16 input with fp32 weights).
    """
    if str(trainer.precision) not in ("bf16-true", "16-true"):
        return batch
    return apply_to_collection(batch, torch.Tensor,
                               lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t)


__all__ = ["PHASES", "MemoryReport"]

"""What the GPU stage entries share: model shapes (GPU and rehearsal), a fit, step and phase clocks, allocator stats.

On the GPU machine the clocks are CUDA events (the GPU's timeline, recorded without a synchronisation in the step)
beside host clocks; in the rehearsal (CPU) only host clocks exist, and the CUDA transfer logic runs on the deferred
stand-in (:func:`transfers`).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from benchmarks._harness import bench_trainer, lm_batches
from benchmarks.gpu._imports import DeferredOps, cpu_stand_in
from benchmarks.gpu.registry import Context
from lightning_lowmem import CausalLMModule, OffloadStrategy

GPT2_XL = {"n_layer": 48, "n_embd": 1600, "n_head": 25, "n_positions": 1024}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64}


@dataclass(frozen=True)
class Shape:
    """A GPT-2 shape and its batches: ``steps`` per fit, the first ``warmup`` left out of the figures."""

    config: dict[str, int]
    vocab: int
    batch: int
    seq: int
    steps: int
    warmup: int
    label: str

    @property
    def measured(self) -> int:
        return self.steps - self.warmup


def shape(ctx: Context, batch: int = 4, seq: int = 1024, steps: int = 5, warmup: int = 2) -> Shape:
    """GPT-2-XL (random weights, GPT-2's vocabulary) on the GPU; a 2-layer, 64-wide GPT-2 in the rehearsal."""
    if ctx.rehearsal:
        return Shape(TINY, 512, 2, 32, 3, 1, "tiny GPT-2 2x64, vocab 512 (rehearsal)")
    return Shape(GPT2_XL, 50257, batch, seq, steps, warmup, "GPT-2-XL 48x1600, vocab 50257")


def module(s: Shape) -> CausalLMModule:
    """The demo's causal-LM module on shape ``s``, seeded (GPT-2's dropout kept; no KV cache in training)."""
    torch.manual_seed(0)
    return CausalLMModule(config={**s.config, "vocab_size": s.vocab, "use_cache": False})


def batches(s: Shape) -> DataLoader:
    return DataLoader(lm_batches(s.steps, (s.batch, s.seq), vocab=s.vocab), batch_size=None)


def transfers(ctx: Context) -> contextlib.AbstractContextManager:
    """On the CPU, the CUDA transfer logic on deferred copies (``DeferredOps``); on the GPU, the real streams."""
    return cpu_stand_in(lambda: DeferredOps("run_ahead")) if ctx.rehearsal else contextlib.nullcontext()


def fit(ctx: Context, s: Shape, strategy: Any, callbacks: list[Any], precision: str = "bf16-true",
        lm: CausalLMModule | None = None) -> L.Trainer:
    """``Trainer.fit`` of :func:`module` on ``s`` for ``s.steps`` steps on the stage's device."""
    lm = lm if lm is not None else module(s)
    trainer = bench_trainer(accelerator=ctx.device, strategy=strategy, precision=precision, max_steps=s.steps,
                            callbacks=callbacks, limit_val_batches=0)
    with transfers(ctx):
        trainer.fit(lm, batches(s))
    return trainer


def fresh_cuda() -> None:
    """Free what earlier work left, and start the device allocator's peaks (and the pinned allocator's) from here."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        reset_host = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
        if reset_host is not None:
            reset_host()


def cuda_peaks() -> dict[str, int | None]:
    """The device allocator's allocated, reserved and active peaks (``torch.cuda.memory_stats``); {} on the CPU."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {f"{k}_peak_bytes": stats.get(f"{k}_bytes.all.peak") for k in ("allocated", "reserved", "active")}


def pinned_stats() -> dict[str, int]:
    """The pinned (host) allocator's byte statistics (``torch.cuda.host_memory_stats``), {} where torch lacks it."""
    get = getattr(torch.cuda, "host_memory_stats", None)
    if get is None or not torch.cuda.is_available():
        return {}
    return {k: int(v) for k, v in get().items() if "bytes" in k and k.endswith((".peak", ".current"))}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# --- step phases -------------------------------------------------------------------------------------------------
BOUNDARIES = ("start", "forward_end", "drain_start", "drain_end", "before_step", "host_step_start", "host_step_end",
              "end")
#: phase -> (from boundary, to boundary, what lies between)
PHASES = {
    "forward": ("start", "forward_end", "training_step (+ Lightning's zero_grad)"),
    "backward": ("forward_end", "drain_start", "loss.backward(): gradient hooks queue the D2H copies"),
    "drain": ("drain_start", "drain_end", "drain_transfers(): wait for the copies, fold into the fp32 masters"),
    "hooks": ("drain_end", "before_step", "on_after_backward and Lightning's closure return"),
    "guard": ("before_step", "host_step_start", "clipping (none configured) + the non-finite gradient guard"),
    "host_step": ("host_step_start", "host_step_end", "optimizer.step() on the host (fused AdamW)"),
    "upload": ("host_step_end", "end", "masters rounded to bf16 and copied into the compute weights (H2D)"),
}


class PhaseClock(L.Callback):
    """Marks the boundaries of each training step: Lightning's hooks, the optimizer's step hooks, and the drain.

    The drain's boundaries come from :class:`DrainTimedOffload` (``OffloadStrategy.drain_transfers``, a public
    method). On CUDA each mark records an event on the current stream (no synchronisation inside the step; the
    events are read after fit), beside a host clock.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, tuple[float, Any]]] = []
        self._handles: list[Any] = []

    def mark(self, name: str) -> None:
        if not self.steps or name in self.steps[-1]:
            return  # NOTE: the strategy's post_backward drains again (a no-op): the first call is the drain
        event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.steps[-1][name] = (time.perf_counter(), event)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for opt in trainer.optimizers:  # NOTE: torch's public optimizer step hooks
            self._handles.append(opt.register_step_pre_hook(lambda *_: self.mark("host_step_start")))
            self._handles.append(opt.register_step_post_hook(lambda *_: self.mark("host_step_end")))

    @override
    def on_train_batch_start(self, *args: Any) -> None:
        self.steps.append({})
        self.mark("start")

    @override
    def on_before_backward(self, *args: Any) -> None:
        self.mark("forward_end")

    @override
    def on_before_optimizer_step(self, *args: Any) -> None:
        self.mark("before_step")

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        self.mark("end")

    @override
    def on_train_end(self, *args: Any) -> None:
        for handle in self._handles:
            handle.remove()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def step_seconds(self, warmup: int) -> dict[str, float | None]:
        """Median step time after ``warmup`` steps: ``gpu_s`` from start event to start event of the next step
        (the end of the last step), ``host_s`` likewise on the host clock."""
        steps = self.steps[warmup:]
        gpu, host = [], []
        for i, marks in enumerate(steps):
            nxt = steps[i + 1]["start"] if i + 1 < len(steps) else marks.get("end")
            if "start" not in marks or nxt is None:
                continue
            host.append(nxt[0] - marks["start"][0])
            if marks["start"][1] is not None:
                gpu.append(marks["start"][1].elapsed_time(nxt[1]) / 1e3)
        return {"gpu_s": median(gpu), "host_s": median(host)}

    def phase_rows(self, warmup: int) -> list[dict[str, Any]]:
        """One row per phase: median milliseconds on the GPU's timeline (events) and on the host clock."""
        steps = [s for s in self.steps[warmup:] if all(b in s for b in BOUNDARIES)]
        rows = []
        for phase, (a, b, what) in PHASES.items():
            host = [1e3 * (s[b][0] - s[a][0]) for s in steps]
            gpu = [s[a][1].elapsed_time(s[b][1]) for s in steps if s[a][1] is not None]
            rows.append({"phase": phase, "gpu_ms": _round(median(gpu)), "host_ms": _round(median(host)),
                         "steps": len(steps), "what": what})
        total_host = [1e3 * (s["end"][0] - s["start"][0]) for s in steps]
        total_gpu = [s["start"][1].elapsed_time(s["end"][1]) for s in steps if s["start"][1] is not None]
        rows.append({"phase": "step (start to end)", "gpu_ms": _round(median(total_gpu)),
                     "host_ms": _round(median(total_host)), "steps": len(steps), "what": "sum of the phases"})
        return rows


class DrainTimedOffload(OffloadStrategy):
    """``lowmem_offload`` whose drain (the public :meth:`OffloadStrategy.drain_transfers`) marks a :class:`PhaseClock`."""

    def __init__(self, clock: PhaseClock, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clock = clock

    @override
    def drain_transfers(self) -> None:
        self.clock.mark("drain_start")
        super().drain_transfers()
        self.clock.mark("drain_end")


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

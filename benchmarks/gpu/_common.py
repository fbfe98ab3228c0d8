"""What the GPU stage entries share: model shapes (GPU and rehearsal), a fit, a step clock, allocator statistics.

On the GPU machine the clocks are CUDA events (the GPU's timeline, recorded without a synchronisation in the step)
beside host clocks, and the GPU's busy fraction is sampled from NVML; in the rehearsal (CPU) only host clocks exist,
and the CUDA transfer logic runs on the deferred stand-in (:func:`transfers`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from benchmarks._harness import bench_trainer, lm_batches
from benchmarks.gpu._imports import DeferredOps, cpu_stand_in
from benchmarks.gpu.registry import Context
from lightning_lowmem import CausalLMModule

GiB = 2**30
GPT2_XL = {"n_layer": 48, "n_embd": 1600, "n_head": 25, "n_positions": 1024}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64}


@dataclass(frozen=True)
class Shape:
    """A causal-LM shape and its batches: ``steps`` optimizer steps of ``accumulate`` micro-batches each, the first
    ``warmup`` steps left out of the step time."""

    config: dict[str, int]
    vocab: int
    batch: int
    seq: int
    steps: int
    warmup: int
    label: str
    model_type: str = "gpt2"
    accumulate: int = 1

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq * self.accumulate


def shape(ctx: Context, batch: int = 4, seq: int = 1024, steps: int = 5, warmup: int = 2, accumulate: int = 1,
          config: dict[str, int] | None = None, vocab: int = 50257, label: str = "GPT-2-XL 48x1600, vocab 50257",
          model_type: str = "gpt2", tiny: dict[str, int] | None = None) -> Shape:
    """GPT-2-XL (random weights, GPT-2's vocabulary) on the GPU unless ``config`` is given; in the rehearsal a
    2-layer, 64-wide model (``tiny``) at batch 2 x 32, 3 steps, the first left out."""
    if ctx.rehearsal:
        return Shape(tiny or TINY, 512, 2, 32, 3, 1, f"tiny {model_type} 2x64, vocab 512 (rehearsal)", model_type,
                     accumulate)
    return Shape(config or GPT2_XL, vocab, batch, seq, steps, warmup, label, model_type, accumulate)


def module(s: Shape, device: str | None = None, on_host: bool = True) -> CausalLMModule:
    """The demo's causal-LM module on shape ``s``, seeded, its weights drawn on ``device`` (on the GPU a GPT-2-XL is
    drawn in milliseconds, where the host's single-threaded ``normal_`` takes tens of seconds) and moved to the host
    when ``on_host`` (as a user's module arrives at ``Trainer.fit``). Same seed and device, same weights. Without
    ``device``, built where the caller's default device says (the dry run builds it on the meta device)."""
    torch.manual_seed(0)
    with torch.device(device) if device else contextlib.nullcontext():
        lm = CausalLMModule(model_type=s.model_type, config={**s.config, "vocab_size": s.vocab, "use_cache": False})
    return lm.cpu() if device and on_host else lm


def batches(s: Shape) -> DataLoader:
    """``s.steps * s.accumulate`` micro-batches of random token ids (seeded: every run of a shape sees the same)."""
    return DataLoader(lm_batches(s.steps * s.accumulate, (s.batch, s.seq), vocab=s.vocab), batch_size=None)


def transfers(ctx: Context) -> contextlib.AbstractContextManager:
    """On the CPU, the CUDA transfer logic on deferred copies (``DeferredOps``); on the GPU, the real streams."""
    return cpu_stand_in(lambda: DeferredOps("run_ahead")) if ctx.rehearsal else contextlib.nullcontext()


def fit(ctx: Context, s: Shape, strategy: Any, callbacks: list[Any], precision: str = "bf16-true",
        lm: CausalLMModule | None = None, **trainer: Any) -> L.Trainer:
    """``Trainer.fit`` of ``lm`` (default: :func:`module` drawn on the stage's device, on the host) on ``s``."""
    lm = lm if lm is not None else module(s, ctx.device)
    trainer_ = bench_trainer(accelerator=ctx.device, strategy=strategy, precision=precision, max_steps=s.steps,
                             accumulate_grad_batches=s.accumulate, callbacks=callbacks, limit_val_batches=0,
                             **trainer)
    with transfers(ctx):
        trainer_.fit(lm, batches(s))
    return trainer_


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
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
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


def rnd(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


class Busy:
    """The GPU's busy fraction between :meth:`start` and :meth:`stop`: the mean of NVML's utilization (the share of
    each sample period, 1/6 s to 1 s, in which a kernel ran; ``torch.cuda.utilization``), sampled every 50 ms."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if torch.cuda.is_available() and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.samples.append(int(torch.cuda.utilization()))
            except Exception as err:  # noqa: BLE001 - no NVML here: the fraction is recorded as unknown, with why
                self.error = f"{type(err).__name__}: {err}"[:200]
                return

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return rnd(statistics.fmean(self.samples) / 100, 3) if self.samples else None


class StepClock(L.Callback):
    """Times each optimizer step (its micro-batches, the step, the upload) on the host clock and, on CUDA, on the
    GPU's timeline (an event at each step's start and end, no synchronisation inside a step); keeps each
    micro-batch's loss; samples the GPU's busy fraction over the steps after ``warmup``. With ``on_step`` it calls
    ``on_step(self)`` after each optimizer step (which may synchronise to read the losses) and stops training after
    a step when the next one would not end ``reserve_s`` before ``deadline``. At the end of training (before the
    strategy's teardown) it keeps the strategy's host breakdown (``memory_breakdown().host``, where it has one) and
    the logged metrics."""

    def __init__(self, warmup: int = 1, on_step: Callable[[StepClock], None] | None = None,
                 deadline: float = math.inf, reserve_s: float = 10.0) -> None:
        self.warmup, self.on_step, self.deadline, self.reserve_s = warmup, on_step, deadline, reserve_s
        self.starts: list[tuple[float, Any]] = []
        self.ends: list[tuple[float, Any]] = []
        self._losses: list[torch.Tensor] = []
        self.busy = Busy()
        self.busy_fraction: float | None = None
        self.host: dict[str, int] | None = None
        self.metrics: dict[str, float] = {}

    @staticmethod
    def _mark() -> tuple[float, Any]:
        event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            if len(self.starts) == self.warmup:
                self.busy.start()
            self.starts.append(self._mark())

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # NOTE: Lightning hands this hook the loss divided by accumulate_grad_batches; kept as a tensor (a float()
        # here would synchronise with the device every micro-batch)
        self._losses.append(loss.detach().float() * trainer.accumulate_grad_batches)
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.ends.append(self._mark())
        if self.on_step is None:
            return
        self.on_step(self)
        last = self.ends[-1][0] - self.starts[-1][0]
        if time.time() + 1.1 * last + self.reserve_s > self.deadline:
            trainer.should_stop = True  # NOTE: at an optimizer step's end: every step that ran is whole

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.busy_fraction = self.busy.stop()
        breakdown = getattr(trainer.strategy, "memory_breakdown", None)
        self.host = dict(breakdown().host) if breakdown is not None else None
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def losses(self) -> list[float]:
        """Each micro-batch's loss (synchronises)."""
        return [float(x) for x in self._losses]

    def step_times(self) -> list[float]:
        """Host seconds of each optimizer step (its first micro-batch's start to its last one's end)."""
        return [e[0] - s[0] for s, e in zip(self.starts, self.ends)]

    def step_seconds(self) -> dict[str, Any]:
        """Mean seconds per optimizer step over the steps after ``warmup`` (all steps when none is left, flagged):
        ``gpu_s`` on the GPU's timeline (start event of the first to end event of the last), ``host_s`` likewise."""
        n = len(self.ends)
        first = self.warmup if n > self.warmup else 0
        if n == 0:
            return {"gpu_s": None, "host_s": None, "steps_timed": 0, "warm": False}
        (h0, e0), (h1, e1) = self.starts[first], self.ends[-1]
        gpu = None
        if e0 is not None and e1 is not None:
            e1.synchronize()
            gpu = e0.elapsed_time(e1) / 1e3 / (n - first)
        return {"gpu_s": rnd(gpu), "host_s": rnd((h1 - h0) / (n - first)), "steps_timed": n - first,
                "warm": first > 0}


def cpu_figure(ctx: Context, name: str, **match: Any) -> dict[str, Any] | None:
    """The first row of the committed ``benchmarks/results/<name>.json`` whose fields equal ``match`` (None if the
    file or the row is missing): the CPU figure (or earlier dry run) a GPU figure replaces."""
    path = ctx.repo / "benchmarks" / "results" / f"{name}.json"
    try:
        rows = json.loads(path.read_text()).get("rows", [])
    except (OSError, ValueError):
        return None
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

"""Time lost per out-of-memory recovery (``AccumulationScheduler(on_oom="split")``) on CPU, as a fraction of a step.

The demo GPT-2 through ``Trainer.fit``: effective batch 16 in loader micro-batches of 8 (token-mean loss). Steps
cycle through five variants, timed in alternation inside the same run (so machine noise hits them alike):

- ``clean 8``: no error, micro-batches of 8;
- ``clean 4``: no error, micro-batches already split to 4 (what every step after a recovery costs);
- ``forward end``: the first micro-batch of 8 raises ``torch.OutOfMemoryError`` after the last block's forward
  (almost the whole forward lost), is split into 4 + 4, and the window's second micro-batch runs as 4 + 4;
- ``backward start``: it raises on the gradient of the logits (the whole forward lost, no gradient yet);
- ``backward middle``: it raises on the gradient of the middle block's output (the forward and half the backward
  done; the gradients of the later half are kept, so the halves compute only the first half's).

Time lost by a recovery = median recovered step - median ``clean 4`` step (the same split work plus the failed
part and the split itself); as a fraction of the ``clean 4`` step. The error is injected (CPU has no allocator
limit); on CUDA ``torch.cuda.empty_cache()`` adds to it once per recovery.

Run: ``python benchmarks/run.py oom_recovery [--quick]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import bench_trainer, write_results
from lightning_lowmem.callbacks.accumulation import oom_split as _oom_split
from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.demo.data import StdlibTextDataModule
from lightning_lowmem.demo.module import CausalLMModule

EFFECTIVE, MICRO = 16, 8
# the demo's GPT-2 (configs/demo.yaml): 4 layers, 128 wide
GPT2_DEMO = {"n_layer": 4, "n_embd": 128, "n_head": 4}
VARIANTS = ["clean 8", "clean 4", "forward end", "backward start", "backward middle"]


class Cycle(L.Callback):
    """Sets each window's variant (micro-batch size, where the error is raised) and times the window."""

    def __init__(self, scheduler: AccumulationScheduler, warmup: int) -> None:
        self.scheduler, self.warmup = scheduler, warmup
        self.variant = "clean 8"
        self.times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        self._t0 = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        h = pl_module.model.transformer.h
        h[-1].register_forward_hook(lambda m, a, out: self._hook(out, "forward end", grad=False))
        pl_module.model.lm_head.register_forward_hook(lambda m, a, out: self._hook(out, "backward start", grad=True))
        h[len(h) // 2].register_forward_hook(lambda m, a, out: self._hook(out, "backward middle", grad=True))

    def _hook(self, output: Any, variant: str, grad: bool) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if self.variant != variant or out.size(0) <= MICRO // 2 or not torch.is_grad_enabled():
            return
        if grad:
            out.register_hook(_raise)
        else:
            _raise()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % (EFFECTIVE // MICRO) == 0:
            step = trainer.global_step
            self.variant = VARIANTS[step % len(VARIANTS)]
            self.scheduler._splitter.piece = MICRO // 2 if self.variant == "clean 4" else None
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % (EFFECTIVE // MICRO) == EFFECTIVE // MICRO - 1 and trainer.global_step > self.warmup:
            self.times[self.variant].append(time.perf_counter() - self._t0)


RELEASE_S: list[float] = []


def _timed_release(release: Any) -> Any:
    """The splitter's release after an error, timed: part of what a recovery costs."""

    def timed(self: Any) -> None:
        t0 = time.perf_counter()
        release(self)
        RELEASE_S.append(time.perf_counter() - t0)

    return timed


def _raise(*args: Any) -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB (injected by the benchmark)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="sequence length 64 and 2 rounds")
    args = parser.parse_args(argv)
    seq_len, rounds = (64, 2) if args.quick else (128, 16)
    # NOTE: one thread: on a shared 2-core machine two threads spin against the other processes, and the noise
    # swamps a one-micro-batch difference
    torch.set_num_threads(1)
    torch.manual_seed(0)
    warmup = len(VARIANTS)
    steps = warmup + rounds * len(VARIANTS)
    module = CausalLMModule(config={**GPT2_DEMO, "n_positions": seq_len}, loss_reduction="sum")
    data = StdlibTextDataModule(seq_len=seq_len, batch_size=MICRO, max_bytes=seq_len * EFFECTIVE * (steps + 2),
                                val_fraction=0.0)
    scheduler = AccumulationScheduler(EFFECTIVE, MICRO, loss_normalization="tokens", on_oom="split")
    cycle = Cycle(scheduler, warmup)
    trainer = bench_trainer(max_steps=steps, limit_val_batches=0, callbacks=[scheduler, cycle])
    _oom_split.OOMSplitter._release = _timed_release(_oom_split.OOMSplitter._release)
    trainer.fit(module, data)
    assert scheduler.oom_recoveries == 3 * (steps // len(VARIANTS)), scheduler.oom_recoveries
    # NOTE: the machine is shared: the least time of each variant estimates its uncontended time, and the
    # difference to the 'clean 4' step of the same round (timed a second apart) is the paired estimate
    fastest = {v: min(ts) for v, ts in cycle.times.items()}
    base = fastest["clean 4"]
    rows = []
    for v in VARIANTS:
        recovered = v not in ("clean 8", "clean 4")
        lost = fastest[v] - base if recovered else None
        paired = [t - c for t, c in zip(cycle.times[v], cycle.times["clean 4"])]
        rows.append({
            "variant": v,
            "steps_timed": len(cycle.times[v]),
            "step_s_min": fastest[v],
            "step_s_median": statistics.median(cycle.times[v]),
            "step_vs_clean_4": fastest[v] / base,
            "lost_s": lost,
            "lost_fraction_of_step": None if lost is None else lost / base,
            "lost_s_paired_median": statistics.median(paired) if recovered else None,
            "of_which_gc_s": statistics.median(RELEASE_S) if recovered else None,
        })
    write_results(
        "oom_recovery",
        rows,
        ["variant", "steps_timed", "step_s_min", "step_s_median", "step_vs_clean_4", "lost_s", "lost_fraction_of_step",
         "lost_s_paired_median", "of_which_gc_s"],
        title=f"Out-of-memory recovery: time lost per recovery, demo GPT-2, effective batch {EFFECTIVE}, "
              f"micro-batch {MICRO} -> 4, seq {seq_len}, CPU",
        notes=[
            (
                "Every timed step is one optimizer step of 16 sequences through Trainer.fit (two loader micro-batches of "
                "8); the five variants alternate step by step in one run, after one warm-up round."
            ),
            (
                "forward end / backward start / backward middle: the first micro-batch of the step raises "
                "torch.OutOfMemoryError there (injected), is split into 4 + 4, and the step completes with the same "
                "samples and normalisation; the second micro-batch runs as 4 + 4 (the size kept after a recovery)."
            ),
            (
                "lost_s = fastest recovered step - fastest 'clean 4' step (the least time of each variant estimates its "
                "uncontended time on this shared machine): the failed micro-batch's work plus the split (the release "
                "below, slicing, the chunk bookkeeping); lost_fraction_of_step divides it by the 'clean 4' step. "
                "lost_s_paired_median: the median over rounds of (recovered - 'clean 4' of the same round)."
            ),
            (
                "of_which_gc_s: median time of the release after an error, over all recoveries: gc.collect(1) (the "
                "young generations, for the failed call's frames if they sit in reference cycles); on CUDA also a full "
                "gc.collect() when the allocator still holds more than before the failed micro-batch (about 0.45 s in "
                "this process, measured before that condition was added) and one empty_cache."
            ),
            (
                "step_s_min / step_s_median: least and median wall time; one torch thread; the machine was shared "
                "with other jobs (load average about 6 on 2 cores), so medians are noisy."
            ),
        ],
        extra={"seq_len": seq_len, "effective_batch_size": EFFECTIVE, "micro_batch": MICRO, "model_config": GPT2_DEMO,
               "times": cycle.times, "release_s": RELEASE_S},
    )


if __name__ == "__main__":
    main(sys.argv[1:])

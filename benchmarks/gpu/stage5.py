"""Stage 5: the host step of ``lowmem_offload`` on a GPU: serial vs ``optimizer_in_backward``, the host AdamW's rate,
and ``compute-sanitizer synccheck`` over the CUDA transfer tests.

``host_step[serial|in_backward]``: GPT-2-XL at batch 4 x 1024 under ``lowmem_offload`` bf16-true, torch's AdamW fused
on the host, each in a process of its own: step time and its phases (forward, backward, everything after backward:
the host step and the upload; the whole step) on the GPU's timeline (CUDA events) and the host clock.
``in_backward`` is ``OffloadStrategy(optimizer_in_backward=True)`` (each master steps on a host worker as its gradient
lands). ``host_adamw``: torch's fused CPU AdamW (what ``lowmem_offload`` steps the masters with) at the machine's
thread count and at one, against the host's memory bandwidth. ``synccheck``: two CUDA tests of the transfers under
``compute-sanitizer --tool synccheck``.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from benchmarks.gpu.registry import Context, Entry, Skip

MODES = {"serial": {}, "in_backward": {"optimizer_in_backward": True}}
BOUNDARIES = ("start", "forward_end", "backward_end", "end")
PHASES = {"forward": ("start", "forward_end"), "backward": ("forward_end", "backward_end"),
          "after backward (host step, upload)": ("backward_end", "end"), "step (start to end)": ("start", "end")}


def _phases() -> Any:
    """A callback marking each step's boundaries (host clock and, on CUDA, an event on the compute stream)."""
    import lightning as L
    import torch
    from typing_extensions import override

    class Phases(L.Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, tuple[float, Any]]] = []

        def mark(self, name: str) -> None:
            event = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            self.steps[-1].setdefault(name, (time.perf_counter(), event))

        @override
        def on_train_batch_start(self, *args: Any) -> None:
            self.steps.append({})
            self.mark("start")

        @override
        def on_before_backward(self, *args: Any) -> None:
            self.mark("forward_end")

        @override
        def on_after_backward(self, *args: Any) -> None:
            self.mark("backward_end")

        @override
        def on_train_batch_end(self, *args: Any) -> None:
            self.mark("end")

        @override
        def on_train_end(self, *args: Any) -> None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

    return Phases()


def _host_step(mode: str) -> Any:
    def entry(ctx: Context) -> dict[str, Any]:
        from benchmarks.gpu import _common as c
        from lightning_lowmem import OffloadStrategy

        s = c.shape(ctx, batch=4, steps=6, warmup=2)
        lm = c.module(s, ctx.device)
        c.fresh_cuda()
        phases, clock = _phases(), c.StepClock(warmup=s.warmup)
        c.fit(ctx, s, OffloadStrategy(**MODES[mode]), [phases, clock], lm=lm)
        step = clock.step_seconds()
        steps = [m for m in phases.steps[s.warmup:] if all(b in m for b in BOUNDARIES)]
        rows = []
        for phase, (a, b) in PHASES.items():
            host = c.median([1e3 * (m[b][0] - m[a][0]) for m in steps])
            gpu = c.median([m[a][1].elapsed_time(m[b][1]) for m in steps if m[a][1] is not None])
            rows.append({"mode": mode, "phase": phase, "gpu_ms": c.rnd(gpu, 2), "host_ms": c.rnd(host, 2)})
        rows.append({"mode": mode, "phase": "mean step (start to next start)", "gpu_ms": c.rnd(1e3 * (step["gpu_s"] or 0), 2),
                     "host_ms": c.rnd(1e3 * (step["host_s"] or 0), 2), "gpu_busy_fraction": clock.busy_fraction,
                     **c.cuda_peaks()})
        figure = {"figure": f"GPT-2-XL 4 x 1024 lowmem_offload, host step {mode}: step time",
                  "gpu": f"{step['gpu_s'] or step['host_s']} s per step, GPU busy {clock.busy_fraction}",
                  "dry_run": None, "cpu": None}
        return {"rows": rows, "figures": [figure], "notes": [(
            f"{s.label}, batch {s.batch}x{s.seq}, lowmem_offload bf16-true {MODES[mode]}, torch AdamW fused on the "
            f"host, {s.steps} steps, first {s.warmup} left out; on {ctx.device}. 'after backward' is what is left "
            "of the host step and the upload.")]}

    entry.__name__ = f"host_step_{mode}"
    return entry


def host_adamw(ctx: Context) -> dict[str, Any]:
    import torch

    from benchmarks._harness import interleaved
    from benchmarks.gpu import _common as c

    n_tensor = 2_000_000 if ctx.rehearsal else 25_000_000  # NOTE: 200M params on the GPU machine: 3.2 GB of state
    params = [torch.nn.Parameter(torch.randn(n_tensor)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    foreach = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    a, b = torch.randn(4 * n_tensor), torch.randn(4 * n_tensor)
    rows = []
    for n_threads in sorted({ctx.threads, 1}, reverse=True):
        with c.threads(n_threads):
            timed = interleaved({"fused (lowmem_offload's host AdamW)": fused.step, "foreach": foreach.step,
                                 "bandwidth a += b": lambda: a.add_(b)}, rounds=3 if ctx.rehearsal else 4)
        bandwidth = 3 * a.numel() * 4 / timed.pop("bandwidth a += b")["min_s"]
        for name, t in timed.items():
            rate = 8 * n_tensor / t["median_s"]
            rows.append({"optimizer": name, "threads": n_threads, "params": 8 * n_tensor,
                         "Mparams_per_s": round(rate / 1e6, 1), "step_ms": round(1e3 * t["median_s"], 1),
                         "fraction_of_bandwidth_bound": round(28 * rate / bandwidth, 3),
                         "host_GB_per_s": round(bandwidth / 1e9, 2)})
    best = max((r for r in rows if r["optimizer"].startswith("fused")), key=lambda r: r["Mparams_per_s"])
    cpu = c.cpu_figure(ctx, "offload", table="host optimizer", optimizer="ours (lowmem_offload host AdamW)")
    figure = {"figure": "host AdamW (fused, lowmem_offload's) on the GPU machine's CPU",
              "gpu": (f"{best['Mparams_per_s']} Mparams/s at {best['threads']} threads, "
                      f"{best['fraction_of_bandwidth_bound']} of the bandwidth bound"), "dry_run": None,
              "cpu": (f"{cpu['Mparams/s']:.0f} Mparams/s, {cpu['fraction_of_bandwidth_bound']:.2f} of the bound "
                      "(2-core CPU machine, offload.json)") if cpu else None}
    return {"rows": rows, "figures": [figure], "notes": [(
        "fp32 AdamW over 8 flat tensors (param, grad, m, v: 16 B/param, far beyond the cache); bound: 28 B/param at "
        "the a += b bandwidth measured in the same rounds.")]}


SYNCCHECK_TESTS = (
    "tests/test_deferred_transfers.py::test_cuda_stream_transfer_folds_every_gradient_exactly_once_in_queue_order",
    "tests/strategies/test_offload.py::test_cuda_root_device_staging_and_weights",
)


def sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    for candidate in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if found is None and os.access(candidate, os.X_OK):
            found = candidate
    return found


def synccheck(ctx: Context) -> dict[str, Any]:
    from benchmarks.gpu.stage1 import pytest_run

    tool = sanitizer_path()
    if tool is None and not ctx.rehearsal:
        raise Skip("compute-sanitizer not found (PATH, /usr/local/cuda/bin)")
    # NOTE: the rehearsal has no sanitizer: it runs the same tests plainly, so a renamed test shows here first
    prefix = [tool, "--tool", "synccheck", "--error-exitcode", "3"] if tool and not ctx.rehearsal else []
    out = pytest_run(ctx, ["--timeout=80", *SYNCCHECK_TESTS], timeout_s=ctx.seconds_left() - 5, prefix=prefix)
    out["notes"].append("compute-sanitizer --tool synccheck (exit 3 = a hazard found)" if prefix else
                        "no compute-sanitizer: the tests ran without it")
    return out


ENTRIES = [
    *(Entry(f"host_step[{mode}]", 90, _host_step(mode),
            f"GPT-2-XL lowmem_offload step, {mode}: step time and phases (GPU events, host clock)", fresh=True)
      for mode in MODES),
    Entry("host_adamw", 50, host_adamw, "fused host AdamW rate at the machine's threads and at one"),
    Entry("synccheck", 90, synccheck, "compute-sanitizer synccheck on two CUDA tests"),
]

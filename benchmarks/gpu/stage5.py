"""Stage 5: the host path of ``lowmem_offload`` on a GPU (issue 30: the host step off the critical path).

Each entry trains GPT-2-XL at batch 4 x 1024 under ``lowmem_offload`` bf16-true with torch's AdamW fused on the host,
in a process of its own, and records the step time and its phases on the GPU's timeline (CUDA events) and the host
clock: forward, backward, the drain and whatever of the host pass is left after backward, everything after backward
(drain, step, upload), the whole step. ``host_step[serial]`` is the reference; ``host_step[overlap]`` steps and
uploads each bucket during backward; ``host_step[overlap_upload_at_step]`` is the same pass with every upload left to
the step (as before the upload in backward); ``host_step[delayed]`` the one-step-stale update (it changes what is
trained: timed, not compared); ``host_step[in_backward]`` ``optimizer_in_backward=True`` (each master steps on a host
worker as its gradient lands). Side by side in one stage run.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.registry import Context, Entry

MODES = {  # entry name: (OffloadStrategy kwargs, upload at the step)
    "serial": ({"host_pass": "serial"}, False),
    "overlap": ({"host_pass": "overlap"}, False),
    "overlap_upload_at_step": ({"host_pass": "overlap"}, True),
    "delayed": ({"host_pass": "delayed"}, False),
    "in_backward": ({"optimizer_in_backward": True}, False),
}
PHASES = {"forward": ("start", "forward_end"), "backward": ("forward_end", "drain_start"),
          "drain + tail of the host pass": ("drain_start", "drain_end"),
          "after backward (drain, step, upload)": ("drain_start", "end"), "step (start to end)": ("start", "end")}


def _host_step(name: str) -> Any:
    kwargs, at_step = MODES[name]

    def entry(ctx: Context) -> dict[str, Any]:
        import lightning as L

        from benchmarks._harness import upload_at_step
        from benchmarks.gpu import _common as c
        from benchmarks.gpu._imports import HostPass

        class Clock(c.PhaseClock):
            # NOTE: a callback implementing on_before_optimizer_step keeps the step serial (user code may read the
            # masters or change the gradients there); this clock marks that boundary from the drain instead
            on_before_optimizer_step = L.Callback.on_before_optimizer_step

        class Strategy(c.DrainTimedOffload):
            def drain_transfers(self) -> None:
                super().drain_transfers()
                self.clock.mark("before_step")

        s = c.shape(ctx, batch=4, steps=6, warmup=2)
        c.fresh_cuda()
        clock = Clock()
        with upload_at_step(HostPass, at_step):
            c.fit(ctx, s, Strategy(clock, **kwargs), [clock])
        step = clock.step_seconds(s.warmup)
        rows = []
        for phase, (a, b) in PHASES.items():
            steps = [m for m in clock.steps[s.warmup:] if a in m and b in m]
            host = c.median([1e3 * (m[b][0] - m[a][0]) for m in steps])
            gpu = c.median([m[a][1].elapsed_time(m[b][1]) for m in steps if m[a][1] is not None])
            rows.append({"mode": name, "phase": phase, "gpu_ms": c._round(gpu), "host_ms": c._round(host)})
        rows.append({"mode": name, "phase": "median step (start to next start)",
                     "gpu_ms": c._round(1e3 * step["gpu_s"] if step["gpu_s"] else None),
                     "host_ms": c._round(1e3 * step["host_s"] if step["host_s"] else None), **c.cuda_peaks()})
        return {"rows": rows, "notes": [(
            f"{s.label}, batch {s.batch}x{s.seq}, lowmem_offload bf16-true {kwargs}"
            f"{', upload at the step' if at_step else ''}, torch AdamW fused on the host, {s.steps} steps, first "
            f"{s.warmup} left out; on {ctx.device}. 'after backward' is what is left of the host step.")]}

    return entry


ENTRIES = [Entry(f"host_step[{name}]", 90, _host_step(name),
                 f"GPT-2-XL lowmem_offload step, {name}: step time and phases (GPU events, host clock)", fresh=True)
           for name in MODES]

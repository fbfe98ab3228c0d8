"""Stage 2: activation offload and parameter streaming on GPT-2-XL, and the dry run against what they measured.

Entries: ``activation_offload`` (``lowmem_offload`` + ``ActivationCheckpointing("all")`` +
``ActivationOffload(boundaries_only=True)``): step time, device peaks and pinned host bytes as the pinned allocator
reserves them; ``param_stream[resident]`` (``lowmem_offload``, every block on the device, the baseline) and
``param_stream[prefetch=0|1|2]`` (``lowmem_offload_params``): step time and the device allocator's allocated,
reserved and active peaks (stage 1 measures the streaming bound on a wide model); ``dry_run_vs_measured``: the dry
run's CUDA-target prediction of each of those runs against its measured allocated peak.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.registry import Context, Entry

STREAM_RUNS = {"resident": None, "prefetch=0": 0, "prefetch=1": 1, "prefetch=2": 2}


def _strategy_kwargs(prefetch: int | None) -> dict[str, Any]:
    return {} if prefetch is None else {"offload_params": True, "prefetch": prefetch}


def _callbacks(run: str) -> list[Any]:
    from lightning_lowmem import ActivationCheckpointing, ActivationOffload

    return [ActivationCheckpointing("all"), ActivationOffload(boundaries_only=True)] if run == "activation_offload" else []


def _measure(ctx: Context, run: str, prefetch: int | None) -> dict[str, Any]:
    from benchmarks.gpu import _common as c
    from lightning_lowmem import OffloadStrategy

    s = c.shape(ctx)
    lm = c.module(s, ctx.device)
    c.fresh_cuda()
    clock = c.StepClock(warmup=s.warmup)
    c.fit(ctx, s, OffloadStrategy(**_strategy_kwargs(prefetch)), [clock, *_callbacks(run)], lm=lm)
    step = clock.step_seconds()
    row: dict[str, Any] = {"run": run, "step_gpu_s": step["gpu_s"], "step_host_s": step["host_s"], **c.cuda_peaks()}
    notes = [(f"{s.label}, batch {s.batch}x{s.seq}, bf16-true, {s.steps} steps (first {s.warmup} left out of the "
              "step time); peaks over the whole fit (torch.cuda.memory_stats, *_bytes.all.peak).")]
    if run == "activation_offload":
        row |= {
            "activation_host_peak_bytes": clock.metrics.get("activation_offload/host_peak_bytes"),
            "activation_offloaded_bytes_per_step": clock.metrics.get("activation_offload/bytes_per_step"),
            "staging_bytes": (clock.host or {}).get("other"),
            "pinned_allocator": c.pinned_stats() or "torch.cuda.host_memory_stats unavailable",
        }
        notes.append("activation_host_peak_bytes: ActivationOffload's own count of its host copies at their peak "
                     "(logged metric); pinned_allocator: torch.cuda.host_memory_stats() after fit, whose peaks also "
                     "hold lowmem_offload's pinned staging buckets (staging_bytes, as the strategy reports them).")
    return {"rows": [row], "notes": notes, "run": {"name": run, "prefetch": prefetch, "batch": s.batch, "seq": s.seq}}


def _stream_entry(run: str, prefetch: int | None) -> Any:
    def entry(ctx: Context) -> dict[str, Any]:
        return _measure(ctx, run, prefetch)

    entry.__name__ = f"param_stream_{run}"
    return entry


def activation_offload(ctx: Context) -> dict[str, Any]:
    return _measure(ctx, "activation_offload", None)


def dry_run_vs_measured(ctx: Context) -> dict[str, Any]:
    """The dry run (target="cuda") of each run measured above, against its measured allocated peak."""
    from benchmarks.gpu import _common as c
    from lightning_lowmem import OffloadStrategy, dry_run

    s = c.shape(ctx)
    rows, figures = [], []
    for name in ["activation_offload", *(f"param_stream[{r}]" for r in STREAM_RUNS)]:
        measured = ctx.prior(name)
        if measured is None or measured.get("status") != "ok":
            rows.append({"run": name, "note": "not measured in this stage (see its entry)"})
            continue
        run = measured["run"]
        est = dry_run(lambda: c.module(s), batch_size=run["batch"], seq_len=run["seq"],
                      strategy=OffloadStrategy(**_strategy_kwargs(run["prefetch"])), precision="bf16-true",
                      callbacks=_callbacks(run["name"]), target="cuda")
        context = sum(x.bytes for x in est.corrections if x.name == "cuda_context")
        got = measured["rows"][0].get("allocated_peak_bytes")
        predicted = est.peak_device - context
        rows.append({"run": name, "predicted_device_bytes": est.peak_device, "cuda_context_bytes": context,
                     "predicted_tensors_bytes": predicted, "measured_allocated_peak_bytes": got,
                     "predicted_over_measured": c.rnd(predicted / got) if got else None,
                     "binding_phase": est.binding_phase, "dry_run_s": c.rnd(est.wall_s, 1)})
        figures.append({"figure": f"GPT-2-XL 4 x 1024, {name}: allocated peak", "gpu": c.gib(got),
                        "dry_run": f"{c.gib(predicted)} ({rows[-1]['predicted_over_measured']}x)", "cpu": None})
    return {"rows": rows, "figures": figures, "notes": [(
        "predicted_tensors_bytes = the dry run's device peak less its fixed CUDA-context correction (the allocator "
        "counts tensors, not the context); measured = allocated_bytes.all.peak of the same run (same shape, strategy, "
        "callbacks, precision). Corrections are listed in each estimate as uncalibrated: this is their calibration.")]}


ENTRIES = [
    Entry("activation_offload", 80, activation_offload,
          "ActivationOffload + checkpointing: step time, device peaks, pinned host bytes", fresh=True),
    *(Entry(f"param_stream[{run}]", 55, _stream_entry(run, p),
            f"lowmem_offload{'' if p is None else f'_params prefetch={p}'}: step time, allocated/reserved/active peaks",
            fresh=True) for run, p in STREAM_RUNS.items()),
    Entry("dry_run_vs_measured", 50, dry_run_vs_measured, "dry run (CUDA target) vs the measured peaks above"),
]

"""Stage 2: device memory and step time of parameter streaming and activation offload on GPT-2-XL, and the dry run.

Entries: ``param_stream[resident]`` (``lowmem_offload``, every block on the device, the baseline) and
``param_stream[prefetch=0|1|2]`` (``lowmem_offload_params``): step time and the device allocator's allocated,
reserved and active peaks; ``activation_offload`` (``lowmem_offload`` + ``ActivationCheckpointing("all")`` +
``ActivationOffload(boundaries_only=True)``): step time, device peaks and pinned host bytes as the pinned allocator
reserves them; ``dry_run_vs_measured``: the dry run's CUDA-target prediction of each of those runs against its
measured allocated peak.
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

    s = c.shape(ctx)
    c.fresh_cuda()
    clock = c.PhaseClock()
    strategy = c.DrainTimedOffload(clock, **_strategy_kwargs(prefetch))
    callbacks = _callbacks(run)
    snap = _snapshot()
    c.fit(ctx, s, strategy, [clock, snap, *callbacks])
    step = clock.step_seconds(s.warmup)
    row: dict[str, Any] = {"run": run, "step_gpu_s": _r(step["gpu_s"]), "step_host_s": _r(step["host_s"]),
                           **c.cuda_peaks(), "resident_blocks": strategy.resident_blocks}
    notes = [(f"{s.label}, batch {s.batch}x{s.seq}, bf16-true, {s.steps} steps (first {s.warmup} left out of the "
              "step time); peaks over the whole fit (torch.cuda.memory_stats, *_bytes.all.peak).")]
    if run == "activation_offload":
        row |= {
            "activation_host_peak_bytes": snap.metrics.get("activation_offload/host_peak_bytes"),
            "activation_offloaded_bytes_per_step": snap.metrics.get("activation_offload/bytes_per_step"),
            "staging_bytes": snap.host.get("other"),
            "pinned_allocator": c.pinned_stats() or "torch.cuda.host_memory_stats unavailable",
        }
        notes.append("activation_host_peak_bytes: ActivationOffload's own count of its host copies at their peak "
                     "(logged metric); pinned_allocator: torch.cuda.host_memory_stats() after fit, whose peaks also "
                     "hold lowmem_offload's pinned staging buckets (staging_bytes, as the strategy reports them).")
    return {"rows": [row], "notes": notes, "run": {"name": run, "prefetch": prefetch, "batch": s.batch, "seq": s.seq}}


def _snapshot() -> Any:
    """A callback that keeps, at the end of training, the strategy's host breakdown and the logged metrics."""
    import lightning as L
    from typing_extensions import override

    class Snapshot(L.Callback):
        def __init__(self) -> None:
            self.host: dict[str, int] = {}
            self.metrics: dict[str, float] = {}

        @override
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.host = dict(trainer.strategy.memory_breakdown().host)
            self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}

    return Snapshot()


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
    from lightning_lowmem import CausalLMModule, OffloadStrategy, dry_run

    s = c.shape(ctx)
    config = {**s.config, "vocab_size": s.vocab, "use_cache": False}
    rows = []
    for name in [*(f"param_stream[{r}]" for r in STREAM_RUNS), "activation_offload"]:
        measured = ctx.prior(name)
        if measured is None or measured.get("status") != "ok":
            rows.append({"run": name, "note": "not measured in this stage (see its entry)"})
            continue
        run = measured["run"]
        est = dry_run(lambda: CausalLMModule(config=config), batch_size=run["batch"], seq_len=run["seq"],
                      strategy=OffloadStrategy(**_strategy_kwargs(run["prefetch"])), precision="bf16-true",
                      callbacks=_callbacks(run["name"]), target="cuda")
        context = sum(x.bytes for x in est.corrections if x.name == "cuda_context")
        got = measured["rows"][0].get("allocated_peak_bytes")
        predicted = est.peak_device - context
        rows.append({"run": name, "predicted_device_bytes": est.peak_device, "cuda_context_bytes": context,
                     "predicted_tensors_bytes": predicted, "measured_allocated_peak_bytes": got,
                     "predicted_over_measured": round(predicted / got, 4) if got else None,
                     "binding_phase": est.binding_phase, "dry_run_s": round(est.wall_s, 1)})
    return {"rows": rows, "notes": [(
        "predicted_tensors_bytes = the dry run's device peak less its fixed CUDA-context correction (the allocator "
        "counts tensors, not the context); measured = allocated_bytes.all.peak of the same run (same shape, strategy, "
        "callbacks, precision). Corrections are listed in each estimate as uncalibrated: this is their calibration.")]}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


ENTRIES = [
    *(Entry(f"param_stream[{run}]", 70, _stream_entry(run, p),
            f"lowmem_offload{'' if p is None else f'_params prefetch={p}'}: step time, allocated/reserved/active peaks",
            fresh=True) for run, p in STREAM_RUNS.items()),
    Entry("activation_offload", 90, activation_offload,
          "ActivationOffload + checkpointing: step time, device peaks, pinned host bytes", fresh=True),
    Entry("dry_run_vs_measured", 70, dry_run_vs_measured, "dry run (CUDA target) vs the measured peaks above"),
]

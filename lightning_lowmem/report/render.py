"""What ``MemoryReport`` shows: the end-of-fit table, the JSON file and the plot of one step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lightning_lowmem.core.accounting import CATEGORIES
from lightning_lowmem.core.atomic import atomic_write
from lightning_lowmem.core.units import fmt_mib
from lightning_lowmem.measure.recorder import PHASES
from lightning_lowmem.predict.cuda_target import CUDA_CONTEXT_BYTES

_MAX_TIMELINE_POINTS = 2000


def table(steps: list[dict[str, Any]], predicted: dict[str, Any] | None, baseline: dict[str, Any] | None,
          phases: bool, gpu: dict[str, Any] | None = None) -> str:
    """The measured step with the highest device peak, the prediction of the same run and the plain baseline (and
    both predicted on a GPU, with ``gpu``)."""
    worst = max(steps, key=lambda r: r["peak_bytes"])
    cols = ["", "device peak", *CATEGORIES, "host peak"]
    rows: list[list[str]] = []

    def row(name: str, device: dict[str, int], host_total: int) -> list[str]:
        return [name, fmt_mib(device["total"]), *(fmt_mib(device[c]) for c in CATEGORIES), fmt_mib(host_total)]

    def phase_rows(label: str, record: dict[str, Any]) -> None:
        for phase in PHASES if phases else ():
            p = record["phases"].get(phase)
            if p is not None:
                rows.append(row(f"{label} {phase}", p["device"], p["host"]["total"]))

    phase_rows("measured", worst)
    rows.append(row(f"measured step peak ({worst['peak_phase']})", worst["peak"]["device"], worst["peak_bytes_host"]))
    gpu_run, gpu_plain = (gpu or {}).get("run"), (gpu or {}).get("plain_fp32")
    for label, est, per_phase in (("predicted", predicted, True), ("plain fp32", baseline, True),
                                  (f"GPU {(gpu_run or {}).get('run', {}).get('precision', '')}", gpu_run, False),
                                  ("GPU plain fp32", gpu_plain, False)):
        if est and "phases" in est:
            if per_phase:
                phase_rows(label, est)
            binding = est["binding_phase"]
            rows.append(row(f"{label} step peak ({binding})", est["phases"][binding]["device"], est["peak_host"]))
    widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [cols, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    head = (
        f"MemoryReport: sampled steps {[r['step'] for r in steps]}; the step with the highest device peak is step "
        f"{worst['step']} ({worst['micro_batches']} micro-batch(es)). Bytes of live tensor storage."
    )
    steady = [r["peak_bytes_host"] for r in steps if r.get("window", r["step"]) >= 1]
    tail = [
        "Host peak per sampled step: " + ", ".join(f"step {r['step']} {fmt_mib(r['peak_bytes_host'])}" for r in steps)
        + (f"; steady state (from the second step) {fmt_mib(max(steady))}." if steady else ".")
    ]
    if predicted and "error" in predicted:
        tail.append(f"Predicted: not available ({predicted['error']}).")
    elif predicted and worst["peak_bytes"]:
        host = f", host {predicted['peak_host'] / max(steady):.3f}" if steady and max(steady) else ""
        tail.append(f"Predicted / measured peak: device {predicted['peak_device'] / worst['peak_bytes']:.3f}{host} "
                    f"({predicted['method']}, target {predicted['target']}, the same run on fake tensors).")
    if baseline and "error" in baseline:
        tail.append(f"Plain fp32 baseline: not available ({baseline['error']}).")
    elif baseline:
        plain = baseline["peak_device"]
        saving = plain - worst["peak_bytes"]
        same = baseline.get("same_micro_batch")
        label = "the whole accumulation window as one batch: " if same is not None else ""
        tail.append(
            f"Plain fp32 training of this module ({baseline['run']['strategy']} strategy, 32-true, your optimizer, no "
            f"technique callbacks, {baseline['batch']}), predicted: device peak {fmt_mib(plain)}; measured device peak "
            f"{fmt_mib(worst['peak_bytes'])}: saving {label}{fmt_mib(saving)} ({100 * saving / plain:.1f} %)."
        )
        if same is not None and "error" in same:
            tail.append(f"Plain fp32 at the run's micro-batch: not available ({same['error']}).")
        elif same is not None:
            plain_micro = same["peak_device"]
            saving = plain_micro - worst["peak_bytes"]
            tail.append(
                f"Plain fp32 training at the run's micro-batch ({same['batch']}), predicted: device peak "
                f"{fmt_mib(plain_micro)}: saving of the techniques at the same micro-batch {fmt_mib(saving)} "
                f"({100 * saving / plain_micro:.1f} %); the rest of the saving above is accumulation's."
            )
    if gpu_run and gpu_plain and "phases" in gpu_run and "phases" in gpu_plain:
        saving = gpu_plain["peak_device"] - gpu_run["peak_device"]
        tail.append(f"On a GPU (dry runs, CUDA target, uncalibrated): this recipe at {gpu_run['run']['precision']} "
                    f"{fmt_mib(gpu_run['peak_device'])} against plain fp32 {fmt_mib(gpu_plain['peak_device'])} "
                    f"({gpu_plain['batch']}; both with CUDA's context, {fmt_mib(CUDA_CONTEXT_BYTES)}): saving "
                    f"{fmt_mib(saving)} ({100 * saving / gpu_plain['peak_device']:.1f} %).")
    elif gpu is not None:
        tail.append(f"On a GPU: not available ({(gpu_run or {}).get('error') or (gpu_plain or {}).get('error')}).")
    if worst["cuda_max_allocated"] is not None:
        tail.append(f"CUDA over the step: max allocated {fmt_mib(worst['cuda_max_allocated'])}, "
                    f"max reserved {fmt_mib(worst['cuda_max_reserved'])}.")
    for name, bd in worst["components"].items():
        if "error" in bd:
            tail.append(f"{name}.memory_breakdown() failed: {bd['error']}")
        else:
            tail.append(
                f"{name}.memory_breakdown(): device {fmt_mib(bd['device']['total'])}, host {fmt_mib(bd['host']['total'])} "
                "(host: " + ", ".join(f"{c} {fmt_mib(bd['host'][c])}" for c in CATEGORIES if bd["host"][c]) + ")"
            )
    return "\n".join([head, *lines, *tail])


def plot(timeline: dict[str, Any], path: Path) -> None:
    """Bytes by category over the events of one sampled step (matplotlib, Agg backend), written atomically."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    tl = timeline
    fig = Figure(figsize=(10, 5))
    ax = fig.subplots()
    x = list(range(len(tl["phase"])))
    mib = [[v / 2**20 for v in tl[c]] for c in CATEGORIES]
    ax.stackplot(x, *mib, labels=list(CATEGORIES), alpha=0.85)
    if any(tl["host_total"]):
        ax.plot(x, [v / 2**20 for v in tl["host_total"]], color="black", linestyle="--", label="host (total)")
    last = None
    for i, ph in enumerate(tl["phase"]):  # phase boundaries
        if ph != last:
            name = tl["phases"][ph] if 0 <= ph < len(tl["phases"]) else "?"
            ax.axvline(i, color="grey", linewidth=0.6)
            ax.text(i, ax.get_ylim()[1] * 0.98, f" {name}", rotation=90, va="top", fontsize=7, color="grey")
            last = ph
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel("MiB (device role)")
    ax.set_title(f"Memory over step {tl['step']} by category")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format="png"))


def downsample(tl: dict[str, Any]) -> dict[str, Any]:
    """Keep at most ``_MAX_TIMELINE_POINTS`` events, always keeping each stride's maximum (so the peak survives)."""
    n = len(tl["phase"])
    if n <= _MAX_TIMELINE_POINTS:
        return tl
    stride = math.ceil(n / _MAX_TIMELINE_POINTS)
    totals = [sum(tl[c][i] for c in CATEGORIES) for i in range(n)]
    keep = [max(range(s, min(s + stride, n)), key=totals.__getitem__) for s in range(0, n, stride)]
    return {k: v if k == "phases" else [v[i] for i in keep] for k, v in tl.items()}

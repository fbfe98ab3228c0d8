"""MemoryReport overhead: step time without the callback vs unsampled vs sampled steps, side by side.

Part 1 (through ``Trainer.fit``): three Trainers differing only in the callback run one after the other,
round after round (A B C A B C ...), and each step is timed from the first ``on_train_batch_start`` to the
last ``on_train_batch_end`` (a timer callback on each side of MemoryReport). Steps 0 and 1 (always sampled,
and warm-up) are not timed.
  - ``none``: no MemoryReport;
  - ``unsampled``: ``MemoryReport(every_n_steps=10**9)`` (steps >= 2 are not sampled);
  - ``sampled``: ``MemoryReport(every_n_steps=1)`` (every step tracked by phase, timeline recorded for the plot).
The one-off cost at the end of fit (table, JSON, PNG; no prediction) is timed too.

Part 2 (plain PyTorch loop, ``_harness.interleaved``): one training step untracked, under our ``MemoryTracker``
and under torch's ``torch.distributed._tools.mem_tracker.MemTracker``, with the peak each tracker reports.

Usage: ``python benchmarks/run.py memory_report_overhead [--rounds 5] [--steps 6]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import bench_trainer, fmt_bytes, interleaved, write_results
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.measure.tracker import MemoryTracker
from lightning_lowmem.report.memory_report import MemoryReport

CONFIG = {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 128}
BATCH, SEQ = 4, 128
# the same op count per step with ~10x the FLOPs: the tracker's per-op cost is a smaller share
WIDE_CONFIG = {"n_layer": 4, "n_embd": 384, "n_head": 6, "n_positions": 384}
WIDE_SEQ = 384


class _Batches(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 256, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Start(L.Callback):
    def __init__(self, clock: dict[str, Any]) -> None:
        self.clock = clock

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.clock["t0"] = time.perf_counter()
        self.clock["c0"] = time.process_time()


class _End(L.Callback):
    def __init__(self, clock: dict[str, Any]) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx >= 2:
            self.clock["steps"].append(time.perf_counter() - self.clock["t0"])
            self.clock["cpu"].append(time.process_time() - self.clock["c0"])


def _fit(variant: str, steps: int, out_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = CausalLMModule(config=CONFIG)
    clock: dict[str, Any] = {"steps": [], "cpu": []}
    report = None
    callbacks: list[L.Callback] = [_Start(clock)]
    if variant != "none":
        report = MemoryReport(every_n_steps=1 if variant == "sampled" else 10**9, save_dir=out_dir, predict=False)
        callbacks.append(report)
    callbacks.append(_End(clock))
    end_s = 0.0
    if report is not None:
        on_fit_end = report.on_fit_end

        def timed_on_fit_end(trainer, pl_module):  # type: ignore[no-untyped-def]
            nonlocal end_s
            t0 = time.perf_counter()
            on_fit_end(trainer, pl_module)
            end_s = time.perf_counter() - t0

        report.on_fit_end = timed_on_fit_end  # type: ignore[method-assign]
    trainer = bench_trainer(max_steps=steps + 2, callbacks=callbacks)
    trainer.fit(module, DataLoader(_Batches(BATCH * (steps + 2)), batch_size=BATCH))
    ops = report.steps[-1]["aten_ops"] if report is not None and report.steps else None
    return {"steps": clock["steps"], "cpu": clock["cpu"], "end_s": end_s, "ops": ops, "report": report}


class _NoopMode(TorchDispatchMode):
    """The floor of any Python dispatch-mode tracker: PyTorch's own cost of calling into Python per aten op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _plain_loop_comparison(
    rounds: int, config: dict[str, Any] = CONFIG, seq: int = SEQ, label: str = "plain loop", torch_tracker: bool = True
) -> tuple[list[dict[str, Any]], int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = CausalLMModule(config=config).model
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 256, (BATCH, seq))
    batch = {"input_ids": ids, "labels": ids}
    peaks: dict[str, int] = {}
    ops = {"n": 0}

    def step() -> None:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    def ours() -> None:
        tracker = MemoryTracker(model, [opt])
        with tracker:
            tracker.track(batch)
            with tracker.phase("forward"):
                loss = model(**batch).loss
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                opt.step()
                opt.zero_grad()
        del loss
        peaks["MemoryTracker"] = tracker.peak_bytes
        ops["n"] = tracker.num_ops

    def noop_mode() -> None:
        with _NoopMode():
            step()

    def torch_memtracker() -> None:
        mt = MemTracker()
        mt.track_external(model, opt, batch)
        with mt:
            step()
        peaks["torch MemTracker"] = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    # NOTE: two pairs, each against its own untracked runs: torch's MemTracker leaves garbage behind that slows
    # the steps run after it, which would blur our (much smaller) overhead if all three were interleaved.
    rows = []
    pairs: list[tuple[str, dict[str, Any], int]] = [
        (label, {"no-op dispatch mode": noop_mode, "MemoryTracker": ours}, 3 * rounds)
    ]
    if torch_tracker:
        pairs.append((f"{label} (torch)", {"torch MemTracker": torch_memtracker}, rounds))
    for pair, tracked, n_rounds in pairs:
        fns = {"untracked": step, **tracked}
        cpu: dict[str, list[float]] = {name: [] for name in fns}

        def cpu_timed(fn: Any, out: list[float]) -> Any:
            def run() -> None:
                c0 = time.process_time()
                fn()
                out.append(time.process_time() - c0)

            return run

        times = interleaved({name: cpu_timed(f, cpu[name]) for name, f in fns.items()}, rounds=n_rounds, warmup=1)
        cpu_med = {name: statistics.median(ts[1:]) for name, ts in cpu.items()}  # [0] is the warm-up
        base, cpu_base = times["untracked"]["median_s"], cpu_med["untracked"]
        for name, t in times.items():
            rows.append(
                {
                    "part": pair,
                    "variant": name,
                    "median_step_s": t["median_s"],
                    "min_s": t["min_s"],
                    "max_s": t["max_s"],
                    "n_steps": n_rounds,
                    "ratio_vs_none": t["median_s"] / base,
                    "cpu_step_s": cpu_med[name],
                    "cpu_ratio_vs_none": cpu_med[name] / cpu_base,
                    "overhead_ms_per_step": (t["median_s"] - base) * 1e3,
                    "cpu_overhead_ms_per_step": (cpu_med[name] - cpu_base) * 1e3,
                    "cpu_overhead_us_per_aten_op": (cpu_med[name] - cpu_base) / ops["n"] * 1e6
                    if name != "untracked"
                    else None,
                    "peak_bytes": peaks.get(name),
                    "peak": fmt_bytes(peaks[name]) if name in peaks else None,
                }
            )
    return rows, ops["n"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per fit (after 2 untimed ones)")
    args = parser.parse_args()
    # NOTE: one intra-op thread: on a shared 2-core machine the CPU-time figures are then the work done, not
    # OpenMP spin-waiting, and the wall-time figures are less sensitive to other processes.
    torch.set_num_threads(1)

    variants = ("none", "unsampled", "sampled")
    per_step: dict[str, list[float]] = {v: [] for v in variants}
    per_step_cpu: dict[str, list[float]] = {v: [] for v in variants}
    end_s: dict[str, list[float]] = {v: [] for v in variants}
    ops = None
    peak = None
    with tempfile.TemporaryDirectory() as out_dir:
        for _ in range(args.rounds):
            for v in variants:
                res = _fit(v, args.steps, out_dir)
                per_step[v] += res["steps"]
                per_step_cpu[v] += res["cpu"]
                end_s[v].append(res["end_s"])
                if v == "sampled":
                    ops = res["ops"]
                    peak = res["report"].steps[-1]["peak_bytes"]
    base = statistics.median(per_step["none"])
    cpu_base = statistics.median(per_step_cpu["none"])
    rows: list[dict[str, Any]] = []
    for v in variants:
        med = statistics.median(per_step[v])
        cpu_med = statistics.median(per_step_cpu[v])
        rows.append(
            {
                "part": "Trainer.fit",
                "variant": v,
                "median_step_s": med,
                "min_s": min(per_step[v]),
                "max_s": max(per_step[v]),
                "n_steps": len(per_step[v]),
                "ratio_vs_none": med / base,
                "cpu_step_s": cpu_med,
                "cpu_ratio_vs_none": cpu_med / cpu_base,
                "overhead_ms_per_step": (med - base) * 1e3,
                "cpu_overhead_ms_per_step": (cpu_med - cpu_base) * 1e3,
                "cpu_overhead_us_per_aten_op": (cpu_med - cpu_base) / ops * 1e6 if v == "sampled" and ops else None,
                "end_of_fit_s": statistics.median(end_s[v]) if v != "none" else None,
                "peak": fmt_bytes(peak) if v == "sampled" else None,
            }
        )
    plain_rows, plain_ops = _plain_loop_comparison(args.rounds)
    rows += plain_rows
    wide_rows, _ = _plain_loop_comparison(
        max(2, args.rounds // 3), WIDE_CONFIG, WIDE_SEQ, label="plain loop, wide", torch_tracker=False
    )
    rows += wide_rows
    mt = next(r for r in plain_rows if r["variant"] == "torch MemTracker")
    lite = next(r for r in plain_rows if r["variant"] == "MemoryTracker")
    notes = [
        (f"GPT-2 {CONFIG}, vocab 258, batch {BATCH} x seq {SEQ}, fp32 AdamW on CPU; {ops} aten ops per tracked step "
        f"(plain loop: {plain_ops})."),
        ("Wall time is noisy on a shared machine; cpu_* columns are process CPU time (1 intra-op thread), the "
        "figure to read for the overhead. "
        "Trainer.fit rows: per-step time from the first on_train_batch_start to the last on_train_batch_end, "
        f"median over {args.rounds} interleaved rounds x {args.steps} steps; steps 0 and 1 (always sampled) untimed."),
        "end_of_fit_s: MemoryReport.on_fit_end (table, JSON, PNG; predict=False), paid once per fit.",
        (f"'plain loop, wide': GPT-2 {WIDE_CONFIG}, batch {BATCH} x seq {WIDE_SEQ} (same ops, more work per op). "
        "'no-op dispatch mode': a TorchDispatchMode that only calls the op, the floor of any such tracker. "
        "Plain-loop rows: one step untracked vs MemoryTracker, then untracked vs torch MemTracker, each pair "
        "interleaved; the two trackers' peaks must agree."),
        "Overhead of torch MemTracker vs ours (plain loop): "
        + (
            f"{mt['cpu_overhead_ms_per_step'] / lite['cpu_overhead_ms_per_step']:.1f}x (CPU time)"
            if lite["cpu_overhead_ms_per_step"] > 0
            else "ours within noise of untracked"
        ),
    ]
    write_results(
        "memory_report_overhead",
        rows,
        [
            "part",
            "variant",
            "median_step_s",
            "ratio_vs_none",
            "cpu_step_s",
            "cpu_ratio_vs_none",
            "cpu_overhead_ms_per_step",
            "cpu_overhead_us_per_aten_op",
            "end_of_fit_s",
            "peak",
        ],
        title="MemoryReport overhead per sampled and unsampled step (and MemoryTracker vs torch MemTracker)",
        notes=notes,
    )


if __name__ == "__main__":
    main()

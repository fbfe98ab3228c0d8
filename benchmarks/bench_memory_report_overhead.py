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
import tempfile
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks._harness import fmt_bytes, interleaved, write_results
from lightning_lowmem.callbacks.memory_report import MemoryReport
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.memory.measure import MemoryTracker

CONFIG = {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 128}
BATCH, SEQ = 4, 128


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


class _End(L.Callback):
    def __init__(self, clock: dict[str, Any]) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx >= 2:
            self.clock["steps"].append(time.perf_counter() - self.clock["t0"])


def _fit(variant: str, steps: int, out_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = CausalLMModule(config=CONFIG)
    clock: dict[str, Any] = {"steps": []}
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
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=steps + 2,
        callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(_Batches(BATCH * (steps + 2)), batch_size=BATCH))
    ops = report.steps[-1]["aten_ops"] if report is not None and report.steps else None
    return {"steps": clock["steps"], "end_s": end_s, "ops": ops, "report": report}


def _plain_loop_comparison(rounds: int) -> tuple[list[dict[str, Any]], int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = CausalLMModule(config=CONFIG).model
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 256, (BATCH, SEQ))
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

    def torch_memtracker() -> None:
        mt = MemTracker()
        mt.track_external(model, opt, batch)
        with mt:
            step()
        peaks["torch MemTracker"] = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    times = interleaved({"untracked": step, "MemoryTracker": ours, "torch MemTracker": torch_memtracker}, rounds=rounds)
    base = times["untracked"]["median_s"]
    rows = []
    for name, t in times.items():
        rows.append(
            {
                "part": "plain loop",
                "variant": name,
                "median_step_s": t["median_s"],
                "min_s": t["min_s"],
                "max_s": t["max_s"],
                "ratio_vs_none": t["median_s"] / base,
                "overhead_ms_per_step": (t["median_s"] - base) * 1e3,
                "overhead_us_per_aten_op": (t["median_s"] - base) / ops["n"] * 1e6 if name != "untracked" else None,
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
    torch.set_num_threads(2)

    variants = ("none", "unsampled", "sampled")
    per_step: dict[str, list[float]] = {v: [] for v in variants}
    end_s: dict[str, list[float]] = {v: [] for v in variants}
    ops = None
    peak = None
    with tempfile.TemporaryDirectory() as out_dir:
        for _ in range(args.rounds):
            for v in variants:
                res = _fit(v, args.steps, out_dir)
                per_step[v] += res["steps"]
                end_s[v].append(res["end_s"])
                if v == "sampled":
                    ops = res["ops"]
                    peak = res["report"].steps[-1]["peak_bytes"]
    base = statistics.median(per_step["none"])
    rows: list[dict[str, Any]] = []
    for v in variants:
        med = statistics.median(per_step[v])
        rows.append(
            {
                "part": "Trainer.fit",
                "variant": v,
                "median_step_s": med,
                "min_s": min(per_step[v]),
                "max_s": max(per_step[v]),
                "n_steps": len(per_step[v]),
                "ratio_vs_none": med / base,
                "overhead_ms_per_step": (med - base) * 1e3,
                "overhead_us_per_aten_op": (med - base) / ops * 1e6 if v == "sampled" and ops else None,
                "end_of_fit_s": statistics.median(end_s[v]) if v != "none" else None,
                "peak": fmt_bytes(peak) if v == "sampled" else None,
            }
        )
    plain_rows, plain_ops = _plain_loop_comparison(args.rounds)
    rows += plain_rows
    mt = next(r for r in plain_rows if r["variant"] == "torch MemTracker")
    lite = next(r for r in plain_rows if r["variant"] == "MemoryTracker")
    notes = [
        f"GPT-2 {CONFIG}, vocab 258, batch {BATCH} x seq {SEQ}, fp32 AdamW on CPU; {ops} aten ops per tracked step "
        f"(plain loop: {plain_ops}).",
        "Trainer.fit rows: per-step wall time from the first on_train_batch_start to the last on_train_batch_end, "
        f"median over {args.rounds} interleaved rounds x {args.steps} steps; steps 0 and 1 (always sampled) untimed.",
        "end_of_fit_s: MemoryReport.on_fit_end (table, JSON, PNG; predict=False), paid once per fit.",
        "Plain-loop rows: one step untracked / MemoryTracker / torch MemTracker, interleaved; peaks must agree.",
        "Overhead of torch MemTracker vs ours (plain loop): "
        + (
            f"{mt['overhead_ms_per_step'] / lite['overhead_ms_per_step']:.1f}x"
            if lite["overhead_ms_per_step"] > 0
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
            "overhead_ms_per_step",
            "overhead_us_per_aten_op",
            "end_of_fit_s",
            "peak",
        ],
        title="MemoryReport overhead per sampled and unsampled step (and MemoryTracker vs torch MemTracker)",
        notes=notes,
    )


if __name__ == "__main__":
    main()

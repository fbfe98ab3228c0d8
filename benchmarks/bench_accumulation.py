"""AccumulationScheduler(micro_batch_size="auto") on the demo GPT-2 under three memory budgets.

For each budget: the micro-batch and accumulation the callback chose inside ``Trainer.fit`` (effective batch 64,
token-mean loss), the measured device-role peak of a training step at that micro-batch (``MemoryTracker``: forward,
backward and AdamW step, with gradients and optimizer state alive) and at the next valid micro-batch (which must
not fit), and the wall time of one optimizer step of 64 sequences at that choice, the choices timed side by side
(``interleaved``), as a ratio to the largest micro-batch.

Run: ``python benchmarks/run.py accumulation [--quick]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import bench_trainer, fmt_bytes, interleaved, write_results
from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.demo.data import StdlibTextDataModule
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.predict.micro_batch import dry_run_peak

MiB = 1024**2
EFFECTIVE = 64
# the demo's GPT-2 (configs/demo.yaml): 4 layers, 128 wide, 256 positions
GPT2_DEMO = {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 256}


def build(seq_len: int) -> tuple[CausalLMModule, StdlibTextDataModule]:
    torch.manual_seed(0)
    module = CausalLMModule(config={**GPT2_DEMO, "n_positions": seq_len}, loss_reduction="sum")
    data = StdlibTextDataModule(seq_len=seq_len, batch_size=1, max_bytes=seq_len * 200, val_fraction=0.0)
    return module, data


def choose(budget: int, seq_len: int) -> dict:
    """One ``Trainer.fit`` step with micro_batch_size="auto" under ``budget``: what the callback chose."""
    module, data = build(seq_len)
    callback = AccumulationScheduler(EFFECTIVE, "auto", loss_normalization="tokens", memory_budget=budget,
                                     measure=dry_run_peak)
    trainer = bench_trainer(max_steps=1, limit_val_batches=0, callbacks=[callback])
    trainer.fit(module, data)
    c = callback.choice
    tried = sorted(m for m, p in c.peaks.items() if p is not None)
    above = [m for m in sorted(c.peaks) if m > c.micro_batch_size]
    return {
        "budget": fmt_bytes(budget),
        "budget_bytes": budget,
        "micro_batch": c.micro_batch_size,
        "accumulation": c.accumulation,
        "peak_at_choice": fmt_bytes(c.peaks[c.micro_batch_size]),
        "peak_at_choice_bytes": c.peaks[c.micro_batch_size],
        "next_micro_batch": above[0] if above else None,
        "peak_at_next": fmt_bytes(c.peaks[above[0]]) if above else "-",
        "peak_at_next_bytes": c.peaks[above[0]] if above else None,
        "peaks_tried": {str(m): c.peaks[m] for m in tried},
        "step_tokens_logged": trainer.callback_metrics.get("accumulation/tokens"),
    }


def one_step(micro: int, seq_len: int) -> callable:
    """A plain optimizer step of EFFECTIVE sequences in micro-batches of ``micro`` (token-mean loss)."""
    module, data = build(seq_len)
    data.setup("fit")
    batches = [data.train_set[i] for i in range(EFFECTIVE)]
    stacked = {k: torch.stack([b[k] for b in batches]) for k in batches[0]}
    optimizer = module.configure_optimizers()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        total = 0
        for i in range(0, EFFECTIVE, micro):
            loss_sum, n = module.loss_sum_and_tokens({k: v[i : i + micro] for k, v in stacked.items()})
            loss_sum.backward()
            total += int(n)
        for p in module.parameters():
            if p.grad is not None:
                p.grad.div_(total)
        optimizer.step()

    return step


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="sequence length 64 and one timing round")
    args = parser.parse_args(argv)
    seq_len = 64 if args.quick else 256
    torch.set_num_threads(2)
    budgets = [48 * MiB, 160 * MiB, 640 * MiB] if not args.quick else [24 * MiB, 48 * MiB, 96 * MiB]
    rows = [choose(b, seq_len) for b in budgets]
    timings = interleaved(
        {f"micro {r['micro_batch']}": one_step(r["micro_batch"], seq_len) for r in rows},
        rounds=1 if args.quick else 3,
    )
    fastest = min(t["median_s"] for t in timings.values())
    for r in rows:
        t = timings[f"micro {r['micro_batch']}"]
        r["step_s"] = t["median_s"]
        r["step_time_vs_fastest"] = t["median_s"] / fastest
    write_results(
        "accumulation",
        rows,
        ["budget", "micro_batch", "accumulation", "peak_at_choice", "next_micro_batch", "peak_at_next",
         "step_s", "step_time_vs_fastest"],
        title=f"AccumulationScheduler auto micro-batch: demo GPT-2, effective batch {EFFECTIVE}, seq {seq_len}",
        notes=[
            ("peak_*: device-role peak of one training step measured by MemoryTracker (CPU: live tensor-storage "
            "bytes; forward + backward + AdamW step with gradients and optimizer state alive, batch included)."),
            ("next_micro_batch: the next divisor of the effective batch, measured during the search; its peak is "
            "over the budget (the search is a binary search, so it is the smallest tried size that does not fit)."),
            ("step_s: median wall time of one optimizer step of 64 sequences at that micro-batch (plain loop), the "
            "three timed in alternation; noisy on a shared CPU, read the ratio."),
        ],
        extra={"seq_len": seq_len, "effective_batch_size": EFFECTIVE, "model_config": GPT2_DEMO, "timings": timings},
    )


if __name__ == "__main__":
    main(sys.argv[1:])

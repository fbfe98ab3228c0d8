"""LLaMA-7B full fine-tune with the lean optimizers, no offload: the predicted device peak against AdamW (dry run).

Every row is ``estimate_memory("llama-7b", 1, 512, precision="bf16-true", target="cuda", callbacks=[...])``: the real
``Trainer.fit`` of the demo ``CausalLMModule`` on fake tensors for two steps, with ``ActivationCheckpointing("all")``
and the row's ``LeanOptimizer`` (its package's optimizer, its SVDs and random projections included, runs on the fake
tensors), extrapolated from 3, 4 and 5 traced blocks to 32. The goal: GaLore's claim that a 7B model trains in a
24 GB GPU. ``LeanOptimizer`` + ``OptimizerInBackward`` is GaLore's layer-wise update (no full set of gradients).

torchao's 4-/8-bit AdamW rows are dry runs like the others: torchao's step runs on the fake tensors (its compiled
per-parameter step eagerly), and its state (each moment a tensor subclass wrapping the quantized codes, one scale
per block and the quantization map) is counted at the size of the tensors it wraps, not at the nominal fp32 size
of the wrapper.

Run: ``python benchmarks/run.py lean_optimizer`` (about a minute per row on 2 CPU cores).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import fmt_bytes, write_results
from lightning_lowmem import ActivationCheckpointing, OptimizerInBackward, estimate_memory
from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer

MODEL, BATCH, SEQ, PRECISION = "llama-7b", 1, 512, "bf16-true"
GB24 = 24 * 2**30  # a "24 GB" card (RTX 3090/4090, A5000) has 24 GiB

ROWS = [
    ("AdamW (torch, bf16 state)", []),
    ("GaLore rank 128", [LeanOptimizer("galore")]),
    ("GaLore rank 1024 (the paper's 7B)", [LeanOptimizer("galore", rank=1024)]),
    ("GaLore rank 1024 + layer-wise (OptimizerInBackward)", [LeanOptimizer("galore", rank=1024), OptimizerInBackward()]),
    ("APOLLO-Mini (rank 1)", [LeanOptimizer("apollo_mini")]),
    ("APOLLO-Mini + layer-wise (OptimizerInBackward)", [LeanOptimizer("apollo_mini"), OptimizerInBackward()]),
    ("Adam-mini", [LeanOptimizer("adam_mini")]),
    ("torchao AdamW8bit", [LeanOptimizer("adamw8bit")]),
    ("torchao AdamW4bit", [LeanOptimizer("adamw4bit")]),
]


def main() -> None:
    rows = []
    for label, callbacks in ROWS:
        start = time.perf_counter()
        est = estimate_memory(MODEL, BATCH, SEQ, precision=PRECISION, target="cuda",
                              callbacks=[ActivationCheckpointing("all"), *callbacks])
        phase = est.binding_phase
        dev = est.phases[phase].device
        rows.append({"variant": label, "method": "dry_run", "peak_device": est.peak_device,
                     "peak": fmt_bytes(est.peak_device), "binding_phase": phase,
                     "optimizer_state": dev["optimizer_state"], "state": fmt_bytes(dev["optimizer_state"]),
                     "gradients": fmt_bytes(dev["gradients"]), "fits_24GB": est.peak_device <= GB24,
                     "wall_s": round(time.perf_counter() - start, 1)})
        print(rows[-1], flush=True)
    base = rows[0]
    for row in rows:
        row["vs_adamw"] = round(row["peak_device"] / base["peak_device"], 3)
    write_results(
        "lean_optimizer", rows,
        ["variant", "method", "peak", "vs_adamw", "binding_phase", "state", "gradients", "fits_24GB"],
        title=f"LLaMA-7B full fine-tune, {PRECISION}, batch {BATCH} x {SEQ}, ActivationCheckpointing('all'), no offload: "
              "predicted CUDA device peak (dry run)",
        notes=[
            "DRY RUN figures (fake tensors, target='cuda', CUDA context 512 MiB included); no GPU measurement yet.",
            ("torchao rows: dry runs of LeanOptimizer('adamw8bit'/'adamw4bit'); state: per moment the codes (1 B / "
             "0.5 B per value), one fp32 scale per 256 / 128 values and an fp32 quantization map (256 / 16 values; fp32 "
             "even for bf16 parameters), plus a 0-d fp32 step per tensor. Their optimizer phase holds the temporaries of "
             "torchao's per-parameter step run eagerly (fp32 copies of the largest tensor, the 131M-value embedding/head: "
             "about 3.4 GiB), an upper bound for its compiled, fused step on a GPU; AdamW's foreach step holds about "
             "12.5 GiB of temporaries."),
            "fits_24GB: peak <= 24 GiB (a '24 GB' card: RTX 3090/4090, A5000).",
        ],
    )


if __name__ == "__main__":
    main()

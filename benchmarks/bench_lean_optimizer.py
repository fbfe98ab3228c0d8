"""LLaMA-7B full fine-tune with the lean optimizers, no offload: the predicted device peak against AdamW (dry run).

Every row is ``estimate_memory("llama-7b", 1, 512, precision="bf16-true", target="cuda", callbacks=[...])``: the real
``Trainer.fit`` of the demo ``CausalLMModule`` on fake tensors for two steps, with ``ActivationCheckpointing("all")``
and the row's ``LeanOptimizer`` (its package's optimizer, its SVDs and random projections included, runs on the fake
tensors), extrapolated from 3, 4 and 5 traced blocks to 32. The goal: GaLore's claim that a 7B model trains in a
24 GB GPU. ``LeanOptimizer`` + ``OptimizerInBackward`` is GaLore's layer-wise update (no full set of gradients).

torchao's 4-/8-bit AdamW run in the dry run too (their compiled step eagerly), but the tracker counts their
tensor-subclass state at its nominal fp32 size (the wrapper) besides the quantized codes: those rows are analytic
(stated below), derived from torchao's own layout: a tensor of at least 4096 values whose size divides the block is
quantized, 1 B (8-bit) or 0.5 B (4-bit) per value per moment plus one scale per block (8-bit: block 256, fp32 scale;
4-bit: block 128, fp32 scale); other tensors keep both moments in the parameter's dtype.

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
]


def torchao_state_bytes(shapes: list[tuple[int, ...]], bits: int, param_bytes: int = 2) -> int:
    """torchao AdamW{8,4}bit state for parameters of these shapes (the layout in the module docstring)."""
    block = 256 if bits == 8 else 128
    total = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        if n >= 4096 and n % block == 0:
            total += 2 * (n * bits // 8 + 4 * (n // block))
        else:
            total += 2 * param_bytes * n
    return total


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_lowmem.predict.configs import resolve_config

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
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(resolve_config(MODEL))
    shapes = [tuple(p.shape) for p in meta.parameters()]
    adamw_state = base["optimizer_state"]
    for bits in (8, 4):
        state = torchao_state_bytes(shapes, bits)
        peak = base["peak_device"] - adamw_state + state
        rows.append({"variant": f"torchao AdamW{bits}bit", "method": "dry_run (AdamW's), analytic state",
                     "peak_device": peak, "peak": fmt_bytes(peak), "binding_phase": base["binding_phase"],
                     "optimizer_state": state, "state": fmt_bytes(state), "gradients": base["gradients"],
                     "fits_24GB": peak <= GB24, "wall_s": 0.0})
    for row in rows:
        row["vs_adamw"] = round(row["peak_device"] / base["peak_device"], 3)
    write_results(
        "lean_optimizer", rows,
        ["variant", "method", "peak", "vs_adamw", "binding_phase", "state", "gradients", "fits_24GB"],
        title=f"LLaMA-7B full fine-tune, {PRECISION}, batch {BATCH} x {SEQ}, ActivationCheckpointing('all'), no offload: "
              "predicted CUDA device peak (dry run)",
        notes=[
            "DRY RUN figures (fake tensors, target='cuda', CUDA context 512 MiB included); no GPU measurement yet.",
            ("torchao rows: analytic (the AdamW row's peak with its optimizer state replaced by torchao's layout: "
             "codes 1 B / 0.5 B per value per moment + one fp32 scale per 256 / 128 values for tensors of >= 4096 "
             "values whose size divides the block, bf16 moments otherwise); the dry run counts torchao's wrapper "
             "tensors at their nominal size. An upper bound: the AdamW row's optimizer phase also holds the foreach "
             "step's temporaries, which torchao's per-tensor step does not."),
            "fits_24GB: peak <= 24 GiB (a '24 GB' card: RTX 3090/4090, A5000).",
        ],
    )


if __name__ == "__main__":
    main()

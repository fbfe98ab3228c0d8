"""The host-memory wall: predicted device and host peaks, and host bytes/param by category, per recipe.

LLaMA-7B full fine-tune, bf16-true, AdamW, batch 1 x 2048, ``ActivationCheckpointing("all")`` +
``ActivationOffload(boundaries_only=True)`` + ``ChunkedLMLoss(chunk_tokens=1024)``; ``estimate_memory`` (the dry run of
the real strategy code on fake tensors, CUDA target). Recipes side by side: today's defaults (``lowmem_offload``,
``lowmem_offload_params``), ``+ optimizer_in_backward=True``, ``+ LowBitOptimizer("adamw8bit")``, and
``offload_params="auto"`` under a device budget (the first blocks resident: no host copy of theirs). The goal
(issue 45): a recipe within 12 GiB device and 64 GiB host with no disk.

Run: ``python benchmarks/run.py host_wall [--model llama-7b --seq 2048 --budget 8GiB]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import fmt_bytes, write_results
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

GIB = 2**30
DEVICE_GOAL, HOST_GOAL = 12 * GIB, 64 * GIB
CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "other")


def recipes(budget: str) -> list[tuple[str, dict[str, Any], bool]]:
    """``(name, OffloadStrategy kwargs, 8-bit AdamW)`` per recipe."""
    oib = {"optimizer_in_backward": True}
    return [
        ("lowmem_offload (default)", {}, False),
        ("lowmem_offload_params (default)", {"offload_params": True}, False),
        ("lowmem_offload + adamw8bit", {}, True),
        ("lowmem_offload_params + adamw8bit", {"offload_params": True}, True),
        ("lowmem_offload + in_backward", oib, False),
        ("lowmem_offload_params + in_backward", {"offload_params": True, **oib}, False),
        ("lowmem_offload + in_backward + adamw8bit", oib, True),
        ("lowmem_offload_params + in_backward + adamw8bit", {"offload_params": True, **oib}, True),
        (f"lowmem_offload_params auto ({budget}) + in_backward + adamw8bit",
         {"offload_params": "auto", "device_budget": budget, **oib}, True),
    ]


def estimate(model: str, seq: int, kwargs: dict[str, Any], low_bit: bool) -> Any:
    from lightning_lowmem import estimate_memory
    from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
    from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
    from lightning_lowmem.callbacks.chunked_lm_loss.callback import ChunkedLMLoss
    from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer

    callbacks: list[Any] = [ActivationCheckpointing("all"), ActivationOffload(boundaries_only=True),
                            ChunkedLMLoss(chunk_tokens=1024)]
    callbacks += [LowBitOptimizer("adamw8bit")] if low_bit else []
    # NOTE: a strategy object, not a name: the dry run turns off the host-RAM check of this machine only on objects.
    # "auto" is traced at full depth: the depths the extrapolation traces (3-5 blocks) all fit the budget, so a line
    # through them would keep every block resident
    return estimate_memory(model, 1, seq, strategy=OffloadStrategy(**kwargs), precision="bf16-true",
                           callbacks=callbacks, extrapolate=False if kwargs.get("offload_params") == "auto" else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget", default="8GiB", help="device_budget of the offload_params='auto' recipe")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for name, kwargs, low_bit in recipes(args.budget):
        t0 = time.perf_counter()
        est = estimate(args.model, args.seq, kwargs, low_bit)
        n = est.num_params
        host = max(est.phases.values(), key=lambda bd: bd.total("host")).host  # at the host peak
        row: dict[str, Any] = {
            "part": "estimate", "model": args.model, "batch": f"1x{args.seq}", "recipe": name, "strategy": kwargs,
            "low_bit": low_bit, "peak_device": fmt_bytes(est.peak_device), "peak_host": fmt_bytes(est.peak_host),
            "host_B_per_param": round(est.peak_host / n, 2),
            **{f"host_{c}_B_per_param": round(host[c] / n, 2) for c in CATEGORIES},
            "fits_12GiB_64GiB": est.peak_device <= DEVICE_GOAL and est.peak_host <= HOST_GOAL,
            "peak_device_bytes": est.peak_device, "peak_host_bytes": est.peak_host, "num_params": n,
            "host_bytes": dict(host), "notes": est.notes, "seconds": round(time.perf_counter() - t0, 1),
        }
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("host_bytes", "notes")}, flush=True)
    write_results(
        "host_wall", rows,
        ["recipe", "peak_device", "peak_host", "host_B_per_param", *(f"host_{c}_B_per_param" for c in CATEGORIES),
         "fits_12GiB_64GiB"],
        title=(f"The host-memory wall: {args.model} full fine-tune, bf16-true, AdamW, 1 x {args.seq}: predicted peaks "
               "and host bytes/param by category (dry run, CUDA target)"),
        notes=[
            ("every figure is a dry run (estimate_memory, target='cuda', computed on the CPU): callbacks="
             "[ActivationCheckpointing('all'), ActivationOffload(boundaries_only=True), ChunkedLMLoss(chunk_tokens=1024)]"
             " (+ LowBitOptimizer('adamw8bit') where named); prefetch=1"),
            ("host B/param by category at the host peak, per parameter of the model: weights = the host copies of "
             "streamed weights without an fp32 master (compute dtype; a trained one is rounded from its master at each "
             "fetch); gradients = fp32 gradient buffers (in_backward: the one reused fp32 "
             "buffer that widens a bf16 gradient, the largest parameter's size); optimizer_state = the fp32 masters "
             "(4 B: every parameter is trained) + the optimizer's state (AdamW: 8 B, 8-bit AdamW: ~2 B); other = the "
             "pinned staging of the gradient and weight copies (compute dtype, every trained parameter, pinned "
             "allocator rounding); activations = ActivationOffload's host copies"),
            "in_backward = OffloadStrategy(optimizer_in_backward=True): each master steps as its gradient lands",
            ("auto = OffloadStrategy(offload_params='auto', device_budget=...): the first blocks stay resident within "
             "the budget; traced at full depth (extrapolate=False)"),
            "fits_12GiB_64GiB: peak device <= 12 GiB and peak host <= 64 GiB (the issue's goal, no disk)",
            ("other also holds, with offload_params, the pinned ring the trained weights' fetches are rounded into "
             "((prefetch + 2) x the largest block's weights in the compute dtype; a CUDA correction of the CPU trace)"),
        ],
    )


if __name__ == "__main__":
    main()

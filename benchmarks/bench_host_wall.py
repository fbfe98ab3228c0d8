"""The host-memory wall: predicted device and host peaks, and host bytes/param by category, per recipe.

LLaMA-7B full fine-tune, bf16-true, AdamW, batch 1 x 2048, ``ActivationCheckpointing("all")`` +
``ActivationOffload(boundaries_only=True)`` + ``ChunkedLMLoss(chunk_tokens=1024)``; ``estimate_memory`` (the dry run of
the real strategy code on fake tensors, CUDA target). Recipes side by side: today's defaults (``lowmem_offload``,
``lowmem_offload_params``), ``+ optimizer_in_backward=True``, ``+ LowBitOptimizer("adamw8bit")``, and
``offload_params="auto"`` under a device budget (the first blocks resident: no host copy of theirs). The goal
(issue 45): a recipe within 12 GiB device and 64 GiB host with no disk.

With the disk tier (``OffloadStrategy(offload_params=True, optimizer_in_backward=True, disk=<a temporary directory>)``,
the same callbacks; the dry run creates no file), for each of ``--disk-models``: device, host by category and disk
bytes, against the issue's goals: LLaMA-7B within 12 GiB device and 16 GiB host, LLaMA-70B within 24 GiB device,
128 GiB host and 1.3 TB disk (the host counts the tier's pages in flight, its ``disk_buffer``, 1 GiB by default).

Run: ``python benchmarks/run.py host_wall [--model llama-7b --seq 2048 --budget 8GiB --disk-models llama-7b,llama-70b]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import fmt_bytes, write_results
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

GIB = 2**30
DEVICE_GOAL, HOST_GOAL = 12 * GIB, 64 * GIB
#: the disk tier's goals (issue 45): model -> (device, host, disk or None)
DISK_GOALS = {"llama-7b": (12 * GIB, 16 * GIB, None), "llama-70b": (24 * GIB, 128 * GIB, 1.3e12)}
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


def disk_recipes(disk_dir: str, eight_bit: bool) -> list[tuple[str, dict[str, Any], bool]]:
    """``(name, OffloadStrategy kwargs, 8-bit AdamW)`` per recipe with the disk tier (AdamW, and ``eight_bit``)."""
    tier = {"offload_params": True, "optimizer_in_backward": True, "disk": disk_dir}
    return [("lowmem_offload_params + in_backward + disk", tier, False),
            *([("lowmem_offload_params + in_backward + disk + adamw8bit", tier, True)] if eight_bit else [])]


def row(part: str, model: str, seq: int, name: str, kwargs: dict[str, Any], low_bit: bool) -> dict[str, Any]:
    """One recipe's dry run: peaks, host bytes/param by category at the host peak, disk bytes, and its goal."""
    t0 = time.perf_counter()
    est = estimate(model, seq, kwargs, low_bit)
    n = est.num_params
    host = max(est.phases.values(), key=lambda bd: bd.total("host")).host  # at the host peak
    device_goal, host_goal, disk_goal = (DEVICE_GOAL, HOST_GOAL, None) if part == "estimate" else DISK_GOALS[model]
    goal = f"{fmt_bytes(device_goal)} device, {fmt_bytes(host_goal)} host" + (
        f", {disk_goal / 1e12:.1f} TB disk" if disk_goal else "")
    return {
        "part": part, "model": model, "batch": f"1x{seq}", "recipe": name,
        "strategy": {k: ("<tmp dir>" if k == "disk" else v) for k, v in kwargs.items()},
        "low_bit": low_bit, "peak_device": fmt_bytes(est.peak_device), "peak_host": fmt_bytes(est.peak_host),
        "peak_disk": fmt_bytes(est.peak_disk), "host_B_per_param": round(est.peak_host / n, 2),
        **{f"host_{c}_B_per_param": round(host[c] / n, 2) for c in CATEGORIES},
        "disk_B_per_param": round(est.peak_disk / n, 2),
        "goal": goal,
        "fits_goal": (est.peak_device <= device_goal and est.peak_host <= host_goal
                      and (disk_goal is None or est.peak_disk <= disk_goal)),
        "peak_device_bytes": est.peak_device, "peak_host_bytes": est.peak_host, "peak_disk_bytes": est.peak_disk,
        "num_params": n, "host_bytes": dict(host), "notes": est.notes,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget", default="8GiB", help="device_budget of the offload_params='auto' recipe")
    parser.add_argument("--disk-models", default="llama-7b,llama-70b",
                        help=f"models of the disk tier's rows, comma-separated, of {', '.join(DISK_GOALS)} ('': none)")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    disk_models = list(filter(None, args.disk_models.split(",")))
    with tempfile.TemporaryDirectory() as disk_dir:
        todo = [("estimate", args.model, *r) for r in recipes(args.budget)]
        for model in disk_models:
            # NOTE: the 70B once (its dry run takes minutes): the module's own AdamW, as the goal
            todo += [("estimate_disk", model, *r) for r in disk_recipes(disk_dir, eight_bit=model != "llama-70b")]
        for part, model, name, kwargs, low_bit in todo:
            rows.append(row(part, model, args.seq, name, kwargs, low_bit))
            print({k: v for k, v in rows[-1].items() if k not in ("host_bytes", "notes")}, flush=True)
    write_results(
        "host_wall", rows,
        ["model", "recipe", "peak_device", "peak_host", "peak_disk", "host_B_per_param",
         *(f"host_{c}_B_per_param" for c in CATEGORIES), "disk_B_per_param", "goal", "fits_goal"],
        title=(f"The host-memory wall: {args.model} full fine-tune, bf16-true, AdamW, 1 x {args.seq}: predicted peaks "
               "and host bytes/param by category (dry run, CUDA target)"
               + (f"; with the disk tier: {', '.join(disk_models)}" if disk_models else "")),
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
            ("goal, fits_goal: the issue's goals: without disk, peak device <= 12 GiB and peak host <= 64 GiB; with "
             "the disk tier, LLaMA-7B within 12 GiB device and 16 GiB host, LLaMA-70B within 24 GiB device, 128 GiB "
             "host and 1.3 TB (1.3e12 B) disk"),
            ("disk = OffloadStrategy(offload_params=True, optimizer_in_backward=True, disk=<tmp dir>): the fp32 "
             "masters and the optimizer state in files (peak_disk, disk_B_per_param: 4 B of master + the state, AdamW "
             "8 B, 8-bit AdamW ~2 B, each file's regions rounded to pages); the dry run creates no file. Host 'other' "
             "holds the tier's pages in flight (its disk_buffer, 1 GiB by default: a CUDA correction, as the staging) "
             "and the CUDA transfer's one pinned staging ring (two of the largest weights in bf16, pinned rounding)"),
            ("other also holds, with offload_params, the pinned ring the trained weights' fetches are rounded into "
             "((prefetch + 2) x the largest block's weights in the compute dtype; a CUDA correction of the CPU trace)"),
        ],
    )


if __name__ == "__main__":
    main()

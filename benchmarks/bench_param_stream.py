"""``lowmem_offload_params``: predicted device/host peaks for large shapes, and step time against ``lowmem_offload``.

1. **Predicted peaks** (``estimate_memory``: the dry run of the real strategy code on fake tensors, CUDA target):
   GPT-2-XL at batch 4 x 1024 in bf16 with ``ActivationCheckpointing("all")`` + ``ActivationOffload(boundaries_only=
   True)``, with and without ``ChunkedLMLoss``; LLaMA 7B/13B/70B shapes at batch 1 x 2048 with the same techniques
   and the chunked loss. ``lowmem_offload`` beside ``lowmem_offload_params`` where it is cheap to trace.
2. **CPU step time** of ``lowmem_offload_params`` vs ``lowmem_offload`` on a small GPT-2 through ``Trainer.fit``
   (interleaved rounds; on the CPU every fetch is a real copy).
3. **GPU** (only with CUDA): step time with prefetch 0, 1, 2 against resident weights, at every CPU's thread
   (``--gpu-threads``). ``make gpu-check STAGE=2`` measures the same on GPT-2-XL with the allocator's peaks.

Run: ``python benchmarks/run.py param_stream [--skip-estimates] [--layers 6 --width 256 --seq 128 --batch 4]``
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import RESULTS, add_int_args, bench_trainer, fmt_bytes, lm_batches, step_clock, write_results
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

GIB = 2**30


def estimates(rows: list[dict[str, Any]], quick: bool) -> None:
    from lightning_lowmem import estimate_memory
    from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
    from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
    from lightning_lowmem.callbacks.chunked_lm_loss.callback import ChunkedLMLoss

    def callbacks(chunked: bool) -> list[Any]:
        out: list[Any] = [ActivationCheckpointing("all"), ActivationOffload(boundaries_only=True)]
        return out + [ChunkedLMLoss(chunk_tokens=1024)] if chunked else out

    cases = [("gpt2-xl", 4, 1024, "lowmem_offload", True), ("gpt2-xl", 4, 1024, "lowmem_offload_params", False),
             ("gpt2-xl", 4, 1024, "lowmem_offload_params", True)]
    if not quick:
        cases += [(m, 1, 2048, s, True) for m in ("llama-7b", "llama-13b", "llama-70b")
                  for s in ("lowmem_offload", "lowmem_offload_params")]
    for model, batch, seq, strategy, chunked in cases:
        t0 = time.perf_counter()
        # NOTE: strategy objects, not names: the dry run turns off the host-RAM check of this machine only on objects
        obj = OffloadStrategy(offload_params=strategy == "lowmem_offload_params")
        est = estimate_memory(model, batch, seq, strategy=obj, precision="bf16-true", callbacks=callbacks(chunked))
        rows.append({
            "part": "estimate", "model": model, "batch": f"{batch}x{seq}", "strategy": strategy,
            "chunked_loss": chunked, "peak_device": fmt_bytes(est.peak_device), "peak_host": fmt_bytes(est.peak_host),
            "peak_device_bytes": est.peak_device, "peak_host_bytes": est.peak_host,
            "binding_phase": est.binding_phase, "seconds": round(time.perf_counter() - t0, 1),
        })
        print(rows[-1], flush=True)


def _module(args: Any) -> CausalLMModule:
    torch.manual_seed(0)
    return CausalLMModule(config={"n_layer": args.layers, "n_embd": args.width, "n_head": args.heads,
                                  "n_positions": args.seq, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})


def step_times(args: Any, variants: dict[str, Any], accelerator: str) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds per training step of each variant, rounds interleaved (first two steps dropped)."""
    # NOTE: CPU time beside wall time: it is what a loaded shared machine distorts least
    data = [lm_batches(1, (args.batch, args.seq), seed=i)[0] for i in range(args.steps)]
    base = _module(args)
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in variants}
    for _ in range(args.rounds):
        for name, make in variants.items():
            clock = step_clock()
            trainer = bench_trainer(accelerator=accelerator, strategy=make(), precision=args.precision,
                                    max_steps=args.steps, callbacks=[clock])
            trainer.fit(copy.deepcopy(base), DataLoader(data, batch_size=None))
            times[name]["wall"] += clock.wall[2:]
            times[name]["cpu"] += clock.cpu[2:]
    return {name: {k: statistics.median(v) for k, v in ts.items()} for name, ts in times.items()}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, which a container or ``taskset`` narrows), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main() -> None:
    parser = argparse.ArgumentParser()
    add_int_args(parser, layers=6, width=256, heads=4, seq=128, batch=4, steps=6, rounds=3)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--skip-estimates", action="store_true")
    parser.add_argument("--gpu-shape", default="48,1600,25,1024,4", help="layers,width,heads,seq,batch on CUDA")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the CPU timing")
    parser.add_argument("--gpu-threads", type=int, default=None,
                        help="torch threads for the GPU timing (default: every CPU this process may use)")
    parser.add_argument("--quick-estimates", action="store_true", help="GPT-2-XL only")
    parser.add_argument("--reuse-estimates", action="store_true",
                        help="keep the estimate rows of the last results file (re-time the steps only)")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    if args.reuse_estimates:
        last = Path(os.environ.get("LOWMEM_BENCH_RESULTS", RESULTS)) / "param_stream.json"
        rows += [r for r in json.loads(last.read_text())["rows"] if r["part"] == "estimate"]
    elif not args.skip_estimates and not torch.cuda.is_available():
        # NOTE: on a GPU machine only the step times are new: the estimates are CPU dry runs
        estimates(rows, args.quick_estimates)
    torch.set_num_threads(args.threads)
    cpu = step_times(args, {"lowmem_offload": lambda: OffloadStrategy(),
                            "lowmem_offload_params": lambda: OffloadStrategy(offload_params=True)}, "cpu")
    for name, t in cpu.items():
        rows.append({"part": "cpu step", "model": f"gpt2 {args.layers}x{args.width}", "batch": f"{args.batch}x{args.seq}",
                     "strategy": name, "step_s": round(t["wall"], 4), "vs_resident": round(t["wall"] / cpu["lowmem_offload"]["wall"], 3),
                     "step_cpu_s": round(t["cpu"], 4), "cpu_vs_resident": round(t["cpu"] / cpu["lowmem_offload"]["cpu"], 3)})
    if torch.cuda.is_available():
        # NOTE: the host AdamW, the gradient folds and the bf16 casts of the GPU steps run on the host's threads: one
        # thread (the CPU timing's setting, chosen for a shared machine) would make them the step's bottleneck
        torch.set_num_threads(args.gpu_threads or usable_cpus())
        # NOTE: the GPU goal: GPT-2-XL at batch 4 x 1024 (override with --gpu-shape L,W,H,SEQ,BATCH)
        gpu_args = copy.copy(args)
        gpu_args.layers, gpu_args.width, gpu_args.heads, gpu_args.seq, gpu_args.batch = map(int, args.gpu_shape.split(","))
        variants = {"resident": lambda: OffloadStrategy()}
        variants |= {f"prefetch={p}": (lambda p=p: OffloadStrategy(offload_params=True, prefetch=p)) for p in (0, 1, 2)}
        gpu = step_times(gpu_args, variants, "cuda")
        for name, t in gpu.items():
            rows.append({"part": "gpu step", "model": f"gpt2 {gpu_args.layers}x{gpu_args.width}",
                         "batch": f"{gpu_args.batch}x{gpu_args.seq}", "strategy": name, "step_s": round(t["wall"], 4),
                         "vs_resident": round(t["wall"] / gpu["resident"]["wall"], 3)})
    write_results(
        "param_stream", rows,
        ["part", "model", "batch", "strategy", "chunked_loss", "peak_device", "peak_host", "step_s", "vs_resident",
         "step_cpu_s", "cpu_vs_resident"],
        title="lowmem_offload_params: predicted peaks (dry run, CUDA target) and step time vs lowmem_offload",
        notes=[
            ("estimates: estimate_memory(..., precision='bf16-true', callbacks=[ActivationCheckpointing('all'), "
             "ActivationOffload(boundaries_only=True)] (+ ChunkedLMLoss(chunk_tokens=1024) where chunked_loss), "
             "target='cuda'; prefetch=1"),
            ("cpu step: median wall (step_s) and process CPU (step_cpu_s) seconds per step over the interleaved rounds, "
             "first two steps of each fit dropped, torch threads = --threads; on the CPU each fetch is a real host copy "
             "and nothing overlaps. CPU time is the figure to compare on a shared, loaded machine"),
            "gpu step: only with CUDA, torch threads = --gpu-threads (default: every CPU this process may use)",
        ],
    )


if __name__ == "__main__":
    main()

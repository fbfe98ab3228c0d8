"""``lowmem_offload_params``: predicted device/host peaks for large shapes, and step time against ``lowmem_offload``.

1. **Predicted peaks** (``estimate_memory``: the dry run of the real strategy code on fake tensors, CUDA target):
   GPT-2-XL at batch 4 x 1024 in bf16 with ``ActivationCheckpointing("all")`` + ``ActivationOffload(boundaries_only=
   True)``, with and without ``ChunkedLMLoss``; LLaMA 7B/13B/70B shapes at batch 1 x 2048 with the same techniques
   and the chunked loss. ``lowmem_offload`` beside ``lowmem_offload_params`` where it is cheap to trace.
2. **CPU step time** of ``lowmem_offload_params`` vs ``lowmem_offload`` on a small GPT-2 through ``Trainer.fit``
   (interleaved rounds; on the CPU every fetch is a real copy).
3. **GPU** (only with CUDA; ``make gpu-check`` runs it): step time with prefetch 0, 1, 2 against resident weights.

Run: ``python benchmarks/run.py param_stream [--skip-estimates] [--layers 6 --width 256 --seq 128 --batch 4]``
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks._harness import fmt_bytes, write_results
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.strategies.offload import OffloadStrategy

GIB = 2**30


def estimates(rows: list[dict[str, Any]], quick: bool) -> None:
    from lightning_lowmem import estimate_memory
    from lightning_lowmem.callbacks.activation_checkpointing import ActivationCheckpointing
    from lightning_lowmem.callbacks.activation_offload import ActivationOffload
    from lightning_lowmem.callbacks.chunked_lm_loss import ChunkedLMLoss

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


def step_times(args: Any, variants: dict[str, Any], accelerator: str) -> dict[str, float]:
    """Median seconds per training step of each variant, rounds interleaved (fit `steps` steps, first two dropped)."""
    from benchmarks._harness import step_probe

    data = [{k: v for k, v in _batch(args, i).items()} for i in range(args.steps)]
    base = _module(args)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, make in variants.items():
            probe = step_probe(at=None)
            trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=make(), precision=args.precision,
                                max_steps=args.steps, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])
            trainer.fit(copy.deepcopy(base), DataLoader(data, batch_size=None))
            times[name] += probe.times[2:]
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def _batch(args: Any, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--skip-estimates", action="store_true")
    parser.add_argument("--quick-estimates", action="store_true", help="GPT-2-XL only")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    if not args.skip_estimates:
        estimates(rows, args.quick_estimates)
    cpu = step_times(args, {"lowmem_offload": lambda: OffloadStrategy(),
                            "lowmem_offload_params": lambda: OffloadStrategy(offload_params=True)}, "cpu")
    for name, t in cpu.items():
        rows.append({"part": "cpu step", "model": f"gpt2 {args.layers}x{args.width}", "batch": f"{args.batch}x{args.seq}",
                     "strategy": name, "step_s": round(t, 4), "vs_resident": round(t / cpu["lowmem_offload"], 3)})
    if torch.cuda.is_available():
        gpu_args = copy.copy(args)
        variants = {"resident": lambda: OffloadStrategy()}
        variants |= {f"prefetch={p}": (lambda p=p: OffloadStrategy(offload_params=True, prefetch=p)) for p in (0, 1, 2)}
        gpu = step_times(gpu_args, variants, "cuda")
        for name, t in gpu.items():
            rows.append({"part": "gpu step", "model": f"gpt2 {args.layers}x{args.width}",
                         "batch": f"{args.batch}x{args.seq}", "strategy": name, "step_s": round(t, 4),
                         "vs_resident": round(t / gpu["resident"], 3)})
    write_results(
        "param_stream", rows,
        ["part", "model", "batch", "strategy", "chunked_loss", "peak_device", "peak_host", "step_s", "vs_resident"],
        title="lowmem_offload_params: predicted peaks (dry run, CUDA target) and step time vs lowmem_offload",
        notes=[
            "estimates: estimate_memory(..., precision='bf16-true', callbacks=[ActivationCheckpointing('all'), "
            "ActivationOffload(boundaries_only=True)] (+ ChunkedLMLoss(chunk_tokens=1024) where chunked_loss), "
            "target='cuda'; prefetch=1",
            "cpu step: median seconds per step over the interleaved rounds (first two steps of each fit dropped); on the "
            "CPU each fetch is a real host copy, nothing overlaps",
            "gpu step: only with CUDA (make gpu-check)",
        ],
    )


if __name__ == "__main__":
    main()

"""``lowmem_offload``'s CUDA transfer logic: host work on the autograd thread, and pinned staging bytes.

Two measurements:

1. **Host work on the autograd thread per step** (CPU, the CUDA transfer logic on ``DeferredOps``): the time
   spent inside the gradient hooks (which run on the autograd thread: on CUDA, time the GPU's kernel queue is
   not being fed) and in the drain at the end of backward, per training step, through ``Trainer.fit``.
   Rows: *before*: the policy of the previous ``CudaTransfer`` (after queueing a copy the hook folds every copy
   that has landed; with ``progress="eager"`` every copy has, as on a GPU that keeps up with the hooks);
   *after*: the hook only queues, the drain folds (this commit). Both end bit-identical (checked). The stand-in
   runs the device's copies on the host; their time is left out of the hook time (on CUDA the copy engine does them).
2. **Pinned staging bytes, allocated vs planned**: per-parameter pinned buffers (the previous layout: torch's
   pinned allocator rounds each one up to a power of two) against flat 64 MiB buckets, for GPT-2 shapes built
   on the meta device (no weights), and for a tiny model measured through ``Trainer.fit`` (``memory_breakdown``
   against the host-RAM check's plan against the allocator's rounding of the buffers actually allocated).

Run: ``python benchmarks/run.py transfer [--layers 4 --width 256 --seq 64 --batch 4 --steps 6]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import add_int_args, bench_trainer, fmt_bytes, lm_batches, lm_sample, write_results
from lightning_lowmem.core.host_memory import pinned_bytes
from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from lightning_lowmem.strategies.offload.transfer import StreamTransfer, planned_staging_bytes


class FoldInHook(StreamTransfer):
    """The previous policy, for the *before* row: the hook folds every copy that has landed."""

    def grad_to_host(self, i: int, grad: torch.Tensor, sink: Any) -> None:
        super().grad_to_host(i, grad, sink)
        while self._pending and self.ops.query(self._pending[0][0]):
            event, j, fold = self._pending.popleft()
            self.ops.synchronize(event)
            fold(j, self._staging[j])
            self._unread.discard(j)


class Timed(OffloadStrategy):
    """Times the gradient hooks (autograd thread) and the drain, per step."""

    def __init__(self, policy: str) -> None:
        super().__init__()
        self.policy = policy
        self.hook_s = self.drain_s = 0.0
        self.hook_calls = 0

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if self.policy == "before":
            self._transfer = FoldInHook(self.root_device, self._masters.p_device, DeferredOps("eager"))

    def _grad_ready(self, *args: Any) -> None:
        # NOTE: the stand-in does the device's copies on this thread too; on CUDA they run on the copy engine
        ops = self._transfer.ops  # type: ignore[union-attr]
        t0, copies = time.perf_counter(), ops.copy_seconds
        super()._grad_ready(*args)
        self.hook_s += time.perf_counter() - t0 - (ops.copy_seconds - copies)
        self.hook_calls += 1

    def drain_transfers(self) -> None:
        t0 = time.perf_counter()
        super().drain_transfers()
        self.drain_s += time.perf_counter() - t0


def autograd_thread_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    config = {"n_layer": args.layers, "n_embd": args.width, "n_head": max(1, args.width // 64), "n_positions": args.seq,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    base = CausalLMModule(config=config, learning_rate=1e-3)
    data = lm_batches(args.steps * args.batch, (args.seq,))
    results: dict[str, dict[str, Any]] = {}
    weights: dict[str, list[torch.Tensor]] = {}
    for rnd in range(args.rounds):
        for policy in ("before", "after"):
            module = copy.deepcopy(base)
            strategy = Timed(policy)
            with cpu_stand_in(lambda: DeferredOps("eager")):
                trainer = bench_trainer(strategy=strategy, precision="bf16-true", max_steps=args.steps)
                t0 = time.perf_counter()
                trainer.fit(module, DataLoader(data, batch_size=args.batch))
                total = time.perf_counter() - t0
            row = results.setdefault(policy, {"hook": [], "drain": [], "fit": []})
            row["hook"].append(strategy.hook_s / args.steps)
            row["drain"].append(strategy.drain_s / args.steps)
            row["fit"].append(total / args.steps)
            weights[policy] = [p.detach().clone() for p in module.parameters()]
    identical = all(torch.equal(a, b) for a, b in zip(weights["before"], weights["after"]))
    rows = []
    for policy, r in results.items():
        rows.append({
            "policy": policy,
            "autograd_thread_ms_per_step": round(1e3 * statistics.median(r["hook"]), 2),
            "drain_ms_per_step": round(1e3 * statistics.median(r["drain"]), 2),
            "fit_ms_per_step": round(1e3 * statistics.median(r["fit"]), 1),
            "bit_identical": identical,
        })
    return rows


def _gpt2_specs(n_layer: int, n_embd: int, vocab: int = 50257, n_pos: int = 1024) -> list[tuple[int, torch.dtype]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64),
                                           vocab_size=vocab, n_positions=n_pos))
    return [(p.numel(), torch.bfloat16) for p in model.parameters()]


def pinned_rows() -> list[dict[str, Any]]:
    rows = []
    cuda = torch.device("cuda")
    for name, (layers, width) in {"gpt2-124M": (12, 768), "gpt2-355M": (24, 1024), "gpt2-1.5B": (48, 1600)}.items():
        specs = _gpt2_specs(layers, width)
        payload = sum(2 * n for n, _ in specs)
        per_param = sum(pinned_bytes(2 * n) for n, _ in specs)
        bucketed = planned_staging_bytes(cuda, specs)
        for layout, reserved in (("per-parameter buffers (before)", per_param), ("64 MiB flat buckets (after)", bucketed)):
            rows.append({"model": name, "layout": layout, "params": len(specs), "payload": fmt_bytes(payload),
                         "reserved": fmt_bytes(reserved), "overhead_pct": round(100 * (reserved / payload - 1), 1),
                         "reserved_bytes": reserved, "payload_bytes": payload})
    return rows


def measured_row() -> dict[str, Any]:
    """A tiny model through ``Trainer.fit`` on the deferred stand-in (pinned accounting): planned == reported == allocated."""
    torch.manual_seed(0)
    module = CausalLMModule(config={"n_layer": 2, "n_embd": 48, "n_head": 2, "n_positions": 16}, learning_rate=1e-3)
    seen: dict[str, int] = {}

    class Inspect(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *rest: Any) -> None:
            s = trainer.strategy
            storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in s._transfer.staging()}
            seen["allocated"] = sum(pinned_bytes(n) for n in storages.values())
            seen["reported"] = s.memory_breakdown().host["other"]

    strategy = OffloadStrategy()
    ids = torch.randint(0, 256, (2, 16))
    with cpu_stand_in(lambda: DeferredOps("run_ahead")):
        bench_trainer(strategy=strategy, precision="bf16-true", max_steps=1,
                      callbacks=[Inspect()]).fit(module, DataLoader([lm_sample(ids)], batch_size=None))
        seen["planned"] = strategy.host_bytes_needed(module, [])["staging_or_compute_weights"]
    per_param = sum(pinned_bytes(2 * p.numel()) for p in module.parameters())
    return {"model": "tiny (measured in fit)", "per_parameter_reserved": per_param, **seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_int_args(parser, layers=4, width=256, seq=64, batch=4, steps=6, rounds=3)
    args = parser.parse_args()
    thread = autograd_thread_rows(args)
    pinned = pinned_rows()
    measured = measured_row()
    write_results(
        "transfer", thread, ["policy", "autograd_thread_ms_per_step", "drain_ms_per_step", "fit_ms_per_step", "bit_identical"],
        title="lowmem_offload transfers: host work on the autograd thread (CPU, deferred seam)",
        notes=[
            (
                f"GPT-2 architecture, {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}, "
                f"bf16-true, {args.steps} steps per fit, median of {args.rounds} rounds (before/after interleaved)."
            ),
            (
                "autograd_thread = host time inside the gradient hooks (the stand-in's copies left out); drain = the "
                "fold at the end of backward (main thread, after the autograd engine returned); fit = whole fit wall "
                "time / steps (setup included; noisy on a shared 2-core machine)."
            ),
            "Pinned staging, reserved by torch's pinned allocator (power-of-two rounding), bf16:",
            *(f"{r['model']}: {r['layout']}: {r['reserved']} for {r['payload']} of gradients (+{r['overhead_pct']}%)"
              for r in pinned),
            (
                f"Measured in fit (tiny model, deferred stand-in with pinned accounting): planned {measured['planned']} B, "
                f"memory_breakdown {measured['reported']} B, allocator rounding of the buffers allocated "
                f"{measured['allocated']} B (per-parameter buffers would reserve {measured['per_parameter_reserved']} B)."
            ),
        ],
        extra={"pinned": pinned, "measured": measured},
    )


if __name__ == "__main__":
    main()

"""ChunkedLMLoss: the LM loss's own memory, GPT-2-XL's predicted device peak, and CPU step time, with and without.

Three parts, one table (column ``part``):

- ``loss``: the loss alone at GPT-2-XL's shapes (hidden 1600, vocab 50257, batch 4 x 1024, bf16 as under
  ``precision="bf16-true"``) on fake tensors, measured with ``MemoryTracker``: forward + backward of Hugging Face's
  loss (bf16 logits, upcast to fp32, ``cross_entropy``) vs ``chunked_causal_lm_loss`` at several ``chunk_tokens``.
  ``loss_transient_MiB``: the highest activations + other bytes at any phase peak, less the inputs (hidden states,
  labels) and the hidden states' gradient (what any loss hands back); the head's weight and its gradient are
  their own categories and not counted.
- ``dry_run``: GPT-2-XL ``CausalLMModule`` at batch 4 x 1024 through ``dry_run`` (fake tensors, CUDA target), the
  ``lowmem_offload`` recipes of ``estimate_gpt2xl.md`` with and without ``ChunkedLMLoss.apply`` (the callback's own
  wrapping; ``CausalLMModule`` then asks the model for ``labels=``).
- ``cpu_time``: one training step (forward, backward, SGD step) of a small GPT-2 on this CPU, the model's own
  ``labels=`` loss vs ``ChunkedLMLoss``, timed interleaved in one process (process CPU time on one thread, and wall
  time); with the demo's 258-token vocabulary and with GPT-2's 50257.

Run: ``python benchmarks/run.py chunked_lm_loss [--rounds 9] [--skip-dry-run]``
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import write_results
from lightning_lowmem.callbacks.chunked_lm_loss.callback import ChunkedLMLoss, chunked_causal_lm_loss
from lightning_lowmem.measure.tracker import MemoryTracker

MiB, GiB = 2**20, 2**30
XL = {"n_layer": 48, "n_embd": 1600, "n_head": 25, "n_positions": 1024, "use_cache": False, "vocab_size": 50257}
CHUNKS = (1024, 256, 128)


def loss_memory(chunk: int | None, recompute: bool = True, batch: int = 4, seq: int = 1024, hidden: int = 1600,
                vocab: int = 50257) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
        h = torch.empty(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(batch, seq, dtype=torch.long)
        tracker = MemoryTracker(module=head)
        with tracker:
            tracker.track([h, labels])
            with tracker.phase("forward"):
                if chunk is None:  # Hugging Face's ForCausalLMLoss on the head's bf16 logits
                    logits = head(h).float()
                    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
                    loss = F.cross_entropy(logits.view(-1, vocab), targets, ignore_index=-100)
                    del logits
                else:
                    loss = chunked_causal_lm_loss(h, head.weight, labels, chunk_tokens=chunk, recompute=recompute)
            with tracker.phase("backward"):
                loss.backward()
    interface = h.numel() * 2 * 2 + labels.numel() * 8  # hidden + its gradient (bf16), labels
    by_phase = {name: p.by_category["activations"] + p.by_category["other"] - interface for name, p in tracker.peaks.items()}
    return {
        "part": "loss",
        "variant": "model's own loss (bf16 logits -> fp32 CE)" if chunk is None
        else "chunked_causal_lm_loss" + ("" if recompute else "(recompute=False)"),
        "chunk_tokens": chunk,
        "loss_fwd_MiB": round(by_phase["forward"] / MiB, 1),
        "loss_bwd_MiB": round(by_phase["backward"] / MiB, 1),
        "loss_transient_MiB": round(max(by_phase.values()) / MiB, 1),
        "one_chunk_fp32_logits_MiB": None if chunk is None else round(chunk * vocab * 4 / MiB, 1),
    }


def dry_run_rows() -> list[dict[str, Any]]:
    from lightning_lowmem.demo.module import CausalLMModule
    from lightning_lowmem.predict.dry_run import dry_run

    def build(chunk: int | None, recompute: bool) -> Any:
        def make() -> CausalLMModule:
            module = CausalLMModule(config=XL)
            if chunk is not None:
                ChunkedLMLoss(chunk_tokens=chunk, backend="chunked", recompute=recompute).apply(module)
            return module

        return make

    rows = []
    for recipe, kwargs in (("offload + ckpt(all)", {}), ("offload + ckpt(all) + act. offload", {"activation_offload": True})):
        for chunk, recompute in ((None, True), (1024, True), (128, True), (128, False)):
            est = dry_run(build(chunk, recompute), batch_size=4, seq_len=1024, precision="bf16-true",
                          checkpointing="all", offload=True, target="cuda", **kwargs)
            name = "" if chunk is None else " + ChunkedLMLoss" + ("" if recompute else "(recompute=False)")
            rows.append({
                "part": "dry_run", "variant": recipe + name,
                "chunk_tokens": chunk, "device_peak_GiB": round(est.peak_device / GiB, 2), "binds": est.binding_phase,
            })
    return rows


def cpu_time_rows(rounds: int) -> list[dict[str, Any]]:
    from lightning_lowmem.demo.module import build_causal_lm

    rows = []
    shapes = (
        ("12 x 256, seq 512, batch 2, vocab 258", {"n_layer": 12, "n_embd": 256, "n_head": 4, "n_positions": 512}, 258, 512),
        ("4 x 256, seq 256, batch 2, vocab 50257", {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 256}, 50257, 256),
    )
    for label, config, vocab, seq in shapes:
        torch.manual_seed(0)
        base = build_causal_lm("gpt2", {**config, "use_cache": False, "vocab_size": vocab}, vocab_size=None).train()
        ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
        models = {"model's own loss": base}
        for chunk, recompute in ((1024, True), (128, True), (1024, False)):
            model = copy.deepcopy(base)
            ChunkedLMLoss(chunk_tokens=chunk, backend="chunked", recompute=recompute).apply(model)
            models[f"ChunkedLMLoss({chunk}{'' if recompute else ', recompute=False'})"] = model

        def step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()

        steps = {name: functools.partial(step, m, torch.optim.SGD(m.parameters(), lr=1e-4), ids)
                 for name, m in models.items()}
        times = _interleaved_cpu(steps, rounds)
        ref_cpu, ref_wall = times["model's own loss"]
        for name, (cpu, wall) in times.items():
            rows.append({"part": "cpu_time", "variant": f"{name}; {label}", "step_cpu_s": round(cpu, 4),
                         "vs_model_loss": round(cpu / ref_cpu, 3), "step_wall_s": round(wall, 4),
                         "wall_vs_model_loss": round(wall / ref_wall, 3)})
    return rows


def _interleaved_cpu(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, tuple[float, float]]:
    """Median process CPU time and wall time per variant, variants alternating (A B C A B C ...) after a warm-up.

    NOTE: process CPU time, on one thread, is the headline: on a shared 2-core machine other processes stretch the
    wall time of whichever variant they overlap; CPU time counts only this process's own work.
    """
    for fn in variants.values():
        fn()
    cpu: dict[str, list[float]] = {n: [] for n in variants}
    wall: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return {n: (statistics.median(cpu[n]), statistics.median(wall[n])) for n in variants}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--skip-dry-run", action="store_true")
    args = parser.parse_args()
    rows = [loss_memory(None), *(loss_memory(c) for c in CHUNKS), loss_memory(128, recompute=False)]
    if not args.skip_dry_run:
        rows += dry_run_rows()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows += cpu_time_rows(args.rounds)
    torch.set_num_threads(threads)
    columns = ["part", "variant", "chunk_tokens", "loss_fwd_MiB", "loss_bwd_MiB", "loss_transient_MiB",
               "one_chunk_fp32_logits_MiB", "device_peak_GiB", "binds", "step_cpu_s", "vs_model_loss", "step_wall_s",
               "wall_vs_model_loss"]
    notes = [
        ("loss: fake tensors, GPT-2-XL head (1600 x 50257, bf16) at batch 4 x 1024; transient = activations + other at "
        "each phase's peak less the inputs and the hidden states' gradient (MemoryTracker, device role)."),
        ("dry_run: CausalLMModule (GPT-2-XL) through lightning_lowmem.predict.dry_run, precision bf16-true, "
        "lowmem_offload, checkpointing 'all', target 'cuda' (uncalibrated corrections, see estimate_gpt2xl.md)."),
        ("cpu_time: forward + backward + SGD step, fp32, dropout 0.1 (GPT-2's default), one torch thread; median "
        "process CPU time (headline) and wall time of interleaved rounds. The machine's 2 cores are shared with "
        "other work: wall times are stretched by it, compare rows of one run only."),
        ("The head's matmul runs 4 times per step with ChunkedLMLoss instead of 3 (the forward's is recomputed in "
        "backward): with the demo's 258-token vocabulary the head is a rounding error of the step, with GPT-2's "
        "50257 on a 4-layer, 256-wide model it is most of it."),
    ]
    write_results("chunked_lm_loss", rows, columns, title="ChunkedLMLoss: the LM loss without its full logits",
                  notes=notes)


if __name__ == "__main__":
    main()

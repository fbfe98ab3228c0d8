"""Stage 3: what only a GPU can measure of the adapters: LoRA, and QLoRA with the nf4 base resident or streamed.

On a LLaMA shape built from a ``transformers`` config (random weights, no download): 16 layers x 2048, MLP 5504,
16 heads, vocabulary 32000 (0.94 B parameters) on the GPU; 2 layers x 64 in the rehearsal.

``qlora_adapters[lora|qlora|qlora_streamed]``: ``Adapters("lora", r=16, target_modules="all-linear")`` at batch
4 x 1024, bf16-true, with a bf16 base under ``lowmem_offload``, an nf4 base under ``lowmem_offload`` (resident) and an
nf4 base under ``lowmem_offload_params`` (the packed base streamed block by block): device peaks, the strategy's host
bytes (and the pinned allocator's), step time, the loss of every step; the streamed run against the resident one
(the CPU rehearsal requires them bit-identical, as ``tests/strategies/test_offload_packed_stream.py`` does; on the GPU
the max |diff| of the adapter weights and of the losses is recorded). ``qlora_adapters[dry_run]``: the dry run's
CUDA-target prediction of each of these runs beside its measured allocated peak (the nf4 base traced through
bitsandbytes' own layers on fake weights).
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.registry import Context, Entry, need

LLAMA = {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 5504, "num_attention_heads": 16,
         "num_key_value_heads": 16, "max_position_embeddings": 1024}
LLAMA_TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64}
LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear"}
#: run -> (quantize_base, parameter streaming)
QLORA_RUNS = {"lora": (None, False), "qlora": ("nf4", False), "qlora_streamed": ("nf4", True)}


def llama(ctx: Context, batch: int, steps: int = 6, warmup: int = 2) -> Any:
    """The LLaMA shape (a :class:`~benchmarks.gpu._common.Shape`): on the GPU 16 x 2048, in the rehearsal 2 x 64."""
    from benchmarks.gpu import _common as c

    return c.shape(ctx, batch=batch, steps=steps, warmup=warmup, config=LLAMA, vocab=32000, model_type="llama",
                   tiny=LLAMA_TINY, label="LLaMA 16x2048 (MLP 5504, 16 heads), vocab 32000")


def _qlora(run: str) -> Any:
    quantize, streamed = QLORA_RUNS[run]

    def entry(ctx: Context) -> dict[str, Any]:
        import sys
        import time

        import torch

        from benchmarks.gpu import _common as c
        from benchmarks.gpu._imports import packed_bytes
        from lightning_lowmem import Adapters, OffloadStrategy

        need("peft", "Adapters wraps the model with PEFT")
        if quantize is not None:
            need("bitsandbytes", "quantize_base='nf4' builds bitsandbytes' Linear4bit")
        s = llama(ctx, batch=4)
        lm = c.module(s, ctx.device)
        c.fresh_cuda()
        clock = c.StepClock(warmup=s.warmup)
        t0 = time.perf_counter()
        c.fit(ctx, s, OffloadStrategy(offload_params=streamed), [clock, Adapters("lora", **LORA, quantize_base=quantize)], lm=lm)
        fit_s = time.perf_counter() - t0
        step, losses, host = clock.step_seconds(), clock.losses(), clock.host or {}
        trainable = {n: p.detach().float().cpu() for n, p in lm.named_parameters() if p.requires_grad}
        bnb_nn = sys.modules.get("bitsandbytes.nn")  # NOTE: loaded by Adapters when it quantized the base
        packed = [m for m in lm.modules() if bnb_nn is not None and isinstance(m, bnb_nn.Linear4bit)]
        row: dict[str, Any] = {
            "run": run, "strategy": "lowmem_offload_params" if streamed else "lowmem_offload",
            "quantize_base": quantize, "step_gpu_s": step["gpu_s"], "step_host_s": step["host_s"],
            **c.cuda_peaks(), "host_bytes": sum(host.values()), "host_breakdown": host,
            "pinned_allocator": c.pinned_stats() or None, "trainable_params": sum(t.numel() for t in trainable.values()),
            "quantized_linears": len(packed), "packed_base_bytes": sum(packed_bytes(m) for m in packed),
            "final_loss": losses[-1] if losses else None, "fit_s": c.rnd(fit_s),
        }
        status, notes = "ok", [(f"{s.label}, batch {s.batch}x{s.seq}, bf16-true, Adapters('lora', r=16, alpha=32, "
                                f"all-linear, quantize_base={quantize!r}) under {row['strategy']} on {ctx.device}, "
                                f"{s.steps} steps (first {s.warmup} left out of the step time); peaks over the whole "
                                "fit; host_bytes: the strategy's own host breakdown at the end of training; fit_s: the "
                                "whole Trainer.fit (the base's quantization on the host in setup included).")]
        if run == "qlora":
            torch.save({"trainable": trainable, "losses": losses}, ctx.state_dir / "qlora_resident.pt")
        if run == "qlora_streamed":
            ref_path = ctx.state_dir / "qlora_resident.pt"
            if not ref_path.is_file():
                notes.append("not compared: the resident run (qlora_adapters[qlora]) did not finish in this stage")
            else:
                ref = torch.load(ref_path)
                diff = max((float((trainable[k] - v).abs().max()) for k, v in ref["trainable"].items()
                            if k in trainable), default=None)
                loss_diff = max((abs(a - b) for a, b in zip(ref["losses"], losses)), default=None)
                identical = ref["trainable"].keys() == trainable.keys() and ref["losses"] == losses and all(
                    torch.equal(trainable[k], v) for k, v in ref["trainable"].items())
                row |= {"vs_resident_adapter_max_abs_diff": diff, "vs_resident_loss_max_abs_diff": loss_diff,
                        "vs_resident_bit_identical": identical}
                if ctx.rehearsal and not identical:
                    status = "failed"  # NOTE: on the CPU the streamed run must train exactly as the resident one
                notes.append("vs_resident_*: the streamed run against qlora_adapters[qlora] (adapter weights after "
                             "the fit, loss of every step); bit-identical required on the CPU, recorded on the GPU.")
        figure = {"figure": f"LLaMA 0.94B LoRA r=16, {quantize or 'bf16'} base "
                            f"{'streamed' if streamed else 'resident'}: device peak, host, step",
                  "gpu": (f"allocated peak {c.gib(row.get('allocated_peak_bytes'))}, host {c.gib(row['host_bytes'])}, "
                          f"step {row['step_gpu_s'] or row['step_host_s']} s"), "dry_run": None, "cpu": None}
        return {"status": status, "rows": [row], "notes": notes, "figures": [figure],
                "run": {"name": run, "batch": s.batch, "seq": s.seq, "streamed": streamed}}

    entry.__name__ = f"qlora_adapters_{run}"
    return entry


def qlora_dry_run(ctx: Context) -> dict[str, Any]:
    """The dry run (target="cuda") of each adapters run measured above beside its measured allocated peak; an nf4 base
    is traced through bitsandbytes' own layers on fake weights."""
    from benchmarks.gpu import _common as c
    from lightning_lowmem import Adapters, OffloadStrategy, dry_run

    need("peft", "Adapters wraps the model with PEFT")
    s = llama(ctx, batch=4)
    rows, figures = [], []
    for run, (quantize, streamed) in QLORA_RUNS.items():
        measured = ctx.prior(f"qlora_adapters[{run}]")
        if measured is None or measured.get("status") not in ("ok", "failed"):
            rows.append({"run": run, "note": "not measured in this stage (see its entry)"})
            continue
        est = dry_run(lambda: c.module(s), batch_size=s.batch, seq_len=s.seq,
                      strategy=OffloadStrategy(offload_params=streamed), precision="bf16-true",
                      callbacks=[Adapters("lora", **LORA, quantize_base=quantize)], target="cuda")
        context = sum(x.bytes for x in est.corrections if x.name == "cuda_context")
        tensors = est.peak_device - context
        got = measured["rows"][0].get("allocated_peak_bytes")
        rows.append({"run": run, "predicted_device_bytes": est.peak_device, "cuda_context_bytes": context,
                     "predicted_tensors_bytes": tensors, "measured_allocated_peak_bytes": got,
                     "predicted_over_measured": c.rnd(tensors / got) if got else None,
                     "predicted_host_bytes": est.peak_host, "measured_host_bytes": measured["rows"][0].get("host_bytes"),
                     "binding_phase": est.binding_phase, "dry_run_s": c.rnd(est.wall_s, 1)})
        figures.append({"figure": f"LLaMA 0.94B LoRA, {run}: allocated peak", "gpu": c.gib(got),
                        "dry_run": f"{c.gib(tensors)} ({rows[-1]['predicted_over_measured']}x)", "cpu": None})
    return {"rows": rows, "figures": figures, "notes": [(
        "predicted_tensors_bytes = the dry run's device peak less its fixed CUDA-context correction; measured = "
        "allocated_bytes.all.peak of the same run (shape, strategy, callbacks, precision). predicted_host_bytes: the "
        "dry run's host peak; measured_host_bytes: the strategy's host breakdown of the measured run. The CPU rehearsal "
        "has no device figures.")]}


#: seconds per entry: the nf4 runs quantize the base on the host in ``setup`` (the model is built there, as a user's
#: is), about 0.8 B values through bitsandbytes' CPU kernel, before the first step
QLORA_BUDGET = {"lora": 45, "qlora": 60, "qlora_streamed": 60, "dry_run": 35}

ENTRIES = [
    *(Entry(f"qlora_adapters[{run}]", QLORA_BUDGET[run], _qlora(run),
            f"LLaMA 0.94B LoRA r=16, {'nf4' if q else 'bf16'} base {'streamed' if st else 'resident'}: peaks, host, step",
            fresh=True) for run, (q, st) in QLORA_RUNS.items()),
    Entry("qlora_adapters[dry_run]", QLORA_BUDGET["dry_run"], qlora_dry_run,
          "dry run (CUDA target) of the adapters runs vs their peaks"),
]

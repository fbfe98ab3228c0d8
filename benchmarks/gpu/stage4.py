"""Stage 4: what only a GPU can measure of the adapters (LoRA, QLoRA with the nf4 base resident or streamed) and of
the lean optimizers.

Both on a LLaMA shape built from a ``transformers`` config (random weights, no download): 16 layers x 2048, MLP 5504,
16 heads, vocabulary 32000 (0.94 B parameters) on the GPU; 2 layers x 64 in the rehearsal.

``qlora_adapters[lora|qlora|qlora_streamed]``: ``Adapters("lora", r=16, target_modules="all-linear")`` at batch
4 x 1024, bf16-true, with a bf16 base under ``lowmem_offload``, an nf4 base under ``lowmem_offload`` (resident) and an
nf4 base under ``lowmem_offload_params`` (the packed base streamed block by block): device peaks, the strategy's host
bytes (and the pinned allocator's), step time, the loss of every step; the streamed run against the resident one
(the CPU rehearsal requires them bit-identical, as ``tests/strategies/test_offload_packed_stream.py`` does; on the GPU
the max |diff| of the adapter weights and of the losses is recorded). ``qlora_adapters[dry_run]``: the dry run's
CUDA-target prediction of each of these runs beside its measured allocated peak (the nf4 base traced through
bitsandbytes' own layers on fake weights).

``lean_optimizer[adamw|galore|apollo_mini|adam_mini|adamw8bit|adamw4bit]``: the LLaMA trained with
``strategy="auto"``, bf16-mixed, batch 2 x 1024, with torch's AdamW and with ``LeanOptimizer(kind=...)``: optimizer
state bytes per parameter, device peaks, step time (modelled on stage 3's ``low_bit``). An entry whose package is not
installed is skipped, naming the wheel.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from benchmarks.gpu.registry import Context, Entry, Skip

LLAMA = {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 5504, "num_attention_heads": 16,
         "num_key_value_heads": 16, "max_position_embeddings": 1024}
LLAMA_TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64}
LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear"}
#: run -> (quantize_base, parameter streaming)
QLORA_RUNS = {"lora": (None, False), "qlora": ("nf4", False), "qlora_streamed": ("nf4", True)}
#: LeanOptimizer kind -> the module its package provides (None: torch's AdamW, the baseline)
LEAN = {"adamw": None, "galore": "galore_torch", "apollo_mini": "apollo_torch", "adam_mini": "adam_mini",
        "adamw8bit": "torchao", "adamw4bit": "torchao"}
_WHEEL = {"galore_torch": "galore-torch", "apollo_torch": "apollo-torch", "adam_mini": "adam-mini", "torchao": "torchao"}


def llama(ctx: Context, batch: int, steps: int = 6, warmup: int = 2) -> Any:
    """The stage's LLaMA shape (a :class:`~benchmarks.gpu._common.Shape`): on the GPU 16 x 2048, in the rehearsal 2 x 64."""
    from benchmarks.gpu import _common as c

    if ctx.rehearsal:
        return c.Shape(LLAMA_TINY, 512, 2, 32, 3, 1, "tiny LLaMA 2x64, vocab 512 (rehearsal)")
    return c.Shape(LLAMA, 32000, batch, 1024, steps, warmup, "LLaMA 16x2048 (MLP 5504, 16 heads), vocab 32000")


def llama_module(s: Any) -> Any:
    """The demo's causal-LM module on the LLaMA shape ``s``, seeded."""
    import torch

    from lightning_lowmem import CausalLMModule

    torch.manual_seed(0)
    return CausalLMModule(model_type="llama", config={**s.config, "vocab_size": s.vocab, "use_cache": False})


def _need(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Skip(f"{module} is not installed: {why} (carry its wheel {_WHEEL.get(module, module)}: make gpu-wheels)")


def _recorder() -> Any:
    """A callback that keeps each step's loss, the strategy's host bytes and, at the end, the trainable weights."""
    import lightning as L
    import torch
    from typing_extensions import override

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self._losses: list[torch.Tensor] = []
            self.host: dict[str, int] = {}
            self.trainable: dict[str, torch.Tensor] = {}

        @override
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            # NOTE: kept as tensors, read after the fit: a float() here would synchronise with the device every step
            self._losses.append(loss.detach().float().clone())

        @override
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            breakdown = getattr(trainer.strategy, "memory_breakdown", None)
            self.host = dict(breakdown().host) if breakdown is not None else {}
            self.losses = [float(x) for x in self._losses]

    return Recorder()


def _qlora(run: str) -> Any:
    quantize, streamed = QLORA_RUNS[run]

    def entry(ctx: Context) -> dict[str, Any]:
        import sys
        import time

        import torch

        from benchmarks.gpu import _common as c
        from benchmarks.gpu._imports import packed_bytes
        from lightning_lowmem import Adapters, OffloadStrategy

        _need("peft", "Adapters wraps the model with PEFT")
        if quantize is not None:
            _need("bitsandbytes", "quantize_base='nf4' builds bitsandbytes' Linear4bit")
        s = llama(ctx, batch=4)
        c.fresh_cuda()
        clock, rec = c.PhaseClock(), _recorder()
        lm = llama_module(s)
        strategy = OffloadStrategy(offload_params=streamed)
        adapters = Adapters("lora", **LORA, quantize_base=quantize)
        t0 = time.perf_counter()
        c.fit(ctx, s, strategy, [clock, rec, adapters], precision="bf16-true", lm=lm)
        fit_s = time.perf_counter() - t0
        step = clock.step_seconds(s.warmup)
        trainable = {n: p.detach().float().cpu() for n, p in lm.named_parameters() if p.requires_grad}
        bnb_nn = sys.modules.get("bitsandbytes.nn")  # NOTE: loaded by Adapters when it quantized the base
        packed = [m for m in lm.modules() if bnb_nn is not None and isinstance(m, bnb_nn.Linear4bit)]
        base_params = sum(m.in_features * m.out_features for m in packed)
        row: dict[str, Any] = {
            "run": run, "strategy": "lowmem_offload_params" if streamed else "lowmem_offload",
            "quantize_base": quantize, "step_gpu_s": _r(step["gpu_s"]), "step_host_s": _r(step["host_s"]),
            **c.cuda_peaks(), "host_bytes": sum(rec.host.values()), "host_breakdown": rec.host,
            "pinned_allocator": c.pinned_stats() or None, "trainable_params": sum(t.numel() for t in trainable.values()),
            "quantized_linears": len(packed), "packed_base_bytes": sum(packed_bytes(m) for m in packed),
            "final_loss": rec.losses[-1] if rec.losses else None, "fit_s": _r(fit_s),
        }
        status, notes = "ok", [(f"{s.label}, batch {s.batch}x{s.seq}, bf16-true, Adapters('lora', r=16, alpha=32, "
                                f"all-linear, quantize_base={quantize!r}) under {row['strategy']} on {ctx.device}, "
                                f"{s.steps} steps (first {s.warmup} left out of the step time); peaks over the whole "
                                "fit; host_bytes: the strategy's own host breakdown at the end of training; fit_s: the whole "
                                "Trainer.fit (the base's quantization on the host in setup included).")]
        if run == "qlora":
            torch.save({"trainable": trainable, "losses": rec.losses}, ctx.state_dir / "qlora_resident.pt")
        if run == "qlora_streamed":
            ref_path = ctx.state_dir / "qlora_resident.pt"
            if not ref_path.is_file():
                notes.append("not compared: the resident run (qlora_adapters[qlora]) did not finish in this stage")
            else:
                ref = torch.load(ref_path)
                same_keys = ref["trainable"].keys() == trainable.keys()
                diff = max((float((trainable[k] - v).abs().max()) for k, v in ref["trainable"].items()
                            if k in trainable), default=None)
                loss_diff = max((abs(a - b) for a, b in zip(ref["losses"], rec.losses)), default=None)
                identical = same_keys and ref["losses"] == rec.losses and all(
                    torch.equal(trainable[k], v) for k, v in ref["trainable"].items())
                row |= {"vs_resident_adapter_max_abs_diff": diff, "vs_resident_loss_max_abs_diff": loss_diff,
                        "vs_resident_bit_identical": identical}
                if ctx.rehearsal and not identical:
                    status = "failed"  # NOTE: on the CPU the streamed run must train exactly as the resident one
                notes.append("vs_resident_*: the streamed run against qlora_adapters[qlora] (adapter weights after "
                             "the fit, loss of every step); bit-identical required on the CPU, recorded on the GPU.")
        result = {"status": status, "rows": [row], "notes": notes,
                  "run": {"name": run, "batch": s.batch, "seq": s.seq, "streamed": streamed,
                          "packed_base_bytes": row["packed_base_bytes"], "base_params": base_params}}
        return result

    entry.__name__ = f"qlora_adapters_{run}"
    return entry


def qlora_dry_run(ctx: Context) -> dict[str, Any]:
    """The dry run (target="cuda") of each adapters run measured above beside its measured allocated peak; an nf4 base
    is traced through bitsandbytes' own layers on fake weights."""
    from lightning_lowmem import Adapters, OffloadStrategy, dry_run

    _need("peft", "Adapters wraps the model with PEFT")
    s = llama(ctx, batch=4)
    rows = []
    for run, (quantize, streamed) in QLORA_RUNS.items():
        measured = ctx.prior(f"qlora_adapters[{run}]")
        if measured is None or measured.get("status") not in ("ok", "failed"):
            rows.append({"run": run, "note": "not measured in this stage (see its entry)"})
            continue
        est = dry_run(lambda: llama_module(s), batch_size=s.batch, seq_len=s.seq,
                      strategy=OffloadStrategy(offload_params=streamed), precision="bf16-true",
                      callbacks=[Adapters("lora", **LORA, quantize_base=quantize)], target="cuda")
        context = sum(x.bytes for x in est.corrections if x.name == "cuda_context")
        tensors, figure = est.peak_device - context, "dry run (CUDA target)"
        got = measured["rows"][0].get("allocated_peak_bytes")
        rows.append({"run": run, "figure": figure, "predicted_device_bytes": tensors + context,
                     "cuda_context_bytes": context, "predicted_tensors_bytes": tensors,
                     "measured_allocated_peak_bytes": got,
                     "predicted_over_measured": round(tensors / got, 4) if got else None,
                     "predicted_host_bytes": est.peak_host, "measured_host_bytes": measured["rows"][0].get("host_bytes"),
                     "binding_phase": est.binding_phase, "dry_run_s": round(est.wall_s, 1)})
    return {"rows": rows, "notes": [(
        "predicted_tensors_bytes = the dry run's device peak less its fixed CUDA-context correction; measured = "
        "allocated_bytes.all.peak of the same run (shape, strategy, callbacks, precision). predicted_host_bytes: the "
        "dry run's host peak; measured_host_bytes: the strategy's host breakdown of the measured run. The CPU rehearsal has no device "
        "figures.")]}


def _state_bytes(optimizer: Any) -> int:
    """Bytes of the distinct storages of the optimizer's state: tensors, tensor attributes of objects it holds
    (GaLore's projector), and the inner tensors of tensor subclasses (torchao's quantized moments)."""
    import torch

    seen: dict[tuple[str, int], int] = {}

    def add(t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
            return
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()

    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
            elif hasattr(value, "__dict__") and not isinstance(value, type):
                for attr in vars(value).values():
                    for t in attr if isinstance(attr, (list, tuple)) else (attr,):
                        if isinstance(t, torch.Tensor):
                            add(t)
    return sum(seen.values())


def _lean(kind: str) -> Any:
    package = LEAN[kind]

    def entry(ctx: Context) -> dict[str, Any]:
        import lightning as L
        import torch
        from typing_extensions import override

        from benchmarks.gpu import _common as c
        from lightning_lowmem import LeanOptimizer

        if package is not None:
            _need(package, f"LeanOptimizer(kind={kind!r}) builds its optimizer")
        if package == "torchao" and tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11):
            raise Skip(f"torchao 0.18's optimizers need torch >= 2.11; this is torch {torch.__version__}")

        class State(L.Callback):
            def __init__(self) -> None:
                self.bytes, self.params, self.optimizer = 0, 0, ""

            @override
            def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                opt = trainer.optimizers[0]
                self.bytes, self.optimizer = _state_bytes(opt), f"{type(opt).__module__}.{type(opt).__name__}"
                self.params = sum(p.numel() for p in pl_module.parameters())

        s = llama(ctx, batch=2)
        # NOTE: GaLore's default rank (128) projects no weight of the rehearsal's 64-wide model
        flags = {"rank": 16} if ctx.rehearsal and kind == "galore" else {}
        c.fresh_cuda()
        clock, state = c.PhaseClock(), State()
        callbacks: list[Any] = [clock, state] + ([LeanOptimizer(kind=kind, **flags)] if package else [])
        c.fit(ctx, s, "auto", callbacks, precision="bf16-mixed", lm=llama_module(s))
        step = clock.step_seconds(s.warmup)
        row = {"kind": kind, "optimizer": state.optimizer, "state_B_per_param": round(state.bytes / max(state.params, 1), 3),
               "state_bytes": state.bytes, "params": state.params, "step_gpu_s": _r(step["gpu_s"]),
               "step_host_s": _r(step["host_s"]), **c.cuda_peaks()}
        return {"rows": [row], "notes": [(f"{s.label}, batch {s.batch}x{s.seq}, strategy='auto' on {ctx.device}, "
                                          f"bf16-mixed (fp32 weights), {s.steps} steps, first {s.warmup} left out of "
                                          "the step time (torchao compiles its step, GaLore runs its SVDs, in the "
                                          "first); LeanOptimizer's defaults; state bytes: distinct storages of the "
                                          "optimizer's state (torchao's quantized moments by their inner tensors).")]}

    entry.__name__ = f"lean_optimizer_{kind}"
    return entry


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


#: seconds per entry: GaLore's first step runs an SVD per projected weight (112 here); torchao compiles its step
#: (Triton) per parameter shape in the first step
LEAN_BUDGET = {"adamw": 30, "galore": 50, "apollo_mini": 30, "adam_mini": 30, "adamw8bit": 50, "adamw4bit": 50}
#: seconds per entry: the nf4 runs quantize the base on the host in ``setup`` (the model is built there, as a user's
#: is), about 0.8 B values through bitsandbytes' CPU kernel, before the first step
QLORA_BUDGET = {"lora": 45, "qlora": 55, "qlora_streamed": 55, "dry_run": 35}

ENTRIES = [
    *(Entry(f"qlora_adapters[{run}]", QLORA_BUDGET[run], _qlora(run),
            f"LLaMA 0.94B LoRA r=16, {'nf4' if q else 'bf16'} base {'streamed' if st else 'resident'}: peaks, host, step",
            fresh=True) for run, (q, st) in QLORA_RUNS.items()),
    Entry("qlora_adapters[dry_run]", QLORA_BUDGET["dry_run"], qlora_dry_run, "dry run (CUDA target) of the adapters runs vs their peaks"),
    *(Entry(f"lean_optimizer[{kind}]", LEAN_BUDGET[kind], _lean(kind),
            f"LLaMA 0.94B bf16-mixed with {kind}: state B/param, peaks, step time", fresh=True) for kind in LEAN),
]

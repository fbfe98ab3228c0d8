"""Stage 4: the low-bit and lean optimizers on a GPU: optimizer state bytes per parameter, device peaks, step time.

The LLaMA of stage 3 (0.94 B; 2 x 64 in the rehearsal) trained with ``strategy="auto"``, bf16-mixed, batch
2 x 1024: ``optimizer[adamw]`` (torch's AdamW, the baseline), ``low_bit[adamw8bit|paged_adamw8bit]``
(``LowBitOptimizer``: bitsandbytes' CUDA kernels) and ``lean_optimizer[galore|apollo_mini|adam_mini|adamw8bit|
adamw4bit]`` (``LeanOptimizer(kind=...)`` at its defaults). An entry whose package is not installed is skipped,
naming the wheel.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.registry import Context, Entry, Skip, need

#: LowBitOptimizer kinds (bitsandbytes)
LOW_BIT = ("adamw8bit", "paged_adamw8bit")
#: LeanOptimizer kind -> the module its package provides
LEAN = {"galore": "galore_torch", "apollo_mini": "apollo_torch", "adam_mini": "adam_mini", "adamw8bit": "torchao",
        "adamw4bit": "torchao"}
WHEEL = {"galore_torch": "galore-torch", "apollo_torch": "apollo-torch", "adam_mini": "adam-mini", "torchao": "torchao",
         "bitsandbytes": "bitsandbytes"}


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


def _optimizer(family: str, kind: str) -> Any:
    """An entry training the LLaMA with ``family`` ("adamw", "low_bit" or "lean_optimizer") of ``kind``."""
    package = {"adamw": None, "low_bit": "bitsandbytes", "lean_optimizer": LEAN.get(kind)}[family]

    def entry(ctx: Context) -> dict[str, Any]:
        import lightning as L
        import torch
        from typing_extensions import override

        from benchmarks.gpu import _common as c
        from benchmarks.gpu.stage3 import llama
        from lightning_lowmem import LeanOptimizer, LowBitOptimizer

        if package is not None:
            need(package, f"{family}(kind={kind!r}) builds its optimizer", WHEEL[package])
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
        swap = {"adamw": [], "low_bit": [LowBitOptimizer(kind)] if family == "low_bit" else [],
                "lean_optimizer": [LeanOptimizer(kind=kind, **flags)] if family == "lean_optimizer" else []}[family]
        lm = c.module(s, ctx.device, on_host=False)
        c.fresh_cuda()
        clock, state = c.StepClock(warmup=s.warmup), State()
        c.fit(ctx, s, "auto", [clock, state, *swap], precision="bf16-mixed", lm=lm)
        step = clock.step_seconds()
        per_param = c.rnd(state.bytes / max(state.params, 1), 3)
        row = {"family": family, "kind": kind, "optimizer": state.optimizer, "state_B_per_param": per_param,
               "state_bytes": state.bytes, "params": state.params, "step_gpu_s": step["gpu_s"],
               "step_host_s": step["host_s"], **c.cuda_peaks()}
        figure = {"figure": f"LLaMA 0.94B bf16-mixed, {family} {kind}: optimizer state, device peak, step",
                  "gpu": (f"{per_param} B/param, allocated peak {c.gib(row.get('allocated_peak_bytes'))}, "
                          f"step {step['gpu_s'] or step['host_s']} s"), "dry_run": None, "cpu": None}
        return {"rows": [row], "figures": [figure], "notes": [(
            f"{s.label}, batch {s.batch}x{s.seq}, strategy='auto' on {ctx.device}, bf16-mixed (fp32 weights), "
            f"{s.steps} steps, first {s.warmup} left out of the step time (torchao compiles its step, GaLore runs its "
            "SVDs, in the first); defaults; state bytes: distinct storages of the optimizer's state (torchao's "
            "quantized moments by their inner tensors).")]}

    entry.__name__ = f"{family}_{kind}"
    return entry


#: seconds per entry: GaLore's first step runs an SVD per projected weight (112 here); torchao compiles its step
#: per parameter shape in the first step (Triton; the CPU rehearsal runs it eagerly)
BUDGET = {"galore": 45, "adamw8bit": 60, "adamw4bit": 60}

ENTRIES = [
    Entry("optimizer[adamw]", 25, _optimizer("adamw", "adamw"), "LLaMA 0.94B bf16-mixed, torch AdamW: the baseline",
          fresh=True),
    *(Entry(f"low_bit[{kind}]", 35, _optimizer("low_bit", kind),
            f"LLaMA 0.94B bf16-mixed, LowBitOptimizer({kind!r}): state B/param, peaks, step time", fresh=True)
      for kind in LOW_BIT),
    *(Entry(f"lean_optimizer[{kind}]", BUDGET.get(kind, 30), _optimizer("lean_optimizer", kind),
            f"LLaMA 0.94B bf16-mixed, LeanOptimizer({kind!r}): state B/param, peaks, step time", fresh=True)
      for kind in LEAN),
]

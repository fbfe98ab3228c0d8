"""The flags of the suite the corpus runs, alone and in the README's recipes, with the plain-Lightning run each is
judged against and the comparison its maths allows (see ``compare.py``).

A flag is the Trainer's ``strategy``, ``precision`` and callbacks for one technique; ``ref`` is the plain Lightning
run with the same maths: the same precision, the Trainer's own accumulation where the technique accumulates, the same
8-bit optimizer built in ``configure_optimizers`` where the technique swaps it in. Strategies run with
``host_optimizer="as_is"`` (the module's optimizer as configured) except the ``(fused)`` flags, which keep the
registered name's default fused kernel and are judged as a reordering.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tests.conformance.corpus import ModuleSpec


@dataclass(frozen=True)
class Ref:
    """A plain Lightning run: precision, ``accumulate_grad_batches``, whether ``configure_optimizers``' Adam/AdamW
    is replaced by bitsandbytes' ``AdamW8bit`` with the same groups, and whether it runs torch's fused CPU kernel
    (``fused=True`` on its fp32 groups: what a user gets by passing ``fused=True`` to their Adam/AdamW)."""

    precision: str = "32-true"
    accumulate: int = 1
    bnb: bool = False
    fused: bool = False

    def fp32(self) -> Ref:
        return replace(self, precision="32-true")

    @property
    def key(self) -> str:
        return f"plain@{self.precision}" + (f"+accumulate{self.accumulate}" if self.accumulate > 1 else "") + (
            "+AdamW8bit" if self.bnb else "") + ("+fused" if self.fused else "")


def _none(spec: ModuleSpec) -> list[Any]:
    return []


def _always(spec: ModuleSpec) -> str | None:
    return None


def _causal_lm(spec: ModuleSpec) -> str | None:
    return None if "causal_lm" in spec.tags else "ChunkedLMLoss is for causal LMs"


@dataclass(frozen=True)
class Flag:
    name: str
    strategy: Callable[[], Any] | None = None  # None: Lightning's "auto"
    precision: str = "32-true"
    callbacks: Callable[[ModuleSpec], list[Any]] = _none
    batches_per_step: int = 1  # loader batches per optimizer step (an AccumulationScheduler of 2 micro-batches: 2)
    ref: Ref = field(default_factory=Ref)
    compare: str = "exact"
    reason: str = ""
    group: str = "torch"  # "deepspeed" flags run in their own worker process (DeepSpeed patches torch globally)
    applies: Callable[[ModuleSpec], str | None] = _always
    slice: bool = True  # in the fast slice of `make test`


# --- builders (imported lazily: the corpus must load without the package's optional extras) --------------------
def offload(**kwargs: Any) -> Callable[[], Any]:
    def build() -> Any:
        from lightning_lowmem.strategies.offload import OffloadStrategy

        return OffloadStrategy(**{"host_optimizer": "as_is", **kwargs})

    return build


def registered(name: str) -> Callable[[], Any]:
    return lambda: name


def zero(stage: int, offload_: bool) -> Callable[[], Any]:
    def build() -> Any:
        from lightning_lowmem.strategies.zero import ZeroStrategy

        kwargs = {"offload_optimizer": True, "offload_parameters": stage == 3} if offload_ else {}
        return ZeroStrategy(stage=stage, **kwargs)

    return build


def auto() -> Any:
    from lightning_lowmem.plan.auto import AutoStrategy

    return AutoStrategy(device_budget="8GiB")


def ckpt(policy: Any = "all", **kwargs: Any) -> Callable[[ModuleSpec], list[Any]]:
    def build(spec: ModuleSpec) -> list[Any]:
        from lightning_lowmem import ActivationCheckpointing

        return [ActivationCheckpointing(policy, **kwargs)]

    return build


def cb(name: str, **kwargs: Any) -> Callable[[ModuleSpec], list[Any]]:
    def build(spec: ModuleSpec) -> list[Any]:
        import lightning_lowmem

        return [getattr(lightning_lowmem, name)(**kwargs)]

    return build


def accumulation(spec: ModuleSpec) -> list[Any]:
    from lightning_lowmem import AccumulationScheduler

    return [AccumulationScheduler(effective_batch_size=8, micro_batch_size=4)]


def memory_report(spec: ModuleSpec) -> list[Any]:
    from lightning_lowmem import MemoryReport

    return [MemoryReport(every_n_steps=1, predict=False, plot=False)]


def both(*parts: Callable[[ModuleSpec], list[Any]]) -> Callable[[ModuleSpec], list[Any]]:
    return lambda spec: [c for part in parts for c in part(spec)]


def chunked_if_lm(spec: ModuleSpec) -> list[Any]:
    return cb("ChunkedLMLoss", chunk_tokens=16)(spec) if "causal_lm" in spec.tags else []


# --- the reasons a `close` is allowed -------------------------------------------------------------------------------
R_ACCUM = ("each micro-batch's loss is weighted by its samples and the sum rescaled, where Lightning divides each by "
           "the accumulation: the same mean, rounded in another order")
R_FUSED = ("torch's fused CPU Adam/AdamW kernel, which the registered name runs by default: judged against plain "
           "Lightning running the same kernel (fused=True), bit for bit; the fused and for-loop kernels round "
           "otherwise, and under Adam an element whose gradient is within rounding of zero takes a full step either "
           "way (0.6-1.1 of the update of BatchNorm biases of LeViT/MobileNetV2 between two plain runs), which no "
           "rounding bound of the whole tensor covers")
R_MASTERS = ("fp32 master weights (the technique) against half weights (plain {p}): an update below half a bf16 ulp "
             "is kept by the master and lost by plain {p}")
R_CHUNKED = "the cross-entropy and the head's weight gradient summed chunk by chunk: another summation order"
R_DS = ("DeepSpeed steps a flat fp32 partition and reduces gradients in buckets; the _offload presets run "
        "DeepSpeedCPUAdam's vectorised kernel: the same update, another rounding order")
R_DS_BF16 = ("DeepSpeed's bf16 runs the whole module in bf16 without autocast, like Lightning's bf16-true, but with "
             "fp32 master weights: judged against plain bf16-true")

B16 = Ref("bf16-true")
FLAGS: list[Flag] = [
    # --- lowmem_offload, every precision it accepts
    Flag("lowmem_offload@32-true", offload(), "32-true", ref=Ref("32-true")),
    Flag("lowmem_offload@bf16-mixed", offload(), "bf16-mixed", ref=Ref("bf16-mixed")),
    Flag("lowmem_offload@16-mixed", offload(), "16-mixed", ref=Ref("16-mixed")),
    Flag("lowmem_offload@bf16-true", offload(), "bf16-true", ref=B16, compare="precision",
         reason=R_MASTERS.format(p="bf16-true")),
    Flag("lowmem_offload(fused)@32-true", registered("lowmem_offload"), "32-true", ref=Ref(fused=True),
         reason=R_FUSED),
    Flag("lowmem_offload(fused)@bf16-true", registered("lowmem_offload"), "bf16-true", ref=Ref("bf16-true", fused=True),
         compare="precision", reason=R_MASTERS.format(p="bf16-true") + "; " + R_FUSED, slice=False),
    Flag("lowmem_offload(optimizer_in_backward)@32-true", offload(optimizer_in_backward=True), "32-true"),
    Flag("lowmem_offload_params@32-true", offload(offload_params=True), "32-true"),
    Flag("lowmem_offload_params@bf16-mixed", offload(offload_params=True), "bf16-mixed", ref=Ref("bf16-mixed")),
    Flag("lowmem_offload_params@bf16-true", offload(offload_params=True), "bf16-true", ref=B16, compare="precision",
         reason=R_MASTERS.format(p="bf16-true")),
    # NOTE: the disk tier's files go to the temporary directory (unlinked as soon as they are open)
    Flag("lowmem_offload_disk@32-true", offload(optimizer_in_backward=True, disk=tempfile.gettempdir()), "32-true"),
    Flag("lowmem_offload_disk@bf16-true", offload(optimizer_in_backward=True, disk=tempfile.gettempdir()), "bf16-true",
         ref=B16, compare="precision", reason=R_MASTERS.format(p="bf16-true"), slice=False),
    Flag("lowmem_auto", auto, "32-true", compare="auto", slice=False),
    # --- callbacks, alone (fp32: bit-identical claims)
    *[Flag(f"ActivationCheckpointing({name})", callbacks=ckpt(policy, **kw), slice=name in ("all", "selective"))
      for name, policy, kw in [("all", "all", {}), ("every_n=2", "every_n", {"n": 2}), ("sqrt", "sqrt", {}),
                               ("selective", "selective", {}), ("budget=256KiB", "budget", {"budget": "256KiB"}),
                               ("[Linear]", ["Linear"], {})]],
    Flag("ActivationOffload(min_bytes=0)", callbacks=cb("ActivationOffload", min_bytes=0)),
    Flag("AccumulationScheduler(8/4)", callbacks=accumulation, batches_per_step=2, ref=Ref(accumulate=2),
         compare="reorder", reason=R_ACCUM),
    Flag("LowBitOptimizer(adamw8bit)", callbacks=cb("LowBitOptimizer"), ref=Ref(bnb=True)),
    Flag("OptimizerInBackward", callbacks=cb("OptimizerInBackward")),
    Flag("ChunkedLMLoss(16)", callbacks=cb("ChunkedLMLoss", chunk_tokens=16), compare="reorder", reason=R_CHUNKED,
         applies=_causal_lm),
    Flag("MemoryReport", callbacks=memory_report),
    # --- the README's recipes
    Flag("recipe:ckpt(all)+ActivationOffload(boundaries_only)",
         callbacks=both(ckpt("all"), cb("ActivationOffload", boundaries_only=True))),
    Flag("recipe:LowBitOptimizer+OptimizerInBackward", callbacks=both(cb("LowBitOptimizer"), cb("OptimizerInBackward")),
         ref=Ref(bnb=True)),
    Flag("recipe:offload@bf16-mixed+ckpt(sqrt)+AccumulationScheduler+MemoryReport", offload(), "bf16-mixed",
         callbacks=both(ckpt("sqrt"), accumulation, memory_report), batches_per_step=2,
         ref=Ref("bf16-mixed", accumulate=2), compare="reorder", reason=R_ACCUM),
    Flag("recipe:demo (offload@bf16-true+ckpt+AccumulationScheduler+LowBitOptimizer+MemoryReport)", offload(),
         "bf16-true", callbacks=both(ckpt("all"), accumulation, cb("LowBitOptimizer"), memory_report),
         batches_per_step=2, ref=Ref("bf16-true", accumulate=2, bnb=True), compare="precision",
         reason=R_MASTERS.format(p="bf16-true") + "; " + R_ACCUM),
    Flag("recipe:offload_params@bf16-true+ckpt(all)+ActivationOffload(boundaries_only)+ChunkedLMLoss",
         offload(offload_params=True), "bf16-true",
         callbacks=both(ckpt("all"), cb("ActivationOffload", boundaries_only=True), chunked_if_lm), ref=B16,
         compare="precision", reason=R_MASTERS.format(p="bf16-true") + "; " + R_CHUNKED),
    # --- DeepSpeed ZeRO presets (own worker), alone and with the callbacks
    *[Flag(f"{name}@32-true", zero(stage, off), "32-true", compare="reorder", reason=R_DS, group="deepspeed")
      for name, stage, off in [("lowmem_zero2", 2, False), ("lowmem_zero2_offload", 2, True),
                               ("lowmem_zero3", 3, False), ("lowmem_zero3_offload", 3, True)]],
    *[Flag(f"{name}@bf16-mixed", zero(stage, off), "bf16-mixed", ref=B16, compare="precision",
           reason=R_DS_BF16 + "; " + R_DS, group="deepspeed", slice=stage == 3 and off)
      for name, stage, off in [("lowmem_zero2", 2, False), ("lowmem_zero2_offload", 2, True),
                               ("lowmem_zero3", 3, False), ("lowmem_zero3_offload", 3, True)]],
    Flag("lowmem_zero2+ActivationCheckpointing(all)", zero(2, False), callbacks=ckpt("all"), compare="reorder",
         reason=R_DS, group="deepspeed"),
    Flag("lowmem_zero2+ActivationOffload", zero(2, False), callbacks=cb("ActivationOffload"), compare="reorder",
         reason=R_DS, group="deepspeed", slice=False),
    Flag("lowmem_zero2+AccumulationScheduler(8/4)", zero(2, False), callbacks=accumulation, batches_per_step=2,
         ref=Ref(accumulate=2), compare="reorder", reason=R_DS + "; " + R_ACCUM, group="deepspeed"),
    Flag("lowmem_zero2+LowBitOptimizer", zero(2, False), callbacks=cb("LowBitOptimizer"), ref=Ref(bnb=True),
         compare="reorder", reason=R_DS, group="deepspeed", slice=False),
    Flag("lowmem_zero2+OptimizerInBackward", zero(2, False), callbacks=cb("OptimizerInBackward"), compare="reorder",
         reason=R_DS, group="deepspeed", slice=False),
    Flag("lowmem_zero2+ChunkedLMLoss(16)", zero(2, False), callbacks=cb("ChunkedLMLoss", chunk_tokens=16),
         compare="reorder", reason=R_DS + "; " + R_CHUNKED, group="deepspeed", applies=_causal_lm, slice=False),
    Flag("lowmem_zero3+ChunkedLMLoss(16)", zero(3, False), callbacks=cb("ChunkedLMLoss", chunk_tokens=16),
         compare="reorder", reason=R_DS + "; " + R_CHUNKED, group="deepspeed", applies=_causal_lm, slice=False),
    Flag("lowmem_zero3_offload+MemoryReport", zero(3, True), callbacks=memory_report, compare="reorder", reason=R_DS,
         group="deepspeed", slice=False),
]
FLAGS_BY_NAME = {f.name: f for f in FLAGS}
assert len(FLAGS_BY_NAME) == len(FLAGS), "flag names are unique"

"""Candidate recipes: every combination of the suite's techniques the planner considers, and how they compare.

A :class:`Recipe` is one way of running the same training (same model, same effective batch): a base
(precision and where the model states live) and the techniques on top of it. It becomes the run description
the dry run traces and the Trainer runs (:meth:`Recipe.run`, the same ``RunSpec.from_flags`` that
``estimate_memory``'s shorthands use), YAML for ``lowmem fit`` and Python ``Trainer`` arguments.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.callbacks.chunked_lm_loss.callback import ChunkedLMLoss
from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer
from lightning_lowmem.predict.run_spec import RunSpec

Base = Literal["fp32", "mixed", "half", "offload", "offload_obw", "offload_params", "zero2_offload", "zero3_offload"]
Checkpointing = Literal["every_n", "all"]

#: base -> (label, where the model states live)
BASES: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32 weights, gradients and AdamW state on the device"),
    "mixed": ("{h}-mixed", "fp32 weights and optimizer on the device, {h} compute"),
    "half": ("{h}-true (no fp32 master)", "{h} weights and optimizer state on the device: numerics change"),
    "offload": ("lowmem_offload", "{h} weights on the device; fp32 masters, gradients and optimizer on the host"),
    "offload_obw": ("lowmem_offload + opt-in-bwd", "as lowmem_offload, host step overlapped with backward"),
    "offload_params": ("lowmem_offload_params", "as lowmem_offload, the blocks' {h} weights streamed from the host"),
    "zero2_offload": ("lowmem_zero2_offload", "DeepSpeed ZeRO-2, optimizer on the host"),
    "zero3_offload": ("lowmem_zero3_offload", "DeepSpeed ZeRO-3, parameters and optimizer on the host"),
}
_DEEPSPEED = ("zero2_offload", "zero3_offload")
_CKPT_RANK = {None: 0, "every_n": 1, "all": 2}
#: the chunk of ``ChunkedLMLoss`` the planner uses (GPT-2-XL's loss under 64 MiB)
CHUNK_TOKENS = 128
#: the technique callbacks a recipe switches on -> the recipe field that switches each on (a user's own callback of
#: one of these types fixes that field: ``lowmem_auto`` keeps it and plans around it)
TECHNIQUE_FIELDS: tuple[tuple[type, str], ...] = (
    (ActivationCheckpointing, "checkpointing"),
    (ActivationOffload, "activation_offload"),
    (ChunkedLMLoss, "chunked_loss"),
    (LowBitOptimizer, "optimizer_8bit"),
    (AccumulationScheduler, "micro_batch_size"),
)


def technique_field(callback: Any) -> str | None:
    """The recipe field that ``callback``'s technique is (by type), or None for a callback no recipe switches on."""
    return next((name for cls, name in TECHNIQUE_FIELDS if isinstance(callback, cls)), None)


@dataclass(frozen=True)
class Recipe:
    """One candidate: a base, the techniques on it, and the micro-batch (for the same effective batch)."""

    base: Base
    micro_batch_size: int
    checkpointing: Checkpointing | None = None
    activation_offload: bool = False
    chunked_loss: bool = False
    optimizer_8bit: bool = False

    def name(self, half: str = "bf16") -> str:
        parts = [BASES[self.base][0].format(h=half)]
        if self.checkpointing:
            parts.append("ckpt(every 2nd)" if self.checkpointing == "every_n" else "ckpt(all)")
        parts += [n for n, on in (("act. offload", self.activation_offload), ("chunked loss", self.chunked_loss),
                                  ("8-bit AdamW", self.optimizer_8bit)) if on]
        return " + ".join(parts) + f", micro {self.micro_batch_size}"

    def flags(self, batch_size: int | None, half: str = "bf16") -> dict[str, Any]:
        """``RunSpec.from_flags`` / ``estimate_memory`` shorthands for this recipe."""
        precision = {"fp32": "32-true", "mixed": f"{half}-mixed", "half": f"{half}-true", "offload": f"{half}-true",
                     "offload_obw": f"{half}-true", "offload_params": f"{half}-true"}.get(self.base, f"{half}-mixed")
        flags: dict[str, Any] = {"precision": precision}
        if self.base in ("offload", "offload_obw", "offload_params", *_DEEPSPEED):
            flags["offload"] = True
        if self.base == "offload_params":
            flags["offload_params"] = True
        if self.base == "offload_obw":
            flags["optimizer_in_backward"] = True
        if self.base in _DEEPSPEED:
            flags["zero_stage"] = 2 if self.base == "zero2_offload" else 3
        if self.checkpointing:
            flags["checkpointing"] = self.checkpointing
        if self.activation_offload:
            flags["activation_offload"] = True
        if self.chunked_loss:
            flags["chunked_loss"] = CHUNK_TOKENS
        if self.optimizer_8bit:
            flags["optimizer"] = "adamw8bit"
        if batch_size is not None and self.micro_batch_size != batch_size:
            flags["micro_batch_size"] = self.micro_batch_size
        return flags

    def run(self, batch_size: int | None, half: str = "bf16", loader_batch: int | None = None,
            scheduler: dict[str, Any] | None = None) -> RunSpec:
        """The run description the dry run traces and ``lowmem fit`` runs.

        ``loader_batch``: what the data loader yields now (a YAML's data module at its micro-batch); when it is not
        this recipe's micro-batch, an ``AccumulationScheduler`` sets it, even for a micro-batch of the whole batch.
        ``scheduler``: the run's own ``AccumulationScheduler`` arguments besides the batch sizes (its
        ``loss_normalization``: the maths of the run), given to the plan's.
        """
        flags = self.flags(batch_size, half)
        micro = flags.pop("micro_batch_size", None)
        run = RunSpec.from_flags(batch_size=batch_size, micro_batch_size=micro, **flags)
        if micro is None and loader_batch is not None and batch_size is not None and loader_batch != batch_size:
            run.callbacks.insert(0, AccumulationScheduler(effective_batch_size=batch_size, micro_batch_size=batch_size))
        if scheduler:
            run.callbacks = [c.fresh(**scheduler) if isinstance(c, AccumulationScheduler) else c
                             for c in run.callbacks]
        return run

    def saves_at_least(self, other: Recipe) -> bool:
        """Every technique of ``other`` is on here too, at least as strongly, with a micro-batch no larger.

        NOTE: the planner's pruning rests on this order: a recipe that saves at least as much as one that does
        not fit is taken not to fit either (each technique lowers the device peak, or leaves it where it is).
        """
        return (self.base == other.base and self.micro_batch_size <= other.micro_batch_size
                and _CKPT_RANK[self.checkpointing] >= _CKPT_RANK[other.checkpointing]
                and self.activation_offload >= other.activation_offload and self.chunked_loss >= other.chunked_loss
                and self.optimizer_8bit >= other.optimizer_8bit)

    def conflict(self, batch_size: int, half: str = "bf16") -> str | None:
        """Why the real run refuses this combination, for the pairs known not to compose (not traced)."""
        if self.base == "offload_obw" and half == "16":
            return "the optimizer in backward cannot use fp16: an overflow must skip the whole step"
        if self.base == "offload_obw" and self.micro_batch_size != batch_size:
            return "the optimizer in backward steps at every backward: no accumulation"
        if self.base == "offload_obw" and self.optimizer_8bit:
            return "the optimizer in backward runs its own per-parameter AdamW"
        if self.base == "zero3_offload" and self.chunked_loss:
            return "ZeRO-3 re-gathers a partitioned weight only for its own module's backward, not the loss's"
        return None


def micro_batches(batch_size: int) -> list[int]:
    """Micro-batches for the same effective batch: the batch, then halved while it divides (4 -> 4, 2, 1)."""
    out = [batch_size]
    while out[-1] % 2 == 0:
        out.append(out[-1] // 2)
    if out[-1] != 1:
        out.append(1)
    return out


def candidates(batch_size: int, *, pure_half: bool = False, deepspeed: bool = True, eight_bit: bool = True,
               chunked_loss: bool = True, micro: bool = True, checkpointing: bool = True,
               activation_offload: bool = True, bases: Sequence[str] | None = None, half: str = "bf16") -> list[Recipe]:
    """Every recipe considered, for an effective batch of ``batch_size`` on one device.

    DeepSpeed bases take the checkpointing callback (per-block policies compose with ZeRO's parameter fetching) but
    no activation offload or 8-bit optimizer (``ActivationOffload`` refuses DeepSpeed, and its engine runs its own
    optimizer), and pairs the real run refuses (:meth:`Recipe.conflict`) are left out; ``pure_half`` adds half weights without fp32 masters; ``bases`` keeps only the bases named.
    """
    if bases is not None:
        unknown = [b for b in bases if b not in BASES]
        if unknown:
            raise ValueError(f"Passed `bases={list(bases)!r}`; {unknown} are not bases: expected some of {list(BASES)}.")
    bases = [b for b in (bases or BASES) if (pure_half or b != "half" or bases) and (deepspeed or b not in _DEEPSPEED)]
    out = []
    for base in bases:
        ds = base in _DEEPSPEED
        for mb, ckpt, act, chunk, q in itertools.product(
            micro_batches(batch_size) if micro else [batch_size],
            [None, "every_n", "all"] if checkpointing else [None],
            [False] if ds or not activation_offload else [False, True], [False, True] if chunked_loss else [False],
            [False] if ds or not eight_bit else [False, True],
        ):
            recipe = Recipe(base, mb, ckpt, act, chunk, q)  # type: ignore[arg-type]
            if recipe.conflict(batch_size, half) is None:
                out.append(recipe)
    return out


__all__ = ["BASES", "CHUNK_TOKENS", "TECHNIQUE_FIELDS", "Recipe", "candidates", "micro_batches", "technique_field"]

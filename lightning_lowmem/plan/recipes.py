"""Candidate recipes: every combination of the suite's techniques the planner considers, and how they compare.

A :class:`Recipe` is a base (precision, where the model states live) and the techniques on it, for the same training;
:meth:`Recipe.run` makes it the run the dry run traces and the Trainer runs (``RunSpec.from_flags``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.callbacks.adapters.callback import Adapters
from lightning_lowmem.callbacks.chunked_lm_loss.callback import ChunkedLMLoss
from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer
from lightning_lowmem.core.optional import package_available
from lightning_lowmem.predict.estimate import lean_extra_problem
from lightning_lowmem.predict.run_spec import LEAN_OPTIMIZERS, RunSpec

Base = Literal["fp32", "mixed", "half", "offload", "offload_obw", "offload_params", "offload_params_obw",
               "offload_disk", "offload_params_disk", "zero2_offload", "zero3_offload"]
Checkpointing = Literal["every_n", "all"]

#: base -> (label, where the model states live)
BASES: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32 weights, gradients and AdamW state on the device"),
    "mixed": ("{h}-mixed", "fp32 weights and optimizer on the device, {h} compute"),
    "half": ("{h}-true (no fp32 master)", "{h} weights and optimizer state on the device: numerics change"),
    "offload": ("lowmem_offload", "{h} weights on the device; fp32 masters, gradients and optimizer on the host"),
    "offload_obw": ("lowmem_offload + opt-in-bwd", "as lowmem_offload, each master stepped as its gradient lands"),
    "offload_params": ("lowmem_offload_params", "as lowmem_offload, the blocks' {h} weights streamed from the host"),
    "offload_params_obw": ("lowmem_offload_params + opt-in-bwd",
                           "as lowmem_offload_params, each master stepped as its gradient lands"),
    "offload_disk": ("lowmem_offload_disk",
                     "as lowmem_offload + opt-in-bwd, fp32 masters and optimizer state in files on a local disk"),
    "offload_params_disk": ("lowmem_offload_params + disk tier",
                            "as lowmem_offload_params + opt-in-bwd, fp32 masters and optimizer state on a local disk"),
    "zero2_offload": ("lowmem_zero2_offload", "DeepSpeed ZeRO-2, optimizer on the host"),
    "zero3_offload": ("lowmem_zero3_offload", "DeepSpeed ZeRO-3, parameters and optimizer on the host"),
}
_DEEPSPEED = ("zero2_offload", "zero3_offload")
#: the bases with the disk tier (``OffloadStrategy(disk=...)``): candidates only with a directory (``plan(disk_dir=)``)
DISK = ("offload_disk", "offload_params_disk")
_OFFLOAD = ("offload", "offload_obw", "offload_params", "offload_params_obw", *DISK)
#: the bases that step each master in backward (``OffloadStrategy(optimizer_in_backward=True)``)
IN_BACKWARD = ("offload_obw", "offload_params_obw", *DISK)
_CKPT_RANK = {None: 0, "every_n": 1, "all": 2}
#: the chunk of ``ChunkedLMLoss`` the planner uses (GPT-2-XL's loss under 64 MiB)
CHUNK_TOKENS = 128
#: the technique callbacks a recipe switches on -> the recipe field that switches each on (a user's own fixes it)
TECHNIQUE_FIELDS: tuple[tuple[type, str], ...] = (
    (ActivationCheckpointing, "checkpointing"),
    (ActivationOffload, "activation_offload"),
    (ChunkedLMLoss, "chunked_loss"),
    (LowBitOptimizer, "optimizer"),
    (AccumulationScheduler, "micro_batch_size"),
    (Adapters, "adapters"),
    (LeanOptimizer, "optimizer"),
)
#: an adapter variant a plan may consider: (kind, quantized base), ``(None, None)`` the full fine-tune
AdapterVariant = tuple[str | None, str | None]
FULL_FINE_TUNE: AdapterVariant = (None, None)
#: ``plan(optimizers=...)``: "adamw" (the module's own optimizer), "adamw8bit" (``LowBitOptimizer``) or a
#: ``LeanOptimizer`` shorthand of ``estimate_memory`` -> how recipe names show it
OPTIMIZER_LABELS: dict[str, str] = {"adamw8bit": "8-bit AdamW", "galore": "GaLore", "apollo": "APOLLO", "apollo_mini": "APOLLO-Mini",
                                    "adam_mini": "Adam-mini", "adamw4bit": "4-bit AdamW (torchao)",
                                    "torchao_adamw8bit": "8-bit AdamW (torchao)"}


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
    #: ``Adapters(adapters, r=adapter_r, quantize_base=quantize_base)``, where allowed; None: the full fine-tune
    adapters: str | None = None
    adapter_r: int = 16
    quantize_base: str | None = None
    #: ``LowBitOptimizer`` (``"adamw8bit"``) or a ``LeanOptimizer`` shorthand (``"galore"``, ...), where allowed;
    #: None: the module's own
    optimizer: str | None = None
    #: the disk tier's directory (``OffloadStrategy(disk=...)``), for the bases of ``DISK``; the dry run makes no file
    disk: str | None = None

    @property
    def training_name(self) -> str:
        """What is trained and how: ``"full fine-tune"``, ``"LoRA r=16"``, ``"full fine-tune with GaLore"``, ..."""
        return self.adapter_name + (f" with {OPTIMIZER_LABELS[self.optimizer]}" if self.optimizer else "")

    @property
    def adapter_name(self) -> str:
        """``"full fine-tune"``, ``"LoRA r=16"``, ``"QLoRA (nf4 base) r=16"``, ``"DoRA r=8"``, ..."""
        if self.adapters is None:
            return "full fine-tune"
        kind = {"lora": "LoRA", "dora": "DoRA"}.get(self.adapters, self.adapters)
        if self.quantize_base is not None:
            kind = f"Q{kind} ({self.quantize_base} base)"
        return f"{kind} r={self.adapter_r}"

    def name(self, half: str = "bf16") -> str:
        parts = [BASES[self.base][0].format(h=half)]
        if self.adapters is not None:
            parts.append(self.adapter_name)
        if self.optimizer is not None:
            parts.append(OPTIMIZER_LABELS[self.optimizer])
        if self.checkpointing:
            parts.append("ckpt(every 2nd)" if self.checkpointing == "every_n" else "ckpt(all)")
        parts += [n for n, on in (("act. offload", self.activation_offload), ("chunked loss", self.chunked_loss)) if on]
        return " + ".join(parts) + f", micro {self.micro_batch_size}"

    def flags(self, batch_size: int | None, half: str = "bf16") -> dict[str, Any]:
        """``RunSpec.from_flags`` / ``estimate_memory`` shorthands for this recipe."""
        precision = {"fp32": "32-true", "half": f"{half}-true",
                     **dict.fromkeys(_OFFLOAD, f"{half}-true")}.get(self.base, f"{half}-mixed")
        # NOTE: a flag at its default (None here) is left out
        flags = {k: v for k, v in {
            "precision": precision,
            "offload": self.base in (*_OFFLOAD, *_DEEPSPEED) or None,
            "offload_params": self.base.startswith("offload_params") or None,
            "optimizer_in_backward": self.base in IN_BACKWARD or None,
            "zero_stage": {"zero2_offload": 2, "zero3_offload": 3}.get(self.base),
            "checkpointing": self.checkpointing or None,
            "activation_offload": self.activation_offload or None,
            "chunked_loss": CHUNK_TOKENS if self.chunked_loss else None,
            "optimizer": self.optimizer,
            "disk": self.disk if self.base in DISK else None,
            "micro_batch_size": self.micro_batch_size if batch_size not in (None, self.micro_batch_size) else None,
        }.items() if v is not None}
        if self.adapters is not None:
            flags.update(adapters=self.adapters, adapter_r=self.adapter_r, quantize_base=self.quantize_base)
        return flags

    def run(self, batch_size: int | None, half: str = "bf16", loader_batch: int | None = None,
            scheduler: dict[str, Any] | None = None) -> RunSpec:
        """The run description the dry run traces and ``lowmem fit`` runs.

        ``loader_batch``: what the data loader yields now; when it is not this recipe's micro-batch, an
        ``AccumulationScheduler`` sets it. ``scheduler``: the run's own scheduler arguments, given to the plan's.
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

        NOTE: the planner's pruning rests on this order (each technique lowers the device peak or leaves it); only
        within one training (adapters and a lean optimizer change the maths, they are no saving to rank by).
        """
        return (self.base == other.base and self.training == other.training
                and self.micro_batch_size <= other.micro_batch_size
                and _CKPT_RANK[self.checkpointing] >= _CKPT_RANK[other.checkpointing]
                and self.activation_offload >= other.activation_offload and self.chunked_loss >= other.chunked_loss)

    @property
    def adapter_variant(self) -> tuple[str | None, int, str | None]:
        return self.adapters, self.adapter_r, self.quantize_base

    @property
    def training(self) -> tuple[str | None, int, str | None, str | None]:
        """The adapter variant and the optimizer: recipes compare (and are planned in order) only within one."""
        return (*self.adapter_variant, self.optimizer)

    def conflict(self, batch_size: int, half: str = "bf16") -> str | None:
        """Why the real run refuses this combination, for the pairs known not to compose (not traced)."""
        if self.base in DISK and self.disk is None:
            return "the disk tier needs a directory (`plan(disk_dir=...)`, `lowmem plan --disk-dir`)"
        if self.base in IN_BACKWARD and half == "16":
            return "the optimizer in backward cannot use fp16: an overflow must skip the whole step"
        if self.base in IN_BACKWARD and self.micro_batch_size != batch_size:
            return "the optimizer in backward steps at every backward: no accumulation"
        if self.base == "zero3_offload" and self.chunked_loss:
            return "ZeRO-3 re-gathers a partitioned weight only for its own module's backward, not the loss's"
        if self.quantize_base is not None and self.base in _DEEPSPEED:
            return "bitsandbytes' packed base weights cannot be partitioned by DeepSpeed"
        if self.optimizer is not None and self.base in _DEEPSPEED:
            return "DeepSpeed's engine builds its own optimizer: LeanOptimizer and LowBitOptimizer cannot replace it"
        return None


def micro_batches(batch_size: int) -> list[int]:
    """Micro-batches for the same effective batch: the batch, then halved while it divides (4 -> 4, 2, 1)."""
    out = [batch_size]
    while out[-1] % 2 == 0:
        out.append(out[-1] // 2)
    if out[-1] != 1:
        out.append(1)
    return out


def candidates(batch_size: int, *, pure_half: bool = False, deepspeed: bool = True, chunked_loss: bool = True, micro: bool = True, checkpointing: bool = True,
               activation_offload: bool = True, bases: Sequence[str] | None = None, half: str = "bf16",
               adapters: Sequence[AdapterVariant] = (FULL_FINE_TUNE,), adapter_r: int = 16,
               optimizers: Sequence[str | None] = (None,), disk_dir: str | None = None) -> list[Recipe]:
    """Every recipe considered, for an effective batch of ``batch_size`` on one device.

    DeepSpeed bases take no activation offload; pairs the real run refuses (:meth:`Recipe.conflict`) are left out;
    ``pure_half`` adds half weights without fp32 masters; ``bases`` keeps only those named; the disk bases (``DISK``)
    come only with ``disk_dir``, their tier's directory. Every recipe is considered with each of ``adapters``
    (``(kind, quantized base)``, ``(None, None)`` the full fine-tune, at rank ``adapter_r``) and of ``optimizers``
    (None: the module's own).
    """
    if bases is not None:
        unknown = [b for b in bases if b not in BASES]
        problems = [f"{unknown} are not bases: expected some of {list(BASES)}"] if unknown else []
        if disk_dir is None and any(b in DISK for b in bases):
            problems.append(f"{[b for b in bases if b in DISK]} need a directory for the disk tier: pass `disk_dir`")
        if problems:
            raise ValueError(f"Passed `bases={list(bases)!r}`; " + "; ".join(problems) + ".")
    bases = [b for b in (bases or BASES) if (pure_half or b != "half" or bases) and (deepspeed or b not in _DEEPSPEED)]
    out = []
    for base in bases:
        ds = base in _DEEPSPEED
        for (kind, quant), lean, mb, ckpt, act, chunk in itertools.product(
            adapters, optimizers,
            micro_batches(batch_size) if micro else [batch_size],
            [None, "every_n", "all"] if checkpointing else [None],
            [False] if ds or not activation_offload else [False, True], [False, True] if chunked_loss else [False],
        ):
            recipe = Recipe(base, mb, ckpt, act, chunk, kind, adapter_r if kind else 16,  # type: ignore[arg-type]
                            quant if kind else None, lean, disk_dir if base in DISK else None)
            if recipe.conflict(batch_size, half) is None:
                out.append(recipe)
    return out


def disk_problems(disk_dir: Any, disk_budget: Any, problems: list[str], cli: bool = False) -> bool:
    """Add what is wrong with the disk tier's directory ``disk_dir`` (an existing directory) and ``disk_budget`` (only
    with one; its size is checked by the caller) to ``problems``, as ``plan`` spells them (``cli``: as ``lowmem
    plan``'s); True when ``disk_dir`` is of a wrong type."""
    def call(name: str, value: Any) -> str:
        return f"`--{name.replace('_', '-')} {value}`" if cli else f"`{name}={value!r}`"

    if disk_dir is not None and not isinstance(disk_dir, (str, os.PathLike)):
        problems.append(f"Passed {call('disk_dir', disk_dir)}; expected a directory (str or os.PathLike).")
        return True
    if disk_dir is not None and not os.path.isdir(disk_dir):
        problems.append(f"Passed {call('disk_dir', os.fspath(disk_dir))}, which is not a directory; create it (on a "
                        "local disk, an NVMe SSD is best) or pass another.")
    elif disk_dir is None and disk_budget is not None:
        problems.append(f"Passed {call('disk_budget', disk_budget)} without {'`--disk-dir`' if cli else '`disk_dir`'}; "
                        "the disk tier needs a directory: pass it too, or leave the disk budget out.")
    return False


ADAPTER_KINDS = ("none", "lora", "dora")
OPTIMIZERS = ("adamw", "adamw8bit", *LEAN_OPTIMIZERS)


def optimizer_choices(optimizers: Any, own_callbacks: Sequence[Any], problems: list[str],
                      cli: bool = False) -> tuple[tuple[str | None, ...], bool]:
    """The optimizers ``plan``'s ``optimizers`` allows, in order (None: the module's own, ``"adamw"``), and whether a
    wrong type was given; what is wrong is added to ``problems``, as ``plan`` spells it (``cli``: ``--optimizers``)."""
    names = [optimizers] if isinstance(optimizers, str) else list(optimizers) if isinstance(optimizers, Sequence) else None
    call = (f"`--optimizers {','.join(names or [])}`" if cli else f"`optimizers={optimizers!r}`")
    if not names or any(n not in OPTIMIZERS for n in names):
        problems.append(f"Passed {call}; expected some of {', '.join(repr(n) for n in OPTIMIZERS)} ('adamw': the "
                        "module's own optimizer; 'adamw8bit': LowBitOptimizer)")
        return (None,), names is None
    lean = [n for n in names if n != "adamw"]
    own = [c for c in own_callbacks if technique_field(c) == "optimizer"]
    if lean and own:
        problems.append(f"Passed {call}, but the run has its own `{own[0]!r}`: its optimizer stays; leave "
                        "`optimizers` out (or remove the callback to let the plan choose among the ones you list)")
    problems += [p for p in (lean_extra_problem(n, call) for n in dict.fromkeys(lean)) if p]
    if "adamw8bit" in lean and not package_available("bitsandbytes"):
        problems.append(f"Passed {call}: 'adamw8bit' needs `bitsandbytes`: `pip install 'lightning-lowmem[bnb]'`")
    # NOTE: in the order listed: the planner takes the first optimizer that has a recipe that fits
    return tuple(dict.fromkeys(None if n == "adamw" else n for n in names)), False
QUANTIZED_BASES = ("none", "nf4", "fp4", "int8")


def adapter_variants(adapters: Any, quantize_base: Any, adapter_r: Any, own_callbacks: Sequence[Any],
                     problems: list[str], cli: bool = False) -> tuple[tuple[AdapterVariant, ...], bool]:
    """The ``(kind, quantized base)`` pairs ``plan``'s ``adapters`` and ``quantize_base`` allow, in the order given,
    and whether a wrong type was given; what is wrong with them (or ``adapter_r``, or an ``Adapters`` among
    ``own_callbacks``) is added to ``problems``, spelled as ``plan``'s arguments (``cli``: as ``lowmem plan``'s)."""
    wrong_type = not isinstance(adapters, (str, Sequence)) or not isinstance(quantize_base, (str, Sequence))
    kinds = [adapters] if isinstance(adapters, str) else list(adapters) if isinstance(adapters, Sequence) else None
    quants = ([quantize_base] if isinstance(quantize_base, str) else list(quantize_base)
              if isinstance(quantize_base, Sequence) else None)
    def given(name: str, value: Any) -> str:
        if cli:
            return f"`--{name.replace('_', '-')} {','.join(value) if isinstance(value, list) else value}`"
        return f"`{name}={value!r}`"

    call = given("adapters", adapters)
    if not kinds or any(k not in ADAPTER_KINDS for k in kinds):
        problems.append(f"Passed {call}; expected some of {', '.join(repr(k) for k in ADAPTER_KINDS)} ('none': the "
                        "full fine-tune)")
        kinds = []
    if not quants or any(q not in QUANTIZED_BASES for q in quants):
        problems.append(f"Passed {given('quantize_base', quantize_base)}; expected some of "
                        f"{', '.join(repr(q) for q in QUANTIZED_BASES)} ('none': the base keeps its dtype)")
        quants = []
    trained = [k for k in kinds if k != "none"]
    if isinstance(adapter_r, bool) or not isinstance(adapter_r, int) or adapter_r < 1:
        problems.append(f"Passed {given('adapter_r', adapter_r)}; expected an int >= 1 (the adapters' rank)")
        wrong_type |= isinstance(adapter_r, bool) or not isinstance(adapter_r, int)
    if any(q != "none" for q in quants) and not trained:
        problems.append(f"Passed {given('quantize_base', quantize_base)} with {call}: a quantized base is frozen, for "
                        "adapters only; add 'lora' (or 'dora') to the trainings allowed")
    own = [c for c in own_callbacks if technique_field(c) == "adapters"]
    if trained and own:
        problems.append(f"Passed {call}, but the run has its own `{own[0]!r}`: its training stays; leave `adapters` "
                        "out (or remove the callback to let the plan choose among the trainings you list)")
    for package, needed in (("peft", bool(trained)), ("bitsandbytes", any(q != "none" for q in quants) and trained)):
        if needed and not package_available(package):
            extra = "bnb" if package == "bitsandbytes" else package
            problems.append(f"Passed {call}" + (f" with {given('quantize_base', quantize_base)}" if extra == "bnb" else "")
                            + f", which needs `{package}`: `pip install 'lightning-lowmem[{extra}]'`")
    # NOTE: in the order listed: the planner takes the first training that has a recipe that fits
    variants = [FULL_FINE_TUNE if k == "none" else (k, None if q == "none" else q)
                for k in kinds for q in (quants if k != "none" else ["none"])]
    return tuple(dict.fromkeys(variants)) or (FULL_FINE_TUNE,), wrong_type


__all__ = ["ADAPTER_KINDS", "BASES", "CHUNK_TOKENS", "DISK", "FULL_FINE_TUNE", "OPTIMIZERS", "OPTIMIZER_LABELS",
           "QUANTIZED_BASES", "TECHNIQUE_FIELDS", "AdapterVariant", "Recipe", "adapter_variants", "candidates",
           "disk_problems", "micro_batches", "optimizer_choices", "technique_field"]

"""Repeated-block discovery and per-block checkpointing by forward replacement (no wrapper modules).

A block is checkpointed by giving the module an instance-level ``forward`` (a :class:`CheckpointedForward`)
that runs the class's ``forward`` under non-reentrant ``torch.utils.checkpoint``, its recompute on the buffers
the forward found (``_buffers.BufferGuard``). The module tree, the
parameter names and therefore ``state_dict`` keys are unchanged, module hooks (FSDP2's, DeepSpeed's) stay
outside the checkpointed region, and :func:`unwrap` restores the module exactly.

For other techniques (``ActivationOffload(boundaries_only=True)``): :func:`checkpoint_info` tells whether a
module is checkpointed and whether it is a *boundary*, i.e. whether the tensors passed to it are what the
checkpoint keeps alive for backward; :func:`checkpointed_modules` lists them in module order.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.buffers import BufferGuard, checkpoint_contexts

# the attribute that marks a checkpointed module (read it through `checkpoint_info`)
INFO_ATTR = "_lowmem_checkpoint"


@dataclass(frozen=True)
class CheckpointInfo:
    """How a module is checkpointed.

    Attributes:
        kind: ``"block"`` (recomputed on its own) or ``"segment"`` (recomputed with its segment's other blocks).
        segment: index of the segment (blocks checkpointed on their own each form a segment of one).
        position: position of the module inside its segment (0 for the first).
        is_boundary: True when the module's inputs are kept for backward (the first block of each segment).
        selective: True when matmul outputs are kept too (selective activation checkpointing).
    """

    kind: Literal["block", "segment"]
    segment: int
    position: int
    is_boundary: bool
    selective: bool = False


def checkpoint_info(module: nn.Module) -> CheckpointInfo | None:
    """The :class:`CheckpointInfo` of a module checkpointed by ``ActivationCheckpointing``, else None."""
    return module.__dict__.get(INFO_ATTR)


def checkpointed_modules(root: nn.Module) -> list[tuple[str, nn.Module, CheckpointInfo]]:
    """Every checkpointed module under ``root`` (``root`` included), in module order."""
    out = []
    for name, module in root.named_modules():
        info = checkpoint_info(module)
        if info is not None:
            out.append((name, module, info))
    return out


# --- discovery ------------------------------------------------------------------------------------


def find_repeated_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of a model: the children of its longest ``nn.ModuleList`` of same-class modules.

    Every such list of the maximal length is taken (an encoder-decoder has two), and lists nested inside an
    already chosen block are skipped. Covers GPT-2 (``transformer.h``), LLaMA (``model.layers``), BERT
    (``encoder.layer``), T5 (``encoder.block``, ``decoder.block``), ViT and ``nn.TransformerEncoder``
    (``layers``). Returns ``[]`` when no list of at least two same-class modules exists.
    """
    candidates: list[tuple[str, nn.ModuleList]] = []
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            classes = {type(child) for child in module}
            if len(classes) == 1:
                candidates.append((name, module))
    if not candidates:
        return []
    longest = max(len(m) for _, m in candidates)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module_list in candidates:
        if len(module_list) != longest:
            continue
        # NOTE: a list that is itself a chosen block (a list of lists) is nested too, not only a list below one
        if any(name == prefix or name.startswith(prefix + ".") for prefix, _ in chosen):
            continue
        prefix = f"{name}." if name else ""
        chosen.extend((f"{prefix}{i}", child) for i, child in enumerate(module_list))
    return chosen


def called_blocks(blocks: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules whose ``forward`` runs: a container (``nn.ModuleList``, ``nn.ModuleDict``) is replaced by its children.

    NOTE: a container has no ``forward``: the model walks its layers itself (Funnel's ``encoder.blocks.0``,
    PoolFormer's ``encoder.block.0``), so the hooks of a streamed container never run and its weights would be read
    released (NaN). Its children are called: they are the streamed blocks.
    """
    out: list[tuple[str, nn.Module]] = []
    for name, block in blocks:
        if isinstance(block, (nn.ModuleList, nn.ModuleDict)):
            out += called_blocks([(f"{name}.{child}", m) for child, m in block.named_children()])
        else:
            out.append((name, block))
    return out


def select_modules(root: nn.Module, targets: Sequence[str | type]) -> list[tuple[str, nn.Module]]:
    """Modules named by ``targets``: classes, class names, or ``fnmatch`` patterns on qualified names.

    A name matching an ``nn.ModuleList`` selects its children. Modules nested inside an already selected
    module are skipped (checkpointing the outer one covers them).
    """
    chosen: list[tuple[str, nn.Module]] = []

    def covered(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p, _ in chosen)

    for name, module in root.named_modules():
        if covered(name):
            continue
        for target in targets:
            if isinstance(target, type):
                hit = isinstance(module, target)
            else:
                hit = type(module).__name__ == target or (bool(name) and fnmatch.fnmatchcase(name, target))
            if hit:
                if isinstance(module, nn.ModuleList):
                    chosen.extend((f"{name}.{i}", child) for i, child in enumerate(module) if not covered(f"{name}.{i}"))
                else:
                    chosen.append((name, module))
                break
    return chosen


def compiled_names(root: nn.Module) -> list[str]:
    """Qualified names of the ``torch.compile``-d submodules of ``root`` (outermost first)."""
    return [n for n, m in root.named_modules() if n and torch_internals.is_compiled_module(m)]


def in_compiled(name: str, compiled: list[str]) -> str | None:
    """The compiled module (of ``compiled``) that is ``name``, holds it or is held by it, or None (a module
    holding a compiled one runs its compiled code in its own forward: checkpointing it recomputes that code)."""
    return next((c for c in compiled if name == c or name.startswith(c + ".") or not name
                 or c.startswith(name + ".")), None)


def outside_compiled(root: nn.Module, found: list[tuple[str, nn.Module]]) -> tuple[list[tuple[str, nn.Module]], dict[str, list[str]]]:
    """``found`` without the ``torch.compile``-d modules, the modules inside them and those holding them; and
    ``{compiled module name: the names dropped}``.

    NOTE: no checkpointing composes with a compiled region bit for bit. Inside it, the checkpoint is traced into the
    graph, which inductor partitions and fuses otherwise (|diff|/|update| ~3e-6 after 3 fp32 steps with
    ``backend="inductor"``, bit-identical with ``"aot_eager"``), and a segment closed by a forward hook inside it fails
    in the compiled backward (a saved weight's strides). Around it, the recompute of a compiled module saves other
    tensors than its forward did at ``bf16-true`` (torch's ``CheckpointError``, plain Lightning alike).
    """
    compiled = compiled_names(root)
    kept: list[tuple[str, nn.Module]] = []
    dropped: dict[str, list[str]] = {}
    for name, module in found:
        outer = in_compiled(name, compiled)
        if outer is None:
            kept.append((name, module))
        else:
            dropped.setdefault(outer, []).append(name)
    return kept, dropped


def owner_of(root: nn.Module, name: str) -> nn.Module:
    """The module whose ``forward`` calls the block ``name`` (the parent of its ``ModuleList``)."""
    parts = name.split(".")
    parent_name = ".".join(parts[:-1])
    parent = root.get_submodule(parent_name) if parent_name else root
    if isinstance(parent, nn.ModuleList):
        grand_name = ".".join(parts[:-2])
        return root.get_submodule(grand_name) if grand_name else root
    return parent


# --- per-block checkpointing ----------------------------------------------------------------------


def call_inner(module: nn.Module, inner: Callable[..., Any] | None, args: tuple, kwargs: dict) -> Any:
    """Run a wrapped module's own forward: the instance-level one it had before, else its class's."""
    if inner is not None:
        return inner(*args, **kwargs)
    # NOTE: looked up at call time, so a class swapped in later (FSDP2's `FSDP<Block>`) is honoured.
    return type(module).forward(module, *args, **kwargs)


def refuse_kv_cache(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Recomputing a block that writes a KV cache would write it twice: refuse with the fix."""
    for value in (*args, *kwargs.values()):
        if value is not None and any(c.__name__ == "Cache" for c in type(value).__mro__):
            raise RuntimeError(
                f"`{type(module).__name__}` received a key/value cache (`{type(value).__name__}`) while training "
                "under ActivationCheckpointing: recomputing the block in backward would update the cache a second "
                "time. Turn caching off for training (`model.config.use_cache = False`, or pass `use_cache=False`)."
            )


class CheckpointedForward:
    """The instance-level ``forward`` of a block checkpointed on its own (picklable, deep-copyable)."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None, context_fn: Callable[[], Any] | None) -> None:
        self.module = module
        self.inner = inner
        self.context_fn = context_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return call_inner(self.module, self.inner, args, kwargs)
        refuse_kv_cache(self.module, args, kwargs)
        # NOTE: the guard gives each recompute the buffers this forward found, and leaves those it left (a
        # recompute of BatchNorm would update its running statistics a second time, and read updated ones)
        context_fn = functools.partial(checkpoint_contexts, BufferGuard(self.module), self.context_fn)
        # NOTE: top-level tensor arguments are handed to `checkpoint` one by one, not inside the `args` tuple:
        # checkpoint then keeps them as saved tensors, which saved-tensor hooks see (ActivationOffload's
        # `boundaries_only=True` moves them to the host); inside a tuple they were plain, unreachable references.
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        rest = tuple(None if i in slots else a for i, a in enumerate(args))
        return checkpoint(
            _call_with_tensors, self.module, self.inner, rest, kwargs, slots, *(args[i] for i in slots),
            use_reentrant=False, preserve_rng_state=True, context_fn=context_fn,
        )  # fmt: skip


def _call_with_tensors(
    module: nn.Module, inner: Callable[..., Any] | None, rest: tuple, kwargs: dict, slots: list[int], *tensors: Any
) -> Any:
    args = list(rest)
    for i, t in zip(slots, tensors):
        args[i] = t
    return call_inner(module, inner, tuple(args), kwargs)


def has_foreign_checkpointing(module: nn.Module) -> str | None:
    """Name the checkpointing someone else already applied to ``module`` (or an ancestor's wrapper), if any."""
    if type(module).__name__ == "CheckpointWrapper":
        return "torch.distributed CheckpointWrapper (e.g. FSDP's activation_checkpointing_policy)"
    for child in module.modules():
        if type(child).__name__ == "CheckpointWrapper":
            return "torch.distributed CheckpointWrapper (e.g. FSDP's activation_checkpointing_policy)"
    return None


def wrap_block(module: nn.Module, info: CheckpointInfo, context_fn: Callable[[], Any] | None) -> bool:
    """Checkpoint ``module`` on its own. Returns False (and changes nothing) when it is checkpointed already."""
    if checkpoint_info(module) is not None:
        return False
    inner = module.__dict__.get("forward")
    module.forward = CheckpointedForward(module, inner, context_fn)  # type: ignore[method-assign]
    module.__dict__[INFO_ATTR] = info
    return True


def unwrap(module: nn.Module) -> None:
    """Undo :func:`wrap_block` / segment wrapping: the module's forward is what it was before."""
    if checkpoint_info(module) is None:
        return
    wrapper = module.__dict__.pop("forward")
    if wrapper.inner is not None:
        module.__dict__["forward"] = wrapper.inner
    del module.__dict__[INFO_ATTR]


"""Checkpointing a module through its forward hooks: the module tree, parameter names and ``state_dict`` keys unchanged.

A block checkpointed on its own gets a :class:`BlockCheckpoint`: its forward pre-hook (the module's last) enters
torch's non-reentrant checkpoint and its forward hook (the module's first) leaves it, so the checkpointed region is
exactly the module's ``forward``, as ``torch.utils.checkpoint.checkpoint(module.forward, ...)`` around it would make
it (torch's composable ``checkpoint`` works the same way). The recompute calls ``module.forward``: hooks that other
techniques registered on the module itself (ZeRO-3's gather, parameter streaming's fetch, FSDP2's unshard) run
outside the region, once, as they do without checkpointing; the callback registers its hooks at ``on_fit_start``,
after the strategy registered those.

Each recompute runs on a copy of the buffers its forward found (:class:`RecomputeBuffers`), and every tensor the
forward saved keeps autograd's in-place check (``core.saved_versions.CheckedSaves``).

For other techniques: :func:`checkpoint_info` tells whether a module is checkpointed and whether it is a *boundary*
(the tensors passed to it are what the checkpoint keeps for backward); :func:`checkpointed_modules` lists them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import override

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.saved_versions import CheckedSaves


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


class CheckpointHooks:
    """The pair of forward hooks that checkpoints one module (the role :func:`checkpoint_info` looks for)."""

    info: CheckpointInfo

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise NotImplementedError

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        raise NotImplementedError

    def attach(self, module: nn.Module) -> bool:
        """Register on ``module``; False (and nothing changed) when it is checkpointed already."""
        if checkpoint_info(module) is not None:
            return False
        # NOTE: the last pre-hook and the first forward hook: the region is the forward alone, inside every other
        # technique's hooks (a saved-tensor hook pair pushed by a pre-hook is popped by its forward hook, in order)
        module.register_forward_pre_hook(self.pre, with_kwargs=True)
        module.register_forward_hook(self.post, prepend=True, always_call=True)
        return True


def _ours(hook: Any) -> CheckpointHooks | None:
    owner = getattr(hook, "__self__", None)
    return owner if isinstance(owner, CheckpointHooks) else None


def checkpoint_info(module: nn.Module) -> CheckpointInfo | None:
    """The :class:`CheckpointInfo` of a module checkpointed by ``ActivationCheckpointing``, else None."""
    for hook in torch_internals.forward_pre_hooks(module).values():
        owner = _ours(hook)
        if owner is not None:
            return owner.info
    return None


def checkpointed_modules(root: nn.Module) -> list[tuple[str, nn.Module, CheckpointInfo]]:
    """Every checkpointed module under ``root`` (``root`` included), in module order."""
    found = [(name, module, checkpoint_info(module)) for name, module in root.named_modules()]
    return [(name, module, info) for name, module, info in found if info is not None]


def remove_checkpointing(module: nn.Module) -> bool:
    """Drop ``module``'s checkpointing hooks; True when it had them."""
    pre = [k for k, hook in torch_internals.forward_pre_hooks(module).items() if _ours(hook) is not None]
    for key in pre:
        torch_internals.remove_forward_pre_hook(module, key)
    for key in [k for k, hook in torch_internals.forward_hooks(module).items() if _ours(hook) is not None]:
        torch_internals.remove_forward_hook(module, key)
    return bool(pre)


def refuse_kv_cache(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Recomputing a block that writes a Hugging Face KV cache would write it twice: refuse with the fix."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # NOTE: no cache without transformers loaded
    if cache_utils is None:
        return
    for value in (*args, *kwargs.values()):
        if isinstance(value, cache_utils.Cache):
            raise RuntimeError(  # noqa: TRY004  (a cache in training, not a wrong argument type)
                f"`{type(module).__name__}` received a key/value cache (`{type(value).__name__}`) while training "
                "under ActivationCheckpointing: recomputing the block in backward would update the cache a second "
                "time. Turn caching off for training (`model.config.use_cache = False`, or pass `use_cache=False`)."
            )


class RecomputeBuffers:
    """A checkpointed call's buffers: copied before its forward, handed (copied again) to each recompute.

    A block that updates buffers in forward (``BatchNorm``'s running statistics and ``num_batches_tracked``, a
    module's own counters) would update them a second time in its recompute, and recompute on the updated values
    (other gradients). Each recompute runs on fresh copies of the buffers the forward found; the tensors the forward
    left are put back after it (the same objects: references held elsewhere, such as DDP's, stay valid).

    NOTE: BatchNorm's kernel writes its statistics without bumping their version counter, so whether a forward
    changed a buffer cannot be told cheaply: every buffer of the block is copied, the copies held until its
    backward. Blocks without buffers (Hugging Face transformer blocks) cost nothing.
    """

    __slots__ = ("_before", "_left", "module")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._before: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._left: list[list[tuple[nn.Module, str, Any]]] = []

    def snapshot(self) -> None:
        with torch.no_grad():
            self._before = [(owner, name, buf.clone()) for owner in self.module.modules()
                            for name, buf in owner.named_buffers(recurse=False)]

    def swap_in(self) -> None:
        self._left.append([(owner, name, getattr(owner, name)) for owner, name, _ in self._before])
        with torch.no_grad():
            for owner, name, before in self._before:
                setattr(owner, name, before.clone())

    def swap_out(self) -> None:
        for owner, name, value in self._left.pop():
            setattr(owner, name, value)


class _Around:
    """A reusable context manager (a recompute runs once per backward): ``enter()``, then ``inner``; on the way out
    ``inner``, then ``leave()``."""

    __slots__ = ("enter", "inner", "leave")

    def __init__(self, enter: Callable[[], None], leave: Callable[[], None], inner: Any) -> None:
        self.enter, self.leave, self.inner = enter, leave, inner

    def __enter__(self) -> None:
        self.enter()
        try:
            self.inner.__enter__()
        except BaseException:
            self.leave()
            raise

    def __exit__(self, *exc: object) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.leave()


def checkpoint_contexts(buffers: RecomputeBuffers, inner: Callable[[], tuple[Any, Any]] | None) -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn``: the buffers' forward and recompute contexts around ``inner``'s
    (selective checkpointing's), the forward's saves checked for in-place changes (``CheckedSaves``).

    NOTE: the buffer copies are made outside ``inner``'s contexts (selective checkpointing's dispatch modes), so they
    are not operations of the block that those modes would count or cache.
    """
    forward, recompute = inner() if inner is not None else (None, contextlib.nullcontext())
    return (_Around(buffers.snapshot, lambda: None, CheckedSaves("ActivationCheckpointing", forward)),
            _Around(buffers.swap_in, buffers.swap_out, recompute))


class BlockCheckpoint(CheckpointHooks):
    """The hooks of a module checkpointed on its own (picklable and deep-copyable with it, as its hooks are).

    ``context_fn``: ``torch.utils.checkpoint``'s (selective checkpointing), or None.
    """

    def __init__(self, info: CheckpointInfo, context_fn: Callable[[], tuple[Any, Any]] | None = None) -> None:
        self.info, self.context_fn = info, context_fn
        self._open: list[Any] = []  # one entry per call in progress: its checkpoint, or None (no autograd)

    @override
    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():  # NOTE: validation, generation: the block runs once, as without the callback
            self._open.append(None)
            return
        refuse_kv_cache(module, args, kwargs)
        contexts = functools.partial(checkpoint_contexts, RecomputeBuffers(module), self.context_fn)
        # NOTE: the positional tensors are the checkpoint's saved inputs (ActivationOffload(boundaries_only=True)
        # moves them to the host); keyword arguments are held by reference, as `torch.utils.checkpoint` holds them
        region = torch_internals.checkpoint_region(module.forward, contexts, *args, **kwargs)
        next(region)
        self._open.append(region)

    @override
    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        region = self._open.pop() if self._open else None
        if region is not None:
            next(region, None)

    def __getstate__(self) -> dict[str, Any]:
        return {"info": self.info, "context_fn": self.context_fn, "_open": []}

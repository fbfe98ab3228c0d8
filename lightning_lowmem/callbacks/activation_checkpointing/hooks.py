"""Checkpointing a module through its forward hooks: the module tree, parameter names and ``state_dict`` keys unchanged.
The region is exactly ``module.forward`` (pre-hook last, forward hook first), so other techniques' hooks on the module
(ZeRO-3's gather, parameter streaming's fetch, FSDP2's unshard) run outside it, once.
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
    """How a module is checkpointed."""

    kind: Literal["block", "segment"]  # recomputed on its own, or with its segment's other blocks
    segment: int  # index of the segment (a block checkpointed on its own is a segment of one)
    position: int  # position inside its segment
    is_boundary: bool  # its inputs are kept for backward (the first block of each segment)
    selective: bool = False  # matmul outputs are kept too


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
        # NOTE: the last pre-hook and the first forward hook: the region is the forward alone, inside other hooks
        module.register_forward_pre_hook(self.pre, with_kwargs=True)
        module.register_forward_hook(self.post, prepend=True, always_call=True)
        return True


def _ours(hook: Any) -> CheckpointHooks | None:
    owner = getattr(hook, "__self__", None)
    return owner if isinstance(owner, CheckpointHooks) else None


def checkpoint_info(module: nn.Module) -> CheckpointInfo | None:
    """The :class:`CheckpointInfo` of a module checkpointed by ``ActivationCheckpointing``, else None."""
    owners = (_ours(hook) for hook in torch_internals.forward_pre_hooks(module).values())
    return next((owner.info for owner in owners if owner is not None), None)


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
    """A checkpointed call's buffers: copied before its forward, handed (copied again) to each recompute, so that a
    recompute neither updates ``BatchNorm`` statistics twice nor runs on updated values; the forward's tensors are put
    back after it (the same objects). NOTE: BatchNorm writes without bumping the version, so every buffer is copied.
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
    """``torch.utils.checkpoint``'s ``context_fn``: the buffers' contexts around ``inner``'s (selective checkpointing's
    dispatch modes, which then do not see the copies), the forward's saves checked for in-place changes."""
    forward, recompute = inner() if inner is not None else (None, contextlib.nullcontext())
    return (_Around(buffers.snapshot, lambda: None, CheckedSaves("ActivationCheckpointing", forward)),
            _Around(buffers.swap_in, buffers.swap_out, recompute))


class BlockCheckpoint(CheckpointHooks):
    """The hooks of a module checkpointed on its own (picklable, deep-copyable); ``context_fn``: selective's or None."""

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
        # NOTE: positional tensors are the saved inputs (ActivationOffload(boundaries_only=True)); kwargs by reference
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

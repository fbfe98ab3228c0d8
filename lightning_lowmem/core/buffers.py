"""Module buffers across a recompute: training ends with the buffers plain training gives.

A checkpointed block runs its forward twice: once in the forward pass, once in backward to recompute what it
saved. A forward that updates buffers (``BatchNorm``'s running statistics and ``num_batches_tracked``, a
module's own running scale or call count) would update them twice, and its recompute would read the values its
first run had already updated (a different computation, so wrong gradients). :class:`BufferGuard` holds, for one
checkpointed call, a copy of the block's buffers as the forward found them; every recompute runs on fresh copies
of those, and the block's own buffer tensors, as the forward left them, are put back after it (the same tensor
objects: references held elsewhere, such as DDP's buffer list, stay valid).

NOTE: BatchNorm's kernel writes its running statistics without bumping their version counter, so whether a
forward changed a buffer cannot be told cheaply; every buffer of the block is copied, and the copies live until
the block's backward. Blocks without buffers (Hugging Face transformer blocks) cost nothing.

A step run outside the loop (a probe, a trial step) puts every buffer back instead: ``core.kept_state``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_lowmem.core.saved_versions import CheckedSaves


def submodules(module: nn.Module) -> list[nn.Module]:
    """``module.modules()`` (each once, in the same order), by identity.

    NOTE: ``nn.Module.modules()`` keeps a set of the modules it met, which needs them hashable; a LightningModule
    whose class defines ``__eq__`` has no ``__hash__``, and a side step must still work on it.
    """
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(reversed([child for _, child in m.named_children()]))
    return out


def buffers_of(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(owner, name, tensor)`` of every buffer under ``module`` (each owner once; ``None`` buffers left out)."""
    return [(owner, name, buf) for owner in submodules(module) for name, buf in owner.named_buffers(recurse=False)]


class BufferGuard:
    """The buffers of one checkpointed call: copied before its forward, handed (copied again) to each recompute."""

    __slots__ = ("_before", "_swapped", "module")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._before: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._swapped: list[list[tuple[nn.Module, str, Any]]] = []

    def snapshot(self) -> None:
        """Before the forward: copy every buffer of the block."""
        with torch.no_grad():
            self._before = [(owner, name, buf.clone()) for owner, name, buf in buffers_of(self.module)]

    def swap_in(self) -> None:
        """Before a recompute: the block's buffers become fresh copies of those its forward found."""
        current = [(owner, name, getattr(owner, name, None)) for owner, name, _ in self._before]
        with torch.no_grad():
            for owner, name, before in self._before:
                setattr(owner, name, before.clone())
        self._swapped.append(current)

    def swap_out(self) -> None:
        """After a recompute: the buffer tensors the forward left, whatever the recompute did to its copies."""
        for owner, name, value in self._swapped.pop():
            setattr(owner, name, value)


class _Around:
    """A reusable context manager: ``enter()``, then ``inner``; on the way out ``inner``, then ``leave()``."""

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


def _nothing() -> None:
    return None


def checkpoint_contexts(guard: BufferGuard, inner: Callable[[], tuple[Any, Any]] | None) -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn``: the guard's forward and recompute contexts around ``inner``'s,
    the forward's saves checked for in-place changes (:class:`~lightning_lowmem.core.saved_versions.CheckedSaves`).

    NOTE: the guard's copies are made outside ``inner``'s contexts (selective checkpointing's dispatch modes),
    so they are not operations of the block that those modes would count or cache.
    """
    forward, recompute = inner() if inner is not None else (None, contextlib.nullcontext())
    # NOTE: the forward's saves keep autograd's in-place check, which checkpointing's hooks turn off (`CheckedSaves`)
    forward = CheckedSaves("ActivationCheckpointing", forward)
    return _Around(guard.snapshot, _nothing, forward), _Around(guard.swap_in, guard.swap_out, recompute)

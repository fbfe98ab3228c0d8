"""Checkpointing a *segment* of consecutive blocks as one unit, without changing the model's code.

``torch.utils.checkpoint`` needs one function that runs the whole region, but a model's ``forward`` calls
its blocks one by one (``for block in self.h: x = block(x, ...)``). Here each block of a segment gets forward hooks
(:class:`SegmentBlock`) that record its call; the first block opens the segment, the last one closes it.
While a segment is open, tensors that the blocks save for backward are replaced by empty holders (a
``saved_tensors_hooks`` pair); in backward, the first unpack replays the recorded block calls (the output
of block k feeding block k+1 as in forward, the RNG state of each call restored, autocast as in forward)
and fills every holder; each block replays on the buffers its forward found, and its buffers are left as the
forward left them (:class:`~.hooks.RecomputeBuffers`). Only each segment's input stays alive: the O(sqrt L) trade of
``policy="sqrt"``.

Tensors saved by the model's own code *between* two blocks of a segment are kept as usual (they are not
replayed), so any code between the blocks is allowed. A segment is closed early (still correct, less
saving) if blocks are called out of order, and in all cases when the module that owns the blocks returns or
raises. The replay calls each block's ``forward``, not its module hooks: segments must not span FSDP units.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import get_device_states, set_device_states

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.callbacks.activation_checkpointing.hooks import (
    CheckpointHooks,
    CheckpointInfo,
    RecomputeBuffers,
    checkpoint_info,
    refuse_kv_cache,
)
from lightning_lowmem.core.saved_versions import SavedVersion
from lightning_lowmem.core.tensors import tensors_in


class _Holder:
    __slots__ = ("__weakref__", "saved", "value")

    def __init__(self, saved: SavedVersion) -> None:
        self.value: torch.Tensor | None = None
        self.saved = saved  # NOTE: autograd's in-place check, which our hooks turn off (see `_SegmentRun._unpack`)


class _Ref:
    """Stands in a recorded call for the ``leaf``-th tensor output of recorded call ``call``."""

    __slots__ = ("call", "leaf")

    def __init__(self, call: int, leaf: int) -> None:
        self.call, self.leaf = call, leaf


def _map(value: Any, fn: Any) -> Any:
    """``fn`` applied to every tensor and reference in a nested call's arguments (Lightning's collection walk)."""
    return apply_to_collection(value, (torch.Tensor, _Ref), fn)


def _device_type(args: tuple) -> str:
    for t in tensors_in(args):
        if t.device.type != "cpu":
            return t.device.type
    return "cuda"


def _autocast_state(device_type: str) -> dict[str, dict[str, Any]]:
    out = {}
    for dt in {device_type, "cpu"}:
        if torch.amp.is_autocast_available(dt):
            out[dt] = {"enabled": torch.is_autocast_enabled(dt), "dtype": torch.get_autocast_dtype(dt)}
    return out


class _SegmentRun:
    """One forward pass through one segment, and its replay in backward."""

    def __init__(self, first_args: tuple) -> None:
        self.calls: list[tuple[nn.Module, tuple, dict, Any, RecomputeBuffers]] = []
        self.outputs: dict[int, tuple[weakref.ref, int, int]] = {}
        self.holders: list[weakref.ref] = []
        self.depth = 0
        self.replayed = False
        self.device_type = _device_type(first_args)
        self.autocast = _autocast_state(self.device_type)
        self.device_module = getattr(torch, self.device_type, None)
        self.hooks = saved_tensors_hooks(self._pack, self._unpack)

    # forward side
    def _pack(self, x: torch.Tensor) -> Any:
        if self.depth == 0:
            return SavedVersion(x, keep=True)  # NOTE: saved by the model's code between blocks: kept, not replayed
        holder = _Holder(SavedVersion(x))
        self.holders.append(weakref.ref(holder))
        return holder

    def record_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        def to_ref(t: Any) -> Any:
            hit = self.outputs.get(id(t)) if isinstance(t, torch.Tensor) else None
            if hit is not None and hit[0]() is t:
                return _Ref(hit[1], hit[2])  # NOTE: not kept alive: recomputed in the replay
            return t

        rng_cpu = torch.get_rng_state()
        rng_dev = get_device_states(*args) if torch_internals.device_module_initialized(self.device_module) else ([], [])
        buffers = RecomputeBuffers(module)  # NOTE: the replay runs each block on the buffers its forward found
        buffers.snapshot()
        self.calls.append((module, _map(args, to_ref), _map(kwargs, to_ref), (rng_cpu, rng_dev), buffers))

    def record_output(self, out: Any) -> None:
        index = len(self.calls) - 1
        for leaf, t in enumerate(tensors_in(out)):
            self.outputs[id(t)] = (weakref.ref(t), index, leaf)

    # backward side
    def _unpack(self, saved: Any) -> torch.Tensor:
        # NOTE: a tensor changed in place after it was saved: plain PyTorch raises here, and so do we (the replay
        # would hand back recomputed values instead)
        if isinstance(saved, SavedVersion):
            saved.check("ActivationCheckpointing(policy='sqrt')")
            return saved.counter
        saved.saved.check("ActivationCheckpointing(policy='sqrt')")
        if saved.value is None:
            if self.replayed:
                raise RuntimeError(
                    "A checkpointed segment was backpropagated through twice (or `retain_graph=True` was used). "
                    "ActivationCheckpointing(policy='sqrt') supports one backward per forward."
                )
            self._replay()
        value, saved.value = saved.value, None
        return value

    def _replay(self) -> None:
        count = 0
        holders = self.holders

        def pack(x: torch.Tensor) -> None:
            nonlocal count
            if count < len(holders):
                holder = holders[count]()
                if holder is not None:
                    holder.value = x.detach() if x.requires_grad else x
            count += 1

        def unpack(_: Any) -> torch.Tensor:
            raise RuntimeError("internal error: the replay graph of a checkpointed segment was backpropagated")

        results: list[list[torch.Tensor]] = []

        def from_ref(t: Any) -> Any:
            return results[t.call][t.leaf] if isinstance(t, _Ref) else t

        devices = self.calls[0][3][1][0] if self.calls else []
        with torch.random.fork_rng(devices=devices, device_type=self.device_type), torch.enable_grad():
            autocasts = [torch.amp.autocast(dt, **kw) for dt, kw in self.autocast.items()]
            for ctx in autocasts:
                ctx.__enter__()
            try:
                with saved_tensors_hooks(pack, unpack):
                    for module, args, kwargs, (rng_cpu, (dev_ids, dev_states)), buffers in self.calls:
                        torch.set_rng_state(rng_cpu)
                        if dev_ids:
                            set_device_states(dev_ids, dev_states, device_type=self.device_type)
                        buffers.swap_in()
                        try:
                            out = module.forward(*_map(args, from_ref), **_map(kwargs, from_ref))
                        finally:
                            buffers.swap_out()
                        results.append(list(tensors_in(out)))
            finally:
                for ctx in reversed(autocasts):
                    ctx.__exit__(None, None, None)
        self.replayed = True
        if count != len(holders):
            raise RuntimeError(
                f"Recomputing a checkpointed segment of {len(self.calls)} block(s) saved {count} tensors for backward; "
                f"the forward saved {len(holders)}. The blocks do not compute the same thing twice from the same "
                "inputs (global state changed between forward and backward?). Use a per-block policy ('all')."
            )


class Segment:
    """Consecutive blocks checkpointed as one unit; see the module docstring."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.run: _SegmentRun | None = None

    def open(self, args: tuple) -> _SegmentRun:
        self.close()
        self.run = _SegmentRun(args)
        self.run.hooks.__enter__()
        return self.run

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.hooks.__exit__(None, None, None)

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "run": None}


class SegmentBlock(CheckpointHooks):
    """The forward hooks of one block of a :class:`Segment` (picklable, deep-copyable with the module)."""

    def __init__(self, segment: Segment, info: CheckpointInfo) -> None:
        self.segment, self.info = segment, info
        self._recording: list[bool] = []  # one entry per call in progress: whether the segment records it

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        segment, position = self.segment, self.info.position
        run = segment.run
        if not torch.is_grad_enabled():
            run = None
        elif position == 0:
            refuse_kv_cache(module, args, kwargs)
            run = segment.open(args)
        elif run is None or len(run.calls) != position:
            segment.close()  # NOTE: out of order: what was recorded so far still replays correctly
            run = None
        else:
            refuse_kv_cache(module, args, kwargs)
        self._recording.append(run is not None)
        if run is not None:
            run.record_call(module, args, kwargs)
            run.depth += 1

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        run = self.segment.run
        if not (self._recording.pop() if self._recording else False) or run is None:
            return
        run.depth -= 1
        run.record_output(output)
        if self.info.position == self.segment.size - 1:
            self.segment.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"segment": self.segment, "info": self.info, "_recording": []}


def wrap_segment(modules: list[nn.Module], segment_index: int) -> tuple[Segment, bool]:
    """Checkpoint ``modules`` (consecutive blocks, in call order) as one segment.

    Returns the segment, and False when any of them is checkpointed already (then nothing is changed).
    """
    segment = Segment(len(modules))
    if any(checkpoint_info(m) is not None for m in modules):
        return segment, False
    for position, module in enumerate(modules):
        SegmentBlock(segment, CheckpointInfo("segment", segment_index, position, is_boundary=position == 0)).attach(module)
    return segment, True


class CloseSegments:
    """A forward hook for the module that owns the blocks: closes any segment its forward left open (picklable)."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        for segment in self.segments:
            segment.close()

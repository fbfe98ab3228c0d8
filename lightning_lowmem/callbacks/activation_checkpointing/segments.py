"""Checkpointing a *segment* of consecutive blocks as one unit (``policy="sqrt"``), without changing the model's code.
The first block's pre-hook opens the checkpoint, the last block's forward hook closes it, and the recompute replays
the recorded calls. NOTE: the replay calls ``forward``, not module hooks: segments must not span FSDP units.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import get_device_states, set_device_states
from typing_extensions import override

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.callbacks.activation_checkpointing.hooks import (
    CheckpointHooks,
    CheckpointInfo,
    RecomputeBuffers,
    checkpoint_info,
    refuse_kv_cache,
)
from lightning_lowmem.core.saved_versions import CheckedSaves, SavedVersion
from lightning_lowmem.core.tensors import tensors_in

_WHO = "ActivationCheckpointing(policy='sqrt')"


class _Ref:
    """Stands in a recorded call for the ``leaf``-th tensor output of recorded call ``call``."""

    __slots__ = ("call", "leaf")

    def __init__(self, call: int, leaf: int) -> None:
        self.call, self.leaf = call, leaf


class _Input:
    """Stands in the first call for its ``index``-th positional tensor: the segment's saved input."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _map(value: Any, fn: Any) -> Any:
    """``fn`` applied to every tensor and reference in a nested call's arguments (Lightning's collection walk)."""
    return apply_to_collection(value, (torch.Tensor, _Ref, _Input), fn)


def _kept(t: torch.Tensor) -> SavedVersion:
    return SavedVersion(t, keep=True)


def _checked(saved: SavedVersion) -> torch.Tensor:
    saved.check(_WHO)
    return saved.counter


class _SegmentRun:
    """One forward pass through one segment (a checkpoint region), and its replay in backward."""

    def __init__(self, args: tuple) -> None:
        self.calls: list[tuple[nn.Module, tuple, dict, Any, RecomputeBuffers]] = []
        self.outputs: dict[int, tuple[weakref.ref, int, int]] = {}
        self.inputs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.device_type = next((t.device.type for t in tensors_in(args) if t.device.type != "cpu"), "cuda")
        self.device_module = getattr(torch, self.device_type, None)
        # NOTE: between two blocks, the model's own saves go to a pair that keeps them (not to the checkpoint)
        self.between: saved_tensors_hooks | None = None
        self.region = torch_internals.checkpoint_region(
            self._replay, lambda: (CheckedSaves(_WHO), contextlib.nullcontext()), *(args[i] for i in self.inputs))
        next(self.region)

    def record_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.between is not None:
            self.between.__exit__(None, None, None)
            self.between = None

        def to_ref(t: Any) -> Any:
            hit = self.outputs.get(id(t)) if isinstance(t, torch.Tensor) else None
            if hit is not None and hit[0]() is t:
                return _Ref(hit[1], hit[2])  # NOTE: not kept alive: recomputed in the replay
            return t

        if not self.calls:  # NOTE: the first block's tensors are the checkpoint's saved inputs, not kept here
            args = tuple(_Input(i) if i in self.inputs else a for i, a in enumerate(args))
        rng_dev = get_device_states(*args) if torch_internals.device_module_initialized(self.device_module) else ([], [])
        buffers = RecomputeBuffers(module)  # NOTE: the replay runs each block on the buffers its forward found
        buffers.snapshot()
        self.calls.append((module, _map(args, to_ref), _map(kwargs, to_ref), (torch.get_rng_state(), rng_dev), buffers))

    def record_output(self, out: Any, last: bool) -> None:
        index = len(self.calls) - 1
        for leaf, t in enumerate(tensors_in(out)):
            self.outputs[id(t)] = (weakref.ref(t), index, leaf)
        if not last:
            self.between = saved_tensors_hooks(_kept, _checked)
            self.between.__enter__()

    def close(self) -> None:
        if self.between is not None:
            self.between.__exit__(None, None, None)
            self.between = None
        next(self.region, None)

    def _replay(self, *inputs: torch.Tensor) -> None:
        results: list[list[torch.Tensor]] = []

        def value(t: Any) -> Any:
            if isinstance(t, _Input):
                return inputs[self.inputs.index(t.index)]
            return results[t.call][t.leaf] if isinstance(t, _Ref) else t

        for module, args, kwargs, (rng_cpu, (dev_ids, dev_states)), buffers in self.calls:
            torch.set_rng_state(rng_cpu)
            if dev_ids:
                set_device_states(dev_ids, dev_states, device_type=self.device_type)
            buffers.swap_in()
            try:
                out = module.forward(*_map(args, value), **_map(kwargs, value))
            finally:
                buffers.swap_out()
            results.append(list(tensors_in(out)))


class Segment:
    """Consecutive blocks checkpointed as one unit; see the module docstring."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.run: _SegmentRun | None = None

    def open(self, args: tuple) -> _SegmentRun:
        self.close()
        self.run = _SegmentRun(args)
        return self.run

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "run": None}


class SegmentBlock(CheckpointHooks):
    """The forward hooks of one block of a :class:`Segment` (picklable, deep-copyable with the module)."""

    def __init__(self, segment: Segment, info: CheckpointInfo) -> None:
        self.segment, self.info = segment, info
        self._recording: list[bool] = []  # one entry per call in progress: whether the segment records it

    @override
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

    @override
    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        run = self.segment.run
        if not (self._recording.pop() if self._recording else False) or run is None:
            return
        last = self.info.position == self.segment.size - 1
        run.record_output(output, last)
        if last:
            self.segment.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"segment": self.segment, "info": self.info, "_recording": []}


def wrap_segment(modules: list[nn.Module], segment_index: int) -> tuple[Segment, bool]:
    """Checkpoint ``modules`` (consecutive blocks, in call order) as one segment; False: one is already (no change)."""
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

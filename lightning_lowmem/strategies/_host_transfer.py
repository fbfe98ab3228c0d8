"""The one seam between ``OffloadStrategy`` and the accelerator: gradient D2H and weight H2D copies.

:class:`HostTransfer` is the CPU path (the "device" is host memory: a copy is a tensor copy, done at
once). :class:`StreamTransfer` (CUDA, or the CPU stand-in of the tests) does the same through pinned staging buffers in the compute dtype on a
side stream, so gradients leave the GPU while backward continues and the weights go back at 2 B/param.
Both call the same ``sink(i, grad)`` with a host tensor, so the host-side maths is one code path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_lowmem._streams import CudaOps, StreamOps, cpu_ops
from lightning_lowmem.memory.categories import mark_host

Sink = Callable[[int, torch.Tensor], None]


class HostTransfer:
    """CPU path: gradients are folded into the host buffers as soon as they are ready."""

    pinned = False

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor]) -> None:
        self.device = device

    def staging(self) -> list[torch.Tensor]:
        return []

    def grad_to_host(self, i: int, grad: torch.Tensor, sink: Sink) -> None:
        sink(i, grad)

    def synchronize(self) -> None:
        """Wait until every gradient handed to :meth:`grad_to_host` has reached its sink."""

    @torch.no_grad()
    def weights_to_device(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Copy each ``(i, p_host, p_device)`` master into its compute weight (rounding to its dtype)."""
        for _, p_host, p_device in pairs:
            p_device.copy_(p_host)


class StreamTransfer(HostTransfer):
    """The CUDA path, on :class:`~lightning_lowmem._streams.StreamOps`: staging buffers (compute dtype), a side stream, events.

    On CUDA the ops are :class:`~lightning_lowmem._streams.CudaOps` (pinned staging); on the CPU the tests run this
    same class on :class:`~lightning_lowmem._streams.DeferredOps`, whose copies land only when the host must see them.
    """

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor], ops: StreamOps) -> None:
        super().__init__(device, params)
        self.ops = ops
        self.pinned = ops.pins
        self.stream = ops.side_stream()
        # NOTE: only these staging buffers are pinned (2 B/param in bf16): pinned memory is a scarce,
        # unswappable resource, and the fp32 masters / gradient buffers never cross PCIe.
        self._staging = [ops.empty_host(p.numel(), p.dtype).view(p.shape) for p in params]
        mark_host(*self._staging)
        self._pending: deque[tuple[Any, int, Sink]] = deque()
        self._h2d_done: Any = None

    def staging(self) -> list[torch.Tensor]:
        return self._staging

    def grad_to_host(self, i: int, grad: torch.Tensor, sink: Sink) -> None:
        ops = self.ops
        ops.wait_stream(self.stream, ops.compute_stream())  # the gradient was written on the compute stream
        ops.copy(self._staging[i], grad, self.stream)
        event = ops.record_event(self.stream)
        # NOTE: [grad lifetime] the caching allocator must not hand the gradient's block to another
        # tensor while the side stream still reads it; the caller drops its reference right after.
        ops.record_stream(grad, self.stream)
        self._pending.append((event, i, sink))
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        while self._pending and (block or self.ops.query(self._pending[0][0])):
            event, i, sink = self._pending.popleft()
            self.ops.synchronize(event)  # NOTE: sync point: the host waits for this one copy only
            sink(i, self._staging[i])

    def synchronize(self) -> None:
        self._drain(block=True)

    @torch.no_grad()
    def weights_to_device(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        ops = self.ops
        self.synchronize()
        if self._h2d_done is not None:
            ops.synchronize(self._h2d_done)  # the staging buffers are about to be rewritten on the host
        ops.wait_stream(self.stream, ops.compute_stream())  # backward may still read the weights
        for i, p_host, p_device in pairs:
            staging = self._staging[i]
            staging.copy_(p_host)  # fp32 -> compute dtype on the host (round to nearest even)
            ops.copy(p_device, staging, self.stream)  # overlaps the host cast of the next one
        self._h2d_done = ops.record_event(self.stream)
        ops.wait_stream(ops.compute_stream(), self.stream)


def transfer_for(device: torch.device, params: Sequence[torch.Tensor]) -> HostTransfer:
    if device.type == "cuda":
        return StreamTransfer(device, params, CudaOps(device))
    ops = cpu_ops()
    if ops is not None:
        return StreamTransfer(device, params, ops)
    return HostTransfer(device, params)

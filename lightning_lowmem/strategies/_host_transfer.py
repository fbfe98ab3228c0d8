"""The one seam between ``OffloadStrategy`` and the accelerator: gradient D2H and weight H2D copies.

:class:`HostTransfer` is the CPU path (the "device" is host memory: a copy is a tensor copy, done at
once). :class:`CudaTransfer` does the same through pinned staging buffers in the compute dtype on a
side stream, so gradients leave the GPU while backward continues and the weights go back at 2 B/param.
Both call the same ``sink(i, grad)`` with a host tensor, so the host-side maths is one code path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

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


class CudaTransfer(HostTransfer):
    """CUDA path: pinned staging buffers (compute dtype), a side stream, events per gradient."""

    pinned = True

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor]) -> None:
        super().__init__(device, params)
        self.stream = torch.cuda.Stream(device)
        # NOTE: only these staging buffers are pinned (2 B/param in bf16): pinned memory is a scarce,
        # unswappable resource, and the fp32 masters / gradient buffers never cross PCIe.
        self._staging = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]
        mark_host(*self._staging)
        self._pending: deque[tuple[torch.cuda.Event, int, Sink]] = deque()
        self._h2d_done: torch.cuda.Event | None = None

    def staging(self) -> list[torch.Tensor]:
        return self._staging

    def grad_to_host(self, i: int, grad: torch.Tensor, sink: Sink) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the gradient was written on the compute stream
        with torch.cuda.stream(self.stream):
            self._staging[i].copy_(grad, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # NOTE: [grad lifetime] the caching allocator must not hand the gradient's block to another
        # tensor while the side stream still reads it; the caller drops its reference right after.
        grad.record_stream(self.stream)
        self._pending.append((event, i, sink))
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        while self._pending and (block or self._pending[0][0].query()):
            event, i, sink = self._pending.popleft()
            event.synchronize()  # NOTE: sync point: the host waits for this one copy only
            sink(i, self._staging[i])

    def synchronize(self) -> None:
        self._drain(block=True)

    @torch.no_grad()
    def weights_to_device(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        self.synchronize()
        if self._h2d_done is not None:
            self._h2d_done.synchronize()  # the staging buffers are about to be rewritten on the host
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # backward may still read the weights
        with torch.cuda.stream(self.stream):
            for i, p_host, p_device in pairs:
                staging = self._staging[i]
                staging.copy_(p_host)  # fp32 -> compute dtype on the host (round to nearest even)
                p_device.copy_(staging, non_blocking=True)  # overlaps the host cast of the next one
            self._h2d_done = torch.cuda.Event()
            self._h2d_done.record(self.stream)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def transfer_for(device: torch.device, params: Sequence[torch.Tensor]) -> HostTransfer:
    if device.type == "cuda":
        return CudaTransfer(device, params)
    return HostTransfer(device, params)

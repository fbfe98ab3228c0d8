"""The copy seam of the offload engine: :class:`SyncCopier` (plain copies, the CPU path) and :class:`StreamCopier`
(a side stream and events: ``CudaOps`` on CUDA, ``DeferredOps`` in the CPU tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from lightning_lowmem.core.host_memory import HostMemoryError
from lightning_lowmem.core.streams import StreamOps
from lightning_lowmem.core.units import fmt_bytes


def host_buffer(allocate: Callable[[], torch.Tensor], nbytes: int, pinned: bool) -> torch.Tensor:
    """``allocate()``, with a failure reported as host RAM (:class:`HostMemoryError`): a failed ``cudaHostAlloc``
    raises "CUDA error: out of memory", which Lightning takes for device memory."""
    try:
        return allocate()
    except RuntimeError as err:
        kind = "page-locked (pinned) " if pinned else ""
        raise HostMemoryError(
            f"ActivationOffload: allocating a {fmt_bytes(nbytes)} {kind}host buffer for an offloaded activation "
            f"failed ({err}). This is host RAM, not device memory. Raise `min_bytes`, use `boundaries_only=True` with "
            "ActivationCheckpointing, lower the batch size" + (", or pass `pin_memory=False`." if pinned else ".")
        ) from err


class SyncCopier:
    """Plain synchronous copies (the CPU path). ``events`` are ``None``: a copy is complete when it returns."""

    pin_memory = False

    def empty_host(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    def to_host(self, src_bytes: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A new host buffer (:func:`host_buffer`) holding ``src_bytes``, and the copy's completion event."""
        n = src_bytes.numel()
        host = host_buffer(lambda: self.empty_host(n), n, self.pin_memory)
        return host, self.to_host_into(src_bytes, host)

    def to_host_into(self, src_bytes: torch.Tensor, host: torch.Tensor) -> Any:
        """Copy ``src_bytes`` into ``host`` (a slice of an existing host copy); returns the completion event."""
        host.copy_(src_bytes)
        return None

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        return host.to(device, copy=True), None

    def done(self, event: Any) -> bool:
        return event is None

    def compute_waits(self, event: Any, tensor: torch.Tensor | None = None) -> None:
        """Order the compute stream after ``event``; ``tensor`` is about to be handed to compute."""


class StreamCopier(SyncCopier):
    """Copies on a side stream, into host buffers (pinned where the ops pin), synchronised with events (``ops``:
    ``CudaOps`` on CUDA, ``DeferredOps`` in the CPU tests)."""

    def __init__(self, device: torch.device, ops: StreamOps) -> None:
        self.device = device
        self.ops = ops
        self.pin_memory = ops.pins
        self.side = ops.side_stream()

    @override
    def empty_host(self, n: int) -> torch.Tensor:
        return self.ops.empty_host(n, torch.uint8)

    @override
    def to_host_into(self, src_bytes: torch.Tensor, host: torch.Tensor) -> Any:
        ops = self.ops
        # NOTE: the source was written on the compute stream: the side stream waits for it (read-before-write race)
        ops.wait_stream(self.side, ops.compute_stream())
        ops.copy(host, src_bytes, self.side)
        return ops.record_event(self.side)

    @override
    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        # NOTE: all on the side stream, so no wait on compute here; the consumer waits on the event
        restored = self.ops.to_device(host, device, self.side)
        return restored, self.ops.record_event(self.side)

    @override
    def done(self, event: Any) -> bool:
        return event is None or self.ops.query(event)

    @override
    def compute_waits(self, event: Any, tensor: torch.Tensor | None = None) -> None:
        ops = self.ops
        compute = ops.compute_stream()
        if event is not None:
            # NOTE: a GPU-side wait, not a host sync: compute kernels queued from now on start after the copy.
            ops.wait_event(compute, event)
        if tensor is not None:
            # NOTE: allocated on the side stream: ``record_stream`` keeps its block from reuse while compute reads it
            ops.record_stream(tensor, compute)


__all__ = ["StreamCopier", "SyncCopier"]

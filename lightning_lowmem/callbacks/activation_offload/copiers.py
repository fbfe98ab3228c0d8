"""The copy seam of the saved-tensor offload engine (``callbacks.activation_offload.engine``): where the bytes actually move.

:class:`SyncCopier` makes plain synchronous copies (the CPU path, fully tested); :class:`StreamCopier` copies on a
side stream into host buffers (pinned where the ops pin), synchronised with events: on CUDA through
:class:`~lightning_lowmem.core.streams.CudaOps`, in the CPU tests through :class:`~lightning_lowmem.core.streams.DeferredOps`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from lightning_lowmem.core.host_memory import HostMemoryError
from lightning_lowmem.core.streams import StreamOps
from lightning_lowmem.core.units import fmt_bytes


def host_buffer(allocate: Callable[[], torch.Tensor], nbytes: int, pinned: bool) -> torch.Tensor:
    """``allocate()``, with a failure reported as host RAM (:class:`HostMemoryError`), not as a device OOM.

    NOTE: a failed ``cudaHostAlloc`` raises "CUDA error: out of memory", which Lightning's ``is_oom_error`` (and so
    a batch splitter) takes for device memory; a smaller batch would not cure it.
    """
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
    """Copies on a side stream, into host buffers (pinned where the ops pin), synchronised with events.

    ``ops``: :class:`~lightning_lowmem.core.streams.CudaOps` on CUDA; the CPU tests run this same class on
    :class:`~lightning_lowmem.core.streams.DeferredOps`, whose copies land only when the host or compute must see them.
    """

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
        # NOTE: the source was written by kernels queued on the compute stream; without this wait the side
        # stream could copy it before they ran (a read-before-write race).
        ops.wait_stream(self.side, ops.compute_stream())
        ops.copy(host, src_bytes, self.side)
        return ops.record_event(self.side)

    @override
    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        # NOTE: the destination is allocated from the side stream's pool and the host buffer was written on the
        # side stream, so no wait on the compute stream is needed here; the consumer waits on the event.
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
            # NOTE: ``tensor`` was allocated on the side stream; when we and autograd drop it, the allocator
            # could hand its block to the next side-stream copy while compute kernels still read it.
            # ``record_stream`` defers that reuse until the compute work queued so far has finished.
            ops.record_stream(tensor, compute)


__all__ = ["StreamCopier", "SyncCopier"]

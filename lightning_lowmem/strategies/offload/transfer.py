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
from typing_extensions import override

from lightning_lowmem.core.accounting import mark_host
from lightning_lowmem.core.host_memory import pinned_bytes
from lightning_lowmem.core.streams import CudaOps, StreamOps, cpu_ops

Sink = Callable[[int, torch.Tensor], None]


class HostTransfer:
    """CPU path: gradients are folded into the host buffers as soon as they are ready."""

    pinned = False

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor]) -> None:
        self.device = device

    def staging_bytes(self) -> int:
        return 0

    def grad_to_host(self, i: int, grad: torch.Tensor, sink: Sink) -> None:
        sink(i, grad)

    def synchronize(self) -> None:
        """Wait until every gradient handed to :meth:`grad_to_host` has reached its sink."""

    @torch.no_grad()
    def weights_to_device(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Copy each ``(i, p_host, p_device)`` master into its compute weight (rounding to its dtype)."""
        for _, p_host, p_device in pairs:
            p_device.copy_(p_host)


# NOTE: [staging buckets] one flat pinned buffer per bucket, allocated once: torch's pinned caching allocator rounds
# every request up to a power of two, so per-parameter buffers could take up to 2x their bytes; buckets of a
# power-of-two capacity, filled first-fit, lose only what the last slots leave free.
BUCKET_BYTES = 64 * 2**20
_ALIGN_BYTES = 512  # each slot starts on a 512 B boundary (DMA-friendly)


def staging_layout(nbytes: Sequence[int], bucket_bytes: int = BUCKET_BYTES) -> tuple[list[int], list[tuple[int, int]]]:
    """Bucket sizes in bytes, and ``(bucket, byte offset)`` of each slot: first fit, in order.

    A bucket holds up to ``bucket_bytes``, or the power of two above the slot that opened it when that is more:
    a parameter larger than a bucket is rounded up by the pinned allocator anyway, and later slots fill that tail.
    """
    sizes: list[int] = []
    caps: list[int] = []
    slots: list[tuple[int, int]] = []
    for n in nbytes:
        for b, used in enumerate(sizes):
            start = -(-used // _ALIGN_BYTES) * _ALIGN_BYTES
            if start + n <= caps[b]:
                break
        else:
            b, start = len(sizes), 0
            sizes.append(0)
            caps.append(max(bucket_bytes, pinned_bytes(n)))
        slots.append((b, start))
        sizes[b] = max(sizes[b], start + n)
    return sizes, slots


def _by_dtype(specs: Sequence[tuple[int, torch.dtype]]) -> dict[torch.dtype, list[int]]:
    """Indices of ``(numel, dtype)`` specs grouped by dtype (one set of buckets per dtype), in order of appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype) in enumerate(specs):
        groups.setdefault(dtype, []).append(i)
    return groups


def _bucket_sizes(specs: Sequence[tuple[int, torch.dtype]]) -> list[tuple[list[int], list[tuple[int, int]], list[int]]]:
    out = []
    for dtype, idx in _by_dtype(specs).items():
        size = torch.empty((), dtype=dtype).element_size()
        sizes, slots = staging_layout([specs[i][0] * size for i in idx])
        out.append((sizes, slots, idx))
    return out


def planned_staging_bytes(device: torch.device, specs: Sequence[tuple[int, torch.dtype]]) -> int:
    """Host bytes the transfer for ``device`` allocates for parameters ``(numel, compute dtype)``.

    :class:`StreamTransfer`: its staging buckets, as the (pinned) allocator reserves them; :class:`HostTransfer`: none of
    its own, the compute weights themselves are in host RAM (counted here).
    """
    ops = CudaOps(device) if device.type == "cuda" else cpu_ops()
    if ops is None:
        return sum(n * torch.empty((), dtype=d).element_size() for n, d in specs)
    return sum(ops.host_bytes(n) for sizes, _, _ in _bucket_sizes(specs) for n in sizes)


def pinned_staging_bytes(specs: Sequence[tuple[int, torch.dtype]]) -> int:
    """Pinned host bytes the CUDA transfer's staging buckets take for parameters ``(numel, compute dtype)``
    (the dry run's CUDA correction: no GPU needed)."""
    return sum(pinned_bytes(n, cuda=True) for sizes, _, _ in _bucket_sizes(specs) for n in sizes)


class StreamTransfer(HostTransfer):
    """The CUDA path, on :class:`~lightning_lowmem.core.streams.StreamOps`: staging in the compute dtype, a side stream, events.

    On CUDA the ops are :class:`~lightning_lowmem.core.streams.CudaOps` (pinned staging); on the CPU the tests run this
    same class on :class:`~lightning_lowmem.core.streams.DeferredOps`, whose copies land only when the host must see them.

    The gradient hook only queues the copy (no host work on the autograd thread); the host hands the gradients to
    their sink in :meth:`synchronize`, in the order they were queued, so the sums are those of the plain CPU path bit
    for bit.
    """

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor], ops: StreamOps) -> None:
        super().__init__(device, params)
        self.ops = ops
        self.pinned = ops.pins
        self.stream = ops.side_stream()
        # NOTE: only these staging buffers are pinned (one slot per parameter in its compute dtype): pinned memory is a
        # scarce, unswappable resource, and the fp32 masters / gradient buffers never cross PCIe. See [staging buckets].
        self._buckets: list[torch.Tensor] = []
        self._staging: list[torch.Tensor | None] = [None] * len(params)
        for sizes, slots, idx in _bucket_sizes([(p.numel(), p.dtype) for p in params]):
            buckets = [ops.empty_host(n, torch.uint8) for n in sizes]
            for i, (b, offset) in zip(idx, slots):
                p = params[i]
                self._staging[i] = buckets[b][offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            self._buckets += buckets
        mark_host(*self._buckets)
        self._pending: deque[tuple[Any, int, Sink]] = deque()
        self._unread: set[int] = set()  # slots a queued copy writes that the host has not read yet
        self._h2d_done: Any = None

    @override
    def staging_bytes(self) -> int:
        """Host RAM of the staging buffers, as the (pinned) allocator reserves it."""
        return sum(self.ops.host_bytes(b.numel()) for b in self._buckets)

    @override
    def grad_to_host(self, i: int, grad: torch.Tensor, sink: Sink) -> None:
        ops = self.ops
        if i in self._unread:
            # NOTE: [staging reuse] the hook fired twice in one backward (a weight shared by two reentrant-checkpointed
            # blocks): the second copy would overwrite the slot before the host read the first (one contribution lost,
            # the other doubled). Hand over everything queued up to the first one now (queue order is kept).
            self._drain(until=i)
        ops.wait_stream(self.stream, ops.compute_stream())  # the gradient was written on the compute stream
        ops.copy(self._staging[i], grad, self.stream)  # type: ignore[arg-type]
        event = ops.record_event(self.stream)
        # NOTE: [grad lifetime] the caching allocator must not hand the gradient's block to another
        # tensor while the side stream still reads it; the caller drops its reference right after.
        ops.record_stream(grad, self.stream)
        self._pending.append((event, i, sink))
        self._unread.add(i)
        # NOTE: [host work] no fold here: the hook runs on the autograd thread, and host work there stalls the
        # queueing of the next kernels (the GPU starves once its queue empties). `synchronize` hands them over.

    def _drain(self, until: int | None = None) -> None:
        while self._pending:
            event, i, sink = self._pending.popleft()
            self.ops.synchronize(event)  # NOTE: sync point: the host waits for this one copy only
            sink(i, self._staging[i])  # type: ignore[arg-type]
            self._unread.discard(i)
            if i == until:
                return

    @override
    def synchronize(self) -> None:
        self._drain()

    @torch.no_grad()
    @override
    def weights_to_device(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        ops = self.ops
        self.synchronize()
        if self._h2d_done is not None:
            ops.synchronize(self._h2d_done)  # the staging buffers are about to be rewritten on the host
        ops.wait_stream(self.stream, ops.compute_stream())  # backward may still read the weights
        for i, p_host, p_device in pairs:
            staging = self._staging[i]
            assert staging is not None
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

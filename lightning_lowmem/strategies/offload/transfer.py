"""The one seam between ``OffloadStrategy`` and the accelerator: gradient D2H and weight H2D copies.

:class:`HostTransfer` is the CPU path (a copy is a tensor copy, done at once); :class:`StreamTransfer` (CUDA, or the
tests' CPU stand-in) copies through pinned staging in the compute dtype on a side stream. Both feed ``sink(i, grad)``.
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


# NOTE: [staging buckets] torch's pinned allocator rounds every request up to a power of two (per-parameter buffers
# could take 2x their bytes): flat power-of-two buckets, filled first-fit, lose only what their last slots leave.
BUCKET_BYTES = 64 * 2**20
_ALIGN_BYTES = 512  # each slot starts on a 512 B boundary (DMA-friendly)


def staging_layout(nbytes: Sequence[int], bucket_bytes: int = BUCKET_BYTES) -> tuple[list[int], list[tuple[int, int]]]:
    """Bucket sizes in bytes, and ``(bucket, byte offset)`` of each slot: first fit, in order. A bucket holds up to
    ``bucket_bytes``, or the power of two above a larger slot that opened it (later slots fill that rounding)."""
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


def _bucket_sizes(specs: Sequence[tuple[int, torch.dtype]]) -> list[tuple[list[int], list[tuple[int, int]], list[int]]]:
    """:func:`staging_layout` of ``(numel, dtype)`` specs, one set of buckets per dtype, with the specs' indices."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype) in enumerate(specs):
        groups.setdefault(dtype, []).append(i)
    out = []
    for dtype, idx in groups.items():
        size = torch.empty((), dtype=dtype).element_size()
        sizes, slots = staging_layout([specs[i][0] * size for i in idx])
        out.append((sizes, slots, idx))
    return out


def staged_views(params: Sequence[torch.Tensor], ops: StreamOps) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Flat host buckets from ``ops``, and one view into them per tensor of ``params`` (its shape and dtype)."""
    all_buckets: list[torch.Tensor] = []
    views: list[Any] = [None] * len(params)
    for sizes, slots, idx in _bucket_sizes([(p.numel(), p.dtype) for p in params]):
        buckets = [ops.empty_host(n, torch.uint8) for n in sizes]
        for i, (b, offset) in zip(idx, slots):
            p = params[i]
            views[i] = buckets[b][offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        all_buckets += buckets
    return all_buckets, views


def planned_staging_bytes(device: torch.device, specs: Sequence[tuple[int, torch.dtype]], ring: bool = False) -> int:
    """Host bytes the transfer for ``device`` allocates for parameters ``(numel, compute dtype)``: the staging
    buckets or ``ring`` (:class:`StreamTransfer`), or the compute weights themselves (:class:`HostTransfer`)."""
    ops = CudaOps(device) if device.type == "cuda" else cpu_ops()
    if ops is None:
        return sum(n * torch.empty((), dtype=d).element_size() for n, d in specs)
    if ring:
        return ops.host_bytes(ring_bytes(specs))
    return sum(ops.host_bytes(n) for sizes, _, _ in _bucket_sizes(specs) for n in sizes)


def pinned_staging_bytes(specs: Sequence[tuple[int, torch.dtype]], ring: bool = False) -> int:
    """Pinned host bytes the CUDA transfer's staging buckets (or ``ring``) take for parameters ``(numel, compute
    dtype)`` (the dry run's CUDA correction: no GPU needed)."""
    if ring:
        return pinned_bytes(ring_bytes(specs), cuda=True)
    return sum(pinned_bytes(n, cuda=True) for sizes, _, _ in _bucket_sizes(specs) for n in sizes)


def ring_bytes(params: Sequence[tuple[int, torch.dtype]]) -> int:
    """Bytes of a staging ring for parameters ``(numel, compute dtype)``: two of the largest."""
    largest = max((n * torch.empty((), dtype=d).element_size() for n, d in params), default=0)
    return max(_ALIGN_BYTES, 2 * (-(-largest // _ALIGN_BYTES) * _ALIGN_BYTES))


class StreamTransfer(HostTransfer):
    """The CUDA path, on :class:`~lightning_lowmem.core.streams.StreamOps`: staging in the compute dtype, a side stream, events.

    The gradient hook only queues the copy; :meth:`synchronize` hands the gradients to their sink in queue order, so
    the sums are the CPU path's bit for bit. The tests run it on the CPU on ``DeferredOps``.

    Staging: a slot per parameter (every gradient of a backward can be in flight: 2 B/param pinned in bf16), or with
    ``ring`` bytes one pinned ring the copies take turns in (``optimizer_in_backward``'s): when the ring is full, the
    hook hands the oldest gradients to their sink first, so each master steps while backward goes on (host work on the
    autograd thread: the GPU runs ahead by the ring's bytes).
    """

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor], ops: StreamOps,
                 ring: int | None = None) -> None:
        super().__init__(device, params)
        self.ops = ops
        self.stream = ops.side_stream()
        # NOTE: only these staging buffers are pinned (the fp32 masters never cross PCIe). See [staging buckets].
        self._ring = ring is not None
        if ring is None:
            self._buckets, self._staging = staged_views(params, ops)
        else:
            self._buckets, self._staging = [ops.empty_host(ring, torch.uint8)], []
        mark_host(*self._buckets)
        # (event, parameter, sink or None for an upload, staging, ring offset, bytes) of each copy in flight, in order
        self._pending: deque[tuple[Any, int, Sink | None, torch.Tensor, int, int]] = deque()
        self._head = 0  # the ring offset after the last slot taken
        self._unread: set[int] = set()  # slots a queued copy writes that the host has not read yet
        self._h2d_done: Any = None

    @override
    def staging_bytes(self) -> int:
        """Host RAM of the staging buffers, as the (pinned) allocator reserves it."""
        return sum(self.ops.host_bytes(b.numel()) for b in self._buckets)

    def _slot(self, i: int, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Staging for a copy of ``like`` (parameter ``i``'s), its ring offset and bytes. With the ring, the oldest
        copies in flight are handed over (or waited for) until the slot is free."""
        if not self._ring:
            return self._staging[i], 0, 0
        ring = self._buckets[0]
        n = like.numel() * like.element_size()
        start = -(-self._head // _ALIGN_BYTES) * _ALIGN_BYTES if self._pending else 0
        start = 0 if start + n > ring.numel() else start
        while self._pending and any(o < start + n and start < o + m for *_, o, m in self._pending):
            self._hand_over(*self._pending.popleft())
            start = start if self._pending else 0
        self._head = start + n
        return ring[start : start + n].view(like.dtype).view(like.shape), start, n

    def _hand_over(self, event: Any, i: int, sink: Sink | None, staging: torch.Tensor, *_: int) -> None:
        """Wait for one copy in flight; hand a gradient to its sink."""
        self.ops.synchronize(event)  # NOTE: sync point: the host waits for this one copy only
        if sink is not None:
            sink(i, staging)
            self._unread.discard(i)

    @override
    def grad_to_host(self, i: int, grad: torch.Tensor, sink: Sink) -> None:
        ops = self.ops
        if i in self._unread:
            # NOTE: [staging reuse] the hook fired twice in one backward (a weight shared by two reentrant-checkpointed
            # blocks): hand over everything queued up to the first copy before its slot is overwritten.
            self.synchronize(until=i)
        staging, offset, nbytes = self._slot(i, grad)
        ops.wait_stream(self.stream, ops.compute_stream())  # the gradient was written on the compute stream
        ops.copy(staging, grad, self.stream)
        event = ops.record_event(self.stream)
        # NOTE: [grad lifetime] not reused by the allocator while the side stream reads it (the caller drops it)
        ops.record_stream(grad, self.stream)
        self._pending.append((event, i, sink, staging, offset, nbytes))
        self._unread.add(i)
        # NOTE: [host work] no sink here: host work on the autograd thread starves the GPU's queue (with the ring,
        # only once it is full: the step in backward's host work then overlaps what the GPU still has queued)

    @override
    def synchronize(self, until: int | None = None) -> None:
        while self._pending:
            entry = self._pending.popleft()
            self._hand_over(*entry)
            if entry[1] == until and entry[2] is not None:
                return

    @torch.no_grad()
    @override
    def weights_to_device(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        ops = self.ops
        self.synchronize()
        if self._h2d_done is not None:
            ops.synchronize(self._h2d_done)  # the staging buffers are about to be rewritten on the host
        ops.wait_stream(self.stream, ops.compute_stream())  # backward may still read the weights
        for i, p_host, p_device in pairs:
            staging, offset, nbytes = self._slot(i, p_device)
            staging.copy_(p_host)  # fp32 -> compute dtype on the host (round to nearest even)
            ops.copy(p_device, staging, self.stream)  # overlaps the host cast of the next one
            if nbytes:  # NOTE: a ring slot is taken again only after its copy landed
                self._pending.append((ops.record_event(self.stream), i, None, staging, offset, nbytes))
        self._h2d_done = ops.record_event(self.stream)
        ops.wait_stream(ops.compute_stream(), self.stream)


def transfer_for(device: torch.device, params: Sequence[torch.Tensor], ring: bool = False) -> HostTransfer:
    """The transfer for ``device``; ``ring``: stage through one ring (:func:`ring_bytes`), not a slot per parameter."""
    ops = CudaOps(device) if device.type == "cuda" else cpu_ops()
    if ops is None:
        return HostTransfer(device, params)
    return StreamTransfer(device, params, ops, ring_bytes([(p.numel(), p.dtype) for p in params]) if ring else None)

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

    def staging(self) -> list[torch.Tensor]:
        return []

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

    def upload(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]], compute: Any = None) -> None:
        """:meth:`weights_to_device` from the host pass's worker during backward (see [upload in backward] in
        ``host_pass_uploads.py``); ``compute``: the stream backward runs on (the copies wait for its work so far)."""
        self.weights_to_device(pairs)


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


def planned_staging_bytes(device: torch.device, specs: Sequence[tuple[int, torch.dtype]], landing: bool = False) -> int:
    """Host bytes the transfer for ``device`` allocates for parameters ``(numel, compute dtype)``.

    :class:`StreamTransfer`: its staging buckets, as the (pinned) allocator reserves them, twice with ``landing`` (its
    landing slots: ``host_pass="delayed"``); :class:`HostTransfer`: none of its own, the compute weights themselves are
    in host RAM (counted here).
    """
    ops = CudaOps(device) if device.type == "cuda" else cpu_ops()
    if ops is None:
        return sum(n * torch.empty((), dtype=d).element_size() for n, d in specs)
    return (2 if landing else 1) * sum(ops.host_bytes(n) for sizes, _, _ in _bucket_sizes(specs) for n in sizes)


def pinned_staging_bytes(specs: Sequence[tuple[int, torch.dtype]]) -> int:
    """Pinned host bytes the CUDA transfer's staging buckets take for parameters ``(numel, compute dtype)``
    (the dry run's CUDA correction: no GPU needed)."""
    return sum(pinned_bytes(n, cuda=True) for sizes, _, _ in _bucket_sizes(specs) for n in sizes)


class StreamTransfer(HostTransfer):
    """The CUDA path, on :class:`~lightning_lowmem.core.streams.StreamOps`: staging in the compute dtype, a side stream, events.

    On CUDA the ops are :class:`~lightning_lowmem.core.streams.CudaOps` (pinned staging); on the CPU the tests run this
    same class on :class:`~lightning_lowmem.core.streams.DeferredOps`, whose copies land only when the host must see them.

    The gradient hook only queues the copy (no host work on the autograd thread); the host folds the gradients
    in :meth:`synchronize`, in the order they were queued, so the sums are those of the plain CPU path bit for bit.
    """

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor], ops: StreamOps) -> None:
        super().__init__(device, params)
        self.ops = ops
        self.pinned = ops.pins
        self.stream = ops.side_stream()
        # NOTE: only these staging buffers are pinned (2 B/param in bf16): pinned memory is a scarce,
        # unswappable resource, and the fp32 masters / gradient buffers never cross PCIe. See [staging buckets].
        self._params = params
        self._buckets: list[torch.Tensor] = []
        self._staging = self._slots()
        self._pending: deque[tuple[Any, int, Sink]] = deque()
        self._unread: set[int] = set()  # slots a queued copy writes that the host has not read yet
        self._h2d_done: Any = None
        self._staged: set[int] = set()  # slots that hold their master rounded already (see `stage_weights`)
        # NOTE: set by the overlapped host pass (strategies/offload/host_pass.py) while it is armed: `eager` hands the
        # gradients whose copy has landed to the sink during backward; `barrier` waits until the sink's worker has
        # read every slot handed to it (before a slot is rewritten)
        self.eager = False
        self.barrier: Callable[[], None] = lambda: None
        self._landing: list[torch.Tensor] | None = None  # host_pass="delayed": see `landing_slots`
        self._landing_staged: set[int] = set()
        self._landed: Any = None  # an event after the last copies from the landing slots

    def _slots(self) -> list[torch.Tensor]:
        """One slot per parameter in new pinned buckets (see [staging buckets])."""
        params = self._params
        staging: list[torch.Tensor | None] = [None] * len(params)
        for sizes, slots, idx in _bucket_sizes([(p.numel(), p.dtype) for p in params]):
            buckets = [self.ops.empty_host(n, torch.uint8) for n in sizes]
            for i, (b, offset) in zip(idx, slots):
                p = params[i]
                staging[i] = buckets[b][offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            self._buckets += buckets
            mark_host(*buckets)
        return staging  # type: ignore[return-value]

    @override
    def staging(self) -> list[torch.Tensor]:
        return self._staging

    def landing_slots(self) -> None:
        """``host_pass="delayed"``: a second set of slots (the staging's pinned bytes again) that the host worker rounds
        each stepped master into (:meth:`stage_landing`) while the next window's gradients are copied into the first;
        the landing then only queues their copies (:meth:`land`)."""
        if self._landing is None:
            self._landing = self._slots()

    @torch.no_grad()
    def stage_landing(self, pairs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Round each ``(i, p_host)`` master into its landing slot (the host worker, after its step).

        NOTE: first waits for the last landing's copies from these slots (they may still be in flight on the side
        stream: the worker steps during the next window)."""
        assert self._landing is not None
        if self._landed is not None:
            self.ops.synchronize(self._landed)
        for i, p_host in pairs:
            self._landing[i].copy_(p_host)  # fp32 -> compute dtype on the host (round to nearest even)
            self._landing_staged.add(i)

    @torch.no_grad()
    def land(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> frozenset[int]:
        """Queue the copy of each landing slot :meth:`stage_landing` filled into its compute weight (after the compute
        stream's work so far: backward may still read the weights); return the indices of those copied."""
        staged, self._landing_staged = self._landing_staged, set()
        ops = self.ops
        ops.wait_stream(self.stream, ops.compute_stream())
        for i, _, p_device in pairs:
            if i in staged:
                ops.copy(p_device, self._landing[i], self.stream)  # type: ignore[index]
        self._landed = ops.record_event(self.stream)
        ops.wait_stream(ops.compute_stream(), self.stream)
        return frozenset(i for i, _, _ in pairs if i in staged)

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
            # the other doubled). Fold everything queued up to the first one now (queue order is kept).
            self._drain(until=i)
            self.barrier()
        self._staged.discard(i)
        ops.wait_stream(self.stream, ops.compute_stream())  # the gradient was written on the compute stream
        ops.copy(self._staging[i], grad, self.stream)
        event = ops.record_event(self.stream)
        # NOTE: [grad lifetime] the caching allocator must not hand the gradient's block to another
        # tensor while the side stream still reads it; the caller drops its reference right after.
        ops.record_stream(grad, self.stream)
        self._pending.append((event, i, sink))
        self._unread.add(i)
        # NOTE: [host work] no fold here: the hook runs on the autograd thread, and host work there stalls the
        # queueing of the next kernels (the GPU starves once its queue empties). `synchronize` folds.
        if self.eager:  # the sink only queues work for the host pass's worker: hand it what has landed already
            while self._pending and ops.query(self._pending[0][0]):
                _, j, j_sink = self._pending.popleft()
                j_sink(j, self._staging[j])  # NOTE: j stays in `_unread` until `synchronize`: the worker may read it

    def _drain(self, until: int | None = None) -> None:
        while self._pending:
            event, i, sink = self._pending.popleft()
            self.ops.synchronize(event)  # NOTE: sync point: the host waits for this one copy only
            sink(i, self._staging[i])
            self._unread.discard(i)
            if i == until:
                return

    @override
    def synchronize(self) -> None:
        self._drain()
        self._unread.clear()  # NOTE: slots handed on by `eager` too (the sink's worker is waited for before reuse)

    @torch.no_grad()
    def stage_weights(self, pairs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Round each ``(i, p_host)`` master into its staging slot now: :meth:`weights_to_device` then only queues its copy.

        Called by the overlapped host pass's worker as each bucket steps, during backward. NOTE: [staged weights] no wait
        for the last upload from these slots: the worker stages a slot only after it read a gradient copied into a slot
        on the same side stream in this window, queued after that upload (done, in stream order). A gradient copied into
        a staged slot later (a hook that fires twice) takes it back; so does :meth:`unstage` (the step was undone).
        """
        for i, p_host in pairs:
            self._staging[i].copy_(p_host)  # fp32 -> compute dtype on the host (round to nearest even)
            self._staged.add(i)

    def unstage(self, indices: Sequence[int] | None = None) -> None:
        """The staged masters ``indices`` (all) changed again (a speculative step undone, a write adopted): the upload
        rounds those slots itself."""
        if indices is None:
            self._staged.clear()
        else:
            self._staged.difference_update(indices)

    @torch.no_grad()
    @override
    def upload(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]], compute: Any = None) -> None:
        """Round each ``(i, p_host, p_device)`` into its slot (unless staged) and queue its copy now, on the side stream
        after ``compute``'s work so far: backward has queued every kernel that reads these weights (their gradients
        landed). Called from the host pass's worker: no wait for it (``barrier``), nor for the gradient copies.

        NOTE: [staged weights] holds for these slots too: each read a gradient queued after the last upload from it.
        """
        ops = self.ops
        self.stage_weights([(i, p_host) for i, p_host, _ in pairs if i not in self._staged])
        ops.wait_stream(self.stream, compute if compute is not None else ops.compute_stream())
        for i, _, p_device in pairs:
            ops.copy(p_device, self._staging[i], self.stream)

    @torch.no_grad()
    @override
    def weights_to_device(self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        ops = self.ops
        self.synchronize()
        self.barrier()
        if self._h2d_done is not None:
            ops.synchronize(self._h2d_done)  # the staging buffers are about to be rewritten on the host
        ops.wait_stream(self.stream, ops.compute_stream())  # backward may still read the weights
        for i, p_host, p_device in pairs:
            staging = self._staging[i]
            if i not in self._staged:
                staging.copy_(p_host)  # fp32 -> compute dtype on the host (round to nearest even)
            ops.copy(p_device, staging, self.stream)  # overlaps the host cast of the next one
        self._staged.clear()
        self._h2d_done = ops.record_event(self.stream)
        ops.wait_stream(ops.compute_stream(), self.stream)


def transfer_for(device: torch.device, params: Sequence[torch.Tensor]) -> HostTransfer:
    if device.type == "cuda":
        return StreamTransfer(device, params, CudaOps(device))
    ops = cpu_ops()
    if ops is not None:
        return StreamTransfer(device, params, ops)
    return HostTransfer(device, params)

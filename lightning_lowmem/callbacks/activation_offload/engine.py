"""The saved-tensor offload engine behind ``ActivationOffload``: the pack/unpack hooks, one host copy per
(storage, version), the backward's prefetch queue and the byte counts; the copies go through ``copiers``.
NOTE: views made without autograd's view tracking (``unsafe_chunk``, ``nn.GRU``'s gates) change a storage without a
version change, so a save that hits an existing copy has its bytes copied again unless dense saves cover them.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_lowmem._internals import frames
from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.callbacks.activation_offload.copiers import StreamCopier, SyncCopier
from lightning_lowmem.core.accounting import mark_host
from lightning_lowmem.core.host_memory import PinnedHostCache
from lightning_lowmem.core.saved_versions import SavedVersion

# NOTE: wrapper subclasses (DTensor, quantized tensors) stay in place; a dry run's fake tensors stand for plain ones
_PLAIN = (torch.Tensor, torch.nn.Parameter, torch_internals.FakeTensor)


@dataclass
class OffloadStats:
    """Counts of one training step (all micro-batches since the last optimizer step)."""

    bytes_offloaded: int = 0  # bytes copied to the host: one copy per distinct (storage, version)
    bytes_recopied: int = 0  # bytes copied again into an existing host copy (a region other saves do not cover)
    storages_offloaded: int = 0
    tensors_offloaded: int = 0  # saves answered with a host copy (views and repeats of a storage included)
    bytes_kept: int = 0  # bytes of saves left in place: under min_bytes, not a boundary, not on the device
    tensors_kept: int = 0
    boundary_saves: int = 0  # saves recognised as checkpoint block inputs
    bytes_restored: int = 0  # bytes copied back in backward (a storage restored twice counts twice)
    prefetched: int = 0  # restores issued before the tensor was asked for
    restore_misses: int = 0  # unpacks that found their storage not restored yet (compute waits for the copy)
    host_bytes_peak: int = 0  # most bytes of host copies alive at once
    host_bytes_reserved: int = 0  # host RAM the copies hold from the OS (pinned: rounded, cached, never returned)


class _StorageEntry:
    """One storage offloaded to the host, shared by every saved tensor that aliases it."""

    __slots__ = (
        "__weakref__", "covered", "device", "event", "handles", "host", "index", "nbytes", "owner", "pending", "restored",
    )  # fmt: skip

    def __init__(self, owner: SavedTensorOffloader, host: torch.Tensor, device: torch.device, index: int) -> None:
        self.owner = owner
        self.host = host
        self.nbytes = host.numel()
        self.device = device
        self.index = index  # position in the forward's pack order, for prefetching
        self.handles = 0  # saved-tensor handles packed on this storage
        self.pending = 0  # handles not yet unpacked in this backward
        self.restored: torch.Tensor | None = None  # uint8 copy of the storage on the compute device
        self.event: Any = None  # completion of the restore copy
        self.covered: list[tuple[int, int]] = []  # sorted, disjoint byte ranges of saves that fill their extent

    def covers(self, start: int, end: int) -> bool:
        """Whether bytes ``[start, end)`` lie within dense saves of this copy (saved elements do not change until
        backward; other bytes may, through an untracked alias)."""
        for lo, hi in self.covered:
            if lo <= start < hi:
                return end <= hi
        return start >= end

    def cover(self, start: int, end: int) -> None:
        """Add ``[start, end)`` to :attr:`covered` (merging touching or overlapping ranges)."""
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted([*self.covered, (start, end)]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.covered = merged

    def __del__(self) -> None:
        # NOTE: the host copy lives as long as a saved-tensor handle refers to it; the accounting follows
        owner = self.owner
        if owner is not None:
            owner._host_bytes_live -= self.nbytes
            owner._host_cache.give(self.nbytes)


class _Packed:
    """What autograd stores in place of an offloaded saved tensor: its storage entry, its view geometry, its version."""

    __slots__ = ("dtype", "entry", "offset", "saved", "size", "stride")

    def __init__(self, entry: _StorageEntry, t: torch.Tensor) -> None:
        self.entry, self.saved, self.dtype = entry, SavedVersion(t), t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _extent(t: torch.Tensor) -> tuple[int, int, bool]:
    """The byte range ``[start, end)`` of its storage that ``t`` spans, and whether its elements fill it exactly."""
    size = t.element_size()
    start = t.storage_offset() * size
    if t.numel() == 0:
        return start, start, False
    dims = sorted(((n, s) for n, s in zip(t.size(), t.stride()) if n != 1), key=lambda d: d[1])
    span = 1 + sum((n - 1) * s for n, s in dims)
    expected, dense = 1, True
    for n, s in dims:  # NOTE: dense: each stride is the product of the smaller dims' sizes (no gap, no overlap)
        dense = dense and s == expected
        expected *= n
    return start, start + span * size, dense


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage of ``t`` (no copy)."""
    storage = t.untyped_storage()
    nbytes, size = storage.nbytes(), t.element_size()
    if nbytes % size == 0:
        # NOTE: a view, not `set_`: on a dry run's fake tensors `set_` keeps the storage alive after the tensor dies
        return t.as_strided((nbytes // size,), (1,), 0).view(torch.uint8)
    return t.new_empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))


class SavedTensorOffloader:
    """Pack/unpack hooks that move saved activations to host memory in forward and back in backward; :meth:`hooks`
    around the forward, :meth:`begin_step` with the tensors never offloaded (parameters, buffers, batch) per step.
    ``before_host_alloc(new host bytes, bytes held)`` runs before each host copy; the rest as ``ActivationOffload``'s.
    """

    def __init__(self, device: torch.device, copier: SyncCopier, *, min_bytes: int = 1024, prefetch: int = 2,
                 boundaries_only: bool = False, before_host_alloc: Callable[[int, int], None] | None = None) -> None:
        self.device = torch.device(device)
        self.copier = copier
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.boundaries_only = boundaries_only
        self.before_host_alloc = before_host_alloc
        self.stats = OffloadStats()
        self._skip_ptrs: frozenset[int] = frozenset()
        self._phase = "idle"  # "forward" (packing), "backward" (unpacking), "idle"
        self._host_bytes_live = 0
        self._host_cache = PinnedHostCache(cuda=copier.pin_memory)
        # forward state
        self._by_storage: dict[tuple[int, int], tuple[_StorageEntry, StorageWeakRef]] = {}
        self._order: list[weakref.ref[_StorageEntry]] = []
        self._fwd_inflight: deque[tuple[torch.Tensor, Any]] = deque()
        # backward state
        self._held: set[_StorageEntry] = set()  # entries whose restored copy we hold
        self._prefetched: set[_StorageEntry] = set()
        self._cursor = -1

    # -- lifecycle ------------------------------------------------------------------------------------------
    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def begin_step(self, skip: list[torch.Tensor]) -> None:
        """Start counting a new step; ``skip``: tensors whose storages are never offloaded."""
        self.stats = OffloadStats(host_bytes_peak=self._host_bytes_live, host_bytes_reserved=self._host_cache.reserved)
        self.refresh_skip(skip)

    def refresh_skip(self, skip: list[torch.Tensor]) -> None:
        # NOTE: storages by StorageImpl (`_cdata`), not `data_ptr`: every fake storage of a dry run has address 0.
        self._skip_ptrs = frozenset(torch_internals.storage_key(t.untyped_storage()) for t in skip if isinstance(t, torch.Tensor))

    @property
    def host_bytes_live(self) -> int:
        return self._host_bytes_live

    @property
    def host_bytes_reserved(self) -> int:
        """Host RAM the copies hold from the OS now (:class:`PinnedHostCache`)."""
        return self._host_cache.reserved

    def _begin_forward(self) -> None:
        if self._phase == "backward":
            # NOTE: the last backward raised (an OOM), so `_end_backward` never ran: drop its device copies now
            self._end_backward()
        self._phase = "forward"
        self._by_storage.clear()
        self._order = []
        self._cursor = -1

    def _begin_backward(self) -> None:
        self._phase = "backward"
        self._by_storage.clear()  # NOTE: the weak storage refs go too, so storage addresses may be reused now
        self._drain_forward(limit=0)
        self._cursor = len(self._order)
        for ref in self._order:  # a second backward through a retained graph meets every handle again
            entry = ref()
            if entry is not None:
                entry.pending = entry.handles
        if torch_internals.in_backward():
            torch_internals.queue_backward_callback(self._end_backward)

    def _end_backward(self) -> None:
        """Drop every restored copy we still hold (saved twice but unpacked once, or prefetched but unused)."""
        self._held.clear()
        self._prefetched.clear()
        for ref in self._order:
            entry = ref()
            if entry is not None:
                entry.restored = None
                entry.event = None
        self._phase = "idle"

    def _drain_forward(self, limit: int) -> None:
        """Release device sources of finished host copies; make compute wait for the oldest beyond ``limit``."""
        inflight = self._fwd_inflight
        while inflight and (len(inflight) > limit or self.copier.done(inflight[0][1])):
            src, event = inflight.popleft()
            # NOTE: the side stream may still read ``src``: compute waits for the copy before its block is reused
            self.copier.compute_waits(event)
            del src

    # -- pack -----------------------------------------------------------------------------------------------
    def _keep(self, t: torch.Tensor, caller: Any) -> bool:
        """Whether a saved tensor stays in place; counts the kept bytes."""
        if type(t) not in _PLAIN or t.layout != torch.strided or t.device != self.device:
            return True
        if torch_internals.storage_key(t.untyped_storage()) in self._skip_ptrs:
            return True  # a parameter, buffer or batch tensor: it stays alive anyway, a copy would free nothing
        nbytes = t.numel() * t.element_size()
        boundary = self.boundaries_only and torch_internals.saved_by_checkpoint(caller)
        if boundary:
            self.stats.boundary_saves += 1
        if nbytes < self.min_bytes or nbytes == 0 or (self.boundaries_only and not boundary):
            self.stats.bytes_kept += nbytes
            self.stats.tensors_kept += 1
            return True
        return False

    def pack(self, t: torch.Tensor) -> Any:
        if self._phase != "forward":
            self._begin_forward()
        if self._keep(t, frames.caller_frame()):
            return SavedVersion(t, keep=True)  # NOTE: autograd's in-place check, which our hooks turn off (see unpack)
        storage = t.untyped_storage()
        # NOTE: keyed by storage *and* version (changed in place, saved again: a second copy); the weak storage ref
        # keeps the StorageImpl address from being reused while the key is in the map
        key = (torch_internals.storage_key(storage), torch_internals.tensor_version(t))
        hit = self._by_storage.get(key)
        start, end, dense = _extent(t)
        if hit is not None and not hit[1].expired():
            entry = hit[0]
            if not entry.covers(start, end):
                self._recopy(entry, t, start, end)
        else:
            entry = self._offload(t, storage)
            self._by_storage[key] = (entry, StorageWeakRef(storage))
        if dense:
            entry.cover(start, end)
        entry.handles += 1
        entry.pending += 1
        self.stats.tensors_offloaded += 1
        return _Packed(entry, t)

    def _offload(self, t: torch.Tensor, storage: torch.UntypedStorage) -> _StorageEntry:
        nbytes = storage.nbytes()
        cache = self._host_cache
        if self.before_host_alloc is not None:
            self.before_host_alloc(cache.cost(nbytes), cache.reserved)
        src = _storage_bytes(t)
        host, event = self.copier.to_host(src)
        cache.take(nbytes)
        mark_host(host)
        entry = _StorageEntry(self, host, t.device, len(self._order))
        self._order.append(weakref.ref(entry))
        self._host_bytes_live += nbytes
        stats = self.stats
        stats.bytes_offloaded += nbytes
        stats.storages_offloaded += 1
        stats.host_bytes_peak = max(stats.host_bytes_peak, self._host_bytes_live)
        stats.host_bytes_reserved = max(stats.host_bytes_reserved, cache.reserved)
        # NOTE: on CUDA the device source must outlive the side-stream copy
        self._fwd_inflight.append((src, event))
        self._drain_forward(limit=max(self.prefetch, 1))
        return entry

    def _recopy(self, entry: _StorageEntry, t: torch.Tensor, start: int, end: int) -> None:
        """Copy the bytes ``t`` spans into the existing host copy ``entry``: they may have changed since it was made
        (``nn.GRU`` writes a gate through an ``unsafe_chunk`` view after another gate of its storage was saved)."""
        src = _storage_bytes(t)[start:end]
        event = self.copier.to_host_into(src, entry.host[start:end])
        self.stats.bytes_recopied += end - start
        self._fwd_inflight.append((src, event))
        self._drain_forward(limit=max(self.prefetch, 1))

    # -- unpack ---------------------------------------------------------------------------------------------
    def unpack(self, packed: Any) -> torch.Tensor:
        # NOTE: [in-place check] autograd does not check the version of tensors packed by hooks: a module that
        # changed a saved tensor in place would train on other values here, where plain PyTorch raises
        if isinstance(packed, SavedVersion):
            packed.check("ActivationOffload")
            return packed.counter
        packed.saved.check("ActivationOffload")
        if self._phase != "backward":
            self._begin_backward()
        entry: _StorageEntry = packed.entry
        if entry.restored is None:
            self.stats.restore_misses += 1
            self._restore(entry)
        self._prefetch_before(entry.index)
        self._prefetched.discard(entry)
        self.copier.compute_waits(entry.event, entry.restored)
        entry.event = None
        restored: torch.Tensor = entry.restored  # type: ignore[assignment]
        size = packed.dtype.itemsize
        if restored.numel() % size == 0:  # NOTE: a view, not `set_` (see `_storage_bytes`)
            out = restored.view(packed.dtype).as_strided(packed.size, packed.stride, packed.offset)
        else:
            out = restored.new_empty(0, dtype=packed.dtype)
            out.set_(restored.untyped_storage(), packed.offset, packed.size, packed.stride)
        entry.pending -= 1
        if entry.pending <= 0:
            # NOTE: every save of this storage is with autograd now; a second backward (retain_graph) restores again
            entry.pending = 0
            entry.restored = None
            self._held.discard(entry)
        return out

    def _restore(self, entry: _StorageEntry, prefetch: bool = False) -> None:
        entry.restored, entry.event = self.copier.to_device(entry.host, entry.device)
        self._held.add(entry)
        self.stats.bytes_restored += entry.nbytes
        if prefetch:
            self._prefetched.add(entry)
            self.stats.prefetched += 1

    def _prefetch_before(self, index: int) -> None:
        """Restore, up to ``prefetch`` ahead, what backward asks for next: roughly reverse pack order, but one node
        unpacks its saves in pack order, so after a jump below the frontier the skipped entries come first."""
        frontier = self._cursor
        if index < frontier:
            self._cursor = index
            for j in range(index + 1, min(frontier, index + 1 + self.prefetch)):
                if len(self._prefetched) >= self.prefetch:
                    return
                self._maybe_prefetch(j)
        while len(self._prefetched) < self.prefetch and self._cursor > 0:
            self._cursor -= 1
            self._maybe_prefetch(self._cursor)

    def _maybe_prefetch(self, j: int) -> None:
        entry = self._order[j]()
        if entry is not None and entry.restored is None and entry.pending > 0:
            self._restore(entry, prefetch=True)


__all__ = ["OffloadStats", "SavedTensorOffloader", "StreamCopier", "SyncCopier"]

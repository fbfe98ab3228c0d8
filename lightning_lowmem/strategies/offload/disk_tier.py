"""The disk tier of ``lowmem_offload`` (``OffloadStrategy(disk=...)``): the fp32 masters and the optimizer state in
files on a local disk, streamed through the host step parameter by parameter (docs/techniques/offload.md, "Disk tier").

Each parameter has one file; its master and each state tensor are shared memory maps of a region of it. The mapping is
the tensor, so every part of the strategy that reads or writes a master (the step, the upload, views, checkpoints,
the fp32 module given back after fit) works unchanged and bit for bit; the disk holds the bytes and RAM only the
pages in use. :class:`DiskTier` moves those pages around the step: a reader thread reads the next parameters ahead
(``os.preadv`` into the page cache) while one steps, and a writer thread writes a stepped one behind (``fdatasync``)
and drops its pages, so at most ``budget`` bytes of the tier are in RAM at once (one parameter's, if that is larger).

Why plain threads and ``preadv``/``fdatasync`` on buffered files: the GIL is released in each call, they need no
build (DeepSpeed's async I/O op needs ``libaio-dev`` and a compiler) and no ``O_DIRECT`` alignment of torch's
tensors; buffered writes cost one memory copy, small beside the disk. Each file is unlinked as soon as it is open, so a
killed process leaves no tier behind (the space comes back when the process ends); the tier is never a checkpoint:
checkpoints are whole files written by the strategy's ``CheckpointIO``, and a resume rebuilds the tier from one.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import mark_disk, mark_host
from lightning_lowmem.core.host_memory import fix_mmap_threshold

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_CHUNK = 8 * 2**20  # bytes per read-ahead call
SMALL_BYTES = 4096  # state tensors smaller than a page (a step count) stay in RAM


@dataclass
class _File:
    """One parameter's file: its regions (``"master"``, then the state's keys), each mapped."""

    fd: int
    size: int = 0
    regions: dict[str, tuple[int, int, mmap.mmap, int]] = field(default_factory=dict)  # (..., address of byte 0)


@dataclass
class TierStats:
    """What the tier moved: bytes read ahead and written behind, seconds its threads spent in those calls (and
    ``busy_seconds``: while either was), seconds the training thread waited for them (the I/O not hidden behind
    compute), and the most bytes the budget counted."""

    read_bytes: int = 0
    write_bytes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    wait_seconds: float = 0.0
    busy_seconds: float = 0.0
    peak_bytes_in_ram: int = 0


class DiskTier:
    """Masters and optimizer state in unlinked files under ``directory``, at most ``budget`` bytes of them in RAM.

    Saves: all of the masters' and the optimizer state's host RAM (12 B/param for AdamW stepped in backward becomes
    the budget). Costs:
    disk space for them (``bytes_on_disk``), and per step a read and a write of each trained parameter's master and
    state (plus a read of the master to upload it), overlapped with compute as far as the disk keeps up.

    Example:
        >>> import tempfile
        >>> tier = DiskTier(tempfile.gettempdir(), budget=2**20)
        >>> w = tier.place(0, torch.ones(1024))
        >>> tier.acquire(0); _ = w.mul_(3); tier.release(0); tier.wait()
        >>> float(w.sum()), tier.bytes_on_disk, tier.stats.write_bytes
        (3072.0, 4096, 4096)
        >>> tier.close()
    """

    def __init__(self, directory: str | os.PathLike, budget: int) -> None:
        self.directory = os.fspath(directory)
        self.budget = budget
        self.stats = TierStats()
        self._files: dict[int, _File] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lowmem-tier-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="lowmem-tier-write")
        self._lock = threading.Lock()
        self._reads: dict[int, Future] = {}
        self._writes: deque[Future] = deque()
        self._ahead: deque[int] = deque()  # parameters the pass will touch next, in order
        self._held: dict[int, int] = {}  # parameter -> its bytes counted in RAM (read ahead or in use, not yet written)
        self._master_only = False
        self._fake: dict[tuple[int, str], int] = {}  # a dry run's bytes (fake tensors hold none), by region
        self._active = 0  # reads and writes in flight
        self._busy_since = 0.0

    @property
    def bytes_on_disk(self) -> int:
        return sum(self._fake.values()) + sum(f.size for f in self._files.values())

    @property
    def placed_bytes(self) -> int:
        """Bytes of the tensors placed in the tier (:attr:`bytes_on_disk` rounds each up to a page)."""
        return sum(self._fake.values()) + sum(n for f in self._files.values() for _, n, _, _ in f.regions.values())

    @property
    def bytes_in_ram(self) -> int:
        """The tier's bytes the budget counts now: read ahead or in use, not yet written behind."""
        with self._lock:
            return sum(self._held.values())

    def place(self, i: int, value: Tensor, key: str = "master") -> Tensor:
        """A tensor in parameter ``i``'s file holding ``value`` (a region of the same size is reused). A dry run's fake
        ``value`` is kept as it is, counted on the disk (``mark_disk``)."""
        nbytes = value.numel() * value.element_size()
        if not nbytes:
            return value  # NOTE: nothing to store (and an empty region cannot be mapped)
        if torch_internals.is_fake(value):
            self._fake[(i, key)] = nbytes
            mark_disk(value)
            return value
        f = self._files.get(i)
        if f is None:
            if not self._files and fix_mmap_threshold():  # NOTE: [freed copies stay] in core/host_memory.py
                log.info("lowmem_offload's disk tier: glibc's malloc now maps every block of 1 MiB or more on its own "
                         "(freed copies of masters and optimizer state go back to the system)")
            fd, path = tempfile.mkstemp(prefix=f"lowmem-tier-{i}-", dir=self.directory)
            os.unlink(path)  # NOTE: a killed process leaves nothing behind: the space comes back when it ends
            f = self._files[i] = _File(fd)
        region = f.regions.get(key)
        if region is None or region[1] != nbytes:
            offset = f.size
            try:
                # NOTE: allocated now: a full disk is an error here, never a SIGBUS when a mapped page is first written
                os.posix_fallocate(f.fd, offset, nbytes)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                raise OSError(errno.ENOSPC, (
                    f"lowmem_offload's disk tier in {self.directory!r} is full: placing `{key}` of parameter {i} "
                    f"({nbytes} bytes) after {self.bytes_on_disk} bytes. Free space there or pass another "
                    "`OffloadStrategy(disk=...)`; nothing was lost: checkpoints are separate files, and the tier's "
                    "files are removed when the process ends.")) from err
            m = mmap.mmap(f.fd, nbytes, offset=offset)
            region = f.regions[key] = (offset, nbytes, m, torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr())
            f.size = offset + -(-nbytes // _PAGE) * _PAGE
        if value.data_ptr() == region[3] and value.is_contiguous():
            return value  # NOTE: already this region (a state tensor the optimizer updated in place)
        out = torch.frombuffer(region[2], dtype=value.dtype, count=value.numel()).view(value.shape)
        mark_disk(out)
        return out.copy_(value)

    def store(self, i: int, value: Tensor, key: str = "master") -> Tensor:
        """:meth:`place`, then write it behind at once, within the budget (building the tier, or loading it from a
        checkpoint: dirty pages must not pile up in RAM, where a memory cap counts them too)."""
        self._make_room(value.numel() * value.element_size())
        out = self.place(i, value, key)
        if i in self._files:
            self._hold(i)
            self.release(i)
        return out

    def place_state(self, i: int, state: dict, at_once: bool = False) -> None:
        """Move parameter ``i``'s optimizer state tensors (those not in its file yet) into its file, in place
        (``at_once``: each written behind at once, as :meth:`store` does)."""
        for key, value in state.items():
            if not isinstance(value, Tensor) or value.device.type != "cpu" or value.is_meta:
                continue
            if value.numel() * value.element_size() >= SMALL_BYTES:
                state[key] = (self.store if at_once else self.place)(i, value, f"state.{key}")
            else:
                mark_host(value)

    def plan(self, order: Iterable[int], master_only: bool = False) -> None:
        """The parameters the next pass will :meth:`acquire`, in order (``master_only``: their masters alone, for
        the upload): read ahead within the budget. Reads ahead that the last pass did not use are dropped."""
        for i, read in list(self._reads.items()):
            read.result()
            self.release(i, wrote=False)
        self._reads.clear()
        self._master_only = master_only
        self._ahead = deque(i for i in order if i in self._files)
        self._read_ahead()

    def acquire(self, i: int) -> None:
        """Parameter ``i`` is about to be used: wait for its read (or for room to read it now, within the budget)."""
        if i not in self._files:
            return
        start = time.perf_counter()
        read = self._reads.pop(i, None)
        if read is None:
            if i in self._ahead:
                self._ahead.remove(i)
            self._make_room(self._size(i))
            self._hold(i)
            self._read(i, self._size(i))
        else:
            read.result()
        self.stats.wait_seconds += time.perf_counter() - start
        self._read_ahead()

    def release(self, i: int, wrote: bool = True) -> None:
        """Parameter ``i`` is done for this pass (``wrote``: its master and state changed): write it behind and drop
        its pages."""
        if i in self._files:
            with self._lock:
                if i in self._held:  # NOTE: the step may have grown the file (the optimizer's first state)
                    self._held[i] = max(self._held[i], self._size(i))
            while self._writes and self._writes[0].done():
                self._writes.popleft().result()  # NOTE: raises a write's error (a disk failing) in the training thread
            self._writes.append(self._writer.submit(self._write, i, self._files[i].size if wrote else 0))

    def wait(self) -> None:
        """Wait for every read and write queued so far."""
        start = time.perf_counter()
        for fut in [*self._reads.values(), *self._writes]:
            fut.result()
        self._reads.clear()
        self._writes.clear()
        self.stats.wait_seconds += time.perf_counter() - start

    def release_all(self) -> None:
        """Write every parameter behind and drop its pages (after code read them all: a checkpoint's save)."""
        for i in self._files:
            self.release(i, wrote=False)

    def close(self) -> None:
        """Finish the queued I/O and close the files (the mapped tensors stay valid while anything holds them)."""
        self.wait()
        self._reader.shutdown()
        self._writer.shutdown()
        for f in self._files.values():
            os.close(f.fd)
        self._files.clear()

    def _size(self, i: int) -> int:
        """Bytes of parameter ``i`` this pass uses (its master's region comes first in its file)."""
        f = self._files[i]
        return -(-f.regions["master"][1] // _PAGE) * _PAGE if self._master_only and "master" in f.regions else f.size

    def _hold(self, i: int) -> None:
        with self._lock:
            self._held[i] = self._size(i)
            self.stats.peak_bytes_in_ram = max(self.stats.peak_bytes_in_ram, sum(self._held.values()))

    def _make_room(self, nbytes: int) -> None:
        """Wait for writes behind until ``nbytes`` more fit in the budget (or nothing of the tier is in RAM)."""
        while self._writes and 0 < self.bytes_in_ram and self.bytes_in_ram + nbytes > self.budget:
            self._writes.popleft().result()

    def _read_ahead(self) -> None:
        while self._ahead:
            i = self._ahead[0]
            if self.bytes_in_ram + self._size(i) > self.budget:
                return
            self._ahead.popleft()
            if i not in self._reads:
                self._hold(i)
                self._reads[i] = self._reader.submit(self._read, i, self._size(i))

    def _begin(self) -> float:
        now = time.perf_counter()
        with self._lock:
            if not self._active:
                self._busy_since = now
            self._active += 1
        return now

    def _end(self, start: float) -> float:
        """Seconds since ``start``; counts the busy time (call holding the lock)."""
        now = time.perf_counter()
        self._active -= 1
        if not self._active:
            self.stats.busy_seconds += now - self._busy_since
        return now - start

    def _read(self, i: int, size: int) -> None:
        """Bring the first ``size`` bytes of parameter ``i``'s file into the page cache (its mapped tensors then
        fault without a disk read)."""
        fd = self._files[i].fd
        start = self._begin()
        buf = memoryview(bytearray(min(_CHUNK, size)))
        for offset in range(0, size, _CHUNK):
            os.preadv(fd, [buf[: min(_CHUNK, size - offset)]], offset)
        with self._lock:
            self.stats.read_bytes += size
            self.stats.read_seconds += self._end(start)

    def _write(self, i: int, nbytes: int) -> None:
        """Write parameter ``i``'s dirty pages (``nbytes``) to disk and drop them from RAM (mapping and page cache)."""
        f = self._files[i]
        start = self._begin()
        for _, _, m, _ in f.regions.values():
            m.madvise(mmap.MADV_DONTNEED)  # NOTE: a shared file mapping: the data stays in the file (next use faults)
        os.fdatasync(f.fd)
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.stats.write_bytes += nbytes
            self.stats.write_seconds += self._end(start)
            self._held.pop(i, None)



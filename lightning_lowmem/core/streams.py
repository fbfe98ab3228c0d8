"""Streams, events and asynchronous copies for the host<->device transfers: CUDA's, or a CPU stand-in that defers them.

The transfers are written once against :class:`StreamOps`; :class:`DeferredOps` runs them on the CPU with copies
that land only when the host must see them, so ordering bugs a GPU shows sometimes show every time (docs/design.md,
"The stream seam")::

    with cpu_stand_in(lambda: DeferredOps(progress="run_ahead")):
        trainer.fit(model)
"""

from __future__ import annotations

import contextlib
import random
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

import torch
from typing_extensions import override

from lightning_lowmem.core.host_memory import pinned_bytes

Progress = Literal["lazy", "run_ahead", "eager", "random"]
PROGRESS: tuple[str, ...] = get_args(Progress)


class StreamOps:
    """The primitives the transfers use. ``pins``: host buffers are page-locked (counted as the pinned allocator does)."""

    pins: bool = False

    def side_stream(self) -> Any:
        raise NotImplementedError

    def compute_stream(self) -> Any:
        raise NotImplementedError

    def empty_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host buffer (page-locked where ``pins``)."""
        raise NotImplementedError

    def host_bytes(self, nbytes: int) -> int:
        """Host RAM that :meth:`empty_host` takes for ``nbytes``: torch's pinned allocator rounds to a power of two."""
        return pinned_bytes(nbytes, cuda=self.pins)

    def wait_stream(self, waiter: Any, other: Any) -> None:
        """Work queued on ``waiter`` from now on starts after the work queued on ``other`` so far."""
        raise NotImplementedError

    def wait_event(self, waiter: Any, event: Any) -> None:
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (asynchronous where the host side is pinned)."""
        raise NotImplementedError

    def to_device(self, host: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
        """A new device tensor, allocated for ``stream``, that a copy queued on ``stream`` fills from ``host``."""
        raise NotImplementedError

    def record_event(self, stream: Any) -> Any:
        raise NotImplementedError

    def query(self, event: Any) -> bool:
        """Whether the work before ``event`` is done (never blocks)."""
        raise NotImplementedError

    def synchronize(self, event: Any) -> None:
        """Block the host until the work before ``event`` is done."""
        raise NotImplementedError

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory must not be reused before the work queued on ``stream`` so far is done."""
        raise NotImplementedError


class CudaOps(StreamOps):
    """The CUDA primitives: side streams, events, ``non_blocking`` copies, pinned host buffers."""

    def __init__(self, device: torch.device, pin_memory: bool = True) -> None:
        self.device = torch.device(device)
        self.pins = pin_memory

    @override
    def side_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    @override
    def compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    @override
    def empty_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=self.pins)

    @override
    def wait_stream(self, waiter: Any, other: Any) -> None:
        waiter.wait_stream(other)

    @override
    def wait_event(self, waiter: Any, event: Any) -> None:
        waiter.wait_event(event)  # NOTE: a GPU-side wait, not a host sync

    @override
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            # NOTE: non_blocking into pageable memory would be synchronous anyway (a staged copy)
            dst.copy_(src, non_blocking=self.pins)

    @override
    def to_device(self, host: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return host.to(device, non_blocking=self.pins, copy=True)

    @override
    def record_event(self, stream: Any) -> Any:
        return stream.record_event()

    @override
    def query(self, event: Any) -> bool:
        return bool(event.query())

    @override
    def synchronize(self, event: Any) -> None:
        event.synchronize()

    @override
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class DeferredStream:
    """A side stream of :class:`DeferredOps`: a queue of copies (and waits on other streams) run in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: deque[tuple[int, Any]] = deque()  # (position, a copy closure or (stream, position) to wait for)
        self.issued = 0  # positions handed out
        self.done = 0  # positions run

    def __repr__(self) -> str:
        return f"DeferredStream({self.name!r}, issued={self.issued}, done={self.done})"


class DeferredEvent:
    __slots__ = ("position", "stream")

    def __init__(self, stream: DeferredStream | None, position: int) -> None:
        self.stream, self.position = stream, position


_COMPUTE = DeferredStream("compute")  # NOTE: never queues: CPU kernels run when called


class DeferredOps(StreamOps):
    """The CPU stand-in for :class:`CudaOps`: copies queued on a side stream land only when progress says so.

    Args:
        progress: when queued copies run: ``"lazy"``, when the host must see them and only up to what it waits for;
            ``"run_ahead"``, then everything queued so far (the GPU ran ahead); ``"eager"``, at once; ``"random"``, a
            seeded random number of a random stream's at each query and wait (at least what the host waits for).
        seed: the seed of ``"random"``.
        pins: count host buffers as CUDA's pinned allocator takes them (rounded up to a power of two).
        device_lags: the compute stream finishes the work before a compute-stream event only when the host
            synchronizes on it, and a freed :meth:`to_device` buffer tied to it by :meth:`record_stream` is reused
            only after that, as CUDA's caching allocator does (:attr:`reserved`, :attr:`reserved_peak` count the bytes).

    ``copies_queued``, ``copies_run``, ``most_in_flight`` and ``copy_seconds`` count what happened.
    """

    def __init__(self, progress: Progress = "run_ahead", *, seed: int = 0, pins: bool = True,
                 device_lags: bool = False) -> None:
        if progress not in PROGRESS:
            raise ValueError(f"Passed `progress={progress!r}`; expected one of {', '.join(map(repr, PROGRESS))}.")
        self.progress = progress
        self.pins = pins
        self.device_lags = device_lags
        self.compute_issued = 0  # compute-stream events recorded (positions)
        self.compute_done = 0  # positions the lagging compute stream has finished
        self.reserved = self.reserved_peak = 0
        self._cache: list[tuple[int, int]] = []  # freed device buffers: (bytes, compute position they wait for)
        self._compute_used: set[int] = set()  # ids of live buffers tied to the compute stream (record_stream)
        self._rng = random.Random(seed)
        self.streams: list[DeferredStream] = []
        self.copies_queued = self.copies_run = self.most_in_flight = 0
        self.copy_seconds = 0.0

    # -- streams and events ---------------------------------------------------------------------------------------
    @override
    def side_stream(self) -> DeferredStream:
        stream = DeferredStream(f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    @override
    def compute_stream(self) -> DeferredStream:
        return _COMPUTE

    @override
    def record_event(self, stream: DeferredStream) -> DeferredEvent:
        if stream is _COMPUTE:
            self.compute_issued += 1
            if not self.device_lags:
                self.compute_done = self.compute_issued
            return DeferredEvent(stream, self.compute_issued)
        return DeferredEvent(stream, stream.issued)

    @override
    def query(self, event: DeferredEvent) -> bool:
        self._progress()
        if event.stream is _COMPUTE:
            return self.compute_done >= event.position
        return event.stream is None or event.stream.done >= event.position

    @override
    def synchronize(self, event: DeferredEvent) -> None:
        if event.stream is _COMPUTE:
            self.compute_done = max(self.compute_done, event.position)
        elif event.stream is not None:
            self._run(event.stream, event.stream.issued if self.progress == "run_ahead" else event.position)
            self._progress()

    @override
    def wait_stream(self, waiter: DeferredStream, other: DeferredStream) -> None:
        self._wait(waiter, other, other.issued)

    @override
    def wait_event(self, waiter: DeferredStream, event: DeferredEvent) -> None:
        if event.stream is not None:
            self._wait(waiter, event.stream, event.position)

    @override
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """With ``device_lags``, a :meth:`to_device` buffer read by the compute stream is reused only after it."""
        if stream is _COMPUTE:
            self._compute_used.add(id(tensor))

    # -- memory and copies ------------------------------------------------------------------------------------------
    @override
    def empty_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    @override
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: DeferredStream) -> None:
        # NOTE: `src` is read when the copy runs, not now: a source changed in between is copied changed, as on a GPU.
        # The version counter of `dst` moves now, as a CUDA copy's does when it is queued (`.data`: not again later)
        torch.autograd.graph.increment_version(dst)
        target = dst.data
        self._queue(stream, lambda: target.copy_(src))

    @override
    def to_device(self, host: torch.Tensor, device: torch.device, stream: DeferredStream) -> torch.Tensor:
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        if out.numel():
            out.view(torch.uint8).fill_(0xFF)  # NOTE: read before the copy lands, these bytes are NaN in every float dtype
        self.copy(out, host, stream)
        # NOTE: counted as the caching allocator would hold it: the best fit of a reusable freed buffer, else new
        nbytes = out.numel() * out.element_size()
        usable = [i for i, (size, ready) in enumerate(self._cache) if size >= nbytes and ready <= self.compute_done]
        if usable:
            self._cache.pop(min(usable, key=lambda i: self._cache[i][0]))
        else:
            self.reserved += nbytes
            self.reserved_peak = max(self.reserved_peak, self.reserved)
        weakref.finalize(out, self._freed, id(out), nbytes)
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        # NOTE: the compute kernels queued so far may still read it: reused only after the compute stream passes here
        used = key in self._compute_used
        self._compute_used.discard(key)
        self._cache.append((nbytes, self.compute_issued + 1 if used and self.device_lags else 0))

    # -- running the queues -----------------------------------------------------------------------------------------
    def advance(self, stream: DeferredStream, n: int = 1) -> None:
        """Run the next ``n`` queued items of ``stream`` (a test landing copies by hand)."""
        self._run(stream, min(stream.issued, stream.done + n))

    def in_flight(self) -> int:
        return sum(s.issued - s.done for s in self.streams)

    def _queue(self, stream: DeferredStream, item: Any) -> None:
        if stream is _COMPUTE:
            item() if callable(item) else self._run(*item)
            return
        stream.issued += 1
        stream.queue.append((stream.issued, item))
        if callable(item):
            self.copies_queued += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight())
        if self.progress == "eager":
            self._run(stream, stream.issued)

    def _wait(self, waiter: DeferredStream, other: DeferredStream, position: int) -> None:
        if other is _COMPUTE or other is waiter:
            return  # the compute stream's work is done when the host gets here; a stream is ordered with itself
        if waiter is _COMPUTE:
            # NOTE: compute kernels run on the host as soon as they are called, so "compute waits for the side
            # stream" means the side stream's copies must land now.
            self._run(other, position)
        else:
            self._queue(waiter, (other, position))

    def _progress(self) -> None:
        if self.progress != "random" or not self.streams:
            return
        stream = self._rng.choice(self.streams)
        self.advance(stream, self._rng.randint(0, 2))

    @torch.no_grad()  # NOTE: a copy into a parameter queued under no_grad runs later, outside it
    def _run(self, stream: DeferredStream, position: int) -> None:
        while stream.done < position:
            _, item = stream.queue.popleft()
            stream.done += 1
            if callable(item):
                t0 = time.perf_counter()
                item()
                self.copy_seconds += time.perf_counter() - t0
                self.copies_run += 1
            else:
                self._run(*item)


_stand_in: Callable[[], StreamOps] | None = None


def cpu_ops() -> StreamOps | None:
    """The ops the CPU path of the transfers uses: ``None`` (plain synchronous copies) unless :func:`cpu_stand_in`."""
    return _stand_in() if _stand_in is not None else None


@contextlib.contextmanager
def cpu_stand_in(factory: Callable[[], StreamOps] | None) -> Iterator[None]:
    """Inside, transfers built for a CPU device (``lowmem_offload``, ``ActivationOffload``) run on ``factory()``'s ops
    (tests and benchmarks: the CUDA transfer logic on the CPU, with :class:`DeferredOps`)."""
    global _stand_in
    before, _stand_in = _stand_in, factory
    try:
        yield
    finally:
        _stand_in = before

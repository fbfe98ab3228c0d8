"""One host thread that runs the host work handed to it from the autograd thread, in the order it was handed over.

``lowmem_offload(optimizer_in_backward=True)`` steps each master as its gradient lands: on the autograd thread the
step stalls backward (on CUDA, the queueing of the next kernels: the GPU starves once its queue empties). Handed to
this worker, the step overlaps the rest of backward; :meth:`HostWorker.wait` (the drain after backward) waits for it.

Two rules keep it exact and safe:

- one thread, first in first out: each step runs alone, as on the autograd thread (same kernels, same values);
- the bytes the queue keeps alive are bounded (``max_bytes``): a gradient handed over stays alive until its step ran,
  so without a bound a worker behind backward would hold every gradient at once, the memory the technique saves.
  Past the bound the autograd thread waits for the oldest steps. Work that holds no memory of its own (a staging slot
  that exists anyway) is handed over with ``nbytes=0``.

NOTE: [observed] a torch dispatch mode (``MemoryTracker``, the dry run's ``FakeTensorMode``) is entered per thread:
work handed over while one is active runs at once on the calling thread, where the mode sees it.

Example:
    >>> worker = HostWorker("example", max_bytes=1024)
    >>> done = []
    >>> for k in range(3):
    ...     worker.submit(done.append, k, nbytes=512)
    >>> worker.wait(); done
    [0, 1, 2]
    >>> worker.close()
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lightning_lowmem._internals import torch as torch_internals


class HostWorker:
    """A single host thread with a first-in-first-out queue bounded in bytes.

    Saves: the host work's time on the thread that hands it over. Costs: one thread; up to ``max_bytes`` of the
    tensors handed over kept alive until their work ran.
    """

    def __init__(self, name: str, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"HostWorker({name!r}, max_bytes={max_bytes!r}): expected a number of bytes >= 0.")
        self.name, self.max_bytes = name, max_bytes
        self.threads: set[int] = set()  # idents of the threads that ran handed-over work (tests)
        self.most_bytes = 0  # the most bytes the queue kept alive at once (tests)
        self._executor: ThreadPoolExecutor | None = None
        self._queue: deque[tuple[Future, int]] = deque()
        self._bytes = 0

    def submit(self, fn: Callable[..., Any], *args: Any, nbytes: int = 0) -> None:
        """Run ``fn(*args)`` on the worker after everything handed over before; ``nbytes``: what its arguments keep alive."""
        if torch_internals.dispatch_mode_stack():  # NOTE: [observed]
            fn(*args)
            return
        while self._queue and self._bytes + nbytes > self.max_bytes:
            self._pop()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"lowmem-{self.name}")
        self._queue.append((self._executor.submit(self._run, fn, args), nbytes))
        self._bytes += nbytes
        self.most_bytes = max(self.most_bytes, self._bytes)

    def wait(self) -> None:
        """Wait until everything handed over ran; re-raise the first error (after the rest ran too)."""
        error: BaseException | None = None
        while self._queue:
            try:
                self._pop()
            except BaseException as e:  # noqa: BLE001  (re-raised below, once the queue is empty)
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait, then end the thread (a later :meth:`submit` starts a new one)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _pop(self) -> None:
        future, nbytes = self._queue.popleft()
        self._bytes -= nbytes
        future.result()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.threads.add(threading.get_ident())
        fn(*args)


__all__ = ["HostWorker"]

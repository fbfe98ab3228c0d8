"""CUDA peak statistics that several consumers of one process can read: :class:`CudaPeakWindow`.

``torch.cuda.reset_peak_memory_stats`` is process-wide, so a component that resets it (a phase of
:class:`~lightning_lowmem.measure.tracker.MemoryTracker`, the memory recorder, the micro-batch search) would
hide the peak from every other. Each resets through :func:`reset_cuda_peak_stats` instead, which first
folds the current maxima into every open window. Both are re-exported by :mod:`lightning_lowmem.measure.tracker`.
"""

from __future__ import annotations

import weakref
from typing import ClassVar

import torch

__all__ = ["CudaPeakWindow", "reset_cuda_peak_stats"]


class CudaPeakWindow:
    """The CUDA allocator's peak since this window's last :meth:`lap`, safe to use beside other windows.

    ``torch.cuda.reset_peak_memory_stats`` is process-wide: one consumer resetting it hides the peak
    from every other. Every project component resets through :func:`reset_cuda_peak_stats`, which
    first folds the current maxima into every open window, so each window still reads its own peak.

    Example::

        window = CudaPeakWindow(device=0)
        ...                                     # a training step
        allocated, reserved = window.lap()      # peaks since the window opened; starts a new lap
        window.close()
    """

    _open: ClassVar[weakref.WeakSet[CudaPeakWindow]] = weakref.WeakSet()

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        self.device = _indexed(device)
        if self.device.type != "cuda":
            raise ValueError(f"Passed `device={device!r}`; a CudaPeakWindow reads CUDA statistics, give a CUDA device.")
        self._folded = (0, 0)
        reset_cuda_peak_stats(self.device)
        CudaPeakWindow._open.add(self)

    def _fold(self, allocated: int, reserved: int) -> None:
        self._folded = (max(self._folded[0], allocated), max(self._folded[1], reserved))

    def read(self) -> tuple[int, int]:
        """``(max allocated, max reserved)`` bytes since the last lap, without starting a new one."""
        return (
            max(self._folded[0], torch.cuda.max_memory_allocated(self.device)),
            max(self._folded[1], torch.cuda.max_memory_reserved(self.device)),
        )

    def lap(self) -> tuple[int, int]:
        """Read the peaks since the last lap and start a new lap (one global reset, folded into the others)."""
        peaks = self.read()
        reset_cuda_peak_stats(self.device)
        self._folded = (0, 0)
        return peaks

    def close(self) -> None:
        CudaPeakWindow._open.discard(self)


def _indexed(device: torch.device | int | str | None) -> torch.device:
    """``device`` with its index: ``"cuda"`` and ``None`` are the current CUDA device.

    NOTE: [device index] ``torch.device("cuda") != torch.device("cuda:0")``: a window opened on ``"cuda"`` would
    never see the resets of ``cuda:0`` folded in, and would read a peak another component had reset.
    """
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def reset_cuda_peak_stats(device: torch.device | int | str | None = None) -> None:
    """Reset CUDA's peak statistics without losing them for any open :class:`CudaPeakWindow`.

    Use this instead of ``torch.cuda.reset_peak_memory_stats`` everywhere in the project. A no-op when
    CUDA is not available.
    """
    if not torch.cuda.is_available():
        return
    device = _indexed(device)
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    for window in list(CudaPeakWindow._open):
        if window.device == device:
            window._fold(allocated, reserved)
    torch.cuda.reset_peak_memory_stats(device)

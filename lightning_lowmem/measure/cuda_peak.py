"""CUDA peak statistics that several consumers of one process can read: :class:`CudaPeakWindow` (re-exported by
:mod:`lightning_lowmem.measure.tracker`)."""

from __future__ import annotations

import weakref
from typing import ClassVar, NamedTuple

import torch

__all__ = ["CudaPeakWindow", "CudaPeaks", "reset_cuda_peak_stats"]


class CudaPeaks(NamedTuple):
    """The caching allocator's peaks, bytes. ``allocated``: tensors; ``active``: blocks in use, tensors plus what a
    freed block still holds until the streams that used it finish (``record_stream``); ``reserved``: what the
    allocator holds from the device, cached free blocks and fragmentation included: what must fit in the device."""

    allocated: int
    reserved: int
    active: int = 0


class CudaPeakWindow:
    """The CUDA allocator's peak since this window's last :meth:`lap`, safe to use beside other windows.

    ``torch.cuda.reset_peak_memory_stats`` is process-wide: one consumer's reset hides the peak from every other. The
    project resets through :func:`reset_cuda_peak_stats`, which first folds the current maxima into every open window.

    Example::

        window = CudaPeakWindow(device=0)
        ...                                     # a training step
        allocated, reserved, active = window.lap()  # peaks since the window opened; starts a new lap
        window.close()
    """

    _open: ClassVar[weakref.WeakSet[CudaPeakWindow]] = weakref.WeakSet()

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        self.device = _indexed(device)
        if self.device.type != "cuda":
            raise ValueError(f"Passed `device={device!r}`; a CudaPeakWindow reads CUDA statistics, give a CUDA device.")
        self._folded = CudaPeaks(0, 0, 0)
        reset_cuda_peak_stats(self.device)
        CudaPeakWindow._open.add(self)

    def read(self) -> CudaPeaks:
        """The peaks since the last lap, without starting a new one."""
        return CudaPeaks(*map(max, self._folded, _current_peaks(self.device)))

    def lap(self) -> CudaPeaks:
        """Read the peaks since the last lap and start a new lap (one global reset, folded into the others)."""
        peaks = self.read()
        reset_cuda_peak_stats(self.device)
        self._folded = CudaPeaks(0, 0, 0)
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


def _current_peaks(device: torch.device) -> CudaPeaks:
    return CudaPeaks(torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                     int(torch.cuda.memory_stats(device).get("active_bytes.all.peak", 0)))


def reset_cuda_peak_stats(device: torch.device | int | str | None = None) -> None:
    """Reset CUDA's peak statistics without losing them for any open :class:`CudaPeakWindow`.

    Use this instead of ``torch.cuda.reset_peak_memory_stats`` everywhere in the project. A no-op when
    CUDA is not available.
    """
    if not torch.cuda.is_available():
        return
    device = _indexed(device)
    peaks = _current_peaks(device)
    for window in list(CudaPeakWindow._open):
        if window.device == device:
            window._folded = CudaPeaks(*map(max, window._folded, peaks))
    torch.cuda.reset_peak_memory_stats(device)

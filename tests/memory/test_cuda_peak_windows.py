"""CudaPeakWindow's bookkeeping of CUDA's process-wide peak statistics, against a Python stand-in of them (runs on
the CPU; the real statistics are checked in ``test_measure.py::test_cuda_phase_peaks_and_shared_windows``)."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.measure.tracker import CudaPeakWindow, reset_cuda_peak_stats


class _FakeAllocatorStats:
    """torch.cuda's peak statistics for two devices, in Python: ``use`` raises a device's peaks, ``reset`` drops them."""

    def __init__(self) -> None:
        self.peaks = {0: [0, 0, 0], 1: [0, 0, 0]}
        self.resets: list[int] = []

    def use(self, index: int, allocated: int, reserved: int, active: int | None = None) -> None:
        now = (allocated, reserved, allocated if active is None else active)
        self.peaks[index] = [max(p, n) for p, n in zip(self.peaks[index], now)]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def index(device: torch.device) -> int:
            assert device.type == "cuda" and device.index is not None, device  # always an indexed device
            return device.index

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: self.peaks[index(d)][0])
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: self.peaks[index(d)][1])
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda d: {"active_bytes.all.peak": self.peaks[index(d)][2]})
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: self.resets.append(index(d))
                            or self.peaks.__setitem__(index(d), [0, 0, 0]))


def test_reset_cuda_peak_stats_folds_the_peak_into_every_open_window(monkeypatch):
    """The window bookkeeping against a Python stand-in of CUDA's process-wide peak statistics (runs on CPU)."""
    stats = _FakeAllocatorStats()
    stats.install(monkeypatch)
    first = CudaPeakWindow(0)
    stats.use(0, 100, 200, active=150)
    second = CudaPeakWindow("cuda")  # the current device, cuda:0: its reset is folded into `first`
    other = CudaPeakWindow("cuda:1")
    stats.use(0, 50, 60)
    stats.use(1, 7, 8)
    try:
        assert first.read() == (100, 200, 150) and second.read() == (50, 60, 50)
        reset_cuda_peak_stats()  # someone else resets cuda:0: no window loses its peak
        assert stats.peaks[0] == [0, 0, 0] and stats.resets[-1] == 0
        assert first.read() == (100, 200, 150) and second.read() == (50, 60, 50) and other.read() == (7, 8, 7)
        stats.use(0, 70, 80)
        assert second.lap() == (70, 80, 70) and second.read() == (0, 0, 0)  # a lap starts afresh ...
        assert first.lap() == (100, 200, 150)  # ... and the others still see their own peaks
        assert first.read().active == 0 and other.read() == (7, 8, 7)  # cuda:1 never reset by cuda:0's laps
        assert stats.resets.count(1) == 1  # only when `other` opened
    finally:
        for window in (first, second, other):
            window.close()
    assert not {first, second, other} & set(CudaPeakWindow._open)


def test_reset_cuda_peak_stats_touches_no_cuda_statistics_without_cuda(monkeypatch):
    """Without CUDA it returns before any torch.cuda statistics call (on a CPU build those raise)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_stats", "reset_peak_memory_stats",
                 "current_device"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _name=name: calls.append(_name))
    assert reset_cuda_peak_stats() is None
    assert reset_cuda_peak_stats("cuda:0") is None
    assert calls == []

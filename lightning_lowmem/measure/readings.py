"""What :class:`~lightning_lowmem.measure.tracker.MemoryTracker` reports: the peaks (overall, per phase, both roles),
the breakdowns, the timeline and the JSON-able report (a part of the tracker: :class:`TrackerReadings` is its base
and reads its state; it is not used on its own). :class:`PhasePeak` is the peak of one phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_lowmem.core import accounting as _cat
from lightning_lowmem.core.accounting import CATEGORIES, ROLES, MemoryBreakdown, Role
from lightning_lowmem.measure.ledger import _DEV, _HOST


@dataclass
class PhasePeak:
    """The peak of one phase (the maximum over all its repetitions, e.g. accumulation micro-batches).

    ``total``/``by_category`` are the device role at the moment the device-role bytes were highest;
    ``host_total``/``host_by_category`` the host role at the moment the host-role bytes were highest.
    ``cuda_max_allocated``/``cuda_max_reserved`` are CUDA's own peaks over the phase (None off CUDA).
    """

    name: str
    total: int = 0
    by_category: dict[str, int] = field(default_factory=_cat._zeros)
    host_total: int = 0
    host_by_category: dict[str, int] = field(default_factory=_cat._zeros)
    cuda_max_allocated: int | None = None
    cuda_max_reserved: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": {**self.by_category, "total": self.total},
            "host": {**self.host_by_category, "total": self.host_total},
            "cuda_max_allocated": self.cuda_max_allocated,
            "cuda_max_reserved": self.cuda_max_reserved,
        }


class TrackerReadings:
    """The readings of ``MemoryTracker`` (see the module docstring)."""

    # --- readings ---------------------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int:
        """The highest device-role live bytes seen while tracking."""
        return max(self._best(_DEV).total, 0)

    def peak_bytes_role(self, role: Role) -> int:
        """The highest live bytes of ``role`` (``"device"`` or ``"host"``) seen while tracking."""
        if role not in ROLES:
            raise ValueError(f"Passed `role={role!r}`; expected one of {ROLES}.")
        return max(self._best(ROLES.index(role)).total, 0)

    @property
    def peak_phase(self) -> str | None:
        """The phase in which the device-role peak happened (None: outside every phase)."""
        return self._best(_DEV).phase

    @property
    def peaks(self) -> dict[str, PhasePeak]:
        out = {}
        for name, (dev, host) in self._phase_snaps.items():
            cuda = self._cuda.get(name)
            out[name] = PhasePeak(
                name=name,
                total=max(dev.total, 0),
                by_category=dict(zip(CATEGORIES, dev.cats)),
                host_total=max(host.total, 0),
                host_by_category=dict(zip(CATEGORIES, host.cats)),
                cuda_max_allocated=cuda[0] if cuda else None,
                cuda_max_reserved=cuda[1] if cuda else None,
            )
        return out

    def peak_breakdown(self) -> MemoryBreakdown:
        """Bytes by category at the device-role peak (device) and at the host-role peak (host)."""
        return MemoryBreakdown(
            device=dict(zip(CATEGORIES, self._best(_DEV).cats)), host=dict(zip(CATEGORIES, self._best(_HOST).cats))
        )

    def breakdown(self) -> MemoryBreakdown:
        """Live bytes by category and role now (after exit: at exit)."""
        if self._mode is None and hasattr(self, "_final"):
            return self._final
        return MemoryBreakdown(device=dict(zip(CATEGORIES, self._live[_DEV])), host=dict(zip(CATEGORIES, self._live[_HOST])))

    def live_bytes(self, role: Role = "device") -> int:
        return self.breakdown().total(role)

    @property
    def num_ops(self) -> int:
        """Aten ops seen while tracking."""
        return self._ops

    def timeline(self) -> dict[str, Any]:
        """With ``timeline=True``: device-role bytes by category after every allocation and free.

        Returns ``{"phases": [phase names], "phase": [index into phases per event],
        "<category>": [bytes per event], ..., "host_total": [bytes per event]}``.
        """
        cols = list(zip(*self._timeline)) if self._timeline else [()] * 7
        out: dict[str, Any] = {"phases": list(self._phase_order), "phase": list(cols[0])}
        for i, cat in enumerate(CATEGORIES):
            out[cat] = list(cols[i + 1])
        out["host_total"] = list(cols[6])
        return out

    def report(self) -> dict[str, Any]:
        """A JSON-able summary: peaks (overall and per phase, both roles), the binding phase, live bytes."""
        peaks = self.peaks
        return {
            "peak_bytes": self.peak_bytes,
            "peak_bytes_host": self.peak_bytes_role("host"),
            "peak_phase": self.peak_phase,
            "peak": self.peak_breakdown().to_dict(),
            "phases": {name: p.to_dict() for name, p in peaks.items()},
            "live_at_end": self.breakdown().to_dict(),
            "device": str(self.device),
        }


__all__ = ["PhasePeak", "TrackerReadings"]

"""What a prediction returns: :class:`MemoryEstimate` (bytes per phase, role and category) and its corrections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_lowmem.core.accounting import MemoryBreakdown


@dataclass
class Correction:
    """A CPU-trace-vs-GPU difference applied to the prediction.

    ``applied_in_trace``: the GPU behaviour was traced (the kernel choice was emulated on CPU);
    otherwise ``bytes`` were added. ``calibrated`` stays False until a GPU run confirms it.
    """

    name: str
    bytes: int
    applied_in_trace: bool
    detail: str
    calibrated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "applied_in_trace": self.applied_in_trace,
                "calibrated": self.calibrated, "detail": self.detail}


@dataclass
class MemoryEstimate:
    """Predicted peak bytes per phase (forward, backward, optimizer), role (device, host) and category.

    ``phases[name].device`` is the device-role breakdown at that phase's device peak (the highest over the traced
    steps), ``.host`` the host-role one at its host peak. ``method``: ``"dry_run"`` (a traced run),
    ``"dry_run+zero_closed_form"`` (traced on one device, DeepSpeed's partitioned model states in closed form) or
    ``"analytic"`` (closed form only; ``fallback_reason`` says why). ``run`` describes the run predicted; ``steps``
    holds the traced steps' records (as ``MemoryReport`` records measured ones; empty when extrapolated). ``bounds``
    lists the sizes the dry run could not know (an output size that depends on values computed from the weights) and
    what it assumed: ``{"op", "where" (the model's line), "assumption", "calls"}``.
    """

    phases: dict[str, MemoryBreakdown]
    method: Literal["dry_run", "dry_run+zero_closed_form", "analytic"]
    target: str = "cpu"
    corrections: list[Correction] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    num_params: int | None = None
    run: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    fallback_reason: str | None = None
    analytic_bound: dict[str, int] | None = None
    bounds: list[dict[str, Any]] = field(default_factory=list)
    #: why this target: the caller's ``target=``, a YAML's ``trainer.accelerator``, or the default (CUDA)
    target_source: str = "the default"

    def peak(self, role: Literal["device", "host", "disk"] = "device") -> int:
        return max((bd.total(role) for bd in self.phases.values()), default=0)

    @property
    def peak_device(self) -> int:
        return self.peak("device")

    @property
    def peak_host(self) -> int:
        return self.peak("host")

    @property
    def peak_disk(self) -> int:
        """Bytes a disk tier holds (``lowmem_offload_disk``'s masters and optimizer state; 0 without one)."""
        return self.peak("disk")

    @property
    def binding_phase(self) -> str:
        """The phase whose device peak is the step's peak (the one a technique must shrink to help)."""
        return max(self.phases, key=lambda p: self.phases[p].total("device"))

    def fits(self, budget_bytes: int) -> bool:
        return self.peak_device <= budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_device": self.peak_device,
            "peak_host": self.peak_host,
            "peak_disk": self.peak_disk,
            "binding_phase": self.binding_phase,
            "method": self.method,
            "target": self.target,
            "target_source": self.target_source,
            "num_params": self.num_params,
            "run": self.run,
            "phases": {name: bd.to_dict() for name, bd in self.phases.items()},
            "corrections": [c.to_dict() for c in self.corrections],
            "notes": list(self.notes),
            "fallback_reason": self.fallback_reason,
            "analytic_bound": self.analytic_bound,
            "bounds": list(self.bounds),
            "wall_s": round(self.wall_s, 3),
        }


__all__ = ["Correction", "MemoryEstimate"]

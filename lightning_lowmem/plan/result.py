"""The planner's result: each candidate's verdict (:class:`Row`) and the chosen recipe with how to run it (:class:`Plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_lowmem.core.units import fmt_size
from lightning_lowmem.plan.cost import StepCost
from lightning_lowmem.plan.hardware import HardwareProfile
from lightning_lowmem.plan.output import trainer_arguments, write_yaml
from lightning_lowmem.plan.recipes import DISK, Recipe
from lightning_lowmem.predict.result import MemoryEstimate
from lightning_lowmem.predict.run_spec import RunSpec

Status = Literal["fits", "too big", "refused", "not traced"]


@dataclass
class Row:
    """One candidate: its prediction (where traced), its predicted step time, and the verdict."""

    recipe: Recipe
    name: str
    cost: StepCost
    status: Status = "not traced"
    why: str = ""
    estimate: MemoryEstimate | None = None

    @property
    def peak_device(self) -> int | None:
        return None if self.estimate is None else self.estimate.peak_device

    @property
    def peak_host(self) -> int | None:
        return None if self.estimate is None else self.estimate.peak_host

    @property
    def peak_disk(self) -> int | None:
        """The disk tier's predicted bytes (0 for a recipe without it)."""
        return None if self.estimate is None else self.estimate.peak_disk


@dataclass
class Plan:
    """The ranked candidates, the chosen one (the fastest that fits), and how to run it."""

    rows: list[Row]
    chosen: Row
    device_budget: int
    host_budget: int | None
    hardware: HardwareProfile
    batch_size: int | None
    half: str
    traces: int
    wall_s: float
    notes: list[str] = field(default_factory=list)
    #: what a written YAML takes from the planned source (``base_yaml``, or ``model`` and ``data``)
    yaml_parts: dict[str, Any] = field(default_factory=dict)
    #: the batch the data loader yields as given (a YAML's micro-batch), when it is not the effective batch
    loader_batch: int | None = None
    #: the YAML's own AccumulationScheduler arguments besides the batch sizes (kept in the plan's)
    scheduler: dict[str, Any] = field(default_factory=dict)
    #: the budget of the disk tier's bytes (``plan(disk_budget=)``), if given
    disk_budget: int | None = None

    @property
    def run(self) -> RunSpec:
        """The chosen run (fresh objects: give ``run.trainer_kwargs()`` to a Trainer)."""
        return self.chosen.recipe.run(self.batch_size, self.half, self.loader_batch, self.scheduler)

    def table(self) -> str:
        """The traced candidates (and the chosen one), fastest first; the rest counted by why they were not traced."""
        fastest = min(r.cost.total_s for r in self.rows)
        shown = [r for r in self.rows if r.estimate is not None or r.status == "refused"]
        disk = any(r.recipe.base in DISK for r in shown)  # NOTE: a disk column only where a disk recipe is shown
        body = [("*" if r is self.chosen else "", r.name, r.status, fmt_size(r.peak_device), fmt_size(r.peak_host),
                 *([fmt_size(r.peak_disk) if r.recipe.base in DISK else "-"] if disk else []),
                 f"{r.cost.total_s / fastest:.2f}x", r.why) for r in shown]
        header = ("", "recipe", "verdict", "device peak", "host peak", *(["disk"] if disk else []), "step time", "why")
        widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(x, widths)).rstrip() for x in [header, *body]]
        pruned = sum(r.estimate is None and r.status == "too big" for r in self.rows)
        slower = sum(r.status == "not traced" for r in self.rows)
        lines.append(f"not traced: {pruned} candidates taken to be too big (saving no more than a traced one that is, "
                     f"or scaled from a trace at another micro-batch), {slower} slower than the chosen one (step time: "
                     "relative to the fastest candidate)")
        return "\n".join(lines)

    def trainer_arguments(self) -> str:
        """The chosen recipe as Python ``Trainer`` arguments."""
        return trainer_arguments(self.run)

    def write_yaml(self, path: str | Path, command: str = "") -> Path:
        """The chosen recipe as a YAML ``lowmem fit --config`` runs: the planned YAML with its techniques replaced,
        or (for a model shape) the demo causal-LM module and data at the planned batch and sequence length."""
        header = "\n".join([f"Written by `{command or 'lightning_lowmem.plan.plan'}`.", self.summary(),
                            f"Python: {self.trainer_arguments()}"])
        return write_yaml(path, self.run, header=header, **self.yaml_parts)

    def summary(self) -> str:
        r = self.chosen
        return (f"chosen: {r.name}: device peak {fmt_size(r.peak_device)} of {fmt_size(self.device_budget)}, host peak "
                f"{fmt_size(r.peak_host)}" + (f" of {fmt_size(self.host_budget)}" if self.host_budget else "")
                + (f", disk {fmt_size(r.peak_disk)}" + (f" of {fmt_size(self.disk_budget)}" if self.disk_budget else "")
                   + f" in {r.recipe.disk}" if r.recipe.base in DISK else "")
                + f"; predicted step {r.cost.total_s:.3g} s on {self.hardware.name} (uncalibrated)")

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.name, "run": self.run.describe(), "device_budget": self.device_budget,
            "host_budget": self.host_budget, "disk_budget": self.disk_budget, "hardware": self.hardware.name,
            "traces": self.traces, "wall_s": round(self.wall_s, 2), "notes": self.notes,
            "rows": [{"recipe": r.name, "status": r.status, "why": r.why, "peak_device": r.peak_device,
                      "peak_host": r.peak_host, "peak_disk": r.peak_disk,
                      **{k: round(v, 6) for k, v in r.cost.to_dict().items()}}
                     for r in self.rows if r.status != "not traced" or r is self.chosen],
        }


__all__ = ["Plan", "Row", "Status"]

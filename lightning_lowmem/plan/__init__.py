"""The planner: the fastest recipe of the suite that fits a device and host memory budget (docs/planner.md)."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "plan": "lightning_lowmem.plan.search",
    "Plan": "lightning_lowmem.plan.result",
    "NoRecipeFitsError": "lightning_lowmem.plan.search",
    "Recipe": "lightning_lowmem.plan.recipes",
    "candidates": "lightning_lowmem.plan.recipes",
    "step_cost": "lightning_lowmem.plan.cost",
    "ModelShape": "lightning_lowmem.plan.cost",
    "HardwareProfile": "lightning_lowmem.plan.hardware",
    "PROFILES": "lightning_lowmem.plan.hardware",
    "measure_host": "lightning_lowmem.plan.hardware",
    "AutoStrategy": "lightning_lowmem.plan.auto",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LAZY)

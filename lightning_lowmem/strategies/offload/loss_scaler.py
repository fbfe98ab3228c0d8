"""Dynamic loss scaling for fp16 training whose gradients are unscaled on fp32 host masters. Not ``GradScaler``: the
overflow answer is a bool before the step, the scale has a floor (``min_scale``) and is a Python number (no device
sync to log it); above ``min_scale`` gradients and schedule are GradScaler's, bit for bit (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_lowmem._internals import torch as torch_internals


class DynamicLossScaler:
    """Multiply the loss by ``scale``; on an inf/nan gradient skip the step and lower the scale.

    ``torch.amp.GradScaler``'s schedule: an overflow multiplies the scale by ``backoff_factor``, ``growth_interval``
    clean steps in a row by ``growth_factor``. Memory and cost: a few Python numbers; one sync per ``unscale_``.

    Args:
        init_scale: the first scale. Default ``2**16``.
        growth_factor: factor applied after ``growth_interval`` clean steps (> 1).
        backoff_factor: factor applied after an overflow (in (0, 1)).
        growth_interval: number of clean steps in a row before the scale grows (>= 1).
        min_scale: the scale never goes below this (an overflow at ``min_scale`` still skips the step).

    Example:
        >>> scaler = DynamicLossScaler(init_scale=8.0)
        >>> grads = [torch.tensor([8.0, float("inf")])]
        >>> scaler.unscale_(grads), scaler.update(found_inf=True), scaler.scale
        (True, None, 4.0)
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0) -> None:
        if not init_scale > 0:
            raise ValueError(f"Passed `init_scale={init_scale}`; it must be positive.")
        if not growth_factor > 1:
            raise ValueError(f"Passed `growth_factor={growth_factor}`; it must be greater than 1.")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"Passed `backoff_factor={backoff_factor}`; it must lie strictly between 0 and 1.")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"Passed `growth_interval={growth_interval!r}`; it must be an integer >= 1.")
        if not 0 < min_scale <= init_scale:
            raise ValueError(f"Passed `min_scale={min_scale}`; it must be positive and at most `init_scale={init_scale}`.")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.growth_tracker = 0  # clean steps in a row since the last change of scale
        self.overflows = 0  # steps skipped since training began

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, grads: Sequence[torch.Tensor]) -> bool:
        """Divide ``grads`` in place by the scale; return whether any of them holds an inf or nan (a sync point)."""
        found_inf = False
        inv_scale = 1.0 / self.scale
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_device.items():
            flag = torch.zeros((), dtype=torch.float32, device=device)
            inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
            torch_internals.non_finite_check_and_unscale_(group, flag, inv)
            found_inf = found_inf or bool(flag.item())
        return found_inf

    def update(self, found_inf: bool) -> None:
        """Lower the scale after an overflow, raise it after ``growth_interval`` clean steps."""
        if found_inf:
            self.overflows += 1
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        keys = ("scale", "growth_tracker", "overflows", "growth_factor", "backoff_factor", "growth_interval",
                "min_scale")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"The loss-scaler state in the checkpoint lacks {sorted(missing)}; got keys {sorted(state)}.")
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.overflows = int(state.get("overflows", 0))
        for key, cast in (("growth_factor", float), ("backoff_factor", float), ("min_scale", float),
                          ("growth_interval", int)):
            if key in state:
                setattr(self, key, cast(state[key]))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(scale={self.scale:g}, growth_factor={self.growth_factor:g}, "
            f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, overflows={self.overflows})"
        )

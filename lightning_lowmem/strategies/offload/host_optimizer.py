"""The fast host Adam/AdamW path of ``OffloadStrategy``: torch's fused CPU kernel, inside the user's optimizer.

The user's ``torch.optim.Adam``/``AdamW`` object is kept (so its LR schedulers, param groups and
state-dict format stay exactly as they were); only its groups' ``fused``/``foreach`` flags are set,
which makes ``step()`` call ``torch._fused_adam(w)_``: one pass over parameter, gradient and both
moments, vectorised and multithreaded. Same update rule and hyperparameters; the rounding differs
from the for-loop/foreach kernels by a few ulp per step (measured in
``tests/strategies/test_offload.py::test_fused_host_adamw_matches_foreach_to_rounding``).

``DeepSpeedCPUAdam`` was measured against it on this project's benchmark machine and was not faster
(``benchmarks/results/offload.md``), so it is not wired in: it would also need its own state format
and a JIT-built C++ op.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.optim import Optimizer

HostOptimizer = Literal["auto", "as_is", "torch_fused"]
HOST_OPTIMIZERS: tuple[str, ...] = ("auto", "as_is", "torch_fused")
_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)


def why_not_fused(optimizer: Optimizer) -> str | None:
    """Why torch's fused CPU kernel cannot run ``optimizer`` as given, or None when it can."""
    if type(optimizer) not in _FUSABLE:
        return f"`{type(optimizer).__name__}` is not `torch.optim.Adam`/`AdamW` (subclasses may change the step)"
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            return f"param group {i} has `differentiable=True`"
        if group.get("capturable"):
            return f"param group {i} has `capturable=True`"
        for p in group["params"]:
            # NOTE: a frozen parameter kept without a master (`masters.frozen_without_master`) stays in its group in
            # the compute dtype; it never has a gradient, so no kernel steps it. Counting it made the choice depend
            # on when the module was cast (fused in the run, for-loop in its dry run: +10% predicted at the step).
            if not p.requires_grad:
                continue
            if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.float64):
                return f"param group {i} holds a {p.dtype} tensor on {p.device}"
    return None


def enable_fused(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Switch ``optimizer``'s groups to the fused kernel; return their previous flags (for :func:`restore`)."""
    saved = [{"fused": g.get("fused"), "foreach": g.get("foreach")} for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["fused"] = True
        group["foreach"] = False
    return saved


def restore(optimizer: Optimizer, saved: list[dict[str, Any]]) -> None:
    for group, flags in zip(optimizer.param_groups, saved):
        group.update(flags)

"""The fast host Adam/AdamW path of ``OffloadStrategy``: torch's fused CPU kernel inside the user's optimizer (only the
groups' ``fused``/``foreach`` flags change; a few ulp apart, ``test_fused_host_adamw_matches_foreach_to_rounding``).
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
            # NOTE: a frozen parameter without a master (compute dtype, never stepped) must not change the choice
            if p.requires_grad and (p.device.type != "cpu" or p.dtype not in (torch.float32, torch.float64)):
                return f"param group {i} holds a {p.dtype} tensor on {p.device}"
    return None


def enable_fused(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Switch param ``groups`` to the fused kernel; return their previous flags (for :meth:`HostKernel.restore`)."""
    saved = [{"fused": g.get("fused"), "foreach": g.get("foreach")} for g in groups]
    for group in groups:
        group.update(fused=True, foreach=False)
    return saved


class HostKernel:
    """The kernel each optimizer steps the masters with (``mode`` as ``OffloadStrategy(host_optimizer=...)``); the
    groups' flags are given back at :meth:`restore` (teardown). Memory: none; saves ~5x the for-loop kernel's time.

    Example:
        >>> opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
        >>> kernel = HostKernel("auto")
        >>> kernel.choose(opt)
        >>> opt.param_groups[0]["fused"], (kernel.restore(), opt.param_groups[0]["fused"])[1]
        (True, None)
    """

    def __init__(self, mode: HostOptimizer) -> None:
        self.mode = mode
        self._saved: dict[int, tuple[Optimizer, list[dict[str, Any]]]] = {}  # id(optimizer) -> (optimizer, flags)

    def choose(self, optimizer: Optimizer) -> None:
        """Pick ``optimizer``'s kernel (once; a group it gained since, by ``add_param_group``, takes it too)."""
        if self.mode == "as_is":
            return
        entry = self._saved.get(id(optimizer))
        if entry is not None:
            entry[1].extend(enable_fused(optimizer.param_groups[len(entry[1]):]))
            return
        reason = why_not_fused(optimizer)
        if reason is None:
            self._saved[id(optimizer)] = (optimizer, enable_fused(optimizer.param_groups))
        elif self.mode == "torch_fused":
            raise ValueError(f"`host_optimizer='torch_fused'` cannot run the optimizer `{type(optimizer).__name__}` "
                             f"swapped in after setup: {reason}. Use 'auto' or 'as_is'.")

    def reloaded(self, optimizer: Optimizer) -> None:
        """``optimizer.load_state_dict`` restored the groups' saved flags: keep the kernel this run chose."""
        if id(optimizer) in self._saved:
            enable_fused(optimizer.param_groups)

    def restore(self) -> None:
        for optimizer, saved in self._saved.values():
            for group, flags in zip(optimizer.param_groups, saved):
                group.update(flags)
        self._saved.clear()

"""When the overlapped host pass (``host_pass="overlap"``, :mod:`~lightning_lowmem.strategies.offload.host_pass`) is
exact for a step: the optimizers it steps by buckets (:func:`overlaps`), why a step stays serial (:func:`why_serial`)
and the Trainer's clip it checks against (:func:`trainer_clip`)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.optim import Optimizer

# NOTE: exact types only: a subclass may change the step (couple parameters, read a global statistic)
_PER_ELEMENT = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_USER_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "backward")


def overlaps(optimizer: Optimizer) -> bool:
    """Whether the overlapped pass can step ``optimizer`` by buckets (see :func:`why_not_by_buckets`); the Trainer may
    still keep the step serial (:func:`why_serial`)."""
    return why_not_by_buckets(optimizer) is None


def why_not_by_buckets(optimizer: Optimizer) -> str | None:
    """Why the overlapped pass cannot step ``optimizer`` by buckets, or None: it can when it is exactly torch's
    Adam/AdamW/SGD, neither differentiable nor capturable, or a bitsandbytes 8-bit one (:func:`why_not_bitsandbytes`)."""
    if type(optimizer) not in _PER_ELEMENT:
        return why_not_bitsandbytes(optimizer)
    if any(g.get("differentiable") or g.get("capturable") for g in optimizer.param_groups):
        return "a param group is differentiable or capturable"
    return None


def why_not_bitsandbytes(optimizer: Optimizer) -> str | None:
    """Why ``optimizer`` is not a bitsandbytes optimizer the pass steps by buckets, or None when it is one.

    Exactly ``AdamW8bit``, ``Adam8bit`` or ``Lion8bit``, not paged: each parameter's update reads its own gradient and
    state only (the 8-bit state is quantized in blocks within each tensor), so a step over a subset of the parameters
    is the full step's for them. NOTE: not with per-parameter overrides in bitsandbytes' process-wide
    ``GlobalOptimManager`` (``StableEmbedding``, ``LowBitOptimizer(stable_embedding=True)``): bitsandbytes looks them
    up by the parameter's position in the param groups, which a bucket's subset of the groups changes.
    """
    module = sys.modules.get("bitsandbytes.optim")  # NOTE: one of its optimizers was built: it is imported
    if module is None or type(optimizer) not in (module.AdamW8bit, module.Adam8bit, module.Lion8bit):
        return f"`{type(optimizer).__name__}` is not torch.optim.Adam/AdamW/SGD or bitsandbytes' AdamW8bit/Adam8bit/Lion8bit"
    if getattr(optimizer, "is_paged", False):
        return "a paged bitsandbytes optimizer"
    manager = module.GlobalOptimManager.get_instance()
    if manager.pid2config or manager.index2config or manager.module_weight_config_triple:
        return "bitsandbytes' GlobalOptimManager holds per-parameter overrides (keyed by position in the param groups)"
    return None


def why_serial(strategy: Any, optimizer: Optimizer, model: Any) -> str | None:
    """Why this step of ``strategy`` must stay serial, or None when the overlapped pass is exact for it."""
    from lightning_lowmem.strategies.offload.precision import _overridden  # NOTE: a cycle at import time otherwise

    if strategy.optimizer_in_backward:
        return "optimizer_in_backward steps inside backward already"
    if not model.automatic_optimization:
        return "manual optimization (user code between backward and the step)"
    reason = why_not_by_buckets(optimizer)
    if reason is not None:
        return reason
    if _overridden(model, _USER_HOOKS):
        return f"user code in one of {', '.join(_USER_HOOKS)}"
    return None


def trainer_clip(trainer: Any) -> tuple[float | None, float | None]:
    """``(clip_norm, clip_value)``: the clip ``trainer``'s ``gradient_clip_val``/``gradient_clip_algorithm`` ask for
    (at most one is set; none without a Trainer)."""
    clip = float(trainer.gradient_clip_val) if trainer is not None and trainer.gradient_clip_val else None
    if clip is not None and (trainer.gradient_clip_algorithm or "norm") == "value":
        return None, clip
    return clip, None


__all__ = ["overlaps", "trainer_clip", "why_not_bitsandbytes", "why_not_by_buckets", "why_serial"]

"""What a ZeRO resume needs beyond DeepSpeed's checkpoint (private helper of ``zero.py``).

- :func:`replay_cpu_adam_steps`: ``DeepSpeedCPUAdam`` keeps Adam's bias-correction powers ``beta**t`` in its C++
  object, not in the checkpoint. An uninterrupted run multiplies them by ``beta`` once per step (float32); a fresh
  process resuming at step ``t`` computes ``pow(beta, t)`` in one go (``IncrementStep`` in DeepSpeed's
  ``csrc/includes/cpu_adam.h``). The two differ in the last bit from about the fifth step on, so every weight of a
  resumed run drifts from the uninterrupted one. Replaying the step counter (no tensors touched) rebuilds the
  product exactly as the uninterrupted run built it.
- :func:`load_error`: a checkpoint of another model shape or optimizer, named.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_lowmem._internals import deepspeed as deepspeed_internals
from lightning_lowmem.core import resume_checks as _resume_checks


def _innermost(optimizer: Any) -> Any:
    """The torch optimizer inside DeepSpeed's ZeRO optimizer wrapper(s)."""
    for _ in range(8):  # NOTE: bounded: a wrapper is never nested deeper
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def cpu_adam_of(optimizer: Any) -> Any:
    """The ``DeepSpeedCPUAdam`` inside DeepSpeed's ZeRO optimizer wrapper(s), or None."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    inner = _innermost(optimizer)
    return inner if isinstance(inner, DeepSpeedCPUAdam) else None


@torch.no_grad()
def replay_cpu_adam_steps(optimizer: Any) -> int:
    """Bring a freshly loaded ``DeepSpeedCPUAdam``'s C++ step state to where the uninterrupted run had it.

    Calls the C++ update with empty tensors for steps ``1..t`` (``t``: the loaded ``state["step"]``), once per
    parameter group in the order DeepSpeed steps them, as the uninterrupted run did. Returns ``t`` (0: nothing to do).
    NOTE: exact when every state holds the same step count and the betas did not change during the run (the
    usual case); a parameter group that skipped steps, or betas changed by a scheduler, cannot be replayed exactly.
    """
    adam = cpu_adam_of(optimizer)
    if adam is None:
        return 0
    steps = max((int(s["step"]) for s in adam.state.values() if isinstance(s, dict) and "step" in s), default=0)
    empty = torch.empty(0, dtype=torch.float32)
    for step in range(1, steps + 1):
        for group in adam.param_groups:
            deepspeed_internals.cpu_adam_update(adam, step, group, empty, empty, empty, empty)
    return steps


def load_error(err: BaseException, optimizer: Any, source: str) -> ValueError | None:
    """DeepSpeed's error for a checkpoint of another model shape or optimizer, as one that names both; else None."""
    if isinstance(err, RuntimeError) and "size mismatch" in str(err):
        return ValueError(_resume_checks.shape_message(_resume_checks.parse_size_mismatches(str(err)), source))
    weights = ("or keep only its weights: `lowmem consolidate DIR model.pt`, load that into the model and fit "
               "without `ckpt_path` (the optimizer, the schedule and the step count start afresh)")
    if isinstance(err, KeyError):
        return ValueError(_resume_checks.mismatch_message(set(), _innermost(optimizer), source,
                                                          err=err, weights_only=weights))
    if "ZeRO checkpoint" in str(err):  # NOTE: DeepSpeed's own layout checks (parameter groups, alignment)
        return ValueError(f"Cannot resume from {source}: DeepSpeed cannot load it into this run ({err}) It was written "
                          "with other parameter groups (`configure_optimizers`) or ZeRO settings; resume with those, "
                          f"{weights}.")
    return None


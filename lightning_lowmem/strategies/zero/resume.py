"""What a ZeRO resume needs beyond DeepSpeed's checkpoint: :func:`replay_cpu_adam_steps` and :func:`load_error`."""

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


@torch.no_grad()
def replay_cpu_adam_steps(optimizer: Any) -> int:
    """Bring a freshly loaded ``DeepSpeedCPUAdam``'s C++ step state to where the uninterrupted run had it; return the
    step count ``t`` replayed (0: nothing to do).

    NOTE: the C++ object keeps the bias-correction powers ``beta**t`` as a product built step by step (not
    checkpointed); a fresh ``pow(beta, t)`` differs in the last bit, so the update is replayed with empty tensors for
    steps ``1..t``, per group. Exact unless a group skipped steps or a scheduler changed the betas.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    adam = _innermost(optimizer)
    if not isinstance(adam, DeepSpeedCPUAdam):
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


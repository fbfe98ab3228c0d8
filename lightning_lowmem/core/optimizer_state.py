"""Bytes of optimizer state: the per-parameter table (:func:`optimizer_state_bytes_per_param`) and the estimate for an
optimizer object before its first step (:func:`expected_state_bytes`); imports only ``core.optional``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_lowmem.core.optional import instance_of

__all__ = ["expected_state_bytes", "optimizer_family", "optimizer_state_bytes_per_param"]


def optimizer_state_bytes_per_param(optimizer: str, param_bytes: int, numel: int) -> float:
    """State bytes of one parameter tensor of ``numel`` values under ``optimizer``."""
    if optimizer == "adamw":
        return 2 * param_bytes * numel
    if optimizer == "adamw8bit":
        # NOTE: bitsandbytes keeps tensors under 4096 values in 32-bit state (min_8bit_size)
        if numel < 4096:
            return 8 * numel
        return 2 * numel + 2 * 4 * math.ceil(numel / 256)
    if optimizer == "sgd":
        return param_bytes * numel
    raise ValueError(f"Passed `optimizer={optimizer!r}`; expected 'adamw', 'adamw8bit' or 'sgd'.")


# NOTE: optimizer classes of other packages, recognised by type when their module is imported already (an object of
# them exists only then; see `loaded_class`): never by a class-name string
_LION = (("lion_pytorch", "Lion"),)  # a Lion without bitsandbytes' `optimizer_name`, that LowBitOptimizer swaps
_LION_STATE = (*_LION, ("deepspeed.ops.lion", "DeepSpeedCPULion"), ("deepspeed.ops.lion", "FusedLion"))
_ADAGRAD_STATE = (("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad"),)  # no torch Adagrad: one fp32 sum as well
_EIGHT_BIT = (("torchao.optim", "Adam8bit"), ("torchao.optim", "AdamW8bit"))  # blockwise 8-bit state, as bitsandbytes'
_BNB_BASE = ("bitsandbytes.optim.optimizer", "Optimizer8bit")  # every bitsandbytes optimizer, 8- or 32-bit state


def optimizer_family(optimizer: Optimizer) -> str | None:
    """The family of ``optimizer`` that an 8-bit equivalent exists for (can ``LowBitOptimizer`` swap it):
    ``"adam"``, ``"lion"`` or None."""
    name = getattr(optimizer, "optimizer_name", None)  # bitsandbytes optimizers say it themselves
    if name in ("adam", "lion"):
        return name
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if instance_of(optimizer, _LION):
        return "lion"
    return None


def expected_state_bytes(
    optimizer: Optimizer, low_bit: Any | None = None, keep_32bit: set[int] | frozenset[int] = frozenset()
) -> int:
    """Host bytes of the state ``optimizer`` will create for its fp32 masters (before its first step). ``low_bit``: a
    ``LowBitOptimizer`` that will swap an Adam/Lion optimizer for its 8-bit version (tensors under its
    ``min_8bit_size``, and ``keep_32bit`` ids with ``stable_embedding``, keep 32-bit state). Unknown optimizer classes
    count as Adam (8 B/param).
    """
    # blockwise 8-bit state: a bitsandbytes optimizer with `optim_bits=8`, torchao's
    eight_bit = (getattr(getattr(optimizer, "args", None), "optim_bits", 32) == 8
                 if instance_of(optimizer, (_BNB_BASE,)) else instance_of(optimizer, _EIGHT_BIT))
    min_8bit = getattr(getattr(optimizer, "args", None), "min_8bit_size", 4096)
    lion = getattr(optimizer, "optimizer_name", None) == "lion" or instance_of(optimizer, _LION_STATE)
    family = optimizer_family(optimizer)
    if low_bit is not None and (family == "adam" and not getattr(optimizer, "optimizer_name", None)
                                or family == "lion" and not eight_bit):
        eight_bit, min_8bit = True, low_bit.min_8bit_size
        if not low_bit.stable_embedding:
            keep_32bit = frozenset()
    total = 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            n = p.numel()
            if eight_bit:
                per = optimizer_state_bytes_per_param("adamw" if n < min_8bit or id(p) in keep_32bit else "adamw8bit", 4, n)
                total += per / 2 if lion else per  # NOTE: Lion keeps one moment, Adam two
            elif lion:
                total += optimizer_state_bytes_per_param("sgd", 4, n)  # one fp32 moment
            elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                total += optimizer_state_bytes_per_param("adamw", 4, n) + (4 * n if group.get("amsgrad") else 0)
            elif isinstance(optimizer, torch.optim.SGD):
                total += optimizer_state_bytes_per_param("sgd", 4, n) if group.get("momentum") else 0
            elif (isinstance(optimizer, (torch.optim.Adagrad, torch.optim.ASGD)) or instance_of(optimizer, _ADAGRAD_STATE)
                  or getattr(optimizer, "optimizer_name", None) == "adagrad"):
                total += 4 * n
            elif isinstance(optimizer, torch.optim.RMSprop):
                total += 4 * n * (1 + bool(group.get("momentum")) + bool(group.get("centered")))
            elif isinstance(optimizer, torch.optim.Adafactor):
                rows, cols = (p.shape[0], math.prod(p.shape[1:])) if p.dim() >= 2 else (n, 0)
                total += 4 * (rows + cols) if cols else 4 * n
            else:  # Adadelta, Adamax, NAdam, RAdam, Rprop, and unknown classes: two fp32 tensors per parameter
                total += optimizer_state_bytes_per_param("adamw", 4, n)
    return int(total)


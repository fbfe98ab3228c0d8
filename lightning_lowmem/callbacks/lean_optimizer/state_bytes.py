"""Bytes of the state a ``LeanOptimizer`` kind will keep, before it exists (the host-RAM check of ``lowmem_offload``).

As each package lays its state out, per tensor (fp32 masters: ``param_bytes=4``); checked against the real state
after a step in ``tests/strategies/test_offload_host_ram_optimizers.py``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_lowmem.callbacks.lean_optimizer import build

#: torchao's quantization: kind -> (bits per value, default block, values in the quantization map)
_TORCHAO = {"adamw8bit": (8, 256, 256), "adamw4bit": (4, 128, 16)}
#: torchao quantizes only tensors of at least this many values (bitsandbytes' rule, which torchao follows)
_TORCHAO_MIN = 4096


def projected_bytes(shape: tuple[int, ...], rank: int, proj_type: str, kind: str, param_bytes: int = 4) -> int:
    """GaLore's/APOLLO's state of a projected ``m x n`` weight: Adam's two moments of the projected gradient (``rank``
    times the side kept: ``"std"`` the longer) and the projection (``rank`` times the other side)."""
    m, n = shape
    right = {"std": m >= n, "reverse_std": m < n, "right": True, "left": False}[proj_type]
    kept, other = (m, n) if right else (n, m)
    scalar = 4 if kind != "galore" else 0  # NOTE: APOLLO's `scaled_grad`, a 0-d fp32 tensor
    return param_bytes * (2 * rank * kept + rank * other) + scalar


def torchao_bytes(numel: int, kind: str, block_size: int | None, param_bytes: int = 4) -> int:
    """torchao's AdamW8bit/AdamW4bit state of one tensor: codes, one fp32 scale per block and the quantization map for
    a tensor of at least 4096 values dividing the block; else both moments in the parameter's dtype; a 0-d step."""
    bits, default_block, qmap = _TORCHAO[kind]
    block = block_size or default_block
    step = 4
    if numel >= _TORCHAO_MIN and numel % block == 0:
        return 2 * (numel * bits // 8 + 4 * (numel // block + qmap)) + step
    return 2 * param_bytes * numel + step


def adam_mini_bytes(shape: tuple[int, ...], param_bytes: int = 4) -> int:
    """Adam-mini's state of one tensor, at most: the first moment and one second moment per row (1-D: full)."""
    numel = math.prod(shape)
    second = shape[0] if len(shape) >= 2 else numel
    return param_bytes * (numel + second)


def lean_state_bytes(callback: Any, optimizer: Optimizer, module: torch.nn.Module) -> int:
    """Bytes of the state ``callback`` (a ``LeanOptimizer``)'s optimizer will keep for ``optimizer``'s trainable
    parameters (the module's own, before the swap), stepped as fp32 masters."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    kind = callback.kind
    projected: set[int] = set()
    if kind in ("galore", "apollo", "apollo_mini"):
        with contextlib.suppress(ValueError):  # NOTE: nothing to project: the callback refuses the model at fit start
            projected = build.projection_plan(optimizer, lambda p: p, module, int(callback.rank), repr(callback))
    total = 0
    for p in params:
        if id(p) in projected:
            total += projected_bytes(tuple(p.shape), int(callback.rank), callback.proj_type, kind)
        elif kind in _TORCHAO:
            total += torchao_bytes(p.numel(), kind, callback.block_size)
        elif kind == "adam_mini":
            total += adam_mini_bytes(tuple(p.shape))
        else:
            total += 8 * p.numel()  # Adam's two fp32 moments
    return total


__all__ = ["adam_mini_bytes", "lean_state_bytes", "projected_bytes", "torchao_bytes"]

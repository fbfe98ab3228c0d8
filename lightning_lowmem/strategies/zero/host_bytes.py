"""Host RAM that DeepSpeed ZeRO-Offload allocates, per process, read off DeepSpeed 0.19's code (``stage_1_and_2.py``,
``stage3.py``): checked before DeepSpeed allocates anything, so a model too large for the host is an error naming the
need, not the OOM killer. On CUDA pinned buffers round up to a power of two; on the CPU accelerator DeepSpeed's
"device" buffers are host RAM too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.accelerators import CUDAAccelerator

from lightning_lowmem.core import host_memory as _host_memory
from lightning_lowmem.core.host_memory import pinned_bytes
from lightning_lowmem.core.optimizer_state import expected_state_bytes
from lightning_lowmem.strategies.zero.config import enabled

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}


def zero_offload_host_bytes(
    config: dict[str, Any],
    groups: Sequence[Sequence[int]],
    *,
    world_size: int,
    cuda: bool,
    state_bytes_per_element: float = 8.0,
) -> dict[str, int]:
    """Host bytes one process of a ZeRO-offload run allocates, by part (empty without offload), for the final DeepSpeed
    ``config``, the trainable element counts per param group, and ``state_bytes_per_element`` (8 for Adam)."""
    zero = config.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    off_opt = zero.get("offload_optimizer") or {}
    off_param = zero.get("offload_param") or {}
    opt_device = off_opt.get("device", "none") if isinstance(off_opt, dict) else "none"
    param_device = off_param.get("device", "none") if isinstance(off_param, dict) else "none"
    if opt_device not in ("cpu", "nvme") and param_device not in ("cpu", "nvme"):
        return {}
    w = 2 if (enabled(config.get("fp16")) or enabled(config.get("bf16"))) else 4
    grad_accum = _DTYPE_BYTES.get(str((config.get("data_types") or {}).get("grad_accum_dtype", "")).lower(), w)
    gas = int(config.get("gradient_accumulation_steps", 1) or 1)
    n_ranks = max(1, int(world_size))
    all_params = [n for g in groups for n in g]
    largest = max(all_params, default=0)
    parts: dict[str, float] = {}

    def pin(nbytes: float, enabled: bool = True) -> int:
        return pinned_bytes(int(nbytes), cuda=cuda) if enabled else int(nbytes)

    if stage in (1, 2):
        if opt_device == "cpu":
            pinned = bool(off_opt.get("pin_memory", False))
            partitions = [math.ceil(sum(g) / n_ranks) for g in groups if sum(g)]
            parts["fp32 master partition"] = sum(pin(4 * p, pinned) for p in partitions)
            parts["16-bit partition copy"] = sum(pin(w * p, pinned) for p in partitions)
            parts["fp32 gradient partition"] = sum(pin(4 * p, pinned) for p in partitions)
            parts["gradient staging (largest parameter)"] = pin(w * largest, pinned)
            if gas > 1:
                parts["accumulated gradients"] = sum(pin(w * n, pinned) for n in all_params) / n_ranks
            parts["optimizer state"] = state_bytes_per_element * sum(partitions)
            if pinned and cuda:
                parts["pageable copy while pinning"] = 4 * max(partitions, default=0)
            if not cuda:
                # NOTE: the reduce buckets (two with overlap_comm) are `torch.empty`: only what gradients fill is RAM
                bucket = zero.get("reduce_bucket_size", int(5e8))
                bucket = min(bucket if isinstance(bucket, int) else int(5e8), sum(all_params))
                buckets = 2 if zero.get("overlap_comm", False) else 1
                parts["device buffers in host RAM (flat model copy, gradient staging, reduce buckets)"] = (
                    w * sum(all_params) + w * largest + buckets * w * bucket
                )
    elif stage == 3:
        sub_group_size = int(zero.get("sub_group_size", int(1e9)) or int(1e9))
        partitions = [[math.ceil(n / n_ranks) for n in g] for g in groups]
        p_total = sum(sum(g) for g in partitions)
        sub_groups: list[tuple[int, int]] = []  # (partition elements, full elements)
        for g_part, g_full in zip(partitions, groups):
            if sub_group_size >= sum(g_part):
                sub_groups.append((sum(g_part), sum(g_full)))
                continue
            acc_p = acc_f = 0
            for k, (np_, nf) in enumerate(zip(g_part, g_full)):
                acc_p, acc_f = acc_p + np_, acc_f + nf
                if acc_p >= sub_group_size or k == len(g_part) - 1:
                    sub_groups.append((acc_p, acc_f))
                    acc_p = acc_f = 0
        largest_sub_partition = max((s[0] for s in sub_groups), default=0)
        largest_sub_full = max((s[1] for s in sub_groups), default=0)
        if opt_device in ("cpu", "nvme"):
            pinned = bool(off_opt.get("pin_memory", False)) or opt_device == "nvme"
            parts["gradient partitions"] = pin(grad_accum * p_total, pinned)
        if opt_device == "cpu":
            parts["fp32 gradient buffers"] = sum(pin(4 * s[0], pinned) for s in sub_groups)
            parts["fp32 partitions"] = 4 * p_total
            parts["optimizer state"] = state_bytes_per_element * p_total
        if opt_device in ("cpu", "nvme"):
            # NOTE: two transients at different moments (a sub-group's fp32 copy, `gradient_buffer`): the larger counts
            parts["init transient (largest sub-group)"] = 4 * max(largest_sub_full, largest_sub_partition)
        if opt_device == "nvme":
            count = int(off_opt.get("buffer_count", 4))
            parts["NVMe optimizer swap buffers"] = count * 4 * largest_sub_partition
        if param_device == "cpu":
            pinned = bool(off_param.get("pin_memory", False))
            parts["16-bit parameter partitions"] = sum(pin(w * sum(g), pinned) for g in partitions)
            if pinned and cuda:
                parts["pageable copy while pinning"] = w * max((sum(g) for g in partitions), default=0)
        elif param_device == "nvme":
            count, size = int(off_param.get("buffer_count", 5)), int(off_param.get("buffer_size", int(1e8)))
            in_cpu = min(p_total, int(off_param.get("max_in_cpu", int(1e9))))
            parts["NVMe parameter swap buffers"] = count * size * w
            parts["16-bit parameters kept in RAM (max_in_cpu)"] = pin(w * in_cpu)
        elif not cuda:
            parts["device buffers in host RAM (16-bit partitions)"] = w * p_total
    return {k: int(v) for k, v in parts.items() if v}


def check_zero_host_memory(strategy: Any, optimizer: Any) -> None:
    """Refuse (``HostMemoryError``) when the host RAM that ``strategy``'s offload will allocate is not available
    (before its engine exists; rank 0 decides for every process, so none waits in a collective)."""
    groups = [[p.numel() for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    # NOTE: the one optimizer-state table (DeepSpeedCPUAdam keeps Adam's two fp32 moments, its Adagrad and Lion one)
    per_element = expected_state_bytes(optimizer) / max(1, sum(map(sum, groups)))
    cuda = isinstance(strategy.accelerator, CUDAAccelerator)
    per_rank = zero_offload_host_bytes(
        strategy.config, groups, world_size=strategy.world_size, cuda=cuda, state_bytes_per_element=per_element
    )
    if not per_rank:
        return
    local = max(1, len(strategy.parallel_devices or [None]))
    need = {k: v * local for k, v in per_rank.items()}
    problem = None
    if strategy.is_global_zero:
        zero = strategy.config["zero_optimization"]
        offloads = [zero.get(k) or {} for k in ("offload_optimizer", "offload_param")]
        fixes = ["more processes or machines to shard over (each process holds 1/N of the masters and optimizer state)"]
        if cuda and any(o.get("pin_memory") for o in offloads):
            fixes.append("`ZeroStrategy(pin_memory=False)` (torch rounds each pinned buffer up to a power of two)")
        if not any(o.get("device") == "nvme" for o in offloads):
            fixes.append("`strategy='lowmem_zero3_nvme'` to keep the optimizer state and parameters on an SSD")
        fixes += ["a machine/container with more RAM (or raise the limit named above)",
                  "`ZeroStrategy(check_host_memory=False)` to try anyway"]
        try:
            _host_memory.check_host_memory(
                need,
                who=f"`{type(strategy).__name__}` (ZeRO-{zero.get('stage')} with offload, {local} process(es) on this "
                "machine)",
                fixes=fixes,
            )
        except _host_memory.HostMemoryError as err:
            problem = str(err)
    problem = strategy.broadcast(problem)
    if problem:
        raise _host_memory.HostMemoryError(problem)


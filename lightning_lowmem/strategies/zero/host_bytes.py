"""Host RAM that DeepSpeed ZeRO-Offload allocates, and the NVMe bytes ZeRO-Infinity writes, per process, read off
DeepSpeed 0.19's code (``stage_1_and_2.py``, ``stage3.py``, ``swap_tensor/``): checked before DeepSpeed allocates
anything, so a model too large for the host or the drive is an error naming the need, not the OOM killer or a full
disk mid-step. On CUDA pinned buffers round up to a power of two (DeepSpeed's own swap buffers are ``mlock``ed at their
size); on the CPU accelerator DeepSpeed's "device" buffers are host RAM too.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.accelerators import CUDAAccelerator

from lightning_lowmem.core import host_memory as _host_memory
from lightning_lowmem.core.host_memory import pinned_bytes
from lightning_lowmem.core.optimizer_state import expected_state_bytes
from lightning_lowmem.core.units import fmt_bytes
from lightning_lowmem.strategies.zero.config import enabled

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}
#: the host parts that stay through every step, by category (the rest: transients at start, device buffers in RAM)
HOST_CATEGORIES = {"gradient partitions": "gradients", "fp32 gradient buffers": "gradients",
                   "fp32 partitions": "optimizer_state", "optimizer state": "optimizer_state",
                   "16-bit parameter partitions": "weights", "16-bit parameters kept in RAM (max_in_cpu)": "weights",
                   "NVMe optimizer swap buffers": "other", "NVMe parameter swap buffers": "other"}
#: the parts of :func:`zero_nvme_disk_bytes`, by category, and the offload section whose ``nvme_path`` holds each
DISK_PARTS = {"fp32 master partitions": ("optimizer_state", "offload_optimizer"),
              "optimizer state": ("optimizer_state", "offload_optimizer"),
              "fp32 gradient partitions": ("gradients", "offload_optimizer"),
              "16-bit parameter partitions": ("weights", "offload_param")}


def _offload(zero: dict[str, Any], key: str) -> tuple[dict[str, Any], str]:
    section = zero.get(key) or {}
    return (section, section.get("device", "none")) if isinstance(section, dict) else ({}, "none")


def _swap_sizes(config: dict[str, Any]) -> tuple[int, int]:
    """The smallest tensor DeepSpeed swaps to NVMe and the I/O alignment of a swap file, in bytes (``aio`` block)."""
    aio = config.get("aio") or {}
    return max(2**20, int(aio.get("block_size", 2**20))), 1024 * int(aio.get("intra_op_parallelism", 1))


def _aligned(numel: int, itemsize: int, alignment: int) -> int:
    """``numel`` padded up to a multiple of ``alignment`` bytes, in elements (``_io_aligned_numel``)."""
    step = max(1, alignment // itemsize)
    return -(-numel // step) * step


def _sub_groups(zero: dict[str, Any], partitions: Sequence[Sequence[int]], groups: Sequence[Sequence[int]]
                ) -> list[tuple[list[int], int]]:
    """ZeRO-3's optimizer sub-groups: (each parameter's partition, the full elements), ``_create_fp16_sub_groups``."""
    sub_group_size = int(zero.get("sub_group_size", int(1e9)) or int(1e9))
    out: list[tuple[list[int], int]] = []
    for g_part, g_full in zip(partitions, groups):
        if sub_group_size >= sum(g_part):
            out.append((list(g_part), sum(g_full)))
            continue
        start = acc = 0
        for k, np_ in enumerate(g_part):
            acc += np_
            if acc >= sub_group_size or k == len(g_part) - 1:
                out.append((list(g_part[start:k + 1]), sum(g_full[start:k + 1])))
                start, acc = k + 1, 0
    return out


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
    off_opt, opt_device = _offload(zero, "offload_optimizer")
    off_param, param_device = _offload(zero, "offload_param")
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
        if opt_device in ("cpu", "nvme"):  # NOTE: ZeRO-1/2 swap nothing: "nvme" is the CPU path
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
        partitions = [[math.ceil(n / n_ranks) for n in g] for g in groups]
        p_total = sum(sum(g) for g in partitions)
        sub_groups = _sub_groups(zero, partitions, groups)
        largest_sub_partition = max((sum(s[0]) for s in sub_groups), default=0)
        largest_sub_full = max((s[1] for s in sub_groups), default=0)
        min_swap, alignment = _swap_sizes(config)
        # NOTE: a sub-group under min_swap fp32 bytes keeps its fp32 partition, state and gradient buffer in RAM
        in_ram = [sum(s[0]) for s in sub_groups if opt_device == "cpu" or 4 * sum(s[0]) < min_swap]
        if opt_device in ("cpu", "nvme"):
            pinned = bool(off_opt.get("pin_memory", False))
            parts["gradient partitions"] = pin(grad_accum * p_total, pinned)
            parts["fp32 gradient buffers"] = sum(pin(4 * n, pinned) for n in in_ram)
            parts["fp32 partitions"] = 4 * sum(in_ram)
            parts["optimizer state"] = state_bytes_per_element * sum(in_ram)
            # NOTE: two transients at different moments (a sub-group's fp32 copy, `gradient_buffer`): the larger counts
            parts["init transient (largest sub-group)"] = 4 * max(largest_sub_full, largest_sub_partition)
        if opt_device == "nvme":  # `SwapBufferManager`: buffer_count fp32 buffers of the largest sub-group
            count = int(off_opt.get("buffer_count", 4))
            parts["NVMe optimizer swap buffers"] = count * 4 * _aligned(largest_sub_partition, 4, alignment)
        if param_device == "cpu":
            pinned = bool(off_param.get("pin_memory", False))
            parts["16-bit parameter partitions"] = sum(pin(w * sum(g), pinned) for g in partitions)
            if pinned and cuda:
                parts["pageable copy while pinning"] = w * max((sum(g) for g in partitions), default=0)
        elif param_device == "nvme":
            count, size = int(off_param.get("buffer_count", 5)), int(off_param.get("buffer_size", int(1e8)))
            parts["NVMe parameter swap buffers"] = count * w * _aligned(size, w, alignment)
            # NOTE: each group's flat pinned buffer, up to max_in_cpu elements over the groups; the partitions of
            # the groups past it (under min_swap bytes, they stay in RAM unflattened) are not counted
            room, kept = int(off_param.get("max_in_cpu", int(1e9))), []
            for g in partitions:
                kept.append(max(0, min(sum(g), room)))
                room -= sum(g)
            parts["16-bit parameters kept in RAM (max_in_cpu)"] = sum(pin(w * n) for n in kept)
        elif not cuda:
            parts["device buffers in host RAM (16-bit partitions)"] = w * p_total
    return {k: int(v) for k, v in parts.items() if v}


def zero_nvme_disk_bytes(
    config: dict[str, Any],
    groups: Sequence[Sequence[int]],
    *,
    world_size: int,
    state_bytes_per_element: float = 8.0,
    frozen: Sequence[int] = (),
) -> dict[str, int]:
    """Bytes one process of a ZeRO-3 run with NVMe offload (ZeRO-Infinity) writes under its ``nvme_path``, by part
    (:data:`DISK_PARTS`; empty without it), for the final DeepSpeed ``config``, the trainable element counts per param
    group and the ``frozen`` parameters' counts. DeepSpeed swaps a tensor of at least ``max(1 MiB, aio.block_size)``
    bytes, each to a file padded to the I/O alignment, and keeps the files until the next run starts."""
    zero = config.get("zero_optimization", {}) or {}
    if int(zero.get("stage", 0)) != 3:
        return {}
    _, opt_device = _offload(zero, "offload_optimizer")
    _, param_device = _offload(zero, "offload_param")
    w = 2 if (enabled(config.get("fp16")) or enabled(config.get("bf16"))) else 4
    n_ranks = max(1, int(world_size))
    partitions = [[math.ceil(n / n_ranks) for n in g] for g in groups]
    min_swap, alignment = _swap_sizes(config)
    parts: dict[str, float] = {}
    if opt_device == "nvme":
        swapped = [s[0] for s in _sub_groups(zero, partitions, groups) if 4 * sum(s[0]) >= min_swap]
        elements = sum(_aligned(sum(p), 4, alignment) for p in swapped)
        parts["fp32 master partitions"] = 4 * elements
        parts["optimizer state"] = state_bytes_per_element * elements
        # NOTE: per parameter: a gradient partition under min_swap bytes stays in RAM
        parts["fp32 gradient partitions"] = sum(4 * n for p in swapped for n in p if 4 * n >= min_swap)
    if param_device == "nvme":  # NOTE: every partition, also those max_in_cpu keeps in RAM (written at partitioning)
        every = [n for g in partitions for n in g] + [math.ceil(n / n_ranks) for n in frozen]
        parts["16-bit parameter partitions"] = sum(w * _aligned(n, w, alignment) for n in every if w * n >= min_swap)
    return {k: int(v) for k, v in parts.items() if v}


def _numels(params: Any) -> list[int]:
    """Element counts, the full ones of parameters ZeRO-3 has partitioned already (``zero.Init``)."""
    return [int(getattr(p, "ds_numel", p.numel())) for p in params]


def check_zero_nvme_space(strategy: Any, optimizer: Any) -> None:
    """Refuse (``ValueError``) when the NVMe offload directories cannot hold what DeepSpeed will swap there for every
    process of this machine (an earlier run's swap files under ``zero_stage_3``, which it replaces, count as free)."""
    zero = strategy.config.get("zero_optimization") or {}
    groups = [_numels(p for p in g["params"] if p.requires_grad) for g in optimizer.param_groups]
    module = strategy.lightning_module
    frozen = _numels(p for p in module.parameters() if not p.requires_grad) if module is not None else []
    per_element = expected_state_bytes(optimizer) / max(1, sum(map(sum, groups)))
    parts = zero_nvme_disk_bytes(strategy.config, groups, world_size=strategy.world_size,
                                 state_bytes_per_element=per_element, frozen=frozen)
    if not parts:
        return
    local = max(1, len(strategy.parallel_devices or [None]))
    need: dict[str, dict[str, int]] = {}
    for name, nbytes in parts.items():
        path = (zero.get(DISK_PARTS[name][1]) or {}).get("nvme_path")
        if path is not None:  # NOTE: without one DeepSpeed refuses the config itself
            need.setdefault(str(Path(path).expanduser()), {})[name] = nbytes * local
    problems = []
    if strategy.is_global_zero:
        for path, by_part in need.items():
            old = Path(path, "zero_stage_3")
            reused = sum(f.stat().st_size for f in old.rglob("*") if f.is_file()) if old.is_dir() else 0
            drive = Path(path)
            while not drive.exists() and drive != drive.parent:  # NOTE: DeepSpeed creates a missing directory
                drive = drive.parent
            free = shutil.disk_usage(drive).free + reused
            if sum(by_part.values()) > free:
                listed = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in by_part.items())
                problems.append(
                    f"DeepSpeed will swap {fmt_bytes(sum(by_part.values()))} to `nvme_path={path!r}` ({listed}; "
                    f"{local} process(es) on this machine) and {fmt_bytes(free)} are free there"
                    + (f" (with the {fmt_bytes(reused)} of an earlier run's swap files it replaces)" if reused else "")
                )
    problems = strategy.broadcast(problems)
    if problems:
        raise ValueError(
            f"`{type(strategy).__name__}` (ZeRO-3 with NVMe offload): " + "; ".join(problems) + ". Fix: free space "
            "there, pass an `nvme_path` on a larger drive, or shard over more processes or machines (each process "
            "swaps 1/N of the model states)."
        )


def check_zero_host_memory(strategy: Any, optimizer: Any) -> None:
    """Refuse (``HostMemoryError``) when the host RAM that ``strategy``'s offload will allocate is not available
    (before its engine exists; rank 0 decides for every process, so none waits in a collective)."""
    groups = [_numels(p for p in g["params"] if p.requires_grad) for g in optimizer.param_groups]
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


"""How many repeated blocks ``lowmem_offload_params`` streams (``offload_params=True`` or ``"auto"``), and the stream
that moves them (:class:`~lightning_lowmem.strategies.offload.param_stream.ParamStream`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from lightning_lowmem.core.units import fmt_size
from lightning_lowmem.strategies.offload.param_stream import _FREES_IN_FLIGHT, OffloadParams, ParamStream, block_params

log = logging.getLogger(__name__)

# NOTE: the default budget of "auto" on CUDA leaves this share of the free memory (at least 2 GiB) to all but weights
ACTIVATION_SHARE = 0.25
MIN_RESERVE = 2 * 2**30


def plan_resident(block_bytes: Sequence[int], other_bytes: int, budget: int, prefetch: int, released: int = 0) -> int:
    """How many blocks (the first ones) stay resident under ``budget`` bytes of compute weights, beside the non-block
    weights and ``prefetch + 1 + released`` streamed blocks (a ValueError names the least budget if they do not fit)."""
    n = len(block_bytes)
    largest = max(block_bytes, default=0)
    if other_bytes + sum(block_bytes) <= budget:
        return n
    window = min(prefetch + 1 + released, n)
    minimum = other_bytes + window * largest
    if minimum > budget:
        why = "prefetch + 1" + (f" + {released} released, still read by the GPU" if released else "")
        raise ValueError(
            f"Passed `device_budget={budget}` ({fmt_size(budget)}); streaming needs at least {minimum} bytes "
            f"({fmt_size(minimum)}) for the compute weights: {fmt_size(other_bytes)} outside the blocks plus "
            f"{window} block(s) of {fmt_size(largest)} ({why}). Pass a larger budget, or a smaller `prefetch`."
        )
    keep, used = 0, minimum
    while keep < n and used + block_bytes[keep] <= budget:
        used += block_bytes[keep]
        keep += 1
    # NOTE: conservative: the window in flight is counted as prefetch + 1 blocks even when fewer stay streamed
    return min(keep, n)


def default_budget(device: torch.device) -> int:
    """On CUDA: the free memory now minus a reserve (25 %, at least 2 GiB) for activations and the context."""
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, int(free - max(MIN_RESERVE, ACTIVATION_SHARE * free)))


def plan_stream(
    module: nn.Module, offload_params: OffloadParams, budget: int | None, prefetch: int, device: torch.device,
    logger: logging.Logger = log,
) -> tuple[ParamStream, int]:
    """The stream of ``module``'s blocks and how many stay resident: none with ``offload_params=True``; under
    ``"auto"`` the first ones that fit ``budget`` bytes of compute weights (the choice is logged)."""
    _, per_block, rest = block_params(module)
    sizes = [sum(p.numel() * p.element_size() for p in ps) for ps in per_block]
    other = sum(p.numel() * p.element_size() for p in rest)
    if offload_params is True or budget is None:
        resident = 0
    else:
        released = _FREES_IN_FLIGHT if device.type == "cuda" else 0
        resident = plan_resident(sizes, other, budget, prefetch, released)
        logger.info(
            "lowmem_offload(offload_params='auto'): %d of %d blocks resident, %d streamed (budget %s for the compute "
            "weights: %s outside the blocks, %s per block; predicted weights on the device at most %s)",
            resident, len(sizes), len(sizes) - resident, fmt_size(budget), fmt_size(other),
            fmt_size(max(sizes, default=0)),
            fmt_size(other + sum(sizes[:resident]) + sum(sorted(sizes[resident:])[-(prefetch + 1 + released):])),
        )  # fmt: skip
    streamed = [b >= resident and bool(ps) for b, ps in enumerate(per_block)]
    return ParamStream(module, streamed, prefetch, device), resident


def stream_problems(offload_params: OffloadParams, device_budget: int | None, module: nn.Module,
                    device: torch.device) -> list[str]:
    """What ``offload_params`` cannot do with ``module`` (no repeated blocks; no budget off CUDA)."""
    if offload_params is False:
        return []
    problems = []
    _, per_block, _ = block_params(module)
    if offload_params is True and not any(per_block):
        names = [n for n, _ in module.named_parameters()]
        shown = ", ".join(f"`{n}`" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        problems.append(
            f"`offload_params=True` streams the weights of repeated blocks (the children of an `nn.ModuleList` of two "
            f"or more modules of one class), and `{type(module).__name__}` has none: no parameter would stream, all "
            f"{len(names)} ({shown}) would stay on the device. Put the repeated layers in an `nn.ModuleList`, or pass "
            "`offload_params='auto'` (streams what it finds, here nothing) or `offload_params=False`"
        )
    if offload_params == "auto" and device_budget is None and device.type != "cuda":
        problems.append(
            f"`offload_params='auto'` on the '{device.type}' device needs `device_budget` (bytes for the "
            "compute weights, e.g. `device_budget='6GiB'`); only on CUDA does it default to the free memory"
        )
    return problems


__all__ = ["default_budget", "plan_resident", "plan_stream", "stream_problems"]

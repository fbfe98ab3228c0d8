"""Host RAM that ``lowmem_offload`` allocates, and the check made before it allocates any (private helper).

:func:`host_bytes_needed` adds up, by part, what :class:`~lightning_lowmem.strategies.offload.strategy.OffloadStrategy`
will hold on the host: fp32 masters (4 B/param; none for most frozen parameters, see ``frozen_without_master``), fp32 gradient buffers (4 B/trainable param, none with
``optimizer_in_backward``), the state of the optimizer that will step (the table of
:mod:`lightning_lowmem.core.optimizer_state`, shared with the analytic bound; the callback's own figure when a
``LeanOptimizer`` replaces the optimizer), the copies of the masters and that state kept by ``host_pass="overlap"``,
the pinned staging buckets on CUDA (the compute weights themselves on the CPU) and the host copies of streamed
blocks. :func:`check_host_ram`
compares the total with what this process may allocate (:func:`lightning_lowmem.core.host_memory.check_host_memory`)
and refuses to start, naming the parts and the fixes, instead of being killed mid-setup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core import host_memory as _host_memory
from lightning_lowmem.core.optimizer_state import expected_state_bytes
from lightning_lowmem.core.roles import LeanOptimizerSwap, LowBitOptimizerSwap
from lightning_lowmem.strategies.offload import host_pass as _host_pass
from lightning_lowmem.strategies.offload import host_pass_checks
from lightning_lowmem.strategies.offload.delayed_step import uses_landing_slots
from lightning_lowmem.strategies.offload.masters import HostMasters, frozen_without_master
from lightning_lowmem.strategies.offload.param_stream import block_params
from lightning_lowmem.strategies.offload.precision import autocast_cast_params
from lightning_lowmem.strategies.offload.transfer import planned_staging_bytes

if TYPE_CHECKING:
    from lightning_lowmem.strategies.offload.strategy import OffloadStrategy


def host_bytes_needed(
    strategy: OffloadStrategy,
    module: torch.nn.Module,
    optimizers: list[Optimizer],
    with_grads: bool = True,
    callbacks: Sequence[Any] = (),
) -> dict[str, int]:
    """Host bytes ``strategy`` will allocate for ``module`` and ``optimizers``, by part (see the module docstring)."""
    precision = strategy.precision_plugin
    frozen = frozen_without_master(module, precision, bool(getattr(strategy, "_loading", False)))
    mastered = [p for _, p in HostMasters.unique_params(module) if id(p) not in frozen]
    numel = sum(p.numel() for p in mastered)
    trainable = sum(p.numel() for p in mastered if p.requires_grad)
    dtype = precision.compute_dtype  # type: ignore[attr-defined]
    low_bit = next((cb for cb in callbacks if isinstance(cb, LowBitOptimizerSwap)), None)
    lean = next((cb for cb in callbacks if isinstance(cb, LeanOptimizerSwap)), None)
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    half = {id(p) for p in autocast_cast_params(module)} if precision.mixed else None  # type: ignore[attr-defined]
    # NOTE: on CUDA the staging covers the mastered parameters only; on the CPU every compute weight is host RAM
    staged = mastered if strategy.root_device.type == "cuda" else [p for _, p in HostMasters.unique_params(module)]
    specs = [(p.numel(), dtype if half is None or id(p) in half else torch.float32) for p in staged]
    if lean is not None:
        state = sum(lean.expected_state_bytes(opt, module) for opt in optimizers)
    else:
        state = sum(expected_state_bytes(opt, low_bit, embeddings) for opt in optimizers)
    # NOTE: the overlapped pass keeps, between steps, a copy of every master it stepped (all trainable ones at most) and of
    # its optimizer state (`HostPass._kept`, reused, never trimmed): only for a step it runs (torch's Adam/AdamW/SGD and
    # bitsandbytes' 8-bit ones, see `host_pass_checks.why_serial`; a LowBitOptimizer swap unless paged or with the
    # stable embedding's per-parameter overrides; never a LeanOptimizer swap, whose step stays serial)
    swapped_in = low_bit is None or (low_bit.kind != "paged_adamw8bit" and not (low_bit.stable_embedding and embeddings))
    copies = largest = 0
    if strategy.host_pass == "overlap" and swapped_in and lean is None:
        attached = isinstance(module, pl.LightningModule) and lightning_internals.attached_trainer(module) is not None
        for opt in optimizers:
            # NOTE: in a Trainer every reason the step stays serial is known; without one (a bare strategy), only the
            # optimizer's kind and optimizer-in-backward decide
            if attached and host_pass_checks.why_serial(strategy, opt, module) is not None:
                continue
            if not host_pass_checks.overlaps(opt) or strategy.optimizer_in_backward:
                continue
            stepped = {id(p): p for g in opt.param_groups for p in g["params"] if p.requires_grad and id(p) not in frozen}
            copies += 4 * sum(p.numel() for p in stepped.values()) + expected_state_bytes(opt, low_bit, embeddings)
            largest = max([largest, *(p.numel() for p in stepped.values())])
        value_clip = host_pass_checks.trainer_clip(module.trainer if attached else None)[1]
        if largest and (value_clip is not None or getattr(strategy.precision_plugin, "scaler", None) is not None):
            copies += _host_pass.BUCKET_BYTES + 4 * largest  # NOTE: the reused buffer of one bucket's working gradients
    parts = {
        "masters": 4 * numel,
        # NOTE: host_pass="delayed" folds the next window into a second set while the worker steps with the first
        "gradient_buffers": (8 if strategy.host_pass == "delayed" else 4) * trainable
        if with_grads and not strategy.optimizer_in_backward else 0,
        "optimizer_state": state,
        "host_pass_copies": copies,
        # on CUDA: pinned staging in the compute dtype, flat buckets as torch's pinned allocator reserves them
        # (see [staging buckets]), twice under host_pass="delayed" without streaming (its landing slots); on CPU: the
        # compute weights share host RAM
        "staging_or_compute_weights": planned_staging_bytes(strategy.root_device, specs, landing=uses_landing_slots(strategy)),
        "streamed_weights": streamed_host_bytes(strategy.offload_params, module, dtype),
    }
    parts["total"] = sum(parts.values())
    return parts


def streamed_host_bytes(offload_params: Any, module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Host copies of the streamed blocks (all blocks under ``True``; counted for all under ``"auto"`` too)."""
    if offload_params is False:
        return 0
    _, per_block, _ = block_params(module)
    size = torch.empty((), dtype=dtype).element_size()
    # NOTE: a packed 4-bit weight (bitsandbytes) keeps its uint8 bytes; floating-point weights are in the compute dtype
    return sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for ps in per_block for p in ps)


def check_host_ram(strategy: OffloadStrategy, module: torch.nn.Module, optimizers: list[Optimizer], with_grads: bool) -> None:
    """Raise (naming the parts and the fixes) when the host cannot hold what ``strategy`` is about to allocate."""
    trainer = lightning_internals.attached_trainer(strategy.lightning_module)
    need = strategy.host_bytes_needed(module, optimizers, with_grads, trainer.callbacks if trainer else ())
    need.pop("total")
    swapped = any(isinstance(cb, (LowBitOptimizerSwap, LeanOptimizerSwap)) for cb in (trainer.callbacks if trainer else ()))
    fixes = []
    if need["optimizer_state"] and not swapped:
        fixes.append("8-bit optimizer state (`callbacks=[LowBitOptimizer()]`, ~2 B/param for Adam instead of 8) or a "
                     "lean optimizer (`callbacks=[LeanOptimizer(kind='galore')]`, 'apollo_mini', 'adamw4bit', ...)")
    if need["host_pass_copies"]:
        fixes.append("`OffloadStrategy(host_pass='serial')` (no copies of the masters and optimizer state)")
    if strategy.host_pass == "delayed" and need["gradient_buffers"]:
        fixes.append("`OffloadStrategy(host_pass='serial')` (one set of gradient buffers, not two)")
    if need["gradient_buffers"]:
        fixes.append("`OffloadStrategy(optimizer_in_backward=True)` (no gradient buffers)")
    fixes += [
        "a smaller model, or a machine/container with more RAM (or raise the limit named above)",
        "`OffloadStrategy(check_host_memory=False)` to try anyway",
    ]
    _host_memory.check_host_memory(
        {k.replace("_", " "): v for k, v in need.items()}, who="`OffloadStrategy` (strategy='lowmem_offload')",
        fixes=fixes,
    )

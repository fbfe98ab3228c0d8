"""What ``lowmem_offload`` refuses, and why: each check collects every problem it sees (naming what was passed and what
to do), and the strategy raises them together."""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from lightning_lowmem.core.units import parse_bytes
from lightning_lowmem.strategies.offload import hf_weights
from lightning_lowmem.strategies.offload.host_optimizer import HOST_OPTIMIZERS, why_not_fused
from lightning_lowmem.strategies.offload.nonfinite import NONFINITE
from lightning_lowmem.strategies.offload.param_stream import OFFLOAD_PARAMS
from lightning_lowmem.strategies.offload.precision import PRECISIONS, MasterHalfPrecision


def trainer_problems(accelerator: Accelerator | None, devices: list[torch.device] | None, module: pl.LightningModule,
                     trainer: pl.Trainer, precision: Any, offload_params: Any) -> list[str]:
    """What ``lowmem_offload`` cannot run in this Trainer and module (accelerator, devices, precision, callbacks)."""
    problems: list[str] = []
    if not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator)):
        problems.append(
            f"it runs on the 'cpu' or 'cuda' accelerator, got `{type(accelerator).__name__}`; "
            "pass `accelerator='cuda'` (or 'cpu')"
        )
    if devices and len(devices) > 1:
        problems.append(
            f"it trains on one device, got {len(devices)} ({devices}); pass `devices=1` "
            "(for several GPUs use `strategy='lowmem_zero2_offload'`)"
        )
    if not any(p.is_floating_point() for p in module.parameters()):
        problems.append(
            f"`{type(module).__name__}` has no floating-point parameters, so there are no weights to keep "
            "masters of; create the layers in `__init__` or `configure_model`"
        )
    wide = [n for n, p in module.named_parameters() if p.dtype == torch.float64]
    if wide and precision.weight_dtype == torch.float32:
        # NOTE: fp32 masters would round a float64 update (under "*-true" plain Lightning casts the parameter too)
        names = ", ".join(f"`{n}`" for n in wide[:3]) + (f" and {len(wide) - 3} more" if len(wide) > 3 else "")
        problems.append(
            f"float64 parameters ({names}) would be trained through fp32 masters and given back as fp32, where "
            f"plain Lightning's precision='{precision.precision}' keeps them float64; cast them to "
            "float32 in your module, or train it without `lowmem_offload`"
        )
    fitting = trainer.state.fn == TrainerFn.FITTING
    if precision.precision == "16-true" and not module.automatic_optimization and fitting:
        # NOTE: "16-mixed" is allowed: plain Lightning's GradScaler leaves the gradients loss-scaled until the step too
        problems.append(
            "manual optimization with precision='16-true' is not supported: its fp16 gradients need a loss scale, "
            "so code between `manual_backward` and `opt.step()` would read (and clip) gradients multiplied by it, "
            "where plain Lightning's '16-true' has no loss scale; use precision='16-mixed' (gradients loss-scaled "
            "until the step, as plain Lightning's GradScaler leaves them), 'bf16-true', 'bf16-mixed' or '32-true'"
        )
    return problems + (callback_problems(trainer, offload_params) if fitting else [])


def callback_problems(trainer: pl.Trainer, offload_params: Any) -> list[str]:
    """The Lightning callbacks of ``trainer`` that ``lowmem_offload`` (``offload_params``: streaming) refuses."""
    problems = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        name = type(callback).__name__
        if isinstance(callback, BaseFinetuning):
            problems.append(
                f"`{name}` (a `BaseFinetuning`) matches the optimizer's parameters to the module's, and under "
                "lowmem_offload the optimizer holds the fp32 host masters; unfreeze in your own hook instead "
                "(`requires_grad_(True)` on the layers, then `optimizer.add_param_group({'params': layer.parameters()})`: "
                "the strategy gives them masters at the next batch), or train without `lowmem_offload`"
            )
        elif isinstance(callback, (StochasticWeightAveraging, WeightAveraging)) and offload_params is not False:
            problems.append(
                f"`{name}` averages the module's parameters, and under `offload_params` a streamed block's parameters "
                "hold placeholders between uses; use `offload_params=False` (strategy='lowmem_offload')"
            )
    return problems


def to_master_precision(plugin: Precision | None, strategy: str = "lowmem_offload") -> Precision | None:
    if plugin is None or isinstance(plugin, MasterHalfPrecision):
        return plugin
    name = getattr(plugin, "precision", None)
    if type(plugin) in (Precision, HalfPrecision, MixedPrecision) and name in PRECISIONS:
        return MasterHalfPrecision(name)  # type: ignore[arg-type]
    raise ValueError(
        f"`strategy='{strategy}'` got `precision={name!r}` (`{type(plugin).__name__}`); it supports "
        f"{', '.join(map(repr, PRECISIONS))}: compute weights in that dtype on the device and fp32 masters on the host. "
        "Pass one of these as `Trainer(precision=...)`, or `plugins=[MasterHalfPrecision(...)]` to set the loss scaler."
    )


def check_host_can_run(optimizer: Optimizer, host_optimizer: str) -> None:
    """Refuse optimizers that cannot step fp32 masters on the host, naming why and what to use instead."""
    problems = []
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        problems.append(f"`{name}` re-evaluates the loss inside `step()`; `lowmem_offload` steps once per backward")
    if isinstance(optimizer, torch.optim.SparseAdam):
        problems.append("`SparseAdam` needs sparse gradients; host gradient buffers are dense (use `AdamW`)")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("capturable"):
            problems.append(f"param group {i} has `capturable=True` (CUDA graphs); the host step cannot capture")
        if group.get("fused") and type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
            problems.append(f"param group {i} has `fused=True`, which torch has no CPU kernel for in `{name}`")
    reason = why_not_fused(optimizer) if host_optimizer == "torch_fused" else None
    if reason is not None:
        problems.append(f"`host_optimizer='torch_fused'` cannot fuse it ({reason}); use 'auto' or 'as_is'")
    if problems:
        raise ValueError(
            f"The host cannot run the optimizer `{name}` under `lowmem_offload`: " + "; ".join(problems) + "."
        )


def check_flags(**flags: Any) -> None:
    """TypeError/ValueError for every bad constructor argument at once, each naming the value and what is expected."""
    problems: list[str] = []
    type_error = False
    for name in ("optimizer_in_backward", "check_host_memory"):
        if not isinstance(flags[name], bool):
            problems.append(f"`{name}={flags[name]!r}`; expected True or False")
            type_error = True
    if flags["host_optimizer"] not in HOST_OPTIMIZERS:
        problems.append(f"`host_optimizer={flags['host_optimizer']!r}`; expected one of {', '.join(map(repr, HOST_OPTIMIZERS))}")
    if flags["nonfinite"] not in NONFINITE:
        problems.append(f"`nonfinite={flags['nonfinite']!r}`; expected one of {', '.join(map(repr, NONFINITE))}")
    if not any(flags["offload_params"] is v or (isinstance(v, str) and flags["offload_params"] == v) for v in OFFLOAD_PARAMS):
        problems.append(f"`offload_params={flags['offload_params']!r}`; expected False, True or 'auto'")
    prefetch = flags["prefetch"]
    not_int = isinstance(prefetch, bool) or not isinstance(prefetch, int)
    if not_int or prefetch < 0:
        problems.append(f"`prefetch={prefetch!r}`; expected an int >= 0 (how many blocks to copy ahead)")
        type_error |= not_int
    if flags["load_weights"] is not None and not isinstance(flags["load_weights"], (str, os.PathLike)):
        problems.append(f"`load_weights={flags['load_weights']!r}`; expected a directory (str or os.PathLike)")
        type_error = True
    elif flags["load_weights"] is not None:
        try:
            hf_weights.shard_files(flags["load_weights"])
        except ValueError as err:
            problems.append(str(err).removeprefix("Passed "))
    if flags["device_budget"] is not None:
        try:
            parse_bytes(flags["device_budget"], "`device_budget`")
        except (TypeError, ValueError) as err:
            problems.append(f"`device_budget={flags['device_budget']!r}` ({err})")
            type_error |= isinstance(err, TypeError)
        else:
            if flags["offload_params"] in (False, True):  # NOTE: only "auto" reads it (which blocks stream)
                warnings.warn(
                    f"OffloadStrategy: `device_budget={flags['device_budget']!r}` is used only with "
                    f"`offload_params='auto'` (to choose which blocks stream); with `offload_params="
                    f"{flags['offload_params']!r}` it is ignored. Pass `offload_params='auto'`, or remove it.",
                    UserWarning, stacklevel=3,
                )
    disk = flags["disk"]
    if disk is not None and disk is not False:
        if disk is not True and not isinstance(disk, (str, os.PathLike)):
            problems.append(f"`disk={disk!r}`; expected a directory (str or os.PathLike), True (the Trainer's "
                            "`default_root_dir`) or None")
            type_error = True
        elif disk is not True and not os.path.isdir(disk):
            problems.append(f"`disk={os.fspath(disk)!r}`, which is not a directory; create it (on a local disk, an "
                            "NVMe SSD is best) or pass another")
        if not flags["optimizer_in_backward"]:
            problems.append(f"`disk={disk!r}` with `optimizer_in_backward=False`; the disk tier streams each "
                            "parameter's master and optimizer state through its step as its gradient lands: pass "
                            "`optimizer_in_backward=True` (or use strategy='lowmem_offload_disk')")
    try:
        if flags["disk_buffer"] != "auto":
            parse_bytes(flags["disk_buffer"], "`disk_buffer`")
    except (TypeError, ValueError) as err:
        problems.append(f"`disk_buffer={flags['disk_buffer']!r}` ({err})")
        type_error |= isinstance(err, TypeError)
    skips = flags["max_consecutive_skips"]
    not_int = isinstance(skips, bool) or not isinstance(skips, int)
    if not_int or skips < 1:
        problems.append(f"`max_consecutive_skips={skips!r}`; expected an int >= 1")
        type_error |= not_int
    if problems:
        raise (TypeError if type_error else ValueError)("OffloadStrategy: passed " + "; passed ".join(problems) + ".")

"""What ``lowmem_offload`` refuses, and why (private helper of :mod:`~lightning_lowmem.strategies.offload.strategy`).

Every check collects all the problems it can see and the strategy raises them together, each naming what
was passed and what to do: the constructor's flags (:func:`check_flags`), the Trainer, module and precision
at setup (:func:`trainer_problems`, :func:`streaming_problems`, :func:`loading_problems`), the optimizers the
host cannot step (:func:`check_host_can_run`) and the Trainer's precision plugin (:func:`to_master_precision`).
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

from lightning_lowmem.core.lightning_callbacks import lightning_callback_problems
from lightning_lowmem.core.units import parse_bytes
from lightning_lowmem.strategies.offload import hf_weights
from lightning_lowmem.strategies.offload import host_optimizer as _host_optimizer
from lightning_lowmem.strategies.offload.host_optimizer import HOST_OPTIMIZERS
from lightning_lowmem.strategies.offload.host_pass import HOST_PASSES
from lightning_lowmem.strategies.offload.param_stream import OFFLOAD_PARAMS, block_params
from lightning_lowmem.strategies.offload.precision import PRECISIONS, MasterHalfPrecision

if TYPE_CHECKING:
    from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

NonFinite = Literal["skip", "raise", "ignore"]
NONFINITE: tuple[str, ...] = get_args(NonFinite)


def trainer_problems(strategy: OffloadStrategy, module: pl.LightningModule, trainer: pl.Trainer) -> list[str]:
    """What ``strategy`` cannot run in this Trainer and module (accelerator, devices, precision, optimizer_in_backward)."""
    problems: list[str] = []
    if not isinstance(strategy.accelerator, (CPUAccelerator, CUDAAccelerator)):
        problems.append(
            f"it runs on the 'cpu' or 'cuda' accelerator, got `{type(strategy.accelerator).__name__}`; "
            "pass `accelerator='cuda'` (or 'cpu')"
        )
    if strategy.parallel_devices and len(strategy.parallel_devices) > 1:
        problems.append(
            f"it trains on one device, got {len(strategy.parallel_devices)} ({strategy.parallel_devices}); pass `devices=1` "
            "(for several GPUs use `strategy='lowmem_zero2_offload'`)"
        )
    if not any(p.is_floating_point() for p in module.parameters()):
        problems.append(
            f"`{type(module).__name__}` has no floating-point parameters, so there are no weights to keep "
            "masters of; create the layers in `__init__` or `configure_model`"
        )
    wide = [n for n, p in module.named_parameters() if p.dtype == torch.float64]
    if wide and (strategy.precision_plugin.mixed or strategy.precision_plugin.precision == "32-true"):  # type: ignore[union-attr]
        # NOTE: its masters are fp32: the update would be rounded to fp32 where plain Lightning keeps float64 (under
        # "*-true" half precision plain Lightning casts the parameter itself, and the fp32 master holds more)
        names = ", ".join(f"`{n}`" for n in wide[:3]) + (f" and {len(wide) - 3} more" if len(wide) > 3 else "")
        problems.append(
            f"float64 parameters ({names}) would be trained through fp32 masters and given back as fp32, where "
            f"plain Lightning's precision='{strategy.precision_plugin.precision}' keeps them float64; cast them to "  # type: ignore[union-attr]
            "float32 in your module, or train it without `lowmem_offload`"
        )
    fp16 = strategy.precision_plugin.precision.startswith("16-")  # type: ignore[union-attr]
    fp16_true = fp16 and not strategy.precision_plugin.mixed  # type: ignore[union-attr]
    if fp16_true and not module.automatic_optimization and trainer.state.fn == TrainerFn.FITTING:
        # NOTE: "16-mixed" is allowed: plain Lightning's GradScaler leaves the gradients loss-scaled until the step too
        problems.append(
            "manual optimization with precision='16-true' is not supported: its fp16 gradients need a loss scale, "
            "so code between `manual_backward` and `opt.step()` would read (and clip) gradients multiplied by it, "
            "where plain Lightning's '16-true' has no loss scale; use precision='16-mixed' (gradients loss-scaled "
            "until the step, as plain Lightning's GradScaler leaves them), 'bf16-true', 'bf16-mixed' or '32-true'"
        )
    if strategy.optimizer_in_backward and trainer.state.fn == TrainerFn.FITTING:
        if trainer.accumulate_grad_batches != 1:
            problems.append(
                f"`optimizer_in_backward=True` steps each parameter during backward, so it cannot accumulate: "
                f"remove `accumulate_grad_batches={trainer.accumulate_grad_batches}` or set `optimizer_in_backward=False`"
            )
        algorithm = trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM
        if trainer.gradient_clip_val and GradClipAlgorithmType(algorithm) == GradClipAlgorithmType.NORM:
            problems.append(
                "`optimizer_in_backward=True` cannot clip by the global norm (it is known only after every "
                f"parameter has stepped): remove `gradient_clip_val={trainer.gradient_clip_val}`, use "
                "`gradient_clip_algorithm='value'`, or set `optimizer_in_backward=False`"
            )
        if fp16:
            problems.append(
                "`optimizer_in_backward=True` cannot use fp16: an overflow must skip the whole step, but "
                "parameters would already have stepped; use 'bf16-true'/'bf16-mixed'/'32-true'"
            )
        if not module.automatic_optimization:
            problems.append("`optimizer_in_backward=True` needs automatic optimization (the step happens in backward)")
        problems += lightning_callback_problems(trainer, module, "`optimizer_in_backward=True`")
        problems += _gradient_hook_problems(module)
    return problems


def _gradient_hook_problems(module: pl.LightningModule) -> list[str]:
    """``optimizer_in_backward``: the module's gradient hooks run after every parameter stepped and freed its gradient."""
    name = type(module).__name__
    problems = []
    if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
        problems.append(
            f"`optimizer_in_backward=True` steps each parameter inside backward, before `{name}.configure_gradient_clipping` "
            "runs, so your override would find no gradient to clip; remove it (`gradient_clip_val` with "
            "`gradient_clip_algorithm='value'` clips each gradient before its step) or set `optimizer_in_backward=False`"
        )
    late = [h for h in ("on_after_backward", "on_before_optimizer_step") if is_overridden(h, module, pl.LightningModule)]
    if late:
        warnings.warn(
            f"lowmem_offload(optimizer_in_backward=True) steps each parameter inside backward and frees its gradient: "
            f"{' and '.join(f'`{name}.{h}`' for h in late)} will see `p.grad is None` for every parameter. Read "
            "gradients in a tensor hook (`p.register_post_accumulate_grad_hook`), or set `optimizer_in_backward=False`.",
            UserWarning,
            stacklevel=2,
        )
    return problems


def streaming_problems(strategy: OffloadStrategy, module: torch.nn.Module) -> list[str]:
    """What ``offload_params`` cannot do with ``module`` (no repeated blocks; no budget off CUDA)."""
    if strategy.offload_params is False:
        return []
    problems = []
    _, per_block, _ = block_params(module)
    if strategy.offload_params is True and not any(per_block):
        names = [n for n, _ in module.named_parameters()]
        shown = ", ".join(f"`{n}`" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        problems.append(
            f"`offload_params=True` streams the weights of repeated blocks (the children of an `nn.ModuleList` of two "
            f"or more modules of one class), and `{type(module).__name__}` has none: no parameter would stream, all "
            f"{len(names)} ({shown}) would stay on the device. Put the repeated layers in an `nn.ModuleList`, or pass "
            "`offload_params='auto'` (streams what it finds, here nothing) or `offload_params=False`"
        )
    if strategy.offload_params == "auto" and strategy.device_budget is None and strategy.root_device.type != "cuda":
        problems.append(
            f"`offload_params='auto'` on the '{strategy.root_device.type}' device needs `device_budget` (bytes for the "
            "compute weights, e.g. `device_budget='6GiB'`); only on CUDA does it default to the free memory"
        )
    return problems


def loading_problems(
    load_weights: str | os.PathLike | None, module: torch.nn.Module, trainer: pl.Trainer
) -> tuple[bool, list[str]]:
    """Decide whether ``load_weights`` is read (not on resume: the checkpoint's weights win); what cannot work."""
    meta_params = [n for n, p in module.named_parameters() if p.is_meta]
    meta_buffers = [n for n, b in module.named_buffers() if b.is_meta]
    resuming = getattr(trainer, "ckpt_path", None) is not None
    loading = load_weights is not None and not resuming
    problems = []
    if meta_params and not loading:
        why = "resuming from `ckpt_path` (the checkpoint loads into real tensors only)" if resuming else (
            "no `load_weights` to fill them")
        problems.append(
            f"{len(meta_params)} parameters are on the meta device (`{meta_params[0]}`, ...) and {why}: pass "
            "`OffloadStrategy(load_weights=<save_pretrained directory>)`, or build the module under "
            "`trainer.init_module(empty_init=True)` to resume"
        )
    if meta_buffers:
        problems.append(
            f"buffers on the meta device ({', '.join(f'`{n}`' for n in meta_buffers[:3])}): checkpoints do not hold "
            "computed buffers (rotary `inv_freq`); build the module under `trainer.init_module(empty_init=True)` "
            "instead of the meta device (its weights still come from `load_weights` without an fp32 copy)"
        )
    return loading, problems


def to_master_precision(plugin: Precision | None) -> Precision | None:
    if plugin is None or isinstance(plugin, MasterHalfPrecision):
        return plugin
    name = getattr(plugin, "precision", None)
    if type(plugin) in (Precision, HalfPrecision, MixedPrecision) and name in PRECISIONS:
        return MasterHalfPrecision(name)  # type: ignore[arg-type]
    raise ValueError(
        f"`strategy='lowmem_offload'` got `precision={name!r}` (`{type(plugin).__name__}`); it supports "
        f"{', '.join(map(repr, PRECISIONS))}: compute weights in that dtype on the device and fp32 masters on the host. "
        "Pass one of these as `Trainer(precision=...)`, or `plugins=[MasterHalfPrecision(...)]` to set the loss scaler."
    )


_CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


def check_host_can_run(optimizer: Optimizer, host_optimizer: str) -> None:
    """Refuse optimizers that cannot step fp32 masters on the host, naming why and what to use instead."""
    problems = []
    name = type(optimizer).__name__
    if isinstance(optimizer, _CLOSURE_OPTIMIZERS):
        problems.append(f"`{name}` re-evaluates the loss inside `step()`; `lowmem_offload` steps once per backward")
    if isinstance(optimizer, torch.optim.SparseAdam):
        problems.append("`SparseAdam` needs sparse gradients; host gradient buffers are dense (use `AdamW`)")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("capturable"):
            problems.append(f"param group {i} has `capturable=True` (CUDA graphs); the host step cannot capture")
        if group.get("fused") and type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
            problems.append(f"param group {i} has `fused=True`, which torch has no CPU kernel for in `{name}`")
    reason = _host_optimizer.why_not_fused(optimizer) if host_optimizer == "torch_fused" else None
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
    if flags["host_pass"] not in HOST_PASSES:
        problems.append(f"`host_pass={flags['host_pass']!r}`; expected one of {', '.join(map(repr, HOST_PASSES))}")
    if flags["nonfinite"] not in NONFINITE:
        problems.append(f"`nonfinite={flags['nonfinite']!r}`; expected one of {', '.join(map(repr, NONFINITE))}")
    if not any(flags["offload_params"] is v or (isinstance(v, str) and flags["offload_params"] == v) for v in OFFLOAD_PARAMS):
        problems.append(f"`offload_params={flags['offload_params']!r}`; expected False, True or 'auto'")
    prefetch = flags["prefetch"]
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        problems.append(f"`prefetch={prefetch!r}`; expected an int >= 0 (how many blocks to copy ahead)")
        type_error |= isinstance(prefetch, bool) or not isinstance(prefetch, int)
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
    skips = flags["max_consecutive_skips"]
    if isinstance(skips, bool) or not isinstance(skips, int):
        problems.append(f"`max_consecutive_skips={skips!r}`; expected an int >= 1")
        type_error = True
    elif skips < 1:
        problems.append(f"`max_consecutive_skips={skips!r}`; expected an int >= 1")
    if problems:
        raise (TypeError if type_error else ValueError)("OffloadStrategy: passed " + "; passed ".join(problems) + ".")

"""What the ``lowmem_zero*`` presets refuse at setup, before DeepSpeed builds its engine: combinations that would
train differently from plain Lightning without a word, or fail inside DeepSpeed later."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import GradientAccumulationScheduler, LearningRateFinder, WeightAveraging
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.optional import require

# NOTE: modules whose fp32 running statistics meet the bf16/fp16 weights DeepSpeed casts in one kernel
_RUNNING_STATS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm1d,
                  nn.LazyBatchNorm2d, nn.LazyBatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
                  nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d)


def setup_problems(strategy: Any, trainer: Any, precision: str, config: dict[str, Any]) -> list[str]:
    """Every reason ``strategy`` (a ``ZeroStrategy``) cannot fit ``trainer`` with DeepSpeed ``config``, as sentences."""
    module = trainer.lightning_module
    problems = []
    if precision.startswith("16") and not isinstance(strategy.accelerator, CUDAAccelerator):
        accel = require("deepspeed", "The `lowmem_zero*` strategies (ZeroStrategy)").accelerator.get_accelerator()
        if not accel.is_fp16_supported():
            problems.append(
                f"`Trainer(precision={precision!r})` on the {type(strategy.accelerator).__name__}: DeepSpeed's CPU "
                "accelerator has no fp16 on this processor. Use `precision='bf16-mixed'` or '32-true'"
            )
    if str(trainer.gradient_clip_algorithm) in ("value", "GradClipAlgorithmType.VALUE"):
        problems.append(
            "`Trainer(gradient_clip_algorithm='value')`: DeepSpeed clips by norm only. Use "
            "`gradient_clip_algorithm='norm'`"
        )
    if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
        # NOTE: Lightning's DeepSpeedStrategy only warns, and the override's clipping silently never happens
        problems.append(
            f"`{type(module).__name__}.configure_gradient_clipping` is overridden, but DeepSpeed clips the gradients "
            "itself inside its step (by norm, from `Trainer(gradient_clip_val=...)`), so the override's "
            "`clip_gradients` calls would do nothing. Remove the override and set "
            "`Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm')`, or use `strategy='lowmem_offload'`"
        )
    for callback in trainer.callbacks:
        if isinstance(callback, GradientAccumulationScheduler):
            problems.append(
                f"`{type(callback).__name__}` changes `accumulate_grad_batches` while fitting, but DeepSpeed fixes "
                "`gradient_accumulation_steps` when its engine is built. Use a constant "
                "`Trainer(accumulate_grad_batches=...)` or `lightning_lowmem.AccumulationScheduler` with a fixed "
                "window; for a schedule that changes, use `strategy='lowmem_offload'`"
            )
        if isinstance(callback, LearningRateFinder):
            problems.append(
                f"`{type(callback).__name__}` (also `Tuner.lr_find`) builds its learning-rate ramp with a torch LR "
                "scheduler over the optimizer, which DeepSpeed wraps in its own (not a `torch.optim.Optimizer`). Find "
                "the learning rate without DeepSpeed (plain Lightning or `strategy='lowmem_offload'`, on a smaller "
                "model or batch if needed), then set it and remove the callback"
            )
        if isinstance(callback, WeightAveraging) and strategy.zero_stage_3 and _partitions_some(module, config):
            problems.append(
                f"`{type(callback).__name__}` averages the module's parameters into a copy, but ZeRO-3 partitions "
                "them (each process holds a slice; the module's own tensors are empty between forwards). Use "
                "`strategy='lowmem_zero2'` (or `lowmem_zero2_offload`), or `strategy='lowmem_offload'`"
            )
    return problems + module_problems(strategy, module, precision, config)


def module_problems(strategy: Any, module: nn.Module, precision: str, config: dict[str, Any]) -> list[str]:
    """The reasons of :func:`setup_problems` that depend on the module's layers (checked again after
    ``configure_model``)."""
    problems = _scalar_parameters(module)
    if strategy.zero_stage_3:
        problems += _compiled_submodules(module) + _input_jitter(module)
    if precision.startswith(("bf16", "16")):
        data_types = config.get("data_types")
        if not (isinstance(data_types, dict) and data_types.get("buffer_dtype") is not None):
            problems += _running_statistics(module, precision)
        problems += _pinned_compute_dtype(module, precision) if strategy.zero_stage_3 else []
    return problems


def _partitions_some(module: nn.Module, config: dict[str, Any]) -> bool:
    """Whether ZeRO-3 partitions any of ``module``'s parameters (above ``stage3_param_persistence_threshold``)."""
    threshold = config.get("zero_optimization", {}).get("stage3_param_persistence_threshold")
    if not isinstance(threshold, int) or isinstance(threshold, bool):
        return True
    return any(p.numel() > threshold for p in module.parameters())


def _names(found: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def _running_statistics(module: nn.Module, precision: str) -> list[str]:
    found = [name or type(module).__name__ for name, m in module.named_modules()
             if isinstance(m, _RUNNING_STATS) and getattr(m, "running_mean", None) is not None]
    # NOTE: a parametrization with buffers of its own (spectral norm's fp32 `_u`) meets the cast parameter too
    found += [f"{name}.parametrizations.{tensor}" if name else f"parametrizations.{tensor}"
              for name, m in module.named_modules() if parametrize.is_parametrized(m)
              for tensor, chain in m.parametrizations.items()
              if any(b.is_floating_point() for p in chain for b in p.buffers())]
    half = "bf16" if precision.startswith("bf16") else "fp16"
    return [(
        f"`Trainer(precision={precision!r})` on a module with running statistics or parametrization buffers "
        f"({_names(found)}): DeepSpeed's "
        f"{half} casts the parameters to {half} but keeps the buffers fp32, and the normalization fails on the mixed "
        f"dtypes at the first forward. Use `precision='32-true'`, or `strategy='lowmem_offload'` (whose "
        f"{precision} keeps the statistics fp32), or keep the statistics in {half} as `{half}-true` would with "
        f"`config={{'data_types': {{'buffer_dtype': '{half}'}}}}` (every floating buffer is cast)"
    )] if found else []


def _scalar_parameters(module: nn.Module) -> list[str]:
    found = [name for name, p in module.named_parameters() if p.dim() == 0]
    return [(
        f"0-dimensional parameters ({_names(found)}; neuralforecast's PatchTST attention `scale` is one): DeepSpeed "
        "flattens every parameter through a byte view, which a 0-d tensor cannot take ('self.dim() cannot be 0 to "
        "view Float as Byte', at the engine's start). Give each one dimension (`nn.Parameter(torch.tensor([value]))`), "
        "or use `strategy='lowmem_offload'`, which trains them"
    )] if found else []


def _compiled_submodules(module: nn.Module) -> list[str]:
    # NOTE: no public isinstance for a compiled module (see `_internals.torch.is_compiled_module`)
    found = [name or type(module).__name__ for name, m in module.named_modules()
             if torch_internals.is_compiled_module(m)]
    return [(
        f"ZeRO-3 on a module holding `torch.compile`-d submodules ({_names(found)}): ZeRO-3 installs its "
        "parameter-fetching hooks on every submodule, and DeepSpeed's engine fails on the compiled wrapper at the "
        "first forward. Use `strategy='lowmem_zero2'` (which trains it), or leave the submodules uncompiled under "
        "ZeRO-3"
    )] if found else []


# NOTE: Hugging Face's MoE routers that multiply their input by noise in place (Switch, NLLB-MoE, Mixtral; DBRX)
_JITTER_ATTRIBUTES = ("jitter_noise", "moe_jitter_eps")


def _input_jitter(module: nn.Module) -> list[str]:
    found = [name or type(module).__name__ for name, m in module.named_modules()
             if any(isinstance(v := getattr(m, a, None), (int, float)) and not isinstance(v, bool) and v > 0
                    for a in _JITTER_ATTRIBUTES)]
    return [(
        f"ZeRO-3 on a module whose submodules multiply their input by jitter noise in place while training "
        f"({_names(found)}; Hugging Face's `router_jitter_noise`): ZeRO-3 hands every submodule an alias of its inputs "
        "through DeepSpeed's own autograd function, so the in-place multiply changes the values the caller goes on "
        "using (a Switch router's input feeds the experts) but not the caller's gradients: the weights would silently "
        "differ from plain Lightning. Set the model config's `router_jitter_noise=0` (or the model's jitter setting), "
        "or use `strategy='lowmem_zero2'` (which trains it as plain Lightning does)"
    )] if found else []


def _pinned_compute_dtype(module: nn.Module, precision: str) -> list[str]:
    half = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    # NOTE: a plain attribute (HF's `PreTrainedModel.dtype` is a property, not in `vars`): Switch's `router_dtype`
    found = [name or type(module).__name__ for name, m in module.named_modules()
             if isinstance(d := vars(m).get("dtype"), torch.dtype) and d.is_floating_point and d != half
             and any(True for _ in m.parameters())]
    return [(
        f"ZeRO-3 at `precision={precision!r}` on submodules that compute in their own dtype ({_names(found)}, e.g. "
        "Switch Transformers' `router_dtype`): they cast their parameters in forward, which ZeRO-3's partitioned "
        "parameters do not follow (DeepSpeed fetches them in its half dtype: a dtype error in its linear). Use "
        "`strategy='lowmem_zero2'`, or `precision='32-true'`"
    )] if found else []


def batching_loader(loader: Any) -> type | None:
    """The class of ``loader`` when it is a ``DataLoader`` subclass that batches in its sampler (``batch_size=None``):
    Lightning's distributed sampler rebuilds it through that class's ``__init__`` (see :func:`loader_problem`)."""
    if not isinstance(loader, DataLoader) or type(loader) is DataLoader:
        return None
    return type(loader) if loader.batch_size is None and loader.batch_sampler is None else None


def loader_problem(rebuilt: DataLoader) -> str | None:
    """Why a :func:`batching_loader` cannot run as Lightning rebuilt it (it collates again), or None."""
    if rebuilt.batch_size is None:
        return None
    name = type(rebuilt).__name__
    return (
        f"the loader is a `{name}` that batches in its sampler (`batch_size=None`, each sampler item a list of "
        "indices). Lightning's distributed sampler (on under every DeepSpeed strategy, one process included) "
        f"rebuilds it through `{name}.__init__` with a new `sampler=`, and the rebuilt loader has "
        f"`batch_size={rebuilt.batch_size}`: it would collate whole batches into one, giving every tensor an extra "
        "leading dimension (scvi-tools' `AnnDataLoader` then fails in its first step). Pass "
        "`Trainer(use_distributed_sampler=False)` (in one process there is nothing to shard; with several, give the "
        "loader a distributed sampler of its own, as scvi-tools does under its `ddp` strategies)"
    )

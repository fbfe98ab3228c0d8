"""Optimizer swap for ZeRO-Offload: ``torch.optim.Adam``/``AdamW`` -> ``DeepSpeedCPUAdam`` (DeepSpeed refuses other
client optimizers under ``zero_force_ds_cpu_optimizer``). NOTE: imports DeepSpeed (slow): imported when needed.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.ops.lion import DeepSpeedCPULion
from torch.optim import Optimizer

# per-group keys of torch's Adam that DeepSpeedCPUAdam cannot honour when set
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "differentiable")
# torch-only per-group switches that mean nothing to DeepSpeedCPUAdam (the unsupported ones are refused above)
_TORCH_ONLY = {"params", "foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad", "decoupled_weight_decay"}


class Adam(DeepSpeedCPUAdam):
    """``DeepSpeedCPUAdam`` standing in for ``torch.optim.Adam``, under its name.

    NOTE: Lightning names what it logs after the optimizer's class (``lr-Adam``): the swap must not rename metrics.
    """


class AdamW(DeepSpeedCPUAdam):
    """``DeepSpeedCPUAdam`` standing in for ``torch.optim.AdamW``, under its name (see :class:`Adam`)."""


def to_cpu_optimizer(optimizer: Optimizer, config: dict[str, Any]) -> tuple[Optimizer, str]:
    """``DeepSpeedCPUAdam`` with ``optimizer``'s parameter groups and hyper-parameters, and a log line (``optimizer``
    itself when it is a DeepSpeed CPU optimizer, or under ``zero_force_ds_cpu_optimizer: false``; else ValueError)."""
    if isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion)):
        return optimizer, ""
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        if config.get("zero_force_ds_cpu_optimizer") is False:
            return optimizer, ""
        raise ValueError(
            f"`configure_optimizers` returned a `{name}`, which an optimizer-offload preset cannot run: DeepSpeed "
            "steps offloaded state with its own CPU optimizers only. Return `torch.optim.Adam` or `AdamW` (swapped "
            "for `DeepSpeedCPUAdam` automatically) or a `deepspeed.ops.adam.DeepSpeedCPUAdam`/`DeepSpeedCPUAdagrad`/"
            "`deepspeed.ops.lion.DeepSpeedCPULion`; or use a preset without offload (`lowmem_zero2`, `lowmem_zero3`) "
            "or `lowmem_offload`; or pass `config={'zero_force_ds_cpu_optimizer': False}` to run it as is (slow)."
        )
    bad = sorted({flag for g in optimizer.param_groups for flag in _UNSUPPORTED_FLAGS if g.get(flag)})
    if bad:
        raise ValueError(
            f"`configure_optimizers` returned a `{name}` with {', '.join(f'`{b}=True`' for b in bad)}, which "
            "`DeepSpeedCPUAdam` (used by the optimizer-offload presets) does not implement. Drop the flag, or use "
            "a preset without offload (`lowmem_zero2`, `lowmem_zero3`)."
        )
    # NOTE: torch's AdamW is a subclass of Adam; `decoupled_weight_decay=True` makes Adam an AdamW too.
    adamw = isinstance(optimizer, torch.optim.AdamW) or any(g.get("decoupled_weight_decay") for g in optimizer.param_groups)
    keep = ("lr", "betas", "eps", "weight_decay", "initial_lr")
    groups = [
        {"params": g["params"], **{k: g[k] for k in keep if k in g}, **{k: v for k, v in g.items() if k not in _TORCH_ONLY}}
        for g in optimizer.param_groups
    ]
    # NOTE: DeepSpeed's low-precision master weights check `type(optimizer) == DeepSpeedCPUAdam`: no renaming there
    low_masters = any(isinstance(config.get(k), dict) and config[k].get(f"{k}_master_weights_and_grads")
                      for k in ("bf16", "fp16"))
    cls = DeepSpeedCPUAdam if low_masters else AdamW if type(optimizer) is torch.optim.AdamW else Adam
    defaults = optimizer.defaults
    cpu_adam = cls(groups, lr=float(defaults["lr"]), betas=tuple(defaults["betas"]), eps=defaults["eps"],
                   weight_decay=defaults["weight_decay"], adamw_mode=adamw)
    summary = "; ".join(
        f"group {i}: lr={g['lr']}, betas={tuple(g['betas'])}, eps={g['eps']}, weight_decay={g['weight_decay']}"
        for i, g in enumerate(cpu_adam.param_groups)
    )
    return cpu_adam, (
        f"ZeroStrategy: optimizer offload steps on the CPU, so `{name}` was replaced by "
        f"`DeepSpeedCPUAdam(adamw_mode={adamw})` with the same parameter groups ({summary})"
        + ("." if cls is DeepSpeedCPUAdam else f"; it is the subclass `{cls.__module__}.{cls.__name__}`, named as the "
           f"optimizer it replaces for Lightning's naming (e.g. LearningRateMonitor's `lr-{cls.__name__}`).")
    )

"""After ``fit`` under ZeRO stage 3 the module's parameters are partitioned (empty): say so, or gather them back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_lowmem._internals import torch as torch_internals

PARTITIONED_MESSAGE = (
    "The LightningModule's parameters are partitioned by DeepSpeed ZeRO stage 3 after `fit`, so `state_dict()` "
    "holds empty tensors. Pass `ZeroStrategy(stage=3, ..., gather_on_fit_end=True)` to have the full fp32 weights put "
    "back into the module at the end of fit, or save a checkpoint (`trainer.save_checkpoint('last.ckpt')`) and run "
    "`lowmem consolidate last.ckpt model.pt` for a state dict a plain model loads."
)


class PartitionWarning:
    """``state_dict`` pre-hooks on :meth:`watch`'s module: warn once when partitioned weights are taken, except while
    :meth:`quiet` (the strategy's own checkpoint path)."""

    def __init__(self) -> None:
        self.warned = False
        self._quiet = 0
        self.handles: list[Any] = []

    def watch(self, module: nn.Module) -> None:
        self.remove()
        self.warned = False
        self.handles = [m.register_state_dict_pre_hook(self._hook) for m in module.modules()
                        if any(True for _ in m.parameters(recurse=False))]

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def _hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        # NOTE: a ZeRO-3 parameter whose values live only in its partition has an empty `p.data`
        partitioned = any(hasattr(p, "ds_id") and p.data.numel() == 0 and getattr(p, "ds_numel", 0) > 0
                          for p in module.parameters(recurse=False))
        if not self.warned and not self._quiet and partitioned:
            self.warned = True
            rank_zero_warn(PARTITIONED_MESSAGE)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@torch.no_grad()
def gather_full_weights(module: nn.Module) -> None:
    """Give every parameter of a ZeRO-3 ``module`` its full fp32 value (the master, or a frozen one's gathered value)
    and upcast floating buffers; the partitions are kept, so the engine still works.

    NOTE: collective: every rank walks the parameters in the same order.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    for p in module.parameters():
        value = safe_get_full_fp32_param(p) if p.requires_grad else None
        if value is None:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                value = p.data.detach().clone()
        p.data = value.detach().to(torch.float32)
    for sub in module.modules():
        buffers = torch_internals.module_buffers(sub)
        for name, buffer in buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.float32:
                buffers[name] = buffer.to(torch.float32)

"""Measure the activation bytes each block saves for backward: one forward of ``training_step``, nothing kept."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from lightning_lowmem._compat import training_step_args
from lightning_lowmem.callbacks._blocks import tensors_in
from lightning_lowmem.memory.categories import storage_key


@contextlib.contextmanager
def _quiet_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    # NOTE: the probe runs training_step once more; its self.log calls must not count twice in epoch means.
    pl_module.log = lambda *a, **k: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        pl_module.__dict__.pop("log", None)
        pl_module.__dict__.pop("log_dict", None)


def measure_saved_bytes(pl_module: pl.LightningModule, blocks: list[nn.Module], batch: Any, batch_idx: int) -> dict[str, Any]:
    """Bytes of distinct storages saved for backward outside the blocks, inside each block, and of each block's inputs.

    The forward runs with a pack hook that records sizes (no backward follows). Saved tensors are held only
    until their block returns, so the probe needs the activations outside the blocks plus one block's, the
    same as checkpointing every block; the RNG state is forked so training is unchanged. Parameters and
    buffers are not activations and are not counted.
    """
    params = {storage_key(t) for t in (*pl_module.parameters(), *pl_module.buffers())}
    outside = 0
    per_block = [0] * len(blocks)
    inputs = [0] * len(blocks)
    current: list[int] = []
    # NOTE: storages are identified by address, and a freed address is reused at once: what was saved is
    # held (as training would hold it) until its block returns, so a reused address is never taken for a
    # seen one. Tensors saved outside the blocks are held to the end: training keeps them under any policy.
    seen_outside: set[tuple[str, int]] = set()
    seen_block: set[tuple[str, int]] = set()
    held_outside: list[torch.Tensor] = []
    held_block: list[torch.Tensor] = []

    def pack(x: torch.Tensor) -> None:
        nonlocal outside
        key = storage_key(x)
        if key in params or key in seen_outside or key in seen_block:
            return None
        nbytes = x.untyped_storage().nbytes()
        if current:
            seen_block.add(key)
            held_block.append(x)
            per_block[current[-1]] += nbytes
        else:
            seen_outside.add(key)
            held_outside.append(x)
            outside += nbytes
        return None

    def unpack(_: Any) -> torch.Tensor:
        raise RuntimeError("internal error: the activation probe's graph was backpropagated")

    handles = []
    for index, block in enumerate(blocks):

        def pre(module: nn.Module, args: Any, kwargs: Any, index: int = index) -> None:
            current.append(index)
            seen_block.clear()
            held_block.clear()
            first = next((t for t in tensors_in(args) if t.is_floating_point()), None)
            inputs[index] = 0 if first is None else first.untyped_storage().nbytes()

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if current:
                current.pop()
            seen_block.clear()
            held_block.clear()

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, always_call=True))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), saved_tensors_hooks(pack, unpack), _quiet_logging(pl_module):
            out = pl_module.training_step(*training_step_args(pl_module.training_step, batch, batch_idx))
            del out
    finally:
        for h in handles:
            h.remove()
        held_outside.clear()
        held_block.clear()
    return {"outside": outside, "blocks": per_block, "block_inputs": inputs}

"""Measure the activation bytes each block saves for backward: one forward of ``training_step``, nothing kept."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from lightning_lowmem.core.accounting import storage_key
from lightning_lowmem.core.hooks import training_step_args
from lightning_lowmem.core.kept_state import param_writes_undone
from lightning_lowmem.core.side_step import side_step
from lightning_lowmem.core.tensors import tensors_in


class _ModelStorages:
    """The storage keys of a model's parameters and buffers, and of the parameters a module holds gathered while it runs.

    NOTE: DeepSpeed ZeRO-3 swaps a gathered storage into a module's parameters in its forward pre-hook and frees it in
    its forward hook; the hooks registered here run after those, so a gathered weight saved for backward (its linear
    saves it) is known for a parameter, not counted as an activation, and forgotten before its address can be reused.
    """

    def __init__(self, root: nn.Module) -> None:
        tensors = [*root.parameters(), *root.buffers()]
        self.keys = {storage_key(t) for t in tensors}
        # NOTE: the storages held, not the tensors: ZeRO-3 replaces a parameter's (empty) storage when it gathers it,
        # and a freed storage's address would come back as an activation's and be taken for a parameter's
        self._storages = [t.untyped_storage() for t in tensors]
        self._gathered: dict[tuple[str, int], int] = {}
        self._stack: list[list[tuple[str, int]]] = []
        self._handles = []
        for module in root.modules():
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def __contains__(self, key: object) -> bool:
        return key in self.keys or key in self._gathered

    def _pre(self, module: nn.Module, args: Any) -> None:
        keys = [storage_key(p) for p in module.parameters(recurse=False)]
        for key in keys:
            self._gathered[key] = self._gathered.get(key, 0) + 1
        self._stack.append(keys)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        for key in self._stack.pop() if self._stack else []:
            left = self._gathered.pop(key, 1) - 1
            if left:
                self._gathered[key] = left

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._storages.clear()


def measure_saved_bytes(pl_module: pl.LightningModule, blocks: list[nn.Module], batch: Any, batch_idx: int) -> dict[str, Any]:
    """Bytes of distinct storages saved for backward outside the blocks, inside each block, and of each block's inputs.

    The forward runs with a pack hook that records sizes (no backward follows). Saved tensors are held only
    until their block returns, so the probe needs the activations outside the blocks plus one block's, the
    same as checkpointing every block. It runs as a :func:`~lightning_lowmem.core.side_step.side_step` (RNG
    forked, logging off, training_step wrappers aside, buffers and metric states put back), so training is
    unchanged. Parameters and buffers are not activations and are not counted.
    """
    params = _ModelStorages(pl_module)
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
            return
        nbytes = x.untyped_storage().nbytes()
        if current:
            seen_block.add(key)
            held_block.append(x)
            per_block[current[-1]] += nbytes
        else:
            seen_outside.add(key)
            held_outside.append(x)
            outside += nbytes
        return

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
    try:
        # NOTE: a side step: RNG forked, `self.log` off, a training_step wrapper (AccumulationScheduler's window)
        # stands aside, and every buffer (BatchNorm statistics, counters), metric state and parameter the step
        # writes in place (an EMA teacher) is put back, so the probe leaves the run as it was
        with side_step(pl_module), param_writes_undone(pl_module), torch.enable_grad(), saved_tensors_hooks(pack, unpack):
            out = pl_module.training_step(*training_step_args(pl_module.training_step, batch, batch_idx))
            del out
    finally:
        for h in handles:
            h.remove()
        params.remove()
        held_outside.clear()
        held_block.clear()
    return {"outside": outside, "blocks": per_block, "block_inputs": inputs}


@dataclasses.dataclass
class ModuleActivations:
    """What one submodule's forward calls save for backward, from :func:`measure_submodules`."""

    name: str
    order: int  # position of its first call in the forward
    saved: int  # bytes of storages first saved while it (or a module inside it) ran
    inputs: int  # bytes of its calls' tensor inputs (what checkpointing it keeps)

    @property
    def saving(self) -> int:
        """Bytes checkpointing it frees: what it saves, less the input a checkpoint keeps."""
        return max(0, self.saved - self.inputs)


def measure_submodules(pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> tuple[dict[str, ModuleActivations], int]:
    """Activation bytes saved for backward inside each called submodule (inclusive of its children), and in total.

    One forward of ``training_step`` under the same rules as :func:`measure_saved_bytes` (RNG forked, logging off,
    nothing backpropagated; parameters and buffers not counted). A storage counts for every module running when
    it is *first* saved: a module's input saved again inside it belongs to whoever saved it first.
    """
    params = _ModelStorages(pl_module)
    stack: list[ModuleActivations] = []
    found: dict[str, ModuleActivations] = {}
    seen: set[tuple[str, int]] = set()
    held: list[torch.Tensor] = []  # NOTE: held to the end, as training holds them: no address is reused
    total = 0

    def pack(x: torch.Tensor) -> None:
        nonlocal total
        key = storage_key(x)
        if key in params or key in seen:
            return
        seen.add(key)
        held.append(x)
        nbytes = x.untyped_storage().nbytes()
        total += nbytes
        for entry in {id(e): e for e in stack}.values():
            entry.saved += nbytes
        return

    def unpack(_: Any) -> torch.Tensor:
        raise RuntimeError("internal error: the activation probe's graph was backpropagated")

    handles = []
    for name, module in pl_module.named_modules():
        if not name:
            continue

        def pre(module: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            entry = found.get(name)
            if entry is None:
                entry = found[name] = ModuleActivations(name, len(found), 0, 0)
            kept = {storage_key(t): t for t in tensors_in((args, kwargs))}  # a checkpoint keeps every tensor input
            entry.inputs += sum(t.untyped_storage().nbytes() for k, t in kept.items() if k not in params)
            stack.append(entry)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if stack:
                stack.pop()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        # NOTE: a side step: RNG forked, `self.log` off, a training_step wrapper (AccumulationScheduler's window)
        # stands aside, and every buffer (BatchNorm statistics, counters), metric state and parameter the step
        # writes in place (an EMA teacher) is put back, so the probe leaves the run as it was
        with side_step(pl_module), param_writes_undone(pl_module), torch.enable_grad(), saved_tensors_hooks(pack, unpack):
            out = pl_module.training_step(*training_step_args(pl_module.training_step, batch, batch_idx))
            del out
    finally:
        for h in handles:
            h.remove()
        params.remove()
        held.clear()
    return found, total


def choose_submodules(root: nn.Module, measured: dict[str, ModuleActivations], total: int) -> list[str]:
    """The blocks for a model without repeated blocks: the largest submodules whose checkpointing frees memory.

    From the top of the module tree, each called submodule is a block if checkpointing it frees at least 1% of all
    activations, unless it saves more than half of them and has called submodules: then (recomputing it would bring
    most of the peak back in backward) the blocks are looked for among its children first, and it is taken itself
    only if none qualifies. Returns names in call order.
    """
    names = set(measured)
    least = max(1, total // 100)  # NOTE: a wrapper that frees less is not worth its recompute

    def parent(name: str) -> str:
        while "." in name:
            name = name.rpartition(".")[0]
            if name in names:
                return name
        return ""

    children: dict[str, list[str]] = {}
    for name in measured:
        children.setdefault(parent(name), []).append(name)

    def pick(name: str) -> list[str]:
        entry = measured[name]
        if entry.saved < least:
            return []
        if 2 * entry.saved > total and children.get(name):
            inner = [n for child in children[name] for n in pick(child)]
            if inner:
                return inner
        return [name] if entry.saving >= least else []

    chosen = [n for child in children.get("", []) for n in pick(child)]
    return sorted(chosen, key=lambda n: measured[n].order)

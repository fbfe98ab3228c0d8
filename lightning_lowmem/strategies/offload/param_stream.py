"""Parameter streaming for ``lowmem_offload`` (docs/techniques/param-streaming.md): a streamed parameter's ``.data`` is
a NaN placeholder while released, a device copy fetched ``prefetch`` blocks ahead on the side stream while in use.

NOTE: [saved weights] inside a streamed block, saved-tensor hooks save ``(block, index, size, stride, offset)`` instead
of a weight's view (which would keep the fetched storage alive) and rebuild it on the current data at unpack.
NOTE: [in-place changes] the hooks turn off autograd's saved-version check; the unpack makes it. A forward that changes
a streamed weight in place is refused when the block returns (the change would be lost at release).
NOTE: [derived uploads] a streamed weight with an fp32 master keeps no host copy: each fetch rounds the master into a
pinned ring slot (``prefetch + 2`` blocks' worth; a slot is rewritten once the copy that read it landed) and copies that.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import mark_host, mark_host_weights, storage_key, storage_key_or_none
from lightning_lowmem.core.blocks import called_blocks, find_repeated_blocks
from lightning_lowmem.core.saved_versions import SavedVersion
from lightning_lowmem.core.streams import CudaOps, StreamOps, cpu_ops
from lightning_lowmem.core.tensors import tensors_in
from lightning_lowmem.strategies.offload.packed_weights import (
    QuantStatePointers,
    kept_by_hooks,
    quant_state_param,
    streamable,
)
from lightning_lowmem.strategies.offload.stream_check import ReleasedReadCheck
from lightning_lowmem.strategies.offload.transfer import staged_views

OffloadParams = Literal[False, True, "auto"]
OFFLOAD_PARAMS: tuple[Any, ...] = (False, True, "auto")

_WEIGHT, _OUTER, _PLAIN = 0, 1, 2
#: released blocks whose device buffers the compute stream may still be reading, before a fetch waits for the oldest
_FREES_IN_FLIGHT = 1


def block_params(module: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[list[nn.Parameter]], list[nn.Parameter]]:
    """The repeated blocks, the streamable parameters only each block holds (shared ones stay resident), and all
    others."""
    blocks = called_blocks(find_repeated_blocks(module))
    owners: dict[int, set[int]] = {}
    for b, (_, block) in enumerate(blocks):
        for p in block.parameters():
            owners.setdefault(id(p), set()).add(b)
    inside = {id(m) for _, block in blocks for m in block.modules()}
    # NOTE: a module outside the blocks that holds a block's parameter (tied weights) makes it resident
    outside = {id(p) for m in module.modules() if id(m) not in inside for p in m.parameters(recurse=False)}
    per_block = [
        [q for p in block.parameters() if streamable(p) and owners[id(p)] == {b} and id(p) not in outside
         for q in (p, *quant_state_param(p))]  # NOTE: a packed weight's absmax follows it (see packed_weights)
        for b, (_, block) in enumerate(blocks)
    ]
    streamed = {id(p) for ps in per_block for p in ps}
    rest = [p for p in module.parameters() if id(p) not in streamed]
    return blocks, per_block, rest


def streamed_host_bytes(offload_params: Any, module: nn.Module, dtype: torch.dtype, mastered: Any = (),
                        ring: int = 0) -> int:
    """Host copies of the streamed blocks' weights without a master (all blocks under ``True``; counted for all under
    ``"auto"`` too), and ``ring`` slots of the largest block's weights with one (``mastered``: their ids; see
    [derived uploads])."""
    if offload_params is False:
        return 0
    _, per_block, _ = block_params(module)
    size = torch.empty((), dtype=dtype).element_size()
    # NOTE: a packed 4-bit weight (bitsandbytes) keeps its uint8 bytes; floating-point weights are in the compute dtype
    copies = sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for ps in per_block for p in ps
                 if id(p) not in mastered)
    return copies + ring * max((sum(p.numel() * size for p in ps if id(p) in mastered) for ps in per_block), default=0)


class ParamStream:
    """Moves the compute weights of streamed blocks between their host copies and the device, block by block.

    Memory on the device: the resident weights plus at most ``prefetch + 2`` streamed blocks (see [bounded
    streaming]). On the host: a copy in the compute dtype (pinned on CUDA) of each streamed weight without an fp32
    master; one with a master is rounded from it at each fetch (see [derived uploads]). Cost: each streamed block
    crosses PCIe once in forward and once in backward, on a side stream ahead of compute.

    Built by :class:`~lightning_lowmem.strategies.offload.strategy.OffloadStrategy`; example:

        >>> trainer = L.Trainer(strategy="lowmem_offload_params", precision="bf16-true")
        >>> trainer.strategy.offload_params
        True
    """

    def __init__(self, module: nn.Module, streamed: Sequence[bool], prefetch: int, device: torch.device) -> None:
        blocks, per_block, _ = block_params(module)
        self.names = [name for name, _ in blocks]
        self.blocks = [block for _, block in blocks]
        self.streamed = list(streamed)
        self.prefetch = prefetch
        self.device = device
        self.ops: StreamOps | None = CudaOps(device) if device.type == "cuda" else cpu_ops()
        self.stream = self.ops.side_stream() if self.ops is not None else None
        self.params: list[list[nn.Parameter]] = [ps if s else [] for ps, s in zip(per_block, self.streamed)]
        self.host: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        self.shapes = {id(p): p.shape for ps in self.params for p in ps}  # NOTE: `.data` changes shape when emptied
        self.dtypes = {id(p): p.dtype for ps in self.params for p in ps}
        self._derived: set[int] = set()  # ids of the streamed weights whose host tensor is their fp32 master
        self._ring: list[list[Any]] = []  # [pinned buffer, event of the last copy that read it] (see [derived uploads])
        self._turn = 0
        self._order = [b for b, s in enumerate(self.streamed) if s]
        self._tail = set(self._order[-(prefetch + 1):]) if self._order else set()
        self._fetched: dict[int, list[Any]] = {}  # block -> [device tensors, event, waited]
        self._by_storage: dict[tuple[str, int], tuple[int, int]] = {}  # storage key -> (block, index in block)
        self._handles: list[Any] = []
        self._pushed: list[torch.autograd.graph.saved_tensors_hooks | None] = []
        self._last_pre = -1
        self._last_event: Any = None
        self._frees: deque[Any] = deque()  # compute-stream events recorded after released blocks' buffers were dropped
        self._placeholders: dict[tuple[torch.dtype, str], torch.Tensor] = {}
        self._buckets: list[torch.Tensor] = []
        self.fetches = 0  # blocks copied to the device (a count for tests and benchmarks)
        self._checked: set[str] = set()  # the steps (training, validation) whose first call was checked
        self._matmul = kept_by_hooks(self.params)  # NOTE: entered in `attach`: see packed_weights' [weight kept ...]
        self._quant_states = QuantStatePointers(self.params)
        # NOTE: a dispatch mode makes a compiled region run another path (another rounding): no check there
        self._compiled = any(torch_internals.is_compiled_module(m) for m in module.modules())

    @torch.no_grad()
    def detach_weights(self, masters: dict[int, torch.Tensor] | None = None) -> None:
        """Make the host copies from the current compute weights (none for a weight with a master in ``masters``, by
        parameter id: its master is its host tensor), and leave the parameters empty (before moving)."""
        masters = masters or {}
        self._derived = {id(p) for ps in self.params for p in ps if id(p) in masters}
        flat = [p for ps in self.params for p in ps if id(p) not in self._derived]
        if self.ops is not None:
            buckets, copies = staged_views(flat, self.ops)
            for view, p in zip(copies, flat):
                view.copy_(p.detach())
            self._buckets += buckets
            it = iter(copies)
        else:
            it = iter([p.detach().to("cpu", copy=True) for p in flat])  # NOTE: a separate tensor: fetches really copy
        for b, ps in enumerate(self.params):
            self.host[b] = [masters[id(p)] if id(p) in self._derived else next(it) for p in ps]  # type: ignore[misc]
            for p in ps:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        slot = self.ring_bytes() // (self.prefetch + 2)
        if self.ops is not None and slot:
            self._ring = [[self.ops.empty_host(slot, torch.uint8), None] for _ in range(self.prefetch + 2)]
        mark_host(*self._buckets, *(r[0] for r in self._ring))
        mark_host_weights((p, h) for ps, hs in zip(self.params, self.host) for p, h in zip(ps, hs)
                          if id(p) not in self._derived)

    def attach(self) -> None:
        """After the module moved to the device: placeholders there, and the hooks."""
        for ps in self.params:
            for p in ps:
                p.data = self.released(p)
        self._quant_states.repoint()
        self._matmul.__enter__()
        self.hook_blocks()

    def hook_blocks(self) -> None:
        """(Re-)register the block hooks, after every hook registered so far (called again at ``on_train_start``, so
        a callback's hook on the first block, the dry run's depth windows, runs before the fetch)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for b, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(lambda m, a, b=b: self._pre(b)))
            self._handles.append(block.register_forward_hook(lambda m, a, o, b=b: self._post(b, o), always_call=True))

    def released(self, p: nn.Parameter) -> torch.Tensor:
        """What streamed parameter ``p``'s ``.data`` is while its block is released (built here, never read from ``p``):
        a NaN (0 for packed weights) expanded to its shape."""
        dtype = self.dtypes[id(p)]  # NOTE: not `p.dtype`: `host_view` shows a master (fp32) as `.data`
        key = (dtype, str(self.device))
        base = self._placeholders.get(key)
        if base is None:
            fill = float("nan") if dtype.is_floating_point else 0
            base = self._placeholders[key] = torch.full((), fill, dtype=dtype, device=self.device)
        return base.expand(self.shapes[id(p)])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._matmul.__exit__(None, None, None)
        self._settle_host()

    def first_use_check(self, kind: str) -> contextlib.AbstractContextManager:
        """On the first ``kind`` step: refuse any op that reads a released streamed weight (see ``stream_check``)."""
        if kind in self._checked or not any(self.params) or self._compiled:
            return contextlib.nullcontext()
        self._checked.add(kind)
        names = {id(p): f"{self.names[b]}.{n}" for b, block in enumerate(self.blocks)
                 for n, p in block.named_parameters() if id(p) in self.shapes}
        return ReleasedReadCheck({storage_key(t) for t in self._placeholders.values()}, names)

    def _fetch(self, b: int) -> None:
        if b in self._fetched or not self.streamed[b]:
            return
        ops = self.ops
        if ops is None:
            tensors = [h.to(self.device, self.dtypes[id(p)], copy=True) for p, h in zip(self.params[b], self.host[b])]
            event = None
        else:
            self._limit_frees(ops)
            hosts, slot = self._rounded(b, ops)
            tensors = [ops.to_device(h, self.device, self.stream) for h in hosts]
            event = self._last_event = ops.record_event(self.stream)
            if slot is not None:
                slot[1] = event
        for j, (p, t) in enumerate(zip(self.params[b], tensors)):
            p.data = t
            self._by_storage[storage_key(t)] = (b, j)
        # NOTE: the parameters' own version counters (`.data` assignment keeps them): see `_check_unchanged`
        self._fetched[b] = [tensors, event, ops is None, [torch_internals.tensor_version(p) for p in self.params[b]]]
        self.fetches += 1

    def ring_bytes(self) -> int:
        """Bytes of the pinned ring a CUDA run keeps: ``prefetch + 2`` slots of the largest block's mastered weights."""
        slot = max((sum(self._aligned(p) for p in ps if id(p) in self._derived) for ps in self.params), default=0)
        return (self.prefetch + 2) * slot

    def _aligned(self, p: nn.Parameter) -> int:
        """Bytes of streamed ``p`` in a ring slot, rounded up to 512 B (each view starts DMA-aligned)."""
        return -(-self.shapes[id(p)].numel() * self.dtypes[id(p)].itemsize // 512) * 512

    @torch.no_grad()
    def _rounded(self, b: int, ops: StreamOps) -> tuple[list[torch.Tensor], list[Any] | None]:
        """Block ``b``'s host tensors in the compute dtype: its derived weights' masters rounded into the next ring
        slot (returned, to record the copy that reads it), the others' host copies."""
        if not any(id(p) in self._derived for p in self.params[b]):
            return self.host[b], None
        slot = self._ring[self._turn % len(self._ring)]
        self._turn += 1
        if slot[1] is not None:
            ops.synchronize(slot[1])  # NOTE: sync point: the copy that last read this slot has landed
        out, start = [], 0
        for p, h in zip(self.params[b], self.host[b]):
            if id(p) in self._derived:
                shape, dtype = self.shapes[id(p)], self.dtypes[id(p)]
                n = shape.numel() * dtype.itemsize
                h = slot[0][start : start + n].view(dtype).view(shape).copy_(h)  # round to nearest even, as `update_host`
                start += self._aligned(p)
            out.append(h)
        return out, slot

    def _ready(self, b: int) -> None:
        """Block ``b``'s weights may be read by compute from now on."""
        if not self.streamed[b]:
            return
        self._fetch(b)
        entry = self._fetched[b]
        if not entry[2]:
            ops = self.ops
            assert ops is not None
            compute = ops.compute_stream()
            ops.wait_event(compute, entry[1])
            for t in entry[0]:
                # NOTE: [fetched lifetime] not reused by the allocator before compute is done with it
                ops.record_stream(t, compute)
            entry[2] = True

    def release(self, b: int) -> None:
        entry = self._fetched.pop(b, None)
        if entry is None:
            return
        for p, t in zip(self.params[b], entry[0]):
            self._by_storage.pop(storage_key(t), None)
            p.data = self.released(p)
        read_by_compute = entry[2] and self.ops is not None
        entry = t = None  # NOTE: the buffers are freed here (to the allocator, which waits for compute: record_stream)
        if read_by_compute:
            self._frees.append(self.ops.record_event(self.ops.compute_stream()))  # type: ignore[union-attr]

    def _limit_frees(self, ops: StreamOps) -> None:
        """Wait (host) until at most ``_FREES_IN_FLIGHT`` released blocks may still be read by compute.

        NOTE: [bounded streaming] back-pressure (as FSDP's ``limit_all_gathers``): a host running ahead of the GPU
        would take new memory for every fetch while released blocks wait for compute."""
        frees = self._frees
        while frees and (len(frees) > _FREES_IN_FLIGHT or ops.query(frees[0])):
            ops.synchronize(frees.popleft())

    def release_all(self) -> None:
        for b in list(self._fetched):
            self.release(b)
        self._last_pre = -1

    def fetched_blocks(self) -> list[int]:
        return sorted(self._fetched)

    def _pre(self, b: int) -> None:
        if torch_internals.in_backward():  # a recompute that calls the block's __call__ (reentrant or HF checkpointing)
            self._ready(b)
            self._push(b)
            return
        if b <= self._last_pre:
            self.release_all()  # a new forward pass (the previous one had no backward: validation, a skipped step)
        self._last_pre = b
        self._ready(b)
        for c in [c for c in self._order if c > b][: self.prefetch]:
            self._fetch(c)
        self._push(b)

    def _post(self, b: int, output: Any) -> None:
        pushed = self._pushed.pop() if self._pushed else None
        if pushed is not None:
            pushed.__exit__()
        if torch_internals.in_backward() or output is None:
            return
        self._check_unchanged(b)
        grad = torch.is_grad_enabled()
        if self.streamed[b] and not (grad and b in self._tail):
            self.release(b)
        if grad:
            out = next((t for t in tensors_in(output) if t.requires_grad), None)
            if out is not None:
                out.register_hook(lambda g, b=b: self._before_backward(b))

    def _check_unchanged(self, b: int) -> None:
        """Refuse a forward that changed one of its streamed weights in place (see [in-place changes])."""
        entry = self._fetched.get(b)
        if entry is None:
            return
        for p, version in zip(self.params[b], entry[3]):
            if torch_internals.tensor_version(p) != version:
                name = next((n for n, q in self.blocks[b].named_parameters() if q is p), "?")
                raise RuntimeError(
                    f"lowmem_offload_params: the forward of block `{self.names[b]}` changed its weight `{name}` in "
                    f"place (version {version} -> {torch_internals.tensor_version(p)}). Parameter streaming fetches a fresh copy of the "
                    "block's weights from the host for every use, so the change would be lost (and a weight saved "
                    "for backward before the change makes plain PyTorch refuse the backward). Make the change out "
                    "of place in the module, or keep the block on the device (`OffloadStrategy(offload_params=False)`)."
                )

    def _before_backward(self, b: int) -> None:
        for c in [c for c in self._fetched if c > b]:
            self.release(c)
        self._ready(b)
        for c in [c for c in reversed(self._order) if c < b][: self.prefetch]:
            self._fetch(c)

    def _push(self, b: int) -> None:
        if not self.streamed[b]:
            self._pushed.append(None)
            return
        outer = torch_internals.top_saved_tensors_hooks()
        # NOTE: entered here and left in the block's forward post-hook (`_post`): a hook pair spans two calls
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, outer), lambda packed: self._unpack(packed))
        hooks.__enter__()
        self._pushed.append(hooks)

    def _pack(self, t: torch.Tensor, outer: Any) -> Any:
        found = self._by_storage.get(storage_key_or_none(t))  # type: ignore[arg-type]
        if found is not None:
            b, j = found
            base = self._fetched[b][0][j]
            offset = t.storage_offset() - base.storage_offset()
            return (_WEIGHT, b, j, t.size(), t.stride(), offset, t.requires_grad, SavedVersion(t))
        if outer is not None:
            return (_OUTER, outer[1], outer[0](t))
        return (_PLAIN, SavedVersion(t, keep=True))

    def _unpack(self, packed: Any) -> torch.Tensor:
        # NOTE: [in-place changes] autograd skips its version check for tensors packed by hooks: it is made here
        # (the outer hooks make their own), so a module that changed a saved tensor in place fails as in plain
        kind = packed[0]
        if kind == _PLAIN:
            packed[1].check("lowmem_offload_params")
            return packed[1].counter
        if kind == _OUTER:
            return packed[1](packed[2])
        _, b, j, size, stride, offset, _, saved = packed
        saved.check("lowmem_offload_params")
        self._ready(b)  # NOTE: a no-op when the output-gradient hook fetched it; else a synchronous fetch
        data = self.params[b][j].data
        return data.as_strided(size, stride, data.storage_offset() + offset)

    @torch.no_grad()
    def update_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each ``(master, host copy)`` into the host copy (rounding to the compute dtype, as the device path)."""
        self._settle_host()
        for master, host in pairs:
            if host is not master:  # NOTE: a derived weight's host tensor is its master
                host.copy_(master)

    def _settle_host(self) -> None:
        """Release every block and wait for the last queued fetch (it reads the host copies about to be written)."""
        self.release_all()
        if self._last_event is not None and self.ops is not None:
            self.ops.synchronize(self._last_event)

    @contextlib.contextmanager
    def host_view(self) -> Iterator[None]:
        """Inside, the streamed parameters' ``.data`` are their host copies (a ``load_state_dict`` writes into them)."""
        self._settle_host()
        for ps, hs in zip(self.params, self.host):
            for p, h in zip(ps, hs):
                p.data = h
        try:
            yield
        finally:
            for ps in self.params:
                for p in ps:
                    p.data = self.released(p)

    def host_of(self) -> dict[int, torch.Tensor]:
        """``{id(parameter): host copy}`` for every streamed parameter."""
        return {id(p): h for ps, hs in zip(self.params, self.host) for p, h in zip(ps, hs)}

    def host_bytes(self) -> int:
        if self.ops is not None:
            return sum(self.ops.host_bytes(b.numel()) for b in [*self._buckets, *(r[0] for r in self._ring)])
        return sum(h.numel() * h.element_size() for ps, hs in zip(self.params, self.host) for p, h in zip(ps, hs)
                   if id(p) not in self._derived)


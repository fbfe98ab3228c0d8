"""What blocks save for backward, measured by one ``training_step`` on a fake copy of the module: the run is untouched.
The copy is fake (``FakeTensorMode``), with no Trainer nor other techniques' hooks; the RNGs are put back. Ops on real
tensors only (the batch) run for real. See docs/techniques/activation-checkpointing.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import storage_key
from lightning_lowmem.core.hooks import training_step_args
from lightning_lowmem.core.tensors import tensors_in

Pack = Callable[[torch.Tensor], None]
#: what an op on fake tensors raises when it needs values (or a meta kernel is narrower than the real one)
_NEEDS_VALUES = (RuntimeError, NotImplementedError, *torch_internals.FAKE_ERRORS)
#: ops whose fake kernel returns less than the real one keeps for backward: nn.LSTM's oneDNN workspace on the CPU
_SIZED_BY_THE_REAL_KERNEL = frozenset({torch.ops.aten.mkldnn_rnn_layer.default})


class _RealValues(torch_internals.TorchDispatchMode):
    """Above the fake mode: an op on real tensors only runs for real; one the fake mode cannot size runs on zeros."""

    def __init__(self, fake_mode: Any) -> None:
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        tensors = [t for t in torch_internals.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(torch_internals.is_fake(t) for t in tensors):
            with torch_internals.unset_fake_temporarily():
                return func(*args, **kwargs)
        if func in _SIZED_BY_THE_REAL_KERNEL:
            return self._on_zeros(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except _NEEDS_VALUES as err:  # NOTE: a size that depends on values (pack_padded_sequence's), a meta kernel's limit
            try:
                return self._on_zeros(func, args, kwargs)
            except _NEEDS_VALUES:
                raise err from None
        if not tensors and isinstance(out, torch.Tensor) and not out.is_floating_point() and out.numel() < 2**20:
            # NOTE: indices and counts made from nothing (arange, C++ bookkeeping filled through its pointer, as
            # pad_packed_sequence's lengths) are real: the ops on the batch they meet stay real
            with torch_internals.unset_fake_temporarily():
                return func(*args, **kwargs)
        return out

    def _on_zeros(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The real kernel on zeros of the fake inputs' sizes; its floating outputs fake (activations, as the
        weights' are), the others real (batch sizes, counts: later ops read them as the real run does)."""
        with torch_internals.unset_fake_temporarily():
            zeros = torch_internals.tree_map(
                lambda t: torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                if isinstance(t, torch.Tensor) and torch_internals.is_fake(t) else t, (args, kwargs))
            out = func(*zeros[0], **zeros[1])
        return torch_internals.tree_map(
            lambda t: self.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)


def _fake_copy(pl_module: pl.LightningModule, fake_mode: Any | None) -> pl.LightningModule:
    """A deep copy of ``pl_module`` with fake parameters, buffers and tensor attributes and no module hooks (a
    ``LightningModule`` copies without its Trainer). ``fake_mode`` None: the tensors are fake already (shared)."""
    memo: dict[int, Any] = {}
    for module in pl_module.modules():
        for table in torch_internals.hook_tables(module):
            memo[id(table)] = type(table)()
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False),
               *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for t in own:
            if id(t) in memo or fake_mode is None:
                memo.setdefault(id(t), t)
                continue
            shape = getattr(t, "ds_shape", None)  # NOTE: DeepSpeed ZeRO-3 leaves empty partitions; the full size
            if shape is None:
                fake = fake_mode.from_tensor(t)
            else:
                with fake_mode:
                    fake = torch.empty(shape, dtype=t.dtype, device=t.device)
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    torch_internals.eager_copies(pl_module, memo, set())  # NOTE: compiled regions run eagerly (see its NOTE)
    return copy.deepcopy(pl_module, memo)


@contextlib.contextmanager
def _rng_kept(device: torch.device) -> Iterator[None]:
    """torch's CPU and ``device``'s RNG, Python's and NumPy's global ones, as they were (a real op may draw)."""
    numpy = sys.modules.get("numpy")
    python_state, numpy_state = random.getstate(), numpy.random.get_state() if numpy is not None else None
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def run_on_fake_copy(pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                     attach: Callable[[pl.LightningModule, set[tuple[str, int]]], tuple[Pack, list[Any]]]) -> None:
    """``training_step`` once on a fake copy of ``pl_module``, its saves given to the ``pack`` that ``attach(copy,
    keys of the copy's parameters and buffers)`` returns with its hooks' handles; ``ValueError`` (the cause chained,
    with the fix) when the step cannot run there."""
    fake = not any(torch_internals.is_fake(p) for p in pl_module.parameters())
    fake_mode = torch_internals.FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    try:
        replica = _fake_copy(pl_module, fake_mode)
        states = {storage_key(t) for t in [*replica.parameters(), *replica.buffers()]}
        pack, handles = attach(replica, states)
        held: list[torch.Tensor] = []  # NOTE: held to the end: a storage's identity is never reused meanwhile

        def keep(t: torch.Tensor) -> None:
            held.append(t)
            pack(t)

        def unpack(_: Any) -> torch.Tensor:
            raise RuntimeError("internal error: the activation probe's graph was backpropagated")

        device = next((t.device for t in tensors_in(batch)), torch.device("cpu"))
        modes = (fake_mode, _RealValues(fake_mode)) if fake_mode is not None else ()
        with _rng_kept(device), warnings.catch_warnings(), contextlib.ExitStack() as stack:
            warnings.simplefilter("ignore")  # NOTE: `self.log` without a Trainer warns; the fake step's own
            for mode in modes:
                stack.enter_context(mode)
            try:
                with torch.enable_grad(), saved_tensors_hooks(keep, unpack):
                    replica.training_step(*training_step_args(replica.training_step, batch, batch_idx))
            finally:
                # NOTE: the probe's graph holds `keep` (its saves' hooks), `held` the graph's tensors: a cycle through
                # autograd that Python's collector cannot see, which kept the saved parameters (a dry run's own) alive
                held.clear()
        for handle in handles:
            handle.remove()
    except Exception as err:
        raise ValueError(
            f"ActivationCheckpointing measures what blocks keep for backward by running `training_step` once on a "
            f"fake copy of `{type(pl_module).__name__}` (fake weights, no Trainer attached), and it failed there: "
            f"{type(err).__name__}: {err}. Name the modules to checkpoint instead: `ActivationCheckpointing("
            "policy=['MyBlock'])` or `blocks=` (module names, patterns such as 'encoder.*' or class names)."
        ) from err


def _hook(modules: list[tuple[Any, nn.Module]], pre: Callable[[Any, Any, Any], None],
          post: Callable[[], None]) -> list[Any]:
    """A pre-hook ``pre(key, args, kwargs)`` and a forward hook ``post()`` on each ``(key, module)``; their handles."""
    handles = []
    for key, module in modules:
        handles.append(module.register_forward_pre_hook(lambda m, a, k, key=key: pre(key, a, k), with_kwargs=True))
        handles.append(module.register_forward_hook(lambda m, a, o: post(), always_call=True))
    return handles


def measure_saved_bytes(pl_module: pl.LightningModule, blocks: list[str], batch: Any, batch_idx: int) -> dict[str, Any]:
    """Bytes of distinct storages saved for backward outside the blocks, inside each block (by qualified name), and of
    each block's input (its first floating-point tensor argument); parameters and buffers are not counted."""
    outside, per_block, inputs = 0, [0] * len(blocks), [0] * len(blocks)
    current: list[int] = []
    seen_outside: set[tuple[str, int]] = set()
    seen_block: set[tuple[str, int]] = set()

    def attach(replica: pl.LightningModule, states: set[tuple[str, int]]) -> tuple[Pack, list[Any]]:
        def pack(x: torch.Tensor) -> None:
            nonlocal outside
            key = storage_key(x)
            if key in states or key in seen_outside or key in seen_block:
                return
            nbytes = x.untyped_storage().nbytes()
            if current:
                seen_block.add(key)
                per_block[current[-1]] += nbytes
            else:
                seen_outside.add(key)
                outside += nbytes

        def pre(index: int, args: Any, kwargs: Any) -> None:
            current.append(index)
            seen_block.clear()
            first = next((t for t in tensors_in(args) if t.is_floating_point()), None)
            inputs[index] = 0 if first is None else first.untyped_storage().nbytes()

        def post() -> None:
            if current:
                current.pop()
            seen_block.clear()

        return pack, _hook([(i, replica.get_submodule(name)) for i, name in enumerate(blocks)], pre, post)

    run_on_fake_copy(pl_module, batch, batch_idx, attach)
    return {"outside": outside, "blocks": per_block, "block_inputs": inputs}


@dataclasses.dataclass
class ModuleActivations:
    """What one submodule's forward calls save for backward (:func:`measure_submodules`)."""

    name: str
    order: int  # position of its first call in the forward
    saved: int  # bytes of storages first saved while it (or a module inside it) ran
    inputs: int  # bytes of its calls' tensor inputs (what checkpointing it keeps)

    @property
    def saving(self) -> int:
        """Bytes checkpointing it frees: what it saves, less the input a checkpoint keeps."""
        return max(0, self.saved - self.inputs)


def measure_submodules(pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> tuple[dict[str, ModuleActivations], int]:
    """Activation bytes saved for backward inside each called submodule (children included), and in total; a storage
    counts for every module running when it is *first* saved."""
    stack: list[ModuleActivations] = []
    found: dict[str, ModuleActivations] = {}
    seen: set[tuple[str, int]] = set()
    total = 0

    def attach(replica: pl.LightningModule, states: set[tuple[str, int]]) -> tuple[Pack, list[Any]]:
        def pack(x: torch.Tensor) -> None:
            nonlocal total
            key = storage_key(x)
            if key in states or key in seen:
                return
            seen.add(key)
            nbytes = x.untyped_storage().nbytes()
            total += nbytes
            for entry in {id(e): e for e in stack}.values():
                entry.saved += nbytes

        def pre(name: str, args: Any, kwargs: Any) -> None:
            entry = found.setdefault(name, ModuleActivations(name, len(found), 0, 0))
            kept = {storage_key(t): t for t in tensors_in((args, kwargs))}  # a checkpoint keeps every tensor input
            entry.inputs += sum(t.untyped_storage().nbytes() for k, t in kept.items() if k not in states)
            stack.append(entry)

        def post() -> None:
            if stack:
                stack.pop()

        return pack, _hook([(n, m) for n, m in replica.named_modules() if n], pre, post)

    run_on_fake_copy(pl_module, batch, batch_idx, attach)
    return found, total


def choose_submodules(root: nn.Module, measured: dict[str, ModuleActivations], total: int) -> list[str]:
    """The blocks for a model without repeated blocks, in call order: from the top, each called submodule whose
    checkpointing frees at least 1% of all activations; one saving more than half of them is split into its children
    first (recomputing it would bring most of the peak back), and taken itself only if none qualifies."""
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

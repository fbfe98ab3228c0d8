"""The five memory categories every report and benchmark speaks in, in bytes per role (``device``, ``host``, ``disk``).

On a CPU-only machine both roles are the same memory; the split then says which tensors a technique keeps in the
compute role (docs/design.md, "Memory categories").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lightning_lowmem._internals import torch as torch_internals

Category = Literal["weights", "gradients", "optimizer_state", "activations", "other"]
Role = Literal["device", "host", "disk"]
CATEGORIES: tuple[Category, ...] = ("weights", "gradients", "optimizer_state", "activations", "other")
ROLES: tuple[Role, ...] = ("device", "host", "disk")


def _zeros() -> dict[str, int]:
    return dict.fromkeys(CATEGORIES, 0)


@dataclass
class MemoryBreakdown:
    """Bytes by category, for the device role, the host role and the disk (``lowmem_offload_disk``'s tier)."""

    device: dict[str, int] = field(default_factory=_zeros)
    host: dict[str, int] = field(default_factory=_zeros)
    disk: dict[str, int] = field(default_factory=_zeros)

    def add(self, role: Role, category: Category, nbytes: int) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"Passed `category={category!r}`; expected one of {CATEGORIES}.")
        getattr(self, role)[category] += int(nbytes)

    def total(self, role: Role) -> int:
        return sum(getattr(self, role).values())

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(**{role: {cat: int(getattr(self, role)[cat] + getattr(other, role)[cat])
                                         for cat in CATEGORIES} for role in ROLES})

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {role: {**getattr(self, role), "total": self.total(role)} for role in ROLES}


@runtime_checkable
class ReportsMemory(Protocol):
    """Implemented by strategies and callbacks that know where they keep their tensors (``MemoryReport`` adds them)."""

    def memory_breakdown(self) -> MemoryBreakdown: ...


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage: two views of one storage have the same key."""
    return (str(t.device), torch_internals.storage_key(t.untyped_storage()))


def storage_key_or_none(t: torch.Tensor) -> tuple[str, int] | None:
    """:func:`storage_key`, or None for a tensor without a storage (nested, sparse)."""
    try:
        return storage_key(t)
    except (RuntimeError, NotImplementedError):
        return None


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights and views counted once)."""
    unique = {storage_key(t): t for t in tensors if isinstance(t, torch.Tensor)}
    return sum(t.untyped_storage().nbytes() for t in unique.values())


def quant_state_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a quantized weight's quantization state (bitsandbytes' ``Params4bit.quant_state``, nested
    state included): part of the weight's bytes (NOTE: neither parameters nor buffers, so a module scan misses them)."""
    found: list[torch.Tensor] = []
    state = getattr(p, "quant_state", None)
    while state is not None and hasattr(state, "__dict__") and not isinstance(state, (type, torch.nn.Module)):
        found += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
        state = getattr(state, "state2", None)
    return found


def module_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers of ``module`` (a quantized weight's quantization state included)."""
    params = list(module.parameters())
    return unique_storage_bytes([*params, *module.buffers(), *(t for p in params for t in quant_state_tensors(p))])


def module_grad_bytes(module: torch.nn.Module) -> int:
    return unique_storage_bytes(p.grad for p in module.parameters() if p.grad is not None)


def state_tensors(state: dict) -> list[torch.Tensor]:
    """The tensors of one parameter's optimizer state: its tensor values, and the tensor attributes of objects it
    holds (GaLore's and APOLLO's projector keeps its projection matrix as ``projector.ortho_matrix``)."""
    found = []
    for value in state.values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for attr in vars(value).values():
                items = attr if isinstance(attr, (list, tuple)) else (attr,)
                found += [t for t in items if isinstance(t, torch.Tensor)]
    # NOTE: torchao's 4-/8-bit moments are wrapper subclasses: their codes and scales hold the bytes
    return [inner for t in found for inner in (torch_internals.inner_tensors(t) or [t])]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (moments, quantization state, step counters, projections)."""
    return unique_storage_bytes(t for state in optimizer.state.values() for t in state_tensors(state))


# NOTE: on a CPU-only machine the device cannot tell the roles apart: techniques mark what they keep on the host and
# trackers count marked storages there. Marks are weak (by identity): a freed tensor drops out by itself.
_HOST_TENSORS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_HOST_LISTENERS: list[Callable[..., None]] = []


def _mark(table: WeakIdKeyDictionary, tensors: tuple[torch.Tensor, ...], *role: str) -> None:
    """Add ``tensors`` to ``table`` (idempotent) and tell every listener, with ``role`` after each new one."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t not in table:
            table[t] = True
            for listener in _HOST_LISTENERS:
                listener(t, *role)


def mark_host(*tensors: torch.Tensor) -> None:
    """Mark tensors as kept in the host role (their storage is counted on the host side). Idempotent."""
    _mark(_HOST_TENSORS, tensors)


# host copy -> id of the parameter it copies. NOTE: an id, not a weakref: `module.to()` swaps a fake parameter in a dry
# run, which `swap_tensors` refuses for a weakly referenced one (hazard: a stale entry matches a new parameter that
# reuses the id only while its host copy outlives the parameter; the stream frees both together)
_HOST_WEIGHTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_host_weights(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Mark ``(parameter, host copy)`` pairs (parameter streaming's) in the host role, counted as ``weights`` by a
    tracker of that module entered after they were made (NOTE: it would not see them made)."""
    for p, host in pairs:
        mark_host(host)
        _HOST_WEIGHTS[host] = id(p)


def host_weight_copies(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The live host copies marked with :func:`mark_host_weights` of any of ``params``."""
    ids = {id(p) for p in params}
    return [host for host, i in list(_HOST_WEIGHTS.items()) if i in ids]


_DISK_TENSORS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_disk(*tensors: torch.Tensor) -> None:
    """Mark tensors as held by a disk tier (a dry run's stand-ins for its files): trackers count them on the disk."""
    _mark(_DISK_TENSORS, tensors, "disk")


def disk_tensors() -> list[torch.Tensor]:
    return list(_DISK_TENSORS)


def host_tensors() -> list[torch.Tensor]:
    """Every live tensor marked with :func:`mark_host`."""
    return list(_HOST_TENSORS)


def add_host_listener(fn: Callable[..., None]) -> None:
    """Call ``fn(tensor)`` on every later :func:`mark_host`, ``fn(tensor, "disk")`` on every :func:`mark_disk` (an
    active ``MemoryTracker`` re-tags at once)."""
    _HOST_LISTENERS.append(fn)


def remove_host_listener(fn: Callable[..., None]) -> None:
    if fn in _HOST_LISTENERS:
        _HOST_LISTENERS.remove(fn)


def host_storage_keys() -> set[tuple[str, int]]:
    """Storage keys of every live tensor marked with :func:`mark_host`."""
    return {storage_key(t) for t in list(_HOST_TENSORS)}


def is_host(t: torch.Tensor) -> bool:
    return storage_key(t) in host_storage_keys()


def mark_host_state(optimizer: torch.optim.Optimizer, marked: dict[int, int]) -> None:
    """Mark as host memory the optimizer state of the host-marked parameters (``lowmem_offload``'s masters) of an
    optimizer a callback swapped in. ``marked`` maps ``id(optimizer)`` to its state count at the last call: the scan
    is skipped while no parameter gained state."""
    n = len(optimizer.state)
    if marked.get(id(optimizer)) == n:
        return
    marked[id(optimizer)] = n
    host = host_storage_keys()
    if not host:
        return
    for p, state in optimizer.state.items():
        if isinstance(p, torch.Tensor) and storage_key(p) in host:
            mark_host(*state_tensors(state))

"""The fp32 host masters of ``lowmem_offload``: :class:`HostMasters` (docs/design.md, "The offload core")."""

from __future__ import annotations

import os
import sys
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import mark_host, storage_key
from lightning_lowmem.strategies.offload import hf_weights


def _holders(buf: Tensor) -> tuple[int, int]:
    """Python references to ``buf``, and holders of its storage (a view or ``detach()`` holds the storage only)."""
    return sys.getrefcount(buf), torch_internals.storage_use_count(buf.untyped_storage())


def _unheld() -> tuple[int, int]:
    """:func:`_holders` of a buffer held as :meth:`HostMasters.fold` holds one (counts differ between Pythons)."""
    held = [torch.empty(1)]
    buf = held[0]
    return _holders(buf)


_UNHELD = _unheld()


def frozen_without_master(module: torch.nn.Module, precision: Any, loading: bool, resuming: bool = False) -> set[int]:
    """Ids of ``module``'s frozen parameters whose compute weight holds their whole value (none when ``loading``).

    NOTE: [streamed without a master] a streamed frozen weight's value is its host copy (``stream_values``); packed
    4-bit/8-bit weights never have a master.
    NOTE: [resumed after an unfreeze] ``resuming``: a frozen weight whose fp32 value its half compute weight cannot
    hold came from a master (saved after an unfreeze) and keeps it, so the run continues as uninterrupted.
    """
    if loading or precision is None:
        return set()
    out = {id(p) for _, p in HostMasters.unique_params(module) if not p.requires_grad}
    dtype = precision.weight_dtype
    if resuming and dtype != torch.float32:
        with torch.no_grad():
            out -= {id(p) for _, p in HostMasters.unique_params(module) if id(p) in out and p.dtype == torch.float32
                    and not p.is_meta and not torch.equal(p, p.to(dtype).to(torch.float32))}
    return out


class HostMasters:
    """The masters of one module: parallel lists indexed by ``i``, with look-ups by identity."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.p_device: list[Parameter] = []
        self.p_host: list[Parameter] = []
        self.grad_host: list[Tensor | None] = []
        self.device_index: dict[int, int] = {}  # id(module parameter) -> i
        self.host_index: dict[int, int] = {}  # id(master) -> i
        self.buffers: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (fp32 original on host, value after the cast)
        # i -> (version counter, storage, dtype, device) of the compute weight when it last matched its master
        self.seen: dict[int, tuple[int, tuple[str, int], torch.dtype, torch.device]] = {}
        # id(module parameter) -> (name, parameter): frozen parameters that have no master (see `frozen_without_master`)
        self.frozen: dict[int, tuple[str, Parameter]] = {}
        self.streamed: frozenset[int] = frozenset()  # ids of the module parameters that stream (`offload_params`): not followed
        self._warned_rounded = False

    @staticmethod
    def unique_params(module: torch.nn.Module) -> Iterator[tuple[str, Parameter]]:
        for name, p in module.named_parameters():  # NOTE: de-duplicates tied weights (GPT-2 wte/lm_head)
            if p.is_floating_point():
                yield name, p

    @staticmethod
    def storage(p: Tensor, loading: bool, precision: Any) -> Tensor:
        """The fp32 host tensor of a new master: a copy of ``p``, or (loading weights) room for them."""
        if not loading:
            return p.detach().to("cpu", torch.float32, copy=True)
        if p.device.type == "cpu" and p.dtype == torch.float32 and not p.is_meta and precision.weight_dtype != torch.float32:
            # NOTE: an empty_init module's fp32 storage becomes the master (the cast gives the parameter its own)
            return p.detach()
        return torch.empty(p.shape, dtype=torch.float32)

    def build(self, module: torch.nn.Module, loading: bool, precision: Any, grad_buffers: bool,
              frozen: Collection[int] = (), place: Callable[[int, Tensor], Tensor] | None = None) -> None:
        """One master (and with ``grad_buffers`` an fp32 gradient buffer) per parameter not in ``frozen``; ``place(i,
        value)`` gives master ``i`` its storage (the disk tier's), one at a time."""
        for name, p in self.unique_params(module):
            if id(p) in frozen:
                self.frozen[id(p)] = (name, p)
                continue
            value = self.storage(p, loading, precision)
            p_host = Parameter(value if place is None else place(len(self.names), value), requires_grad=p.requires_grad)
            self._add(name, p, p_host, torch.empty_like(p_host) if grad_buffers and p.requires_grad else None)

    def _add(self, name: str, p: Parameter, p_host: Parameter, grad: Tensor | None) -> int:
        i = len(self.names)
        self.names.append(name)
        self.p_device.append(p)
        self.p_host.append(p_host)
        self.device_index[id(p)] = i
        self.host_index[id(p_host)] = i
        self.grad_host.append(grad)
        return i

    def master_unfrozen(self, value_of: Callable[[Parameter], Tensor]) -> list[int]:
        """Give a master (``value_of(p)`` upcast: nothing rounds) to every masterless parameter now trainable."""
        return self._master_frozen(lambda name, p: value_of(p) if p.requires_grad else None)

    def _master_frozen(self, value: Callable[[str, Parameter], Tensor | None]) -> list[int]:
        """Give every parameter kept without a master whose ``value(name, p)`` is not None an fp32 copy of it as one."""
        new = []
        for key, (name, p) in list(self.frozen.items()):
            v = value(name, p)
            if v is not None:
                del self.frozen[key]
                p_host = Parameter(v.detach().to("cpu", torch.float32, copy=True), requires_grad=p.requires_grad)
                mark_host(p_host)
                new.append(self._add(name, p, p_host, None))
        return new

    def load(self, path: str | os.PathLike) -> dict[str, int]:
        """Read a ``save_pretrained`` directory into the masters (see :mod:`~lightning_lowmem.strategies.offload.hf_weights`)."""
        report = hf_weights.load_into(dict(zip(self.names, self.p_host)), path)
        with torch.no_grad():
            for p, p_host in zip(self.p_device, self.p_host):
                if not p.is_meta and storage_key(p) != storage_key(p_host):
                    p.detach().copy_(p_host)  # NOTE: an empty_init module whose storage the master could not reuse
        return report

    def master_from_checkpoint(self, state: Mapping[str, Any]) -> list[int]:
        """Give a master to every parameter kept without one whose checkpoint value is fp32 and its compute weight half;
        return their indices (see [resumed after an unfreeze])."""
        def fp32_value(name: str, p: Parameter) -> Tensor | None:
            value = state.get(name)
            wanted = isinstance(value, Tensor) and value.dtype == torch.float32 and p.dtype != torch.float32
            return value if wanted else None

        return self._master_frozen(fp32_value)

    def keep_buffers(self, module: torch.nn.Module, precision: Any) -> None:
        """Keep the fp32 originals of the buffers that the cast to the compute dtype will round."""
        # NOTE: only "*-true" casts the buffers (see MasterHalfPrecision.convert_module)
        if precision.weight_dtype != torch.float32:
            for name, b in module.named_buffers():
                if b.is_floating_point():
                    self.buffers[name] = (b.detach().to("cpu", copy=True), b)

    def note_cast_buffers(self, module: torch.nn.Module) -> None:
        """After the cast: remember each kept buffer's value in the compute dtype."""
        for name, (original, _) in self.buffers.items():
            self.buffers[name] = (original, module.get_buffer(name).detach().to("cpu", copy=True))

    def repoint(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s param groups at the masters; move any state it has to the host."""
        for g, group in enumerate(optimizer.param_groups):
            params = []
            for p in group["params"]:
                if id(p) in self.host_index or id(p) in self.frozen:
                    params.append(p)  # NOTE: a frozen parameter without a master has no gradient: no step moves it
                    continue
                i = self.device_index.get(id(p))
                if i is None:
                    raise ValueError(
                        f"`{type(optimizer).__name__}` param group {g} holds a tensor of shape {tuple(p.shape)} that is "
                        "not a parameter of the LightningModule; `lowmem_offload` can only optimize the module's "
                        "parameters (build the optimizer from `self.parameters()` in `configure_optimizers`)."
                    )
                params.append(self.p_host[i])
            group["params"] = params
        if optimizer.state:
            state: defaultdict[Any, Any] = defaultdict(dict)
            for p, s in optimizer.state.items():
                i = self.device_index.get(id(p), self.host_index.get(id(p)))
                key = self.p_host[i] if i is not None else p
                state[key] = {k: v.to("cpu") if isinstance(v, Tensor) else v for k, v in s.items()}
            optimizer.state = state

    def note_device(self, indices: Iterable[int] | None = None) -> None:
        """Remember the version counter (not bumped by ``.data`` writes) and storage of compute weights ``indices``
        (all) that now match their masters."""
        for i in range(len(self.p_device)) if indices is None else indices:
            p = self.p_device[i]
            if id(p) not in self.streamed:
                self.seen[i] = (torch_internals.tensor_version(p), storage_key(p), p.dtype, p.device)

    def adopt_writes(self) -> list[int]:
        """Copy every compute weight written by other code (in place, or ``p.data`` replaced) since it was noted into
        its master (a half one upcast, warned once); return their indices. In-place ``p.data`` writes and streamed
        weights are not seen."""
        seen, p_device = self.seen, self.p_device
        changed = [i for i in range(len(p_device)) if i in seen and (
            seen[i][0] != torch_internals.tensor_version(p_device[i]) or seen[i][1] != storage_key(p_device[i]))]
        for i in changed:
            self.adopt(i)
        self.note_device(changed)
        rounded = [self.names[i] for i in changed if self.p_device[i].dtype != torch.float32]
        if rounded and not self._warned_rounded:
            self._warned_rounded = True
            more = f" and {len(rounded) - 3} more" if len(rounded) > 3 else ""
            warnings.warn(
                f"lowmem_offload: code wrote the weights {', '.join(f'`{n}`' for n in rounded[:3])}{more} outside the "
                f"hooks that show the fp32 masters; their {self.p_device[changed[0]].dtype} compute weights were copied "
                "into the masters (rounded: the masters' low bits are lost). For an exact fp32 write, write inside "
                "`with trainer.strategy.masters_view(write_back=True):`. This warning is shown once.",
                UserWarning,
                stacklevel=4,
            )
        return changed

    @torch.no_grad()
    def adopt_untracked_writes(self) -> list[int]:
        """Copy into their masters the compute weights whose value differs from their master's rounding (``p.data``
        writes, e.g. ``WeightAveraging``'s); one device-to-host read of every weight, so only when giving back."""
        changed = [i for i, (p, p_host) in enumerate(zip(self.p_device, self.p_host))
                   if id(p) not in self.streamed and not p.is_meta
                   and not torch.equal(p.detach().to("cpu"), p_host.detach().to(p.dtype))]
        for i in changed:
            self.p_host[i].copy_(self.p_device[i].detach())
        return changed

    @torch.no_grad()
    def adopt(self, i: int) -> None:
        """Copy compute weight ``i`` (written by other code) into its master; give it back its dtype and device."""
        p, p_host = self.p_device[i], self.p_host[i]
        _, _, dtype, device = self.seen[i]
        self.check_shape(i)
        p_host.copy_(p.detach())  # NOTE: a half compute weight is upcast: the low fp32 bits of the master are lost
        if p.dtype != dtype or p.device != device:
            p.data = p.data.to(device=device, dtype=dtype)

    def check_shape(self, i: int) -> None:
        """Refuse a compute weight ``i`` given a tensor of another shape than its master's."""
        p, p_host = self.p_device[i], self.p_host[i]
        if p.shape != p_host.shape:
            raise RuntimeError(
                f"lowmem_offload: `{self.names[i]}` was given a tensor of shape {tuple(p.shape)} (its weight has shape "
                f"{tuple(p_host.shape)}); a parameter's shape cannot change during training under lowmem_offload. "
                "Write its values in place instead (`with torch.no_grad(): p.copy_(new)`)."
            )

    def master_of(self, p_host: Tensor) -> Parameter | None:
        """The module parameter that ``p_host`` is the master of (None if it is not a master)."""
        i = self.host_index.get(id(p_host))
        return self.p_device[i] if i is not None else None

    @torch.no_grad()
    def fold(self, i: int, grad: Tensor) -> None:
        """Add a gradient (compute dtype, on the host) into master ``i``'s fp32 buffer."""
        p_host = self.p_host[i]
        if p_host.grad is None:  # first micro-batch of the window: the optimizer's zero_grad set it to None
            buf = self.grad_host[i]
            assert buf is not None
            if _holders(buf) != _UNHELD:
                # NOTE: [kept gradient] code kept the last window's gradient (`self.prev = p.grad`): as after plain
                # Lightning's `zero_grad()`, it keeps the old values and the new gradient gets a new tensor
                buf = self.grad_host[i] = torch.empty_like(buf)
                mark_host(buf)
            buf.copy_(grad)
            p_host.grad = buf
        else:
            p_host.grad.add_(grad)

    def pairs(self, optimizer: Optimizer) -> list[tuple[int, Parameter, Parameter]]:
        """``(i, master, module parameter)`` for every parameter ``optimizer`` holds (all must be masters)."""
        pairs = []
        for group in optimizer.param_groups:
            for p_host in group["params"]:
                i = self.host_index.get(id(p_host))
                if i is None and id(p_host) in self.frozen:
                    continue  # NOTE: frozen, without a master (see `repoint`)
                if i is None:
                    raise RuntimeError(
                        f"`{type(optimizer).__name__}` holds a tensor of shape {tuple(p_host.shape)} that is not a master "
                        "of `lowmem_offload`; an optimizer swapped in after setup must be built over the masters "
                        "(the param groups of `trainer.strategy.optimizers`)."
                    )
                pairs.append((i, p_host, self.p_device[i]))
        return pairs

    def nonfinite_grads(self, optimizer: Optimizer) -> tuple[list[str], int] | None:
        """None if every gradient ``optimizer`` holds is finite; else (names of the first bad ones, how many)."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return None
        # NOTE: one vectorised norm pass; a norm that overflows fp32 counts too (AdamW's g*g would be inf)
        if bool(torch.stack(torch_internals.foreach_norm(grads)).isfinite().all()):
            return None
        bad = [
            self.names[self.host_index[id(p)]] if id(p) in self.host_index else f"tensor of shape {tuple(p.shape)}"
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]
        return bad[:3], len(bad) or 1

    def state_dict(self, module: torch.nn.Module) -> OrderedDict[str, Any]:
        """``module``'s state dict with the fp32 masters for the weights (a plain fp32 module loads it)."""
        state = module.state_dict(keep_vars=True)
        if not self.p_host:
            return OrderedDict((k, v.detach() if isinstance(v, Tensor) else v) for k, v in state.items())
        out: OrderedDict[str, Any] = OrderedDict()
        for key, value in state.items():
            i = self.device_index.get(id(value))
            if i is not None:
                out[key] = self.p_host[i].detach()
            elif key in self.buffers:
                out[key] = self.buffer_fp32(key, value.detach())
            else:
                out[key] = value.detach() if isinstance(value, Tensor) else value
        return out

    def buffer_fp32(self, name: str, current: Tensor) -> Tensor:
        original, cast = self.buffers[name]
        # NOTE: a buffer unchanged since the cast goes back to its exact fp32 value; one the model updated
        # (running statistics) can only be upcast from its half-precision value.
        if torch.equal(current.to("cpu"), cast):
            return original
        return current.to("cpu", torch.float32)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a checkpoint's fp32 weights into the masters (loaded after setup)."""
        with torch.no_grad():
            for name, p_host in zip(self.names, self.p_host):
                if name in state:
                    p_host.copy_(state[name])

    @torch.no_grad()
    def give_back_fp32(self, module: torch.nn.Module, optimizers: list[Optimizer]) -> None:
        """Leave the user an fp32 module holding the masters' values, and optimizers pointing at its parameters."""
        for name in self.buffers:
            owner, _, attr = name.rpartition(".")
            buffers = torch_internals.module_buffers(module.get_submodule(owner))
            buffers[attr] = self.buffer_fp32(name, buffers[attr])  # type: ignore[arg-type]
        for p_device, p_host in zip(self.p_device, self.p_host):
            # NOTE: the master's storage becomes the module's weight (no copy); masters are never pinned.
            p_device.data = p_host.detach()
            p_device.grad = None
        back = {id(h): d for d, h in zip(self.p_device, self.p_host)}
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [back.get(id(p), p) for p in group["params"]]
            opt.state = defaultdict(dict, {back.get(id(p), p): s for p, s in opt.state.items()})

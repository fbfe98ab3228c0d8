"""The fp32 masters of ``lowmem_offload`` shown through the module's own parameters (``.data``/``.grad`` swapped, the
``Parameter`` objects kept), for the gradient hooks, manual optimization and ``trainer.strategy.masters_view()``.

NOTE: [views are not tracked] ``.data`` writes bump no version counter: a ``write_back=True`` view copies every master
into its compute weight on exit; the gradient hooks' views do not (the step that follows copies what it steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import storage_key
from lightning_lowmem.strategies.offload import stream_values
from lightning_lowmem.strategies.offload.masters import HostMasters
from lightning_lowmem.strategies.offload.param_stream import ParamStream

Pairs = Sequence[tuple[int, nn.Parameter, nn.Parameter]]


class MastersView:
    """Inside ``view()``, the module's parameters are the fp32 host masters (and, with ``grads``, hold their gradients).

    Memory: none (the masters' own tensors are shown; ``buffers=True`` shows a clone of each rounded buffer's fp32
    value). Cost: a few attribute assignments per parameter, plus with ``write_back`` one copy of every master into
    the compute weights (a host-to-device transfer of the compute weights).

    Example:
        >>> from lightning_lowmem.strategies.offload.transfer import HostTransfer
        >>> net = torch.nn.Linear(2, 2)
        >>> masters = HostMasters()
        >>> masters.build(net, loading=False, precision=None, grad_buffers=False)
        >>> _ = net.to(torch.bfloat16)
        >>> view = MastersView(masters, net, lambda pairs: HostTransfer(torch.device("cpu"), []).weights_to_device(pairs))
        >>> with view.view():
        ...     net.weight.dtype
        torch.float32
        >>> net.weight.dtype
        torch.bfloat16
    """

    def __init__(
        self, masters: HostMasters, module: nn.Module, to_compute: Callable[[Pairs], None], stream: ParamStream | None = None
    ) -> None:
        self.masters = masters
        self.module = module
        self.to_compute = to_compute
        self.stream = stream
        self._depth = 0
        self._write_back = False
        self._compute: list[Tensor] = []  # the compute weights, while a view shows the masters
        self._copies: stream_values.Shown = []  # the streamed weights without a master, shown as their host copies
        self._shown: list[Tensor | None] | None = None  # the gradients a view with `grads` put on the parameters

    @property
    def depth(self) -> int:
        """How many views are open now, nested (0: the parameters hold the compute weights)."""
        return self._depth

    @contextlib.contextmanager
    def view(self, *, grads: bool = False, buffers: bool = False, write_back: bool = False) -> Iterator[MastersView]:
        """Show the masters (``grads``: with their gradients; ``buffers``: the fp32 values of rounded buffers); with
        ``write_back``, on exit (a nested view's: the outermost's) copy every master and buffer into the compute."""
        if not self.masters.p_host and not stream_values.unmastered(self.stream, self.masters):
            yield self
            return
        if self._depth:
            self._write_back |= write_back
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self.masters.adopt_writes()
        self._write_back = write_back
        self._depth = 1
        masters, stream = self.masters, self.stream
        streamed = stream.shapes if stream is not None else {}
        if stream is not None:
            stream.release_all()  # NOTE: a released block is refetched where needed (a pending backward included)
        # NOTE: a streamed weight's placeholder is rebuilt, not read (the dry run's fake mode refuses its `.data`)
        data = [stream.released(p) if id(p) in streamed else p.data for p in masters.p_device]  # type: ignore[union-attr]
        self._compute = data
        # NOTE: [streamed without a master] (masters.py) a frozen streamed weight's value is its host copy: shown here
        self._copies = stream_values.show(stream, masters)
        shown = self._show_buffers() if buffers else {}
        with torch.no_grad():
            for p, p_host in zip(masters.p_device, masters.p_host):
                p.data = p_host  # NOTE: not `p_host.detach()`: no aten op runs (dispatch-level observers see none)
                if grads:
                    p.grad = p_host.grad
        self._shown = [p_host.grad for p_host in masters.p_host] if grads else None
        try:
            yield self
        finally:
            self._depth = 0
            write, self._write_back = self._write_back, False
            if write:
                self._adopt_replaced()
            self.sync_grads()
            for p, d in zip(masters.p_device, data):
                if grads:
                    p.grad = None  # NOTE: before `.data` goes back: the compute weight's dtype may differ
                p.data = d
            stream_values.restore(stream, self._copies)
            self._shown, self._compute, self._copies = None, [], []
            self._restore_buffers(shown, write)
            if write:
                self.to_compute([(i, masters.p_host[i], masters.p_device[i]) for i in range(len(masters.p_host))])
            masters.note_device()

    @torch.no_grad()
    def _adopt_replaced(self) -> None:
        """Inside the view: a parameter whose ``.data`` code replaced (``p.data = new``) has its new value copied into
        its master (an in-place write reached the master already)."""
        for i, (p, p_host) in enumerate(zip(self.masters.p_device, self.masters.p_host)):
            if storage_key(p) != storage_key(p_host):
                self.masters.check_shape(i)
                p_host.copy_(p.detach())

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """Inside a view: put the compute weights back for a while, without gradients (for a memory breakdown)."""
        if not self._depth:
            yield
            return
        params = self.masters.p_device
        kept = [(p.data, p.grad) for p in params]
        with torch.no_grad():
            for p, d in zip(params, self._compute):
                p.grad = None
                p.data = d
            for _, p, _ in self._copies:  # the streamed weights without a master: their placeholders
                p.data = self.stream.released(p)  # type: ignore[union-attr]
        try:
            yield
        finally:
            with torch.no_grad():
                for p, (d, g) in zip(params, kept):
                    p.data = d
                    p.grad = g
                for _, p, h in self._copies:
                    p.data = h

    def sync_grads(self) -> None:
        """Inside a view with ``grads``: make a parameter's ``.grad`` and its master's the same tensor again after code
        replaced one (the parameter's side wins)."""
        if self._shown is None:
            return
        for i, (p, p_host) in enumerate(zip(self.masters.p_device, self.masters.p_host)):
            if p.grad is not self._shown[i]:
                p_host.grad = p.grad  # NOTE: e.g. `self.head.bias.grad = None` in on_before_optimizer_step
            elif p_host.grad is not self._shown[i]:
                p.grad = p_host.grad
            self._shown[i] = p_host.grad

    def _show_buffers(self) -> dict[str, Tensor]:
        """Put the fp32 value of each buffer the cast rounded in its place; return the compute buffers taken out."""
        taken: dict[str, Tensor] = {}
        for name in self.masters.buffers:
            owner, _, attr = name.rpartition(".")
            buffers = torch_internals.module_buffers(self.module.get_submodule(owner))
            current = buffers[attr]
            assert current is not None
            taken[name] = current
            # NOTE: a clone: code in the view may write the buffer in place, and the fp32 original is kept by reference
            buffers[attr] = self.masters.buffer_fp32(name, current.detach()).clone()
        return taken

    @torch.no_grad()
    def _restore_buffers(self, taken: dict[str, Tensor], write: bool) -> None:
        for name, compute in taken.items():
            owner, _, attr = name.rpartition(".")
            buffers = torch_internals.module_buffers(self.module.get_submodule(owner))
            value = buffers[attr]  # NOTE: the one shown, or a new tensor the code assigned (SWA's BN reset does)
            if not write or value is None:
                buffers[attr] = compute
                continue
            if value.shape == compute.shape:
                compute.copy_(value)  # NOTE: the same tensor object stays in the module (the cast rounds)
            else:
                compute = value.detach().to(compute.device, compute.dtype, copy=True)
            buffers[attr] = compute
            # NOTE: remember the exact fp32 value: a later checkpoint or the module given back gets it, not the upcast
            self.masters.buffers[name] = (value.detach().to("cpu", torch.float32, copy=True), compute.to("cpu", copy=True))

"""Code written for a plain fp32 module, run against the fp32 masters of ``lowmem_offload`` (private helper).

Under ``lowmem_offload`` the module's parameters are the compute weights (half precision on the device under
``*-true``; a streamed block's weights are empty placeholders between uses) and hold no ``.grad``: the fp32 weights and
their gradients are the host masters (:class:`~lightning_lowmem.strategies.offload.masters.HostMasters`). Inside a
:class:`MastersView` the module's own parameters show the masters, for the code that must read them:

* the gradient hooks (``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``), which
  the strategy runs inside a view with the masters' gradients, so ``clip_grad_value_(self.encoder.parameters(), ...)``
  clips what the optimizer steps;
* manual optimization: ``training_step`` from each ``manual_backward`` and each step to the next forward
  (:mod:`~lightning_lowmem.strategies.offload.manual_grads`);
* the user's own code: ``with trainer.strategy.masters_view(grads=True):``.

Design: a view swaps each parameter's ``.data`` for its master (and ``.grad`` for the master's gradient), the same
``Parameter`` objects staying in the module. Chosen over putting the master ``Parameter`` objects into the modules
because references user code keeps (a list of parameters made in ``__init__``, tensor hooks, a callback's dict keyed
by parameter) stay valid, tied weights need no table of owners, and ``.grad`` may be assigned (a parameter accepts a
gradient of its own dtype and device only: inside the view that is the master's). The cost is a few attribute
assignments per parameter and view; no tensor is copied on entry. A frozen weight without a master shows its value:
its compute weight, or a streamed block's host copy (:mod:`~lightning_lowmem.strategies.offload.stream_values`).

NOTE: [views are not tracked] writes through ``.data`` bypass autograd's version counters, so a view cannot see
whether its code wrote the weights through ``.data``: a view made with ``write_back=True`` copies every master into its
compute weight on exit; the gradient hooks' views do not, as the optimizer step that follows copies the masters it steps.
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
        """Show the masters (``grads``: with their gradients; ``buffers``: the fp32 values of rounded buffers).

        ``write_back``: on exit, copy every master (and every shown buffer) into the compute tensors. A view inside a
        view shows what the outer one shows and passes its ``write_back`` to it. Before the masters are shown, compute
        weights other code wrote are adopted into them (``HostMasters.adopt_writes``).
        """
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
        masters = self.masters
        stream = self.stream
        streamed = stream.shapes if stream is not None else {}
        if stream is not None:
            stream.release_all()  # NOTE: a released block is refetched where needed (a pending backward included)
        # NOTE: a streamed weight's placeholder is not read back from the parameter (`.data` of it is an op the dry
        # run's fake mode refuses on a real placeholder): it is rebuilt, here, before any parameter shows its master
        # (in its compute dtype; no op runs while only some parameters are put back on exit)
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
                if p.shape != p_host.shape:
                    raise RuntimeError(
                        f"lowmem_offload: `{self.masters.names[i]}` was given a tensor of shape {tuple(p.shape)} (its "
                        f"weight has shape {tuple(p_host.shape)}); a parameter's shape cannot change during training "
                        "under lowmem_offload. Write its values in place instead (`with torch.no_grad(): p.copy_(new)`)."
                    )
                p_host.copy_(p.detach())

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """Inside a view: put the compute weights back for a while, without gradients (what is on the device, for a
        memory breakdown taken in a hook that shows the masters); elsewhere: nothing."""
        if not self._depth:
            yield
            return
        params = self.masters.p_device
        kept = [(p.data, p.grad) for p in params]
        with torch.no_grad():
            for p, d in zip(params, self._compute):
                p.grad = None
                p.data = d
            stream_values.hide(self.stream, self._copies)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, (d, g) in zip(params, kept):
                    p.data = d
                    p.grad = g
                stream_values.unhide(self._copies)

    def sync_grads(self) -> None:
        """Inside a view with ``grads``: after code replaced (or dropped) a parameter's ``.grad`` or its master's, make
        both the same tensor again (the parameter's side wins if both changed)."""
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

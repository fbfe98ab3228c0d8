"""Manual optimization under ``lowmem_offload``: the masters' gradients on ``p.grad`` between ``manual_backward`` and
the step, as plain Lightning leaves them (fp16: still scaled). The view closes at the step, the next backward, a
forward of a module holding parameters, or the end of ``training_step``; the stepped masters reach the compute weights.

NOTE: [stray backward] a backward Lightning does not run opens no view and, on CUDA, is not drained:
:meth:`ManualGrads.before_step` refuses the step it would feed.
NOTE: [direct use] a parameter read outside a module's forward while the view is open is its master (a host tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.strategies.offload.masters_view import MastersView
from lightning_lowmem.strategies.offload.stream_values import unmastered


class ManualGrads:
    """The masters' gradients on the module's parameters from each ``manual_backward`` to the step that uses them.

    Memory: none (the masters' own tensors are shown). Cost: a few attribute assignments per parameter at each
    ``manual_backward`` and close, one Python call per forward of a module holding parameters.

    Example:
        >>> import torch
        >>> from lightning_lowmem.strategies.offload.masters import HostMasters
        >>> net = torch.nn.Linear(2, 2)
        >>> masters = HostMasters()
        >>> masters.build(net, loading=False, precision=None, grad_buffers=True)
        >>> masters.fold(0, torch.ones(2, 2))  # a gradient reached the master of `weight`
        >>> _ = net.to(torch.bfloat16)
        >>> manual = ManualGrads()
        >>> manual.attach(MastersView(masters, net, lambda pairs: None), net)
        >>> manual.open()
        >>> net.weight.grad.dtype, net.weight.dtype  # the master and its gradient
        (torch.float32, torch.float32)
        >>> _ = net(torch.zeros(1, 2, dtype=torch.bfloat16))  # a forward closes the view
        >>> net.weight.grad is None, net.weight.dtype
        (True, torch.bfloat16)
    """

    def __init__(self) -> None:
        self._view: MastersView | None = None
        self._open: ExitStack | None = None
        self._handles: list[RemovableHandle] = []
        self._in_backward = False
        self._stray = False  # a gradient reached the masters outside Lightning's backward since the last step
        self._pending: list[Callable[[], None]] = []  # the copies of stepped masters into the compute weights

    def attach(self, view: MastersView, module: nn.Module) -> None:
        """Manual optimization of ``module``: show the gradients after each backward, close on every trigger."""
        self._view = view
        # NOTE: and the streamed weights without a master, which a view shows as their host copies (stream_values.py)
        owned = {id(p) for p in view.masters.p_device} | {id(p) for _, p, _ in unmastered(view.stream, view.masters)}
        for sub in module.modules():
            if any(id(p) in owned for p in sub.parameters()):
                # NOTE: prepend: the view must be closed before the parameter stream's hook fetches a block
                self._handles.append(sub.register_forward_pre_hook(lambda m, a: self.close(), prepend=True))

    @property
    def attached(self) -> bool:
        return self._view is not None

    def detach(self) -> None:
        self.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._view = None

    def open(self) -> None:
        """After a backward (drained) or a step: the parameters show the masters and their gradients (manual only)."""
        if self._view is None or self._open is not None:
            return
        stack = ExitStack()
        stack.enter_context(self._view.view(grads=True))
        self._open = stack

    def close(self) -> None:
        """The parameters hold the compute weights again, then the stepped masters are copied into them."""
        if self._open is None or (self._view is not None and self._view.depth > 1):
            return  # NOTE: a view the user opened inside this one (`masters_view()`) is still open: it closes first
        stack, self._open = self._open, None
        stack.close()
        pending, self._pending = self._pending, []
        for copy in pending:
            copy()

    def before_backward(self) -> None:
        self.close()
        self._in_backward = True

    def after_backward(self) -> None:
        self._in_backward = False
        self.open()

    def grad_ready(self) -> None:
        """A gradient reached the strategy's hook; note it if no Lightning backward is running (see [stray backward])."""
        if self._view is not None and not self._in_backward:
            self._stray = True

    def after_step(self, copy: Callable[[], None]) -> None:
        """After a step (taken or skipped): show the masters until the next close, which then runs ``copy``."""
        self._pending.append(copy)
        self.open()

    def before_step(self) -> None:
        """Close the view (the step reads the masters); refuse a step fed by a backward Lightning did not run."""
        self.close()
        if self._stray:
            self._stray = False
            raise RuntimeError(
                "lowmem_offload: a backward ran outside `self.manual_backward` before this `opt.step()` (`loss.backward()` "
                "or `torch.autograd.backward` in `training_step`?). Under lowmem_offload the gradients go to the fp32 "
                "host masters: Lightning's backward waits for their copies and shows them on the module's parameters "
                "until the step, a backward of your own does neither. Call `self.manual_backward(loss)` instead."
            )

"""Manual optimization under ``lowmem_offload``: the gradients between ``manual_backward`` and the step (private helper).

Plain Lightning's manual optimization leaves every gradient on ``p.grad`` after ``self.manual_backward(loss)``, and
code in ``training_step`` reads, clips and changes it before ``opt.step()``: ``clip_grad_norm_(self.parameters(), 1.0)``,
a gradient norm logged, ``p.grad.mul_(0.5)``, gradients accumulated over several ``manual_backward`` calls. Under
``lowmem_offload`` the gradients the optimizer steps are the fp32 host masters' (each device gradient leaves as soon as
it is ready), so :class:`ManualGrads` opens a :class:`~lightning_lowmem.strategies.offload.masters_view.MastersView` with the
gradients at the end of every ``manual_backward``, after the strategy drained the copies in flight (on CUDA the
gradients reach the host asynchronously), and again after every step (``opt.step()``: plain Lightning's parameters
are the stepped weights then, with their gradients until ``zero_grad``, and code writes them there: WGAN's critic
clamps ``p.data`` after its step). It closes the view as soon as the compute weights are needed again:

* the step (``OffloadStrategy.optimizer_step``), which steps the masters;
* the next backward (``manual_backward`` again: the gradients keep accumulating on the masters);
* the forward of a module that holds parameters (a pre-hook ahead of every other, so a streamed block is fetched after
  it); a module without parameters (a metric, a loss) leaves the view open;
* the end of ``training_step`` (callbacks and validation see the compute weights, as in automatic optimization).

The copy of a step's masters into the compute weights waits for that close, so what code wrote into the stepped
weights after the step reaches the compute weights too, for no extra copy.

Inside, the parameters are the masters (fp32, on the host) as plain Lightning's parameters are its fp32 weights, so
what the code writes into a gradient (or a weight) is what the optimizer steps. fp16 (``"16-mixed"``): the gradients
there are still multiplied by the loss scale, as plain Lightning's ``GradScaler`` leaves them until its step unscales.

NOTE: [stray backward] a backward Lightning does not run (``loss.backward()`` in ``training_step``) opens no view and,
on CUDA, is not drained before the step; :meth:`ManualGrads.before_step` refuses the step it would feed.

NOTE: [direct use] a parameter read outside a module's forward (``self.scale * x``, ``torch.randn(...).type_as(p)``)
while the view is open is its master: on CUDA that fails (a host tensor), on the CPU it computes in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.strategies.offload.masters_view import MastersView
from lightning_lowmem.strategies.offload.stream_values import unmastered


class ManualGrads:
    """The masters' gradients on the module's parameters from each ``manual_backward`` to the step that uses them.

    Memory: none (the masters' own tensors are shown). Cost: a few attribute assignments per parameter at each
    ``manual_backward`` and at each close, and one Python call per forward of a module holding parameters.

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
                # NOTE: prepend: ahead of the hooks registered so far (and of the parameter stream's, registered at
                # `on_train_start`, after this): the view must be closed before a streamed block is fetched
                self._handles.append(sub.register_forward_pre_hook(self._before_forward, prepend=True))

    @property
    def attached(self) -> bool:
        return self._view is not None

    def detach(self) -> None:
        self.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._view = None

    # --- the window ------------------------------------------------------------------------------------------------
    def open(self) -> None:
        """After a backward (drained) or a step: the parameters show the masters and their gradients (manual only)."""
        if self._view is None or self._open is not None:
            return
        stack = ExitStack()
        stack.enter_context(self._view.view(grads=True))
        self._open = stack

    def close(self) -> None:
        """The parameters hold the compute weights again (what code wrote into a gradient stays on the master), then
        the stepped masters are copied into them."""
        if self._open is None or (self._view is not None and self._view.depth > 1):
            return  # NOTE: a view the user opened inside this one (`masters_view()`) is still open: it closes first
        stack, self._open = self._open, None
        stack.close()
        pending, self._pending = self._pending, []
        for copy in pending:
            copy()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.close()

    # --- backward and step -----------------------------------------------------------------------------------------
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

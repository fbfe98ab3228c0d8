"""Code written for a plain fp32 module, run against the fp32 masters of ``lowmem_offload`` (private helper).

Under ``lowmem_offload`` the module's parameters are the compute weights (half precision on the device; a streamed
block's weights are empty placeholders between uses) and hold no ``.grad``: the fp32 weights and their gradients are
the host masters (:class:`~lightning_lowmem.strategies.offload.masters.HostMasters`). Code that plain Lightning runs
against the fp32 module reads and writes the masters here, through :class:`MastersView`:

* Lightning's weight averaging (``StochasticWeightAveraging``, ``WeightAveraging``/``EMAWeightAveraging``) builds and
  updates its average from ``pl_module.parameters()`` (and ``buffers()``), and writes the average back into them:
  :func:`wrap_averaging` runs every hook of those callbacks inside a view, so the average is taken over the fp32
  masters, as plain Lightning takes it over the fp32 parameters, and what a hook writes reaches the masters and, from
  them, the compute weights;
* the gradient hooks (``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``) read and
  clip ``p.grad``: :class:`~lightning_lowmem.strategies.offload.precision.MasterHalfPrecision` runs them inside a view with
  the masters' gradients, so ``clip_grad_value_(self.encoder.parameters(), ...)`` clips what the optimizer steps;
* the user's own hooks between a step and the next ``zero_grad`` (``on_train_batch_end``, ``on_train_epoch_end``, the
  next ``on_train_batch_start``, ``on_before_zero_grad``), where plain Lightning's ``p.grad`` still holds the last
  step's gradients: :func:`wrap_grad_readers` runs them inside a view with the masters' gradients (a weight written
  there is followed to its compute weight);
* ``zero_grad()`` of the module and of its submodules (:func:`wrap_module_zero_grad`) clears the masters' gradients;
* manual optimization: ``training_step`` from each ``manual_backward`` and each step to the next forward
  (:mod:`~lightning_lowmem.strategies.offload.manual_grads`).

Design: a view swaps each parameter's ``.data`` for its master (and ``.grad`` for the master's gradient), the same
``Parameter`` objects staying in the module. Chosen over putting the master ``Parameter`` objects into the modules
because references user code keeps (a list of parameters made in ``__init__``, tensor hooks, a callback's dict keyed
by parameter) stay valid, tied weights need no table of owners, and ``.grad`` may be assigned (a parameter accepts a
gradient of its own dtype and device only: inside the view that is the master's). The cost is a few attribute
assignments per parameter and view; no tensor is copied on entry. A frozen weight without a master shows its value:
its compute weight, or a streamed block's host copy (:mod:`~lightning_lowmem.strategies.offload.stream_values`).

NOTE: [views are not tracked] writes through ``.data`` bypass autograd's version counters, so a view cannot see
whether its code wrote the weights: a view made with ``write_back=True`` copies every master into its compute weight on
exit (the weight averaging hooks that may write: once per epoch or validation, not per step); the gradient hooks'
views do not, as the optimizer step that follows copies the masters it steps.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch.callbacks import BaseFinetuning, Callback, StochasticWeightAveraging, WeightAveraging
from torch import Tensor, nn
from torch.optim import Optimizer

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
        self._follow = False
        self._compute: list[Tensor] = []  # the compute weights, while a view shows the masters
        self._copies: stream_values.Shown = []  # the streamed weights without a master, shown as their host copies
        self._shown: list[Tensor | None] | None = None  # the gradients a view with `grads` put on the parameters
        # NOTE: [writes outside the hooks] the strategy's: before the masters are shown, a compute weight other code wrote
        # is copied into its master; after they are put back, every compute weight matches its master again
        self.before_show: Callable[[], None] = lambda: None
        self.after_restore: Callable[[], None] = lambda: None

    @property
    def depth(self) -> int:
        """How many views are open now, nested (0: the parameters hold the compute weights)."""
        return self._depth

    @contextlib.contextmanager
    def view(
        self, *, grads: bool = False, buffers: bool = False, write_back: bool = False, follow_writes: bool = False
    ) -> Iterator[None]:
        """Show the masters (``grads``: with their gradients; ``buffers``: the fp32 values of rounded buffers).

        ``write_back``: on exit, copy every master (and every shown buffer) into the compute tensors.
        ``follow_writes``: on exit, copy into the compute weights only the masters code wrote through the module's
        parameters (in place, or ``p.data`` replaced; see :meth:`_written`). A view inside a view shows what the outer
        one shows and passes its ``write_back`` and ``follow_writes`` to it.
        """
        if not self.masters.p_host and not stream_values.unmastered(self.stream, self.masters):
            yield
            return
        if self._depth:
            self._write_back |= write_back
            self._follow |= follow_writes
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.before_show()
        self._write_back, self._follow = write_back, follow_writes
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
        versions = [torch_internals.tensor_version(p) for p in masters.p_device]
        try:
            yield
        finally:
            self._depth = 0
            write, self._write_back = self._write_back, False
            follow, self._follow = self._follow, False
            written = self._written(versions) if write or follow else []
            self.sync_grads()
            for p, d in zip(masters.p_device, data):
                if grads:
                    p.grad = None  # NOTE: before `.data` goes back: the compute weight's dtype may differ
                p.data = d
            stream_values.restore(stream, self._copies)
            self._shown, self._compute, self._copies = None, [], []
            self._restore_buffers(shown, write)
            if write or written:
                self.to_compute([(i, masters.p_host[i], masters.p_device[i])
                                 for i in (range(len(masters.p_host)) if write else written)])
            self.after_restore()

    @torch.no_grad()
    def _written(self, versions: list[int]) -> list[int]:
        """Inside the view: the masters code wrote through the module's parameters since ``versions`` were read; a
        parameter whose ``.data`` was replaced (``p.data = new``) has its new value copied into its master first."""
        written = []
        for i, (p, p_host) in enumerate(zip(self.masters.p_device, self.masters.p_host)):
            if storage_key(p) != storage_key(p_host):
                if p.shape != p_host.shape:
                    raise RuntimeError(
                        f"lowmem_offload: `{self.masters.names[i]}` was given a tensor of shape {tuple(p.shape)} (its "
                        f"weight has shape {tuple(p_host.shape)}); a parameter's shape cannot change during training "
                        "under lowmem_offload. Write its values in place instead (`with torch.no_grad(): p.copy_(new)`)."
                    )
                p_host.copy_(p.detach())
                written.append(i)
            elif torch_internals.tensor_version(p) != versions[i]:  # NOTE: an in-place write through the parameter (not through `p.data`)
                written.append(i)
        return written

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


# --- weight averaging callbacks ---------------------------------------------------------------------------------------
_AVERAGING = (StochasticWeightAveraging, WeightAveraging)
_HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))
# NOTE: hooks of Lightning's own classes that only read the module (update the average), called per step or epoch:
# no write-back after them unless a subclass overrides them
_READ_ONLY = {
    (WeightAveraging, "on_train_batch_end"),
    (WeightAveraging, "on_train_epoch_end"),
    (WeightAveraging, "on_save_checkpoint"),
    (StochasticWeightAveraging, "on_fit_start"),
    (StochasticWeightAveraging, "on_train_epoch_end"),
}


def _set_by_user(obj: Any, hook: str) -> bool:
    """Whether ``obj`` has its own ``hook`` attribute other than the class's hook bound to it (which an object pickled
    during a fit carries, see :func:`_in_view`)."""
    own = vars(obj).get(hook)
    return own is not None and getattr(own, "__func__", None) is not getattr(type(obj), hook)


def _reads_only(callback: Callback, hook: str) -> bool:
    return any(isinstance(callback, cls) and getattr(type(callback), hook) is getattr(cls, hook) for cls, name in _READ_ONLY
               if name == hook)


def wrap_averaging(callbacks: Sequence[Callback], view: MastersView) -> Callable[[], None]:
    """Run every hook of the weight averaging callbacks in ``callbacks`` inside ``view``; return the undo."""
    wrapped: list[tuple[Callback, str]] = []
    for callback in callbacks:
        if not isinstance(callback, _AVERAGING):
            continue
        for hook in _HOOKS:
            if getattr(type(callback), hook) is getattr(Callback, hook) or _set_by_user(callback, hook):
                continue
            write = not _reads_only(callback, hook)
            # NOTE: an instance attribute shadows the class's method for this object only; `undo` deletes it
            setattr(callback, hook, _in_view(callback, hook, view, write))
            wrapped.append((callback, hook))

    def undo() -> None:
        for callback, hook in wrapped:
            vars(callback).pop(hook, None)

    return undo


def _in_view(callback: Callback, hook: str, view: MastersView, write: bool) -> Callable[..., Any]:
    """``callback.hook`` run inside ``view``: a method bound to ``callback`` (it pickles as ``getattr(callback, hook)``,
    i.e. as the class's hook; ``__wrapped__`` keeps Lightning's ``is_overridden`` answering as for the class)."""
    method = getattr(type(callback), hook)

    @functools.wraps(method)
    def run(self: Callback, *args: Any, **kwargs: Any) -> Any:
        with view.view(buffers=True, write_back=write):
            return method(self, *args, **kwargs)

    return types.MethodType(run, callback)


# --- Lightning's fine-tuning callbacks -------------------------------------------------------------------------------
def wrap_finetuning(
    callbacks: Sequence[Callback],
    masters: HostMasters,
    optimizers: Callable[[], Sequence[Optimizer]],
    repoint: Callable[[Optimizer], None],
) -> Callable[[], None]:
    """Run every hook of Lightning's ``BaseFinetuning`` callbacks (``BackboneFinetuning``) with the optimizers' param
    groups holding the module's parameters; after each, ``repoint`` the groups at the masters; return the undo.

    NOTE: those hooks look the groups' parameters up among ``pl_module.named_parameters()`` (a ``KeyError`` on a master)
    and, when they unfreeze, add the module's parameters with ``optimizer.add_param_group``: shown the module's
    parameters, they run as under plain Lightning, and the groups they add get the masters when the hook returns. The
    strategy hooks the gradients of the parameters they make trainable at the next batch start.
    """
    wrapped: list[tuple[Callback, str]] = []
    for callback in callbacks:
        if not isinstance(callback, BaseFinetuning):
            continue
        for hook in _HOOKS:
            if getattr(type(callback), hook) is getattr(Callback, hook) or _set_by_user(callback, hook):
                continue
            setattr(callback, hook, _with_module_params(callback, hook, masters, optimizers, repoint))
            wrapped.append((callback, hook))

    def undo() -> None:
        for callback, hook in wrapped:
            vars(callback).pop(hook, None)

    return undo


def _with_module_params(
    callback: Callback,
    hook: str,
    masters: HostMasters,
    optimizers: Callable[[], Sequence[Optimizer]],
    repoint: Callable[[Optimizer], None],
) -> Callable[..., Any]:
    method = getattr(type(callback), hook)

    @functools.wraps(method)
    def run(self: Callback, *args: Any, **kwargs: Any) -> Any:
        for optimizer in optimizers():
            for group in optimizer.param_groups:
                group["params"] = [_module_param(masters, p) for p in group["params"]]
        try:
            return method(self, *args, **kwargs)
        finally:
            for optimizer in optimizers():  # NOTE: the live list: a hook may have replaced the groups (a resume)
                repoint(optimizer)

    return types.MethodType(run, callback)


def _module_param(masters: HostMasters, p: Tensor) -> Tensor:
    module_param = masters.master_of(p)
    return p if module_param is None else module_param


# --- the module's zero-grad hook ----------------------------------------------------------------------------------
_ZERO_GRAD = "on_validation_model_zero_grad"


def wrap_zero_grad(module: nn.Module, view: MastersView) -> Callable[[], None]:
    """Run ``module.on_validation_model_zero_grad`` (Lightning's default: ``self.zero_grad()``, releasing the gradients
    after a step, before validation) against the masters' gradients; return the undo.

    NOTE: without it the masters keep the step's gradients through validation, and a step with no backward after it
    (``StochasticWeightAveraging``'s BatchNorm epoch skips backward) would apply them again, where plain Lightning finds
    none. The hook is an instance attribute for the fit: a bound method, so pickling the module (it pickles as
    ``getattr(module, name)``) and copying it keep working.
    """
    if _set_by_user(module, _ZERO_GRAD):
        return lambda: None
    hook = getattr(type(module), _ZERO_GRAD)

    def on_validation_model_zero_grad(self: nn.Module) -> None:
        with view.view(grads=True):
            hook(self)

    setattr(module, _ZERO_GRAD, types.MethodType(on_validation_model_zero_grad, module))
    return lambda: vars(module).pop(_ZERO_GRAD, None)


def wrap_module_zero_grad(module: nn.Module, view: MastersView) -> Callable[[], None]:
    """Run ``zero_grad`` of ``module`` and of every submodule holding parameters against the masters' gradients.

    NOTE: plain Lightning's ``self.zero_grad()`` / ``self.discriminator.zero_grad()`` (``set_to_none`` or not) clears the
    gradients the next step would use; without this it would clear nothing here (the parameters hold no gradient
    outside a view) and the masters' gradients would add up across steps. Instance attributes for the fit, as above.
    """
    owned = {id(p) for p in view.masters.p_device}
    wrapped: list[nn.Module] = []
    for sub in module.modules():
        if _set_by_user(sub, "zero_grad") or not any(id(p) in owned for p in sub.parameters()):
            continue
        method = type(sub).zero_grad

        def zero_grad(self: nn.Module, *args: Any, _method: Callable[..., Any] = method, **kwargs: Any) -> Any:
            with view.view(grads=True):
                return _method(self, *args, **kwargs)

        sub.zero_grad = types.MethodType(zero_grad, sub)  # type: ignore[method-assign]
        wrapped.append(sub)

    def undo() -> None:
        for sub in wrapped:
            vars(sub).pop("zero_grad", None)

    return undo


# --- hooks that run between a step and the next zero_grad -----------------------------------------------------------
_GRAD_READERS = ("on_train_batch_start", "on_train_batch_end", "on_train_epoch_end", "on_before_zero_grad")
# NOTE: [grad readers] the packages whose hooks are not wrapped: Lightning's own callbacks and this package's read no
# gradients there (a checkpoint, a progress bar, MemoryReport, which must see the compute weights it measures); the
# defining class's module is checked because their classes are many and a user's subclass may override the hook again
_NOT_USER = ("lightning.", "pytorch_lightning.", "lightning_lowmem.")


def _user_hook(obj: Any, hook: str) -> bool:
    """Whether the class of ``obj`` defines ``hook`` in user code (not in Lightning or this package)."""
    for cls in type(obj).__mro__:
        if hook in vars(cls):
            return not cls.__module__.startswith(_NOT_USER)
    return False


def reads_grads_after_step(callbacks: Sequence[Callback], module: nn.Module) -> list[str]:
    """The user hooks of ``module`` and ``callbacks`` that see the last step's gradients (see :func:`wrap_grad_readers`)."""
    return [f"{type(obj).__name__}.{hook}" for obj in [*callbacks, module] for hook in _GRAD_READERS if _user_hook(obj, hook)]


def wrap_grad_readers(callbacks: Sequence[Callback], module: nn.Module, view: MastersView) -> Callable[[], None]:
    """Run the user's ``on_train_batch_start``, ``on_train_batch_end``, ``on_train_epoch_end`` and
    ``on_before_zero_grad`` (of ``module`` and of ``callbacks``) inside ``view`` with the masters' gradients; return
    the undo.

    NOTE: plain Lightning's ``p.grad`` still holds the last step's gradients in those hooks (until the next step's
    ``zero_grad``): a callback logging gradient norms in ``on_train_batch_end`` reads them. Here the parameters hold no
    ``.grad`` outside a view, so it would silently read ``None``. A weight written in the hook reaches its master and,
    from it, its compute weight (``follow_writes``). Only overridden hooks are wrapped: none, no view.
    """
    wrapped: list[tuple[Any, str]] = []
    for obj in [*callbacks, module]:
        for hook in _GRAD_READERS:
            if _set_by_user(obj, hook) or not _user_hook(obj, hook):
                continue
            setattr(obj, hook, _with_grads(obj, hook, view))
            wrapped.append((obj, hook))

    def undo() -> None:
        for obj, hook in wrapped:
            vars(obj).pop(hook, None)

    return undo


def _with_grads(obj: Any, hook: str, view: MastersView) -> Callable[..., Any]:
    """``obj.hook`` run inside ``view`` with gradients (a bound method: pickles and copies as :func:`_in_view`'s)."""
    method = getattr(type(obj), hook)

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with view.view(grads=True, follow_writes=True):
            return method(self, *args, **kwargs)

    return types.MethodType(run, obj)


def wrap_hooks(callbacks: Sequence[Callback], module: nn.Module, view: MastersView) -> Callable[[], None]:
    """:func:`wrap_averaging`, :func:`wrap_zero_grad`, :func:`wrap_module_zero_grad` and :func:`wrap_grad_readers`
    for one fit; return the undo."""
    undo = [wrap_averaging(callbacks, view), wrap_zero_grad(module, view), wrap_module_zero_grad(module, view),
            wrap_grad_readers(callbacks, module, view)]

    def unwrap() -> None:
        for u in undo:
            u()
        # NOTE: a copy of the module made during the fit (`copy.deepcopy`) keeps its wrapped methods: the view they
        # open shows nothing from now on, instead of the masters of a finished fit on the original's parameters
        view.masters, view.stream = HostMasters(), None

    return unwrap

"""What a side step must put back: the state of a module that a training step run outside the loop changes.

A side step (the probe of ``ActivationCheckpointing``, the trials of ``AccumulationScheduler(micro_batch_size=
"auto")``) runs the user's ``training_step`` on a batch that plain Lightning never trains on. Whatever that step
changes in the module would reach the run. :func:`kept_state` puts back, on exit (after an error too):

- every buffer, the same tensor with the same values: ``BatchNorm`` running statistics and ``num_batches_tracked``
  (its kernel writes them without bumping their version, so every buffer is copied), a module's own running scales
  and counters, written in place or re-registered;
- every ``torchmetrics.Metric`` under the module: its states (tensors updated in place, lists appended to) and its
  bookkeeping (update count, cached ``compute`` and ``forward`` values), so a metric updated in ``training_step``
  does not count the side step's batch in the epoch's value;
- every public attribute (no leading ``_``) of the module and its submodules that the step rebound, such as a
  counter ``self.seen += n`` or a ``self.last = out.detach()``, and the ``training`` flags.

NOTE: [what is not put back] A tensor attribute that is not a buffer, changed in place (``self.ema.mul_(...)``),
a container changed in place (``self.history.append(...)``), an attribute set for the first time, state outside
the module (a DataModule's, a global's), and the parameters: a trial's optimizer step runs at learning rate 0,
which leaves them bit-identical for every optimizer whose update scales with it. A parameter that ``training_step``
itself writes in place (an EMA teacher moved toward its student under ``torch.no_grad``) is put back by
:func:`param_writes_undone` around the step's call. Lightning's own tuners
(``BatchSizeFinder``, ``LearningRateFinder``) restore a checkpoint instead, which covers the parameters, the
optimizer and the persistent buffers but none of the above (metric states and non-persistent buffers are not in
the ``state_dict``) and costs a full copy of the model on disk.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import storage_key, storage_key_or_none
from lightning_lowmem.core.buffers import submodules

_MISSING = object()


@functools.cache
def _is_metric(cls: type) -> bool:
    # NOTE: cached per class: `isinstance` against an ABC costs about 0.5 us a module, per snapshot
    return issubclass(cls, Metric)


class _MetricSnapshot:
    """One metric's states (copied) and its own attributes (by reference), as they were."""

    __slots__ = ("attributes", "lists", "metric", "tensors")

    def __init__(self, metric: Metric) -> None:
        self.metric = metric
        self.attributes = dict(vars(metric))
        self.tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lists: dict[str, tuple[list[Any], list[Any]]] = {}
        with torch.no_grad():
            for name, value in metric.metric_state.items():
                if isinstance(value, torch.Tensor):
                    # NOTE: torchmetrics updates tensor states in place (`self.total += n`): a copy of the values
                    self.tensors[name] = (value, value.clone())
                elif isinstance(value, list):
                    self.lists[name] = (value, list(value))

    def restore(self) -> None:
        own = vars(self.metric)
        for name, value in self.attributes.items():
            if own.get(name, _MISSING) is not value:
                own[name] = value
        with torch.no_grad():
            for state, saved in self.tensors.values():
                state.copy_(saved)
        for state, saved in self.lists.values():
            state[:] = saved


class ModuleState:
    """What :func:`kept_state` puts back, taken now; :meth:`restore` puts it back (any number of times).

    The OOM splitter takes one before each chunk's forward and restores it when the chunk runs out of memory, so a
    failed attempt leaves no trace either.
    """

    __slots__ = ("buffers", "metrics", "public")

    def __init__(self, module: nn.Module) -> None:
        modules = submodules(module)
        with torch.no_grad():
            self.buffers = [(m, name, buf, buf.clone()) for m in modules for name, buf in m.named_buffers(recurse=False)]
        self.metrics = [_MetricSnapshot(m) for m in modules if _is_metric(type(m))]
        # NOTE: whole dictionaries (a fast copy; the OOM splitter takes one per micro-batch), filtered on restore
        self.public = [(m, dict(vars(m))) for m in modules]

    def restore(self) -> None:
        # NOTE: the same buffer tensors, with their values: references held elsewhere (DDP's buffer list) stay valid
        with torch.no_grad():
            for owner, name, buf, before in self.buffers:
                if getattr(owner, name, None) is not buf:
                    setattr(owner, name, buf)
                buf.copy_(before)
        for m, attributes in self.public:
            own = vars(m)
            changed = [k for k, v in attributes.items() if own.get(k, _MISSING) is not v and not k.startswith("_")]
            if changed:
                # NOTE: a name the step registered as a parameter, buffer or submodule is left registered (an entry
                # in the instance dictionary would shadow it)
                registered = {n for n, _ in m.named_parameters(recurse=False)} | {n for n, _ in m.named_buffers(recurse=False)}
                registered |= {n for n, _ in m.named_children()}
                for name in changed:
                    if name not in registered:
                        own[name] = attributes[name]
        for snapshot in self.metrics:
            snapshot.restore()


@contextlib.contextmanager
def kept_state(module: nn.Module) -> Iterator[None]:
    """Buffers, ``torchmetrics`` metric states and rebound public attributes of ``module`` as on entry (see above).

    Cost: a copy of every buffer and of every metric's tensor states (small next to the model for the usual
    ``BatchNorm`` statistics and metrics), held while the context is open; a shallow copy of each submodule's
    attribute dictionary.

    Example:
        >>> from torchmetrics import SumMetric
        >>> net = nn.Sequential(nn.BatchNorm1d(2))
        >>> net.seen = SumMetric()
        >>> with kept_state(net):
        ...     _ = net(torch.randn(4, 2))
        ...     net.seen.update(4.0)
        ...     _ = net.train(False)
        >>> int(net[0].num_batches_tracked), float(net.seen.compute()), net.training
        (0, 0.0, True)
    """
    state = ModuleState(module)
    try:
        yield
    finally:
        state.restore()


class _ParamWrites(torch_internals.TorchDispatchMode):
    """Before the first write into a parameter's storage (an in-place op, ``out=``, also through ``.data`` or a view),
    keeps a host copy of that parameter; :meth:`undo` copies them back."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.params = {storage_key(p): p for p in module.parameters() if p.device.type != "meta"}
        self.kept: dict[tuple[str, int], torch.Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch_internals.op_is_mutable(func):
            declared = torch_internals.op_arguments(func)
            named = dict(zip((a.name for a in declared), args)) | kwargs
            for arg in declared:
                value = named.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                    key = storage_key_or_none(value)
                    if key in self.params and key not in self.kept:
                        self.kept[key] = self.params[key].detach().to("cpu", copy=True)
        return func(*args, **kwargs)

    def undo(self) -> None:
        with torch.no_grad():
            for key, before in self.kept.items():
                self.params[key].data.copy_(before)  # NOTE: `.data`: no version bump (as before the side step)


@contextlib.contextmanager
def param_writes_undone(module: nn.Module) -> Iterator[None]:
    """Inside, the parameters of ``module`` that ops write in place are copied first (to the host), and put back on exit
    (after an error too). Cost: a dispatch mode over the ops inside, and a host copy of each parameter written.

    NOTE: not around a model holding ``torch.compile``-d modules (under a dispatch mode a compiled region runs another
    path, another rounding): their writes stay (see [what is not put back]).

    Example:
        >>> teacher = nn.Linear(2, 2)
        >>> before = teacher.weight.detach().clone()
        >>> with param_writes_undone(teacher), torch.no_grad():
        ...     _ = teacher.weight.mul_(0.5)
        >>> torch.equal(teacher.weight, before)
        True
    """
    if any(torch_internals.is_compiled_module(m) for m in module.modules()):
        yield
        return
    mode = _ParamWrites(module)
    try:
        with mode:
            yield
    finally:
        mode.undo()


__all__ = ["ModuleState", "kept_state", "param_writes_undone"]

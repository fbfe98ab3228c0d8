"""``kept_state``: a module's buffers, metric states and rebound public attributes, put back on exit.

``lowmem_auto`` plans inside ``fit`` and must leave the module as it found it. :func:`kept_state` puts back, on exit
(after an error too): every buffer (the same tensor, its values), every ``torchmetrics.Metric``'s states and
bookkeeping, and every public attribute of the module and its submodules that was rebound.

NOTE: not put back: a tensor attribute that is not a buffer changed in place, a container changed in place, an
attribute set for the first time, state outside the module, the parameters. The module goes once its last user
(``plan.auto``) stops using it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

_MISSING = object()


def submodules(module: nn.Module) -> list[nn.Module]:
    """``module.modules()`` (each once, in the same order), by identity.

    NOTE: ``nn.Module.modules()`` keeps a set of the modules it met, which needs them hashable; a LightningModule
    whose class defines ``__eq__`` has no ``__hash__``.
    """
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(reversed([child for _, child in m.named_children()]))
    return out


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
    """What :func:`kept_state` puts back, taken now; :meth:`restore` puts it back."""

    __slots__ = ("buffers", "metrics", "public")

    def __init__(self, module: nn.Module) -> None:
        modules = submodules(module)
        with torch.no_grad():
            self.buffers = [(m, name, buf, buf.clone()) for m in modules for name, buf in m.named_buffers(recurse=False)]
        self.metrics = [_MetricSnapshot(m) for m in modules if _is_metric(type(m))]
        # NOTE: whole dictionaries (a fast copy), filtered on restore
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


__all__ = ["ModuleState", "kept_state"]

"""fp32 sums of a half weight's gradient contributions when its module is called several times in one step.

Under plain ``*-mixed`` a weight is fp32 and autocast casts it at every use (Lightning turns the cast cache off), so
each use's gradient reaches the fp32 leaf as fp32 and the uses are summed in fp32. ``lowmem_offload`` stores the
weights autocast would cast in the compute dtype (see :func:`~lightning_lowmem.strategies.offload.precision.autocast_cast_params`):
a leaf in bf16, whose contributions autograd sums in bf16. For a layer applied once that is the same gradient; for a
layer applied many times (ALBERT's one shared layer, a GAN's discriminator on real and fake) the bf16 sum differs
from plain by up to half an update after a few steps.

:class:`ReusedGrads` restores the fp32 sum: from the second call of a module in one step on, its half weights are
replaced, for that call only, by a view (``torch_internals.module_parameters(module)[name]``; restored by the post-hook) whose gradient hook
adds the contribution, as fp32, into a stash and passes zeros on to the leaf. When the leaf's gradient is ready (the
first call's contribution, exact since the others are zeros), :meth:`take` adds it last: contributions arrive in
reverse call order, so the sum is the one plain autograd makes, in the same order. A module called once costs two
hook calls and nothing else.

NOTE: the hazard: the order of the fp32 sum follows backward's order; a graph where the first call's contribution
is not the last to arrive rounds differently (still an fp32 sum). Code that reads ``module.weight`` during a repeated
call gets the view (same values, dtype and shape, not a Parameter).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from lightning_lowmem._internals import torch as torch_internals


class ReusedGrads:
    """Per-contribution fp32 gradient sums for ``params`` (the module's half weights; ``index``: ``id -> i``)."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], index: dict[int, int]) -> None:
        half = {id(p) for p in params}
        self.index = index
        self.calls: dict[int, int] = {}
        self.stash: dict[int, Tensor] = {}
        self._swapped: dict[int, list[tuple[str, nn.Parameter]]] = {}
        self._handles: list[Any] = []
        self._owners = [(sub, names) for sub in module.modules()
                        if (names := [n for n, p in sub.named_parameters(recurse=False) if id(p) in half])]
        self.hook()

    def hook(self) -> None:
        """(Re-)register the hooks after every hook registered so far.

        NOTE: after parameter streaming's hooks (``ParamStream.hook_blocks``): the view must be taken of the fetched
        weight, not of the released placeholder the block holds before its pre-hook fetched it.
        """
        self.remove()
        for sub, names in self._owners:
            self._handles.append(sub.register_forward_pre_hook(functools.partial(self._pre, names=names)))
            self._handles.append(sub.register_forward_hook(self._post, always_call=True))

    def new_step(self) -> None:
        self.calls.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, module: nn.Module, args: Any, names: list[str]) -> None:
        if not torch.is_grad_enabled() or torch_internals.in_backward():  # no grad, or a recompute
            return
        calls = self.calls[id(module)] = self.calls.get(id(module), 0) + 1
        if calls < 2 or id(module) in self._swapped:
            return
        swapped = []
        for name in names:
            p = torch_internals.module_parameters(module)[name]
            if not isinstance(p, nn.Parameter) or not p.requires_grad:
                continue
            view = p.view_as(p)
            view.register_hook(functools.partial(self._collect, self.index[id(p)]))
            torch_internals.module_parameters(module)[name] = view  # type: ignore[assignment]
            swapped.append((name, p))
        self._swapped[id(module)] = swapped

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        for name, p in self._swapped.pop(id(module), []):
            torch_internals.module_parameters(module)[name] = p

    def _collect(self, i: int, grad: Tensor) -> Tensor:
        kept = self.stash.get(i)
        if kept is None:
            self.stash[i] = grad.to(torch.float32, copy=True)
        else:
            kept.add_(grad.float())
        return torch.zeros_like(grad)

    def take(self, i: int, grad: Tensor) -> Tensor:
        """The gradient of weight ``i``: ``grad`` (the leaf's), or the fp32 sum with it added last."""
        kept = self.stash.pop(i, None)
        return grad if kept is None else kept.add_(grad.float())

"""When ``lowmem_offload``'s host step runs: after backward (:class:`SerialStep`) or as each gradient lands
(:class:`StepInBackward`, ``optimizer_in_backward=True``); their one interface is in docs/design.md, "The offload core".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import mark_host, storage_key
from lightning_lowmem.core.lightning_callbacks import lightning_callback_problems
from lightning_lowmem.core.reentrant import reentrant_fix
from lightning_lowmem.strategies.offload.disk_tier import DiskTier
from lightning_lowmem.strategies.offload.masters import HostMasters
from lightning_lowmem.strategies.offload.nonfinite import NonFiniteGuard


def in_backward_problems(trainer: pl.Trainer, module: pl.LightningModule, precision: Any) -> list[str]:
    """What ``optimizer_in_backward=True`` cannot run (accumulation, norm clipping, fp16, manual optimization, Lightning
    callbacks and gradient hooks that need the gradients after backward)."""
    problems = []
    if trainer.accumulate_grad_batches != 1:
        problems.append(
            f"`optimizer_in_backward=True` steps each parameter during backward, so it cannot accumulate: "
            f"remove `accumulate_grad_batches={trainer.accumulate_grad_batches}` or set `optimizer_in_backward=False`"
        )
    algorithm = trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM
    if trainer.gradient_clip_val and GradClipAlgorithmType(algorithm) == GradClipAlgorithmType.NORM:
        problems.append(
            "`optimizer_in_backward=True` cannot clip by the global norm (it is known only after every "
            f"parameter has stepped): remove `gradient_clip_val={trainer.gradient_clip_val}`, use "
            "`gradient_clip_algorithm='value'`, or set `optimizer_in_backward=False`"
        )
    if precision.compute_dtype == torch.float16:
        problems.append(
            "`optimizer_in_backward=True` cannot use fp16: an overflow must skip the whole step, but "
            "parameters would already have stepped; use 'bf16-true'/'bf16-mixed'/'32-true'"
        )
    if not module.automatic_optimization:
        problems.append("`optimizer_in_backward=True` needs automatic optimization (the step happens in backward)")
    problems += lightning_callback_problems(trainer, module, "`optimizer_in_backward=True`")
    name = type(module).__name__
    if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
        problems.append(
            f"`optimizer_in_backward=True` steps each parameter inside backward, before `{name}.configure_gradient_clipping` "
            "runs, so your override would find no gradient to clip; remove it (`gradient_clip_val` with "
            "`gradient_clip_algorithm='value'` clips each gradient before its step) or set `optimizer_in_backward=False`"
        )
    late = [h for h in ("on_after_backward", "on_before_optimizer_step") if is_overridden(h, module, pl.LightningModule)]
    if late:
        warnings.warn(
            f"lowmem_offload(optimizer_in_backward=True) steps each parameter inside backward and frees its gradient: "
            f"{' and '.join(f'`{name}.{h}`' for h in late)} will see `p.grad is None` for every parameter. Read "
            "gradients in a tensor hook (`p.register_post_accumulate_grad_hook`), or set `optimizer_in_backward=False`.",
            UserWarning,
            stacklevel=2,
        )
    return problems


def _global_step(model: pl.LightningModule) -> object:
    return model.trainer.global_step if lightning_internals.attached_trainer(model) is not None else "?"


class SerialStep:
    """Each gradient is added into its master's fp32 host buffer as it lands; the optimizer steps after backward.

    Memory: an fp32 gradient buffer per trainable master (4 B/param on the host). Cost: the fold (one add per
    gradient), then the optimizer's step over all masters (torch's fused CPU Adam/AdamW where it applies).
    """

    grad_buffers = True

    def __init__(self, masters: HostMasters, guard: NonFiniteGuard | None) -> None:
        self.masters = masters
        self.guard = guard

    def on_grad(self, i: int, grad: Tensor) -> None:
        self.masters.fold(i, grad)

    def before_backward(self, loss: Tensor) -> None:
        pass

    def drain(self) -> None:
        pass

    def after_closure(self, optimizer: Optimizer, model: pl.LightningModule) -> None:
        """The non-finite guard: a step whose master gradients hold an inf/nan is skipped (its gradients dropped)."""
        if self.guard is None:
            return
        found = self.masters.nonfinite_grads(optimizer)
        if found is None:
            self.guard.stepped()
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # NOTE: no update, and the inf/nan gradient does not reach the next accumulation window
        self.guard.skipped(*found, step=_global_step(model))

    def step(self, precision: Precision, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any],
             **kwargs: Any) -> Any:
        return precision.optimizer_step(optimizer, model=model, closure=closure, **kwargs)


class StepInBackward:
    """Each master steps alone, with the user's optimizer, as soon as its gradient reaches the host; no gradient buffers.

    Memory: no fp32 gradient buffer (4 B/param less than :class:`SerialStep`; one reused fp32 buffer widens half
    gradients). Cost: one optimizer call per parameter. The non-finite guard checks the loss before backward and each
    gradient before its master steps.
    """

    grad_buffers = False

    def __init__(self, masters: HostMasters, guard: NonFiniteGuard | None, clip_value: float | None,
                 optimizers: Callable[[], Sequence[Optimizer]], tier: DiskTier | None = None) -> None:
        self.masters = masters
        self.tier = tier
        self._order: list[int] = []  # masters in the order their gradients arrived (the tier reads ahead in it)
        self.guard = guard
        self.clip_value = clip_value
        self.optimizers = optimizers
        self._skip_all = False  # this backward's loss was not finite
        self._bad: list[str] = []  # masters whose gradient was not finite in this backward
        self._stepped: set[int] = set()  # masters stepped in this backward
        self._fp32 = torch.empty(0)  # the reused buffer half gradients are widened into
        self._owners: tuple[tuple[int, ...], dict[int, tuple[Optimizer, dict[str, Any]]]] | None = None

    def before_backward(self, loss: Tensor) -> None:
        self._bad = []
        # NOTE: a non-finite loss must be caught before the first parameter steps (a device sync on CUDA)
        self._skip_all = self.guard is not None and not bool(torch.isfinite(loss.detach()).all())
        if self.tier is not None:
            # NOTE: the last backward's order; the first one guesses the reverse of the parameters' order
            self.tier.plan(self._order or reversed(range(len(self.masters.p_host))))
            self._order = []

    @torch.no_grad()
    def on_grad(self, i: int, grad: Tensor) -> None:
        masters = self.masters
        if i in self._stepped:
            raise ValueError(
                f"lowmem_offload(optimizer_in_backward=True): the gradient of `{masters.names[i]}` arrived twice in one "
                "backward (a weight shared by two reentrant-checkpointed blocks: each block's inner backward hands over "
                "its part), after its first part had stepped it: this step cannot match plain Lightning's, which steps "
                "once with their sum. " + reentrant_fix("pass `OffloadStrategy(optimizer_in_backward=False)`"))
        self._stepped.add(i)
        if self._skip_all:
            return
        if self.guard is not None and not bool(torch_internals.foreach_norm([grad])[0].isfinite()):
            self._bad.append(masters.names[i])
            return
        p_host = masters.p_host[i]
        if self.tier is not None:
            self.tier.acquire(i)
            self._order.append(i)
        p_host.grad = grad if grad.dtype == torch.float32 else self._widened(grad)
        if self.clip_value is not None:
            p_host.grad.clamp_(-self.clip_value, self.clip_value)  # what clip_grad_value_ does, per parameter
        optimizer, group = self._owner(p_host)
        params = group["params"]
        # NOTE: the group holds this one parameter for the call: the update is exactly the usual one
        group["params"] = [p_host]
        try:
            optimizer.step()
        finally:
            group["params"] = params
            p_host.grad = None
        for k, v in optimizer.state.get(p_host, {}).items():
            if isinstance(v, Tensor) and storage_key(v) == storage_key(self._fp32):
                optimizer.state[p_host][k] = v.clone()  # NOTE: state that kept the gradient itself gets its own copy
                mark_host(optimizer.state[p_host][k])
        if self.tier is not None:
            self.tier.place_state(i, optimizer.state.get(p_host, {}))
            self.tier.release(i)

    def _widened(self, grad: Tensor) -> Tensor:
        """``grad`` in fp32, in the reused buffer (a fresh tensor each time costs page faults)."""
        if self._fp32.numel() < grad.numel():
            self._fp32 = torch.empty(grad.numel(), dtype=torch.float32)
            mark_host(self._fp32)
        return self._fp32[: grad.numel()].view(grad.shape).copy_(grad)

    def _owner(self, p_host: Tensor) -> tuple[Optimizer, dict[str, Any]]:
        """The optimizer and param group that hold ``p_host``, looked up in the *current* optimizers."""
        optimizers = self.optimizers()
        key = tuple(id(o) for o in optimizers)
        if self._owners is None or self._owners[0] != key or id(p_host) not in self._owners[1]:
            table = {id(p): (opt, group) for opt in optimizers for group in opt.param_groups for p in group["params"]}
            self._owners = (key, table)
        found = self._owners[1].get(id(p_host))
        if found is None:
            raise RuntimeError(
                f"Master of `{self.masters.names[self.masters.host_index[id(p_host)]]}` is in no optimizer of the "
                "strategy; an optimizer swapped in after setup must hold the masters "
                "(`trainer.strategy.optimizers[i].param_groups`)."
            )
        return found

    def drain(self) -> None:
        self._stepped.clear()

    def after_closure(self, optimizer: Optimizer, model: pl.LightningModule) -> None:
        if self.guard is None:
            return
        if self._skip_all or self._bad:
            where = self._bad or ["the loss"]
            self.guard.skipped(where[:3], len(where), step=_global_step(model), partial=not self._skip_all)
            self._skip_all, self._bad = False, []
        else:
            self.guard.stepped()

    def step(self, precision: Precision, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any],
             **kwargs: Any) -> Any:
        """The closure (every master steps in its backward), then ``on_before_optimizer_step``."""
        out = closure()
        lightning_internals.precision_after_closure(precision, model, optimizer)
        return out

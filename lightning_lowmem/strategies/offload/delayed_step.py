"""The delayed parameter update of ``lowmem_offload``: ``OffloadStrategy(host_pass="delayed")``, opt in.

DeepSpeed's DPU (ZeRO-Offload's delayed parameter update): the optimizer step of window ``t`` runs on a host worker
while window ``t+1``'s forward and backward run on the weights from before it; at window ``t+1``'s step the worker's
result lands (it is waited for and its weights are uploaded into the compute weights), then window ``t+1``'s own step
is handed to the worker. So window ``t+1``'s gradients are taken at the weights before step ``t``:

    w[t+1] = step(w[t], g(w[t-1]))      (one step stale; plain training has g(w[t]))

This changes what is trained: it is not the serial step bit for bit, and is off by default. Each delayed step is the
serial step's maths for the gradients it is given: unscaled (fp16: on the main thread, the next window's loss scale
depends on it), then clipped and checked for non-finite values on the worker, before the step, by the functions the
serial step runs over the same gradients in the same order (a ``configure_gradient_clipping`` override clips on the
main thread, before the hand-over: code there may read the clipped gradients), with the hyperparameters (learning
rate, ...) the param groups had then, so an LR scheduler stepping meanwhile changes the next step, as serially. A step
the guard skips is counted, warned or raised for (``nonfinite``, ``max_consecutive_skips``) when it lands, naming the
global step it was taken at. Tested bit for bit against a plain-PyTorch loop written this way
(``tests/strategies/test_offload_delayed_step.py``).

What it buys: the optimizer kernel (AdamW: ~28 B/param read and written on the host), the clip and the non-finite
guard leave the critical path; the fold and the upload stay on it. On CUDA the worker also rounds each stepped master
into a landing slot of its own (``StreamTransfer.landing_slots``: the staging slots receive the next window's
gradients meanwhile), so the landing only queues the copies; not under ``offload_params``, whose upload writes the
host copies the next window's fetches read, nor on the plain CPU path, whose upload writes the compute weights the
next window computes on.

Before anything else reads the masters or the optimizer state (a view of the masters for the user hooks and Lightning
callbacks that see them, ``trainer.strategy.masters``), the step is waited for: they read it stepped, and the next
window still computes on the weights before it (those hooks do not change what is trained). The step lands early
(waited for, and its weights uploaded) at a checkpoint (so a run resumed from it continues exactly as the uninterrupted
run did after saving it: both start the next window on landed weights), before validation, at the end of each training
epoch and of training, and after a window that handed no step over (an fp16 overflow, a ``training_step`` that returned
None: the last step lands before the next window as after any step). So checkpoints,
validation and epochs change what is trained after them: their step lands one window early. Code that writes the
compute weights while a step is on the worker (outside those views) is refused when it is found, before the next
backward: the write and the pending step cannot both be kept.

Costs: a second set of fp32 gradient buffers (4 B/param of host RAM: window ``t+1`` folds into one while step ``t``
reads the other), on CUDA a second set of pinned staging buckets (2 B/param in bf16), one worker thread.

Refused before the first step: optimizers other than torch's ``Adam``, ``AdamW`` and ``SGD`` (the step runs on stand-in
tensors that share the masters' storage and optimizer state, which other optimizers may key otherwise: bitsandbytes'
8-bit ones, ``LowBitOptimizer``), differentiable or capturable param groups, manual optimization,
``optimizer_in_backward`` and a LightningModule overriding ``optimizer_zero_grad`` (it may zero the gradients in place
while the worker reads them).

Example:
    >>> import torch
    >>> from lightning_lowmem.strategies.offload.masters import HostMasters
    >>> masters = HostMasters()
    >>> masters.build(torch.nn.Linear(2, 2), loading=False, precision=None, grad_buffers=True)
    >>> opt = torch.optim.SGD(masters.p_host, lr=0.5)
    >>> for p in masters.p_host:
    ...     masters.fold(masters.host_index[id(p)], torch.ones_like(p))
    >>> before = masters.p_host[1].detach().clone()
    >>> delayed = DelayedStep()
    >>> delayed.submit(opt, masters)
    >>> delayed.take_due() is opt, torch.equal(masters.p_host[1], before - 0.5)
    (True, True)
    >>> delayed.close()
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import mark_host
from lightning_lowmem.strategies.offload.host_worker import HostWorker
from lightning_lowmem.strategies.offload.masters import HostMasters
from lightning_lowmem.strategies.offload.transfer import StreamTransfer

#: ``stage(pairs)``: round the stepped masters ``(i, master)`` for their upload (the worker, after the step)
Stage = Callable[[list[tuple[int, Tensor]]], None]
# NOTE: exact types only: their state is keyed by the parameter and their options live in the param groups
_DELAYABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class DelayedStep:
    """One optimizer step at a time on a host worker, over stand-ins of the masters, landed on demand.

    Saves: the optimizer kernel's time on the critical path. Costs: a second set of fp32 gradient buffers, one thread.
    """

    def __init__(self) -> None:
        self._worker = HostWorker("delayed-step", max_bytes=0)
        self.pending: Optimizer | None = None  # the optimizer whose step is on the worker
        self.due: Optimizer | None = None  # the optimizer whose stepped masters are not uploaded yet
        self.submitted = 0  # steps handed to the worker (tests)
        self._taken: dict[int, Tensor] = {}  # master -> the gradient buffer the pending step reads
        self._spare: dict[int, Tensor] = {}  # master -> a buffer the next window may fold into
        #: (names of the first bad masters, how many, global step): the landed step found a non-finite gradient
        self.skipped: tuple[list[str], int, Any] | None = None

    def submit(self, optimizer: Optimizer, masters: HostMasters, *, clip: tuple[float, Any] | None = None,
               guard: bool = False, step: Any = "?", stage: Stage | None = None) -> None:
        """Hand ``optimizer.step()`` over the masters' gradients as they are now to the worker (after :meth:`land`).

        The stand-ins share each master's storage (the step writes the masters) and its state dict (created here, on
        this thread, and filled by the step); the param groups are copies (a scheduler may change the real ones while
        the step runs). The next window folds into other buffers: ``masters.grad_host`` is swapped for the spare set.
        On the worker, before the step: ``clip`` (``(clip_val, algorithm)``, Lightning's clip of the main parameters),
        then with ``guard`` the non-finite check, which skips the step (:attr:`skipped` names it, for global ``step``);
        after it, ``stage`` rounds the stepped masters ``(i, master)`` for their upload (CUDA: the landing slots).
        """
        if self.pending is not None:
            raise RuntimeError("DelayedStep.submit: a step is still pending; land it first.")
        state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        groups, names = [], []
        for group in optimizer.param_groups:
            stand_ins = []
            for p_host in group["params"]:
                if p_host.grad is None:
                    continue
                q = p_host.detach()
                q.grad = p_host.grad
                state[q] = optimizer.state[p_host]
                stand_ins.append(q)
                i = masters.host_index[id(p_host)]
                names.append(masters.names[i])
                # NOTE: p_host.grad is the master's buffer unless code kept it (see [kept gradient] in masters.py)
                self._taken[i] = p_host.grad
                spare = self._spare.pop(i, None)
                if spare is None or spare.shape != p_host.shape:
                    spare = torch.empty_like(p_host)
                    mark_host(spare)
                masters.grad_host[i] = spare
            groups.append({**group, "params": stand_ins})
        shadow = object.__new__(type(optimizer))
        shadow.__dict__.update(vars(optimizer))  # NOTE: the step hooks, defaults, flags: the optimizer's own
        shadow.param_groups, shadow.state = groups, state
        torch_internals.mark_step_called(optimizer)  # NOTE: as a real step does (torch's schedulers check it)
        self.pending = optimizer
        self.submitted += 1
        # NOTE: the class's step, not the instance attribute (an LR scheduler's wrapper bound to the real optimizer)
        stepped = [(i, masters.p_host[i]) for i in self._taken] if stage is not None else []
        self._worker.submit(self._step, type(optimizer).step, shadow, clip, guard, names, step,
                            functools.partial(stage, stepped) if stage is not None else None)

    @torch.no_grad()
    def _step(self, step_fn: Any, shadow: Optimizer, clip: tuple[float, Any] | None, guard: bool, names: list[str],
              step: Any, stage: Callable[[], None] | None) -> None:
        """The worker: the clip and the non-finite guard as serially (``MasterHalfPrecision.clip_gradients``, then
        ``HostMasters.nonfinite_grads``: the same functions over the same gradients in the same order), then the step."""
        params = [q for group in shadow.param_groups for q in group["params"]]
        if clip is not None:
            if clip[1] == GradClipAlgorithmType.VALUE:
                torch.nn.utils.clip_grad_value_(params, clip_value=clip[0])
            else:
                torch.nn.utils.clip_grad_norm_(params, clip[0])
        if guard and params and not bool(torch.stack(torch_internals.foreach_norm([q.grad for q in params])).isfinite().all()):
            bad = [n for n, q in zip(names, params) if not bool(torch.isfinite(q.grad).all())]  # type: ignore[arg-type]
            self.skipped = (bad[:3], len(bad) or 1, step)
            return
        step_fn(shadow)
        if stage is not None:
            stage()

    def land(self) -> None:
        """Wait for the pending step (re-raising its error): the masters and the optimizer state may be read now; its
        optimizer is :attr:`due` for the upload of the stepped masters (:meth:`take_due`)."""
        optimizer, self.pending = self.pending, None
        if optimizer is None:
            return
        self.due = optimizer
        try:
            self._worker.wait()
        finally:
            self._spare.update(self._taken)
            self._taken = {}

    def take_due(self) -> Optimizer | None:
        """Land, then the optimizer whose stepped masters the caller uploads now (None: nothing to upload)."""
        self.land()
        optimizer, self.due = self.due, None
        return optimizer

    def close(self) -> None:
        self.land()
        self.due = None
        self._worker.close()
        self._spare = {}

    @property
    def threads(self) -> set[int]:
        """Idents of the threads the steps ran on (tests)."""
        return self._worker.threads


def why_not_delayed(optimizer: Optimizer) -> str | None:
    """Why ``host_pass="delayed"`` cannot step ``optimizer``, or None."""
    if type(optimizer) not in _DELAYABLE:
        return (f"it steps torch's `Adam`, `AdamW` and `SGD` only (their state keyed by parameter, their options in the "
                f"param groups), got `{type(optimizer).__module__}.{type(optimizer).__qualname__}`")
    if any(g.get("differentiable") or g.get("capturable") for g in optimizer.param_groups):
        return "a param group is differentiable or capturable"
    return None


def uses_landing_slots(strategy: Any) -> bool:
    """Whether ``strategy`` (an ``OffloadStrategy``, or anything else) lands its delayed steps from landing slots on a
    CUDA transfer (``StreamTransfer.landing_slots``): ``host_pass="delayed"`` without parameter streaming. The landing,
    the host-RAM check and the dry run's CUDA correction all ask this."""
    return getattr(strategy, "host_pass", None) == "delayed" and getattr(strategy, "offload_params", None) is False


def delayed_problems(strategy: Any, module: pl.LightningModule) -> list[str]:
    """What ``host_pass="delayed"`` cannot run with this module and strategy (checked at setup)."""
    if strategy.host_pass != "delayed":
        return []
    problems = []
    if not module.automatic_optimization:
        problems.append("`host_pass='delayed'` needs automatic optimization (manual optimization steps in your own "
                        "code); use `host_pass='serial'`")
    if strategy.optimizer_in_backward:
        problems.append("`host_pass='delayed'` and `optimizer_in_backward=True` both move the step: choose one")
    if is_overridden("optimizer_zero_grad", module, pl.LightningModule):
        problems.append(f"`{type(module).__name__}.optimizer_zero_grad` is overridden: it may zero the gradients in "
                        "place while `host_pass='delayed'` steps with them on a worker; remove the override or use "
                        "`host_pass='serial'`")
    return problems


class DelayedLanding(Callback):
    """Lands the delayed step before the other callbacks' epoch-end, validation and train-end hooks read the weights
    (the strategy puts it first in ``trainer.callbacks`` for the fit)."""

    def __init__(self, land: Any) -> None:
        self.land = land

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.land()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.land()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.land()


class DelayedUpdate:
    """The delayed update's part of ``OffloadStrategy``'s step (a mixin of ``HostStep``): hand a window's step to
    :class:`DelayedStep`, land it (wait, then upload what it stepped), and land it early for the callbacks."""

    host_pass: str
    _masters: HostMasters
    _deferred_clip: tuple[float, Any] | None = None  # the Trainer's clip of this window, for the worker

    @functools.cached_property
    def _delayed(self) -> DelayedStep:
        return DelayedStep()

    @contextlib.contextmanager
    def _deferring_clip(self, model: pl.LightningModule) -> Iterator[None]:
        """host_pass="delayed": inside, Lightning's gradient clip is recorded for the worker instead of run (unless
        ``configure_gradient_clipping`` is overridden: code there may read the gradients after its clip)."""
        precision = self.precision_plugin  # type: ignore[attr-defined]
        if self.host_pass != "delayed" or is_overridden("configure_gradient_clipping", model, pl.LightningModule):
            yield
            return
        self._deferred_clip = None
        precision.clip_check = self._defer_clip
        try:
            yield
        finally:
            precision.clip_check = None

    def _defer_clip(self, clip_val: float, algorithm: Any) -> bool:
        self._deferred_clip = (float(clip_val), algorithm)
        return True  # NOTE: `MasterHalfPrecision.clip_gradients` returns: the worker clips before the step

    def _delay(self, optimizer: Optimizer) -> None:
        """host_pass="delayed": hand this window's step (its clip and non-finite guard too) to the worker (the last one
        landed in `_host_step`)."""
        reason = why_not_delayed(optimizer)
        if reason is not None:
            raise ValueError(f"`OffloadStrategy(host_pass='delayed')` cannot step `{type(optimizer).__name__}`: {reason}. "
                             "Use `host_pass='serial'` (or 'overlap').")
        self._pick_kernel(optimizer)  # type: ignore[attr-defined]
        model = self.lightning_module  # type: ignore[attr-defined]
        step = model.trainer.global_step if lightning_internals.attached_trainer(model) is not None else "?"
        clip, self._deferred_clip = self._deferred_clip, None
        transfer = self._landing_transfer()
        self._delayed.submit(optimizer, self._masters, clip=clip, guard=self._guarding(), step=step,  # type: ignore[attr-defined]
                             stage=transfer.stage_landing if transfer is not None else None)

    def _landing_transfer(self) -> StreamTransfer | None:
        """The CUDA transfer with its landing slots (see ``StreamTransfer.landing_slots``); None on the plain CPU path,
        where the upload writes the compute weights the next window computes on, and under ``offload_params``, where it
        writes the host copies the next window's fetches read: both at the landing."""
        transfer = self._transfer  # type: ignore[attr-defined]
        if not isinstance(transfer, StreamTransfer) or not uses_landing_slots(self):
            return None
        transfer.landing_slots()
        return transfer

    def _land_delayed(self) -> None:
        """The delayed step lands: wait for it, then upload the weights it stepped (nothing when none is due, or when
        its guard skipped it: counted, warned or raised for here, as the serial step does at once).

        NOTE: only between a backward and the next forward (the step, the hooks of `DelayedLanding`, a checkpoint): the
        upload writes the compute weights in place, which a forward's saved tensors still waiting for backward read."""
        optimizer = self._delayed.take_due()
        skipped, self._delayed.skipped = self._delayed.skipped, None
        if skipped is not None:
            names, count, step = skipped
            self._nonfinite_step(names, count, self.lightning_module, step=step)  # type: ignore[attr-defined]
        elif optimizer is not None:
            self._consecutive_skips = 0
            self._mark_state(optimizer)  # type: ignore[attr-defined]
            transfer = self._landing_transfer()
            landed = transfer.land(self._masters.pairs(optimizer)) if transfer is not None else frozenset()
            self._note_device(sorted(landed))  # type: ignore[attr-defined]
            self._weights_to_device(optimizer, landed)  # type: ignore[attr-defined]  # NOTE: the masters not rounded

    def _land_early(self, trainer: pl.Trainer) -> Callable[[], None]:
        """host_pass="delayed": a callback first in ``trainer.callbacks`` lands the step before the others' epoch-end,
        validation and train-end hooks; return its removal."""
        if self.host_pass != "delayed":
            return lambda: None
        landing = DelayedLanding(self._land_delayed)
        trainer.callbacks.insert(0, landing)
        return lambda: trainer.callbacks.remove(landing) if landing in trainer.callbacks else None


__all__ = ["DelayedLanding", "DelayedStep", "DelayedUpdate", "delayed_problems", "uses_landing_slots", "why_not_delayed"]

"""The optimizer step of ``lowmem_offload`` (a part of :class:`~lightning_lowmem.strategies.offload.strategy.OffloadStrategy`).

The step on the host masters (the fused host kernel where it applies), the copy of the stepped masters back into the
compute weights, the step of each parameter inside backward (``optimizer_in_backward``) and the non-finite guard
(bf16 / fp32: a step on inf/nan gradients is skipped, counted, warned about once, refused after too many in a row).
:class:`HostStep` is a base of ``OffloadStrategy`` and reads its state (``_masters``, ``_transfer``, ...); it is not
used on its own.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import mark_host, storage_key
from lightning_lowmem.core.reentrant import reentrant_fix
from lightning_lowmem.strategies.offload import host_optimizer as _host_optimizer
from lightning_lowmem.strategies.offload import host_pass as _host_pass
from lightning_lowmem.strategies.offload.delayed_step import DelayedUpdate
from lightning_lowmem.strategies.offload.host_pass_checks import trainer_clip, why_serial
from lightning_lowmem.strategies.offload.host_worker import HostWorker
from lightning_lowmem.strategies.offload.masters_view import reads_grads_after_step
from lightning_lowmem.strategies.offload.mixed_check import CastWeightUseCheck
from lightning_lowmem.strategies.offload.precision import MasterHalfPrecision
from lightning_lowmem.strategies.offload.stream_values import copy_to_compute, upload_in_backward, value_of
from lightning_lowmem.strategies.offload.transfer import HostTransfer, StreamTransfer, transfer_for

IN_BACKWARD_BYTES = 32 * 2**20  # optimizer_in_backward: gradient bytes the host worker's queue may keep alive


class NonFiniteGradientError(FloatingPointError):
    """``lowmem_offload`` refused to step on non-finite (inf/nan) gradients (``nonfinite="raise"``, or too many skips)."""


class HostStep(DelayedUpdate):
    """The step of ``OffloadStrategy`` (see the module docstring)."""

    # --- the step --------------------------------------------------------------------------------------------
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        self._manual.before_step()
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        precision = self.precision_plugin
        assert isinstance(precision, MasterHalfPrecision)
        uploaded: frozenset[int] = frozenset()  # NOTE: by the host pass, during backward
        if self.optimizer_in_backward:
            self._bad_in_backward = []
            try:
                out = closure()  # each parameter steps inside backward (see `_step_in_backward`)
            finally:
                self._in_backward.wait()  # NOTE: a no-op after the drain; where backward raised, nothing steps later
            # NOTE: value clipping happened per parameter; norm clipping is refused; the masters hold no gradient
            precision.step_hooks(model, optimizer, clip=False)
            precision.last_step_skipped = out is None or self._skip_backward
            if self._skip_backward or self._bad_in_backward:
                where = self._bad_in_backward or ["the loss"]
                self._skip_backward = False
                self._nonfinite_step(where[:3], len(where), model, whole=precision.last_step_skipped)
            elif out is not None:
                self._consecutive_skips = 0
        else:
            self._arm_pass(optimizer, model)
            try:
                with self._deferring_clip(model):
                    out = precision.optimizer_step(optimizer, model=model, closure=closure, step_fn=self._host_step,
                                                   **kwargs)
            finally:
                uploaded = self._disarm_pass()
        if self._manual.attached:  # NOTE: code after `opt.step()` may write the stepped masters (strategies/offload/manual_grads.py)
            self._manual.after_step(functools.partial(self._weights_to_device, optimizer))
        elif self.host_pass == "delayed":
            if precision.last_step_skipped:
                self._land_delayed()  # NOTE: the next window computes on the last step's weights, as after any step
        elif not precision.last_step_skipped:
            self._weights_to_device(optimizer, uploaded)
        if (self._guarding() and lightning_internals.attached_trainer(model) is not None
                and lightning_internals.current_hook(model) is not None):
            # NOTE: only inside a loop hook (training_step, optimizer_step): `log` refuses elsewhere
            model.log("lowmem/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1)
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
        except RuntimeError as err:
            ours = self._pass.explain(err) if self._pass is not None else None  # NOTE: the host pass's upload
            if ours is None:
                raise
            raise ours from err

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._reused is not None:
            self._reused.new_step()
        try:
            with self._stream.first_use_check("train") if self._stream is not None else nullcontext(), self._cast_use_check():
                return super().training_step(*args, **kwargs)
        finally:
            self._manual.close()  # NOTE: a `manual_backward` whose step comes in a later batch (manual accumulation)

    def _cast_use_check(self) -> AbstractContextManager:
        """Under ``*-mixed``, on the first training step: the weights stored in the compute dtype are used by their
        layers' ops only (see ``strategies/offload/mixed_check.py``)."""
        cast, module = self.precision_plugin.cast_params, self.lightning_module  # type: ignore[attr-defined]
        if self._cast_use_checked or not cast or any(torch_internals.is_compiled_module(m) for m in module.modules()):
            return nullcontext()
        self._cast_use_checked = True
        streamed = self._stream.shapes if self._stream is not None else {}  # NOTE: placeholders between their uses
        names = {id(p): n for n, p in module.named_parameters()}
        keys = {storage_key(p): names.get(id(p), "?") for p in cast if id(p) not in streamed and p.numel()}
        return CastWeightUseCheck(keys, self.precision_plugin.precision)  # type: ignore[union-attr]

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._stream.first_use_check("validate") if self._stream is not None else nullcontext():
            return super().validation_step(*args, **kwargs)

    def drain_transfers(self) -> None:
        """Fold every gradient queued by the backwards so far into the masters (a sync point on CUDA).

        NOTE: [drain before user code] Lightning calls ``on_after_backward`` from the precision plugin's
        ``post_backward``, *before* the strategy's: ``MasterHalfPrecision.post_backward`` calls this first, so
        every gradient of the backward is on the masters before user code (``on_after_backward``, manual
        ``clip_gradients``, the step) reads them. Code that runs ``backward()`` outside Lightning's loop (the
        micro-batch search's trial steps) must call it too, or its queued copies reach the next real step.
        """
        if self._transfer is not None:
            self._transfer.synchronize()
        self._in_backward.wait()  # NOTE: optimizer_in_backward's steps, queued on the host worker
        self._stepped_in_backward.clear()
        if self._pass is not None:
            self._pass.finish()  # NOTE: the tail of the overlapped host pass; the step checks it
        if self._stream is not None:
            self._stream.release_all()  # NOTE: backward is over: the next forward fetches from the first block

    # --- the non-finite guard (bf16 / fp32) ---------------------------------------------------------------------
    def _guarding(self) -> bool:
        """Whether the guard runs: ``nonfinite != "ignore"`` and no fp16 loss scaler (which skips overflows itself)."""
        return self.nonfinite != "ignore" and getattr(self.precision_plugin, "scaler", None) is None

    def _nonfinite_step(self, names: list[str], count: int, model: pl.LightningModule, whole: bool = True,
                        step: Any = None) -> None:
        """Count a step skipped for non-finite gradients (at global ``step``: now); warn once; raise per
        ``nonfinite``/``max_consecutive_skips``."""
        self.skipped_steps += 1
        self._consecutive_skips += 1
        if step is None:
            step = model.trainer.global_step if lightning_internals.attached_trainer(model) is not None else "?"
        what = ", ".join(f"`{n}`" if not n.startswith(("the ", "tensor ")) else n for n in names)
        more = f" and {count - len(names)} more" if count > len(names) else ""
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"lowmem_offload: non-finite (inf/nan) gradient at global step {step} in {what}{more} "
                "(`OffloadStrategy(nonfinite='raise')`). Look for the batch or loss that produced it "
                "(`Trainer(detect_anomaly=True)`), or pass `nonfinite='skip'` to skip such steps."
            )
        if self._consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteGradientError(
                f"lowmem_offload: {self._consecutive_skips} optimizer steps in a row had non-finite (inf/nan) gradients "
                f"(the last at global step {step}, in {what}{more}); training is not progressing. Lower the learning "
                "rate, check the data and the loss for inf/nan (`Trainer(detect_anomaly=True)`), or raise "
                f"`OffloadStrategy(max_consecutive_skips={self.max_consecutive_skips})`."
            )
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            partial = "" if whole else " (optimizer_in_backward: only those parameters' updates were skipped)"
            warnings.warn(
                f"lowmem_offload: non-finite (inf/nan) gradient at global step {step} in {what}{more}: skipped the "
                f"optimizer step{partial}; the masters and the optimizer state are unchanged. Skips are counted in "
                "`lowmem/skipped_steps`; this warning is shown once. "
                f"{self.max_consecutive_skips} skips in a row raise an error.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _host_step(self, optimizer: Optimizer) -> Any:
        """The step function of ``MasterHalfPrecision``: the non-finite guard, then :meth:`_raw_step`."""
        written = self._masters.device_writes() if self._pass is not None and self._pass.armed else []
        if written:
            self._pass.written(written)  # type: ignore[union-attr]
        self.adopt_device_writes()
        self._land_delayed()  # NOTE: host_pass="delayed": the last window's step, before this one is handed over
        if self._pass is not None and self._pass.stands():  # stepped during backward (strategies/offload/host_pass.py)
            if self._guarding():
                self._consecutive_skips = 0
            self._mark_state(optimizer)
            return None
        if self.host_pass == "delayed":
            self._delay(optimizer)  # NOTE: the guard runs on the worker (and the clip: see `_deferring_clip`)
            return None
        if self._guarding():
            found = self._masters.nonfinite_grads(optimizer)
            if found is not None:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None  # NOTE: the inf/nan gradient must not reach the next accumulation window
                self.precision_plugin.last_step_skipped = True  # type: ignore[attr-defined]
                self._nonfinite_step(*found, self.lightning_module)  # type: ignore[arg-type]
                return None
            self._consecutive_skips = 0
        return self._raw_step(optimizer)

    def _raw_step(self, optimizer: Optimizer) -> Any:
        """``optimizer.step()`` on the host (with the fused kernel where it applies)."""
        self._pick_kernel(optimizer)
        out = optimizer.step()
        self._mark_state(optimizer)
        return out

    def _pick_kernel(self, optimizer: Optimizer) -> None:
        """The fused host kernel for an optimizer swapped in after setup (e.g. by a callback in on_fit_start); under
        ``host_optimizer="torch_fused"`` one it cannot fuse is refused, as at setup."""
        if self.host_optimizer == "as_is" or id(optimizer) in self._fused:
            return
        reason = _host_optimizer.why_not_fused(optimizer)
        if reason is None:
            self._fused[id(optimizer)] = (optimizer, _host_optimizer.enable_fused(optimizer))
        elif self.host_optimizer == "torch_fused":
            raise ValueError(f"`host_optimizer='torch_fused'` cannot run the optimizer `{type(optimizer).__name__}` "
                             f"swapped in after setup: {reason}. Use 'auto' or 'as_is'.")

    def _mark_state(self, optimizer: Optimizer, reset: bool = False) -> None:
        """Count optimizer state created since the last call as host memory (each tensor marked once)."""
        seen = self._state_marked.setdefault(id(optimizer), set())
        if reset:
            seen.clear()
        if len(seen) == len(optimizer.state):
            return
        for p, state in optimizer.state.items():
            if id(p) not in seen:
                seen.add(id(p))
                mark_host(*(v for v in state.values() if isinstance(v, Tensor)))

    def _owner(self, p_host: Tensor) -> tuple[Optimizer, dict[str, Any]]:
        """The optimizer and param group that hold ``p_host``, looked up in the *current* ``self.optimizers``."""
        key = tuple(id(o) for o in self.optimizers)
        if self._owner_cache is None or self._owner_cache[0] != key or id(p_host) not in self._owner_cache[1]:
            table = {id(p): (opt, group) for opt in self.optimizers for group in opt.param_groups for p in group["params"]}
            self._owner_cache = (key, table)
        found = self._owner_cache[1].get(id(p_host))
        if found is None:
            raise RuntimeError(
                f"Master of `{self._masters.names[self._masters.host_index[id(p_host)]]}` is in no optimizer of the strategy; an optimizer "
                "swapped in after setup must hold the masters (`trainer.strategy.optimizers[i].param_groups`)."
            )
        return found

    @functools.cached_property
    def _in_backward(self) -> HostWorker:
        """optimizer_in_backward's host worker (see ``strategies/offload/host_worker.py``)."""
        return HostWorker("in-backward", IN_BACKWARD_BYTES)

    def _queue_step_in_backward(self, i: int, grad: Tensor) -> None:
        """The gradient sink of optimizer_in_backward: master ``i`` steps on the host worker (:meth:`_step_in_backward`),
        not on the autograd thread; the drain after backward waits for it. On the plain CPU path it steps here.

        NOTE: on the CPU backward and the step share the same cores: the hand-over only costs (bench host_path at
        9d7e915, 99.5M: step 526.6 ms on the worker vs 368.0 ms in the hook); on CUDA the host is idle meanwhile.
        """
        if i in self._stepped_in_backward:
            raise ValueError(
                f"lowmem_offload(optimizer_in_backward=True): the gradient of `{self._masters.names[i]}` arrived twice "
                "in one backward (a weight shared by two reentrant-checkpointed blocks: each block's inner backward "
                "hands over its part), after its first part had stepped it: this step cannot match plain Lightning's, "
                "which steps once with their sum. " + reentrant_fix("pass `OffloadStrategy(optimizer_in_backward=False)`"))
        self._stepped_in_backward.add(i)
        if not isinstance(self._transfer, StreamTransfer):
            self._step_in_backward(i, grad)
            return
        self._in_backward.submit(self._step_in_backward, i, grad, nbytes=self._held(i, grad))

    def _held(self, i: int, grad: Tensor) -> int:
        """Bytes a host worker's queue keeps alive by holding ``grad`` (master ``i``'s): none for its staging slot,
        which exists anyway; a gradient of its own stays alive until the worker ran."""
        staging = self._transfer.staging() if self._transfer is not None else []
        return 0 if i < len(staging) and staging[i] is grad else grad.numel() * grad.element_size()

    @torch.no_grad()
    def _step_in_backward(self, i: int, grad: Tensor) -> None:
        """Step master ``i`` alone, now, with the user's optimizer; then free its gradient (and, on the CUDA path, round
        the stepped master into its staging slot: the upload after backward only queues its copy)."""
        p_host = self._masters.p_host[i]
        if self._skip_backward:
            return  # NOTE: the loss was not finite (see `pre_backward`): no parameter steps in this backward
        if self._guarding() and not bool(torch_internals.foreach_norm([grad])[0].isfinite()):
            self._bad_in_backward.append(self._masters.names[i])
            return
        # NOTE: a half gradient is widened into a reused buffer (a fresh fp32 tensor per parameter and step costs page
        # faults that take longer than the widening itself); an fp32 one is aliased
        p_host.grad = grad if grad.dtype == torch.float32 else self._grad_fp32.views([grad], None, torch.float32)[0]
        if self._clip_value is not None:
            p_host.grad.clamp_(-self._clip_value, self._clip_value)  # what clip_grad_value_ does, per parameter
        optimizer, group = self._owner(p_host)
        params = group["params"]
        # NOTE: torch optimizers step every parameter of a group that has a gradient; giving the group this
        # one parameter for the call makes the update (state, hyperparameters, schedulers) exactly the usual one.
        group["params"] = [p_host]
        try:
            self._raw_step(optimizer)
        finally:
            group["params"] = params
            p_host.grad = None
        if grad.dtype != torch.float32:
            self._keep_no_alias(optimizer.state.get(p_host, {}))
        if isinstance(self._transfer, StreamTransfer) and self._stream is None:
            # NOTE: [staged weights] the slot's gradient copy, read above, was queued after the last upload from it
            self._transfer.stage_weights([(i, p_host)])

    def _keep_no_alias(self, state: dict[str, Any]) -> None:
        """An optimizer that kept the gradient itself in its state (not a copy) gets a copy of its own: the reused
        buffer holds the next parameter's gradient next."""
        for k, v in state.items():
            if isinstance(v, Tensor) and self._grad_fp32.holds(v):
                state[k] = v.clone()
                mark_host(state[k])

    def _follow_trainable(self) -> None:
        """Hook the gradient of every trainable parameter that has no hook yet (made trainable after setup: Lightning's
        ``BackboneFinetuning`` unfreezing the backbone), with a master that takes gradients and a host buffer for them."""
        self._master_unfrozen()
        masters = self._masters
        sink = self._queue_step_in_backward if self.optimizer_in_backward else self._fold
        for i, p in enumerate(masters.p_device):
            if not p.requires_grad or i in self._hooked:
                continue
            self._hooked.add(i)
            self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i, sink)))
            masters.p_host[i].requires_grad_(True)  # NOTE: a no-op at setup (the master copied the flag)
            if not self.optimizer_in_backward and masters.grad_host[i] is None:
                masters.grad_host[i] = torch.empty_like(masters.p_host[i])
                mark_host(masters.grad_host[i])

    def _master_unfrozen(self, repoint: bool = True) -> None:
        """Masters for the frozen parameters kept without one that are trainable now (see [unfrozen later] in
        ``masters.py``); the optimizers' groups that hold them are re-pointed, the transfer knows them."""
        # NOTE: a streamed weight's value is its host copy: its parameter holds a placeholder while its block is released
        self._new_masters(self._masters.master_unfrozen(value_of(self._stream)), repoint)

    def _new_masters(self, new: Sequence[int], repoint: bool = True) -> None:
        """Masters ``new`` were added after setup: the transfer and the optimizers' groups learn of them."""
        if not new:
            return
        self._note_device(new)
        if self._transfer is not None:
            self._transfer.synchronize()
            self._transfer = self._new_transfer()
        for opt in self.optimizers if repoint else ():
            self._repoint(opt)

    def _new_transfer(self) -> HostTransfer:
        transfer = transfer_for(self.root_device, self._masters.p_device)
        if self.optimizer_in_backward and isinstance(transfer, StreamTransfer):
            # NOTE: the sink only queues the step on the host worker: each gradient goes to it as its copy lands, and a
            # staging slot is rewritten only once the worker has read it
            transfer.eager, transfer.barrier = True, self._in_backward.wait
        return transfer

    def _close_workers(self) -> None:
        """The host workers' threads end (teardown)."""
        if self._pass is not None:
            self._pass.close()
        self._in_backward.close()
        self._delayed.close()

    # --- the overlapped host pass (strategies/offload/host_pass.py) ------------------------------------------------
    def _fold(self, i: int, grad: Tensor) -> None:
        """The gradient sink: to the host pass's worker while it is armed, else folded here."""
        if self._pass is None or not self._pass.submit(i, grad, self._held(i, grad)):
            self._masters.fold(i, grad)

    def _arm_pass(self, optimizer: Optimizer, model: pl.LightningModule) -> None:
        """Arm the host pass for the backward of this closure (the last of the window), where it is exact."""
        if self.host_pass != "overlap":
            return
        reason = why_serial(self, optimizer, model)
        if reason is not None:
            if not self._warned_serial_pass:  # NOTE: asked for, not given: say so once (exact, only slower)
                self._warned_serial_pass = True
                warnings.warn(f"lowmem_offload: `host_pass='overlap'` runs the step serially (exact, not overlapped): "
                              f"{reason}.", RuntimeWarning, stacklevel=2)
            return
        if (self.host_optimizer != "as_is" and id(optimizer) not in self._fused
                and _host_optimizer.why_not_fused(optimizer) is None):
            return  # NOTE: an optimizer swapped in after setup: `_raw_step` decides its kernel first (serially)
        if self._pass is None:
            self._pass = _host_pass.HostPass(self._masters, _host_pass.BUCKET_BYTES)
        trainer = model.trainer
        clip_norm, clip_value = trainer_clip(trainer)
        scaler = getattr(self.precision_plugin, "scaler", None)
        # NOTE: only the unscale and the value clip are left off the real gradients by a pass that stands
        settle = (scaler is not None or clip_value is not None) and bool(reads_grads_after_step(trainer.callbacks, model))
        staged = isinstance(self._transfer, StreamTransfer)
        # NOTE: a streamed weight's upload rounds its master into its host copy, not a staging slot (`copy_to_compute`)
        resident = self._stream is None
        # NOTE: a module's backward hook may read a weight whose gradient landed (uploaded over): the upload at the step
        hooked = any(torch_internals.has_backward_hooks(m) for m in model.modules())
        self._pass.arm(optimizer, clip_norm=clip_norm, clip_value=clip_value, guard=self._guarding(), scaler=scaler,
                       settle=settle, stager=self._transfer if staged and resident else None,  # type: ignore[arg-type]
                       uploader=None if hooked else self._upload_now)
        self.precision_plugin.clip_check = self._pass.clip_stands  # type: ignore[attr-defined]
        self.precision_plugin.unscale_check = self._pass.unscale_stands if scaler is not None else None  # type: ignore[attr-defined]
        # NOTE: the stream backward runs on, as this thread sees it (the worker's current stream may be another)
        self._compute_stream = self._transfer.ops.compute_stream() if staged else None  # type: ignore[union-attr]
        if staged:
            self._transfer.eager, self._transfer.barrier = True, self._pass.barrier  # type: ignore[union-attr]

    def _disarm_pass(self) -> frozenset[int]:
        """End the host pass's window; return the masters it uploaded when the step took its result (none left)."""
        if self._pass is None or not self._pass.armed:
            return frozenset()
        uploaded = frozenset(self._pass.uploaded if self._pass.taken else ())
        self._pass.disarm()
        self.precision_plugin.clip_check = self.precision_plugin.unscale_check = None  # type: ignore[attr-defined]
        if isinstance(self._transfer, StreamTransfer):
            self._transfer.eager = False
        return uploaded

    def _upload_now(self, indices: list[int], worker: bool) -> None:
        """The host pass's uploader: masters ``indices`` into their compute weights now (``worker``: stepped during
        backward; else put back by a restore). A compute weight written by other code keeps the write (the step adopts it)."""
        assert self._transfer is not None
        masters = self._masters
        written = set(masters.device_writes(indices))
        pairs = [(i, masters.p_host[i], masters.p_device[i]) for i in indices if i not in written]
        if worker:
            upload_in_backward(self._transfer, self._stream, pairs, self._compute_stream)
        else:
            copy_to_compute(self._transfer, self._stream, pairs)
        self._note_device([i for i, _, _ in pairs])

    def _weights_to_device(self, optimizer: Optimizer, uploaded: frozenset[int] = frozenset()) -> None:
        self._to_compute([pair for pair in self._masters.pairs(optimizer) if pair[0] not in uploaded])

    def _to_compute(self, pairs: Sequence[tuple[int, Parameter, Parameter]]) -> None:
        assert self._transfer is not None
        copy_to_compute(self._transfer, self._stream, pairs)
        self._note_device([i for i, _, _ in pairs])

    # --- [writes outside the hooks] -------------------------------------------------------------------------------
    def _note_device(self, indices: Sequence[int] | None = None) -> None:
        """Compute weights ``indices`` (all) match their masters now (streamed weights are not followed)."""
        streamed = self._stream.shapes if self._stream is not None else {}
        skip = frozenset(i for i, p in enumerate(self._masters.p_device) if id(p) in streamed)
        self._masters.note_device(indices, skip)

    def adopt_device_writes(self, land: bool = True) -> None:
        """Copy into their masters the compute weights that code wrote outside the hooks that show the masters (a
        callback clamping or re-initialising weights): see [writes outside the hooks] in ``masters.py``. Before: the
        delayed step lands (``land``; the masters are about to be read), and compute weights written while it was on
        the worker are refused."""
        if self._view is not None and self._view._depth:
            return  # NOTE: the parameters show the masters: code writes them directly
        if self._delayed.pending is not None or self._delayed.due is not None:
            written = self._masters.device_writes()
            if written:
                names = ", ".join(f"`{self._masters.names[i]}`" for i in written[:3])
                raise RuntimeError(
                    f"lowmem_offload(host_pass='delayed'): the weights {names}{' and more' if len(written) > 3 else ''} "
                    "were written (in place, outside the hooks that show the masters) while the last step was delayed "
                    "(on the host worker, or not yet in the compute weights): the write and that step cannot both be "
                    "kept. Write weights in "
                    "`on_train_batch_end` or under `with trainer.strategy.masters_view(write_back=True):`, or use "
                    "`OffloadStrategy(host_pass='serial')`.")
            if land:
                self._delayed.land()  # NOTE: no upload (see `_land_delayed`): the next window computes on the same weights
            return  # NOTE: no compute weight was written (found above): nothing to adopt
        changed = self._masters.adopt_writes()
        if changed:
            if isinstance(self._transfer, StreamTransfer):
                self._transfer.unstage(changed)  # NOTE: a staged slot holds the master as it was before the write
            self._note_device(changed)
            if not self._warned_rounded_write:
                self._warned_rounded_write = self._masters.warn_rounded(changed)


__all__ = ["HostStep", "NonFiniteGradientError"]

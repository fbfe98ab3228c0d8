"""The accumulation window of ``AccumulationScheduler`` (a part of
:class:`~lightning_lowmem.callbacks.accumulation.scheduler.AccumulationScheduler`).

Per batch, the window's edges (when Lightning zeroes and steps); per micro-batch, the weight of its loss
(``training_step`` wrapped); before the step, the exact normalisation of the accumulated gradients by the window's
total count (samples or tokens, over every process); after the batch, the reported mean loss and the window's
metrics. :class:`WindowNormalization` is a base of ``AccumulationScheduler`` and reads its state; it is not used on
its own.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from lightning_lowmem.callbacks.accumulation import window as _aw
from lightning_lowmem.callbacks.accumulation.window import lightning_accumulation
from lightning_lowmem.core.side_step import forward_only, stands_aside


@dataclass
class WindowStats:
    """What the last optimizer step was built from, summed over every process."""

    micro_batches: int
    samples: int
    tokens: torch.Tensor | None  # 0-dim, on the device (read it with ``int(...)``: a sync on CUDA)


class WindowNormalization:
    """The window of ``AccumulationScheduler`` (see the module docstring)."""

    # --- the window -------------------------------------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._pos = 0
        self._window = 0  # micro-batches in the current window
        self._count: Any = 0  # samples or tokens seen, this process
        self._samples = 0
        self._micro_batches = 0
        self._last = False
        self._k: torch.Tensor | None = None  # float64, equal to `_k_loss`
        self._k_loss: torch.Tensor | None = None  # in the loss's dtype, multiplied into every micro-batch
        self._reported: torch.Tensor | None = None  # the micro-batch's mean loss, for `outputs["loss"]`
    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset_window()  # Lightning steps at the end of every epoch: windows never cross epochs
        self._epoch_start_step = trainer.global_step  # the progress bar counts this epoch's steps from here

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._drives_loader and self._pos == 0 and batch_idx == 0:
            _aw.check_first_batch(self, extract_batch_size(batch))
        if self._engine:
            return
        if forward_only(trainer):  # NOTE: SWA's BatchNorm epoch: Lightning's own accumulation prevents every step
            self._last = False
            return
        loop = trainer.fit_loop.epoch_loop
        ready = loop.batch_progress.current.ready
        if self._pos == 0:
            e = self.effective_batch_at(trainer.global_step, trainer.current_epoch)
            self._window = e // (self._micro * trainer.world_size)
        epoch_end = ready == trainer.num_training_batches or loop.batch_progress.is_last_batch
        first, last = self._pos == 0, self._pos == self._window - 1 or epoch_end
        value, zero_here = lightning_accumulation(batch_idx, ready, first, last, epoch_end, self._window)
        # NOTE: Lightning decides zero_grad by `batch_idx % N == 0` and the step by `ready % N == 0`; after a
        # schedule change a window need not start at a multiple of its size, so N is chosen per batch to give
        # exactly this window's boundaries (it equals the real accumulation whenever the windows are aligned).
        self._trainer_accumulation = trainer.accumulate_grad_batches = value
        if zero_here:
            for optimizer in trainer.optimizers:
                pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)
        self._pos = 0 if last else self._pos + 1
        self._last = last

    def _wrap_training_step(self, pl_module: L.LightningModule) -> None:
        # NOTE: flags, not a sentinel object: the callback is pickled into the processes of `ddp_spawn`, and a
        # sentinel's identity does not survive that.
        if self._wrapped_step:
            return
        self._wrapped_step, self._instance_step = True, pl_module.__dict__.get("training_step")
        step = pl_module.training_step

        @functools.wraps(step)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            # NOTE: a side step (a probe, a micro-batch trial) or a module detached from the Trainer: no window
            if stands_aside(pl_module) or forward_only(pl_module.trainer):
                return out
            return self._weigh(pl_module.trainer, out, args[0] if args else kwargs.get("batch"))

        # NOTE: an instance attribute shadows the class method for this module only; DDP and the strategies reach
        # `training_step` through the instance, so they call the wrapper. Removed in `teardown`.
        pl_module.training_step = training_step  # type: ignore[method-assign]

    def _weigh(self, trainer: L.Trainer, out: Any, batch: Any) -> Any:
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if loss is None:
            return out
        n = trainer.accumulate_grad_batches  # Lightning divides the loss by this; undone here
        samples = int(out["num_samples"]) if isinstance(out, Mapping) and "num_samples" in out else extract_batch_size(batch)
        if self.loss_normalization == "tokens":
            if not isinstance(out, Mapping) or "num_tokens" not in out:
                raise TypeError(
                    "AccumulationScheduler(loss_normalization='tokens'): `training_step` must return "
                    "`{'loss': sum_of_token_losses, 'num_tokens': n}` (CausalLMModule(loss_reduction='sum') does); "
                    f"it returned {type(out).__name__}"
                    + (f" with keys {sorted(out)}" if isinstance(out, Mapping) else "")
                    + ". Or pass `loss_normalization='samples'` for a per-micro-batch mean loss."
                )
            count, weight = torch.as_tensor(out["num_tokens"]).detach().to(torch.float64), 1.0
        else:
            count, weight = samples, float(samples)
        self._last_count = count
        if self._counting:  # NOTE: False for the halves of a micro-batch whose forward completed and was counted
            self._samples += samples
            self._micro_batches += 1
            self._reported = (loss / count.clamp(min=1).to(loss.dtype) if self.loss_normalization == "tokens" else loss).detach()
        if self._engine:
            # NOTE: weight relative to a full micro-batch. Lightning's loop has divided the loss by n; Lightning's
            # stock DeepSpeedStrategy divides it by n again in `engine.backward` (so n is undone here), while our
            # ZeroStrategy (`loss_divided_once`) does not divide twice.
            scale = weight / self._micro * (1 if getattr(trainer.strategy, "loss_divided_once", False) else n)
        else:
            if self._k is None:
                if self._n_ref is None:
                    first = torch.as_tensor(count, dtype=torch.float64, device=trainer.strategy.root_device)
                    self._n_ref = trainer.strategy.reduce(first.clamp(min=1), reduce_op="mean")
                # NOTE: k is rounded to the loss's dtype once per window and divided out with exactly that value
                self._k_loss = (1.0 / self._n_ref).to(loss.device, loss.dtype)
                self._k = self._k_loss.to(torch.float64)
            if self._counting:
                self._count = self._count + count
            # NOTE: each micro-batch backpropagates weight * k * loss, with k = 1 / (mean count per micro-batch),
            # fixed for the whole window and equal on every process, so gradients keep the size of a mean loss
            # (fp16 headroom); the exact 1 / window total is applied to the gradients before the step.
            return self._replace_loss(out, loss * float(n * weight) * self._k_loss)
        return self._replace_loss(out, loss * scale)

    @staticmethod
    def _replace_loss(out: Any, loss: torch.Tensor) -> Any:
        return {**out, "loss": loss} if isinstance(out, Mapping) else loss

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # NOTE: [exact normalisation] The mean over a window needs the window's total count, known only after its
        # last forward. Two ways: prefetch the window's micro-batches and count before any backward (holds up to
        # `accumulation` batches in memory, needs a token counter that understands the batch, and fights
        # Lightning's fetcher), or backpropagate unnormalised sums and divide the accumulated gradients once, here,
        # before clipping and the step. We do the latter: it costs one multiply per gradient element per step
        # (plus one all_reduce of two scalars under DDP), uses the count the module itself computed, and is
        # exact (the last micro-batch's count arrives before this hook). Hazard: the gradients must be those the
        # optimizer will step (host masters under `lowmem_offload`), and nothing may read them between backward
        # and this hook expecting a mean (`on_after_backward` sees k-scaled sums).
        if self._engine or self._k is None:
            return
        strategy, world = trainer.strategy, trainer.world_size
        total = torch.as_tensor(self._count, dtype=torch.float64, device=strategy.root_device)
        samples = torch.tensor(float(self._samples), dtype=torch.float64, device=strategy.root_device)
        if world > 1:
            # NOTE: one all_reduce of two scalars per optimizer step (a sync point); DDP averaged the gradients
            total, samples = strategy.reduce(torch.stack([total, samples]), reduce_op="sum").unbind()
        factor = world / (self._k * total.clamp(min=1))
        per_device: dict[torch.device, torch.Tensor] = {}
        # NOTE: the gradients of what the optimizer steps: under `lowmem_offload` these are the host masters
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    f = per_device.get(p.grad.device)
                    if f is None:
                        f = per_device[p.grad.device] = factor.to(p.grad.device)
                    p.grad.mul_(f)
        micro_batches = self._micro_batches
        self._n_ref = total.clamp(min=1) / (micro_batches * world)
        self.last_window = WindowStats(
            micro_batches * world, int(samples.item()) if world > 1 else self._samples,
            None if self.loss_normalization == "samples" else total,
        )
        self._count, self._samples, self._micro_batches, self._k = 0, 0, 0, None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # NOTE: [reported loss] Lightning hands every callback (and then the module) the same `outputs` dict, whose
        # "loss" is what was backpropagated: here a k-scaled sum, or under DeepSpeed the loss / accumulation. Every
        # strategy reports the micro-batch's mean loss instead (as `training_step` computed it; tokens: sum / count),
        # undivided by the accumulation. This callback runs first (see `setup`), so the others see that value.
        if self._reported is not None and isinstance(outputs, dict) and "loss" in outputs:
            outputs["loss"] = self._reported
        self._reported = None
        if self._engine or self.last_window is None or not getattr(self, "_last", False):
            return
        w = self.last_window
        metrics = {"accumulation/micro_batches": float(w.micro_batches), "accumulation/samples": float(w.samples)}
        if w.tokens is not None:
            metrics["accumulation/tokens"] = w.tokens
        if self._splitter is not None:
            self._splitter.window_done()
            metrics["oom/recoveries"] = float(self._splitter.recoveries)
            metrics["oom/bytes_freed"] = float(self._splitter.bytes_freed)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, rank_zero_only=True)


__all__ = ["WindowNormalization", "WindowStats"]

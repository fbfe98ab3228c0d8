"""The search behind ``AccumulationScheduler(micro_batch_size="auto")`` (private helper).

Trial training steps at candidate micro-batches, each measured: on CUDA by the allocator's peak (out-of-memory
recovered), elsewhere by :class:`~lightning_lowmem.measure.tracker.MemoryTracker` (device role). A trial is
forward + backward + an optimizer step at learning rate 0, after one unmeasured step, so gradients and optimizer
state are alive as in steady training; the learning rates, the optimizer state and the gradients are put back
afterwards. The trials run as one :func:`~lightning_lowmem.core.side_step.side_step` (RNG forked, logging
off, the scheduler's ``training_step`` wrapper and the OOM splitter standing aside, and the module's buffers,
metric states and rebound attributes put back: ``BatchNorm`` statistics and a metric updated in ``training_step``
end as if the trials never ran).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.memory import is_oom_error
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_setattr
from typing_extensions import Self

from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.core.hooks import training_step_args
from lightning_lowmem.core.kept_state import param_writes_undone
from lightning_lowmem.core.side_step import side_step
from lightning_lowmem.core.units import fmt_bytes
from lightning_lowmem.measure.tracker import CudaPeakWindow, MemoryTracker


def search(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    candidates: list[int],
    budget: int,
    batch_arg_name: str,
) -> dict[int, int | None]:
    """Binary search over ``candidates`` (ascending, peak assumed to grow with the micro-batch).

    Returns the measured peaks of the tried sizes (``None``: out of memory, or more than the data set holds).

    Raises:
        RuntimeError: even ``candidates[0]`` does not fit, naming what to switch on.
    """
    peaks: dict[int, int | None] = {}
    with _trials(trainer, pl_module, candidates[0], batch_arg_name) as trial:

        def fits(m: int) -> bool:
            peaks[m] = trial(m)
            return peaks[m] is not None and peaks[m] <= budget

        if not fits(candidates[0]):
            first = peaks[candidates[0]]
            what = "runs out of memory" if first is None else f"peaks at {fmt_bytes(first)}"
            raise RuntimeError(
                f"AccumulationScheduler: a micro-batch of {candidates[0]} {what}, over the budget of {fmt_bytes(budget)}. "
                "Switch on activation checkpointing (`ActivationCheckpointing` callback), keep the optimizer and "
                "fp32 master weights on the host (`strategy='lowmem_offload'`), offload activations "
                "(`ActivationOffload`), or raise `memory_budget`."
            )
        lo, hi = 0, len(candidates)  # candidates[lo] fits; candidates[hi] does not (or is past the end)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(candidates[mid]) else (lo, mid)
    return peaks


@contextlib.contextmanager
def _trials(trainer: L.Trainer, pl_module: L.LightningModule, warmup: int, batch_arg_name: str) -> Iterator[Any]:
    """Run trial steps with the learning rate at 0, then put everything back as it was."""
    optimizers, device = trainer.optimizers, trainer.strategy.root_device
    lrs = [[group["lr"] for group in opt.param_groups] for opt in optimizers]
    was_training = pl_module.training
    try:
        # NOTE: `self.log` raises outside the training loop (the trials log nothing), the trials' dropout must not
        # move the run's random stream, and the scheduler must not count them in its window: a side step
        with side_step(pl_module, device):
            for opt in optimizers:
                for group in opt.param_groups:
                    lr = group["lr"]
                    # NOTE: lr 0 leaves the weights bit-identical for every optimizer whose update is scaled by
                    # the learning rate (torch.optim, bitsandbytes); one that ignores it would move them.
                    group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
            pl_module.train()
            # NOTE: one unmeasured step first, so gradients and optimizer state exist, as in steady training
            _trial(trainer, pl_module, warmup, batch_arg_name, measure=False)
            yield lambda micro: _trial(trainer, pl_module, micro, batch_arg_name)
    finally:
        for opt, group_lrs in zip(optimizers, lrs):
            for group, lr in zip(opt.param_groups, group_lrs):
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            opt.state.clear()  # the trial steps' moments are not the run's
        pl_module.zero_grad(set_to_none=True)
        pl_module.train(was_training)
        _collect(device)


def _trial(
    trainer: L.Trainer, pl_module: L.LightningModule, micro: int, batch_arg_name: str, measure: bool = True
) -> int | None:
    """Peak bytes of one training step (forward, backward, optimizer step at lr 0) at micro-batch ``micro``."""
    strategy, device = trainer.strategy, trainer.strategy.root_device
    lightning_setattr(pl_module, batch_arg_name, micro)
    batch = _first_batch(trainer, pl_module)
    if extract_batch_size(batch) < micro:
        return None  # the data set holds fewer samples than this micro-batch
    meter = _PeakMeter(device, pl_module, trainer.optimizers, batch, enabled=measure)
    drain = getattr(strategy, "drain_transfers", lambda: None)
    peak: int | None = None
    try:
        # NOTE: no gradient all_reduce in trials: a process running out of memory cannot hang the others
        with getattr(strategy, "block_backward_sync", contextlib.nullcontext)(), meter:
            # NOTE: a parameter the step writes in place (an EMA teacher) is put back after it (the optimizer's step at
            # lr 0 leaves the others bit-identical)
            with meter.phase("forward"), _offloading(trainer, pl_module, batch), param_writes_undone(pl_module):
                out = strategy.training_step(*training_step_args(pl_module.training_step, batch, 0))
                loss = out["loss"] if isinstance(out, Mapping) else out
            with meter.phase("backward"):
                try:
                    loss.backward()
                finally:
                    # NOTE: [trial drain] lowmem_offload queues each gradient's copy to the host and folds it at the
                    # end of Lightning's backward; this backward is not Lightning's, so fold here (after an OOM too),
                    # or the trial's gradients reach the first real step (and step the masters at the real LR).
                    drain()
                del out, loss
            with meter.phase("optimizer"):
                for opt in trainer.optimizers:
                    opt.step()
        peak = meter.peak if measure else None
    except RuntimeError as err:
        if not (device.type == "cuda" and is_oom_error(err)):
            raise
    finally:
        del batch
        _collect(device)
    if measure and trainer.world_size > 1:  # every process must take the same decisions
        worst = torch.tensor(float("inf") if peak is None else float(peak), device=device)
        worst = float(strategy.reduce(worst, reduce_op="max"))
        peak = None if math.isinf(worst) else int(worst)
    return peak


class _PeakMeter:
    """Peak bytes of the device role over a block: CUDA's allocator reserved peak on CUDA, ``MemoryTracker`` elsewhere."""

    def __init__(self, device: torch.device, module: Any, optimizers: list[Any], batch: Any, enabled: bool) -> None:
        self.device, self.enabled, self.peak = device, enabled, 0
        self._tracker: Any = None
        self._window: Any = None
        if enabled and device.type != "cuda":
            self._tracker = MemoryTracker(module=module, optimizers=optimizers, device=device)
            self._batch = batch

    def phase(self, name: str) -> Any:
        return self._tracker.phase(name) if self._tracker is not None else contextlib.nullcontext()

    def __enter__(self) -> Self:
        if self._tracker is not None:
            self._tracker.__enter__()
            self._tracker.track(self._batch)  # the micro-batch counts too
        elif self.enabled:
            torch.cuda.synchronize(self.device)
            self._window = CudaPeakWindow(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self.peak = int(self._tracker.peak_bytes_role("device"))
        elif self._window is not None:
            torch.cuda.synchronize(self.device)
            # NOTE: the reserved peak, not the allocated one: blocks freed on one stream and not yet reusable, cached
            # blocks and fragmentation are device memory too, and a micro-batch whose allocated peak fits can still
            # run the allocator out of segments (its reserved peak is what must fit).
            self.peak = int(max(self._window.read()))
            self._window.close()


@contextlib.contextmanager
def _offloading(trainer: L.Trainer, pl_module: L.LightningModule, batch: Any) -> Iterator[None]:
    """The trial's forward under every ``ActivationOffload`` of the Trainer.

    NOTE: the search runs in ``on_fit_start``, before the loop's hooks would offload anything: without this the
    trial measures the step without the offload, and the advice to add ``ActivationOffload`` could not change it.
    """
    with contextlib.ExitStack() as stack:
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, ActivationOffload):
                stack.enter_context(cb.offloading(pl_module, batch))
        yield


def _first_batch(trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
    """The first batch of a fresh train loader (built with the batch size just set), on the device."""
    dm = trainer.datamodule
    source = dm if dm is not None and is_overridden("train_dataloader", dm) else pl_module
    batch = next(iter(source.train_dataloader()))
    batch = trainer.precision_plugin.convert_input(batch)
    return trainer.strategy.batch_to_device(batch)


def _collect(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

"""``ActivationOffload``: saved activations go to host memory in forward and come back in backward."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import (
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceXLAStrategy,
    XLAStrategy,
)
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_lowmem.callbacks.activation_offload.engine import (
    OffloadStats,
    SavedTensorOffloader,
    StreamCopier,
    SyncCopier,
)
from lightning_lowmem.core.accounting import MemoryBreakdown
from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.streams import CudaOps, cpu_ops
from lightning_lowmem.core.tensors import tensors_in

# NOTE: leave this share of the machine's RAM free: running the host out of memory kills the process outright
_HOST_RAM_RESERVE = 0.10

METRIC_KEYS = (
    "activation_offload/bytes_per_step",
    "activation_offload/tensors_per_step",
    "activation_offload/kept_bytes_per_step",
    "activation_offload/host_peak_bytes",
)


def _unsupported_strategy(strategy: Any) -> str | None:
    """Why ``strategy`` cannot carry activation offload, or ``None`` when it can."""
    name = type(strategy).__name__
    if isinstance(strategy, DeepSpeedStrategy):  # NOTE: lowmem_zero* (ZeroStrategy) included
        return (
            f"`{name}` (DeepSpeed) manages activation memory itself, and under ZeRO-3 saved tensors alias parameter "
            "storages it gathers and frees. Use DeepSpeed's `activation_checkpointing` with `cpu_checkpointing=True`, "
            "or train with `strategy='lowmem_offload'`, a single device or DDP to use ActivationOffload."
        )
    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        return (
            f"`{name}` re-gathers and frees sharded parameter storages between forward and backward; saved tensors "
            "that alias them would be copied to the host every step. Use the strategy's own CPU offload, or a single "
            "device, DDP or `strategy='lowmem_offload'` with ActivationOffload."
        )
    if isinstance(strategy, (XLAStrategy, SingleDeviceXLAStrategy)):
        return f"`{name}` (XLA) traces the graph lazily; saved-tensor hooks do not see its activations."
    return None


class ActivationOffload(Reproducible, Callback):
    """Move the tensors autograd saves in the training forward to host memory, and bring them back in backward.

    Saves: the activations of the training step on the compute device, down to the tensors kept in place
    (smaller than ``min_bytes``, parameters, buffers, the batch). With ``boundaries_only=True`` and activation
    checkpointing only the checkpointed blocks' inputs go to the host: the smallest activation footprint of the suite.
    Costs: host RAM for every offloaded byte, a device-to-host copy in forward and a host-to-device copy in
    backward (on CUDA on a side stream into pinned buffers, with ``prefetch``, so copies hide behind long enough
    compute). Evaluation and prediction are left alone (docs/techniques/activation-offload.md).

    Args:
        min_bytes: saved tensors smaller than this many bytes stay on the device (their copies cost more in
            launch overhead than they free). Default: 1024.
        pin_memory: host copies in pinned memory (fast asynchronous copies). ``None``: pin when training on CUDA;
            where pinning is impossible, pageable memory with one warning.
        prefetch: copies in flight ahead of compute (backward restores, forward device-to-host copies); each costs a
            tensor of device memory. 0: restore on demand.
        boundaries_only: offload only the inputs ``torch.utils.checkpoint`` saves for checkpointed blocks (not the
            ``"sqrt"`` policy's segments, which keep theirs by reference); everything else stays on the device.

    Logs ``activation_offload/bytes_per_step``, ``tensors_per_step``, ``kept_bytes_per_step`` and ``host_peak_bytes``
    once per optimizer step (the doc page says what each counts); :meth:`memory_breakdown` reports the host peak.

    Example:
        >>> from lightning_lowmem import ActivationCheckpointing, ActivationOffload
        >>> trainer = L.Trainer(callbacks=[ActivationCheckpointing(), ActivationOffload(boundaries_only=True)],
        ...                     max_steps=1, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(tiny_model(), tiny_data())
        >>> trainer.callback_metrics["activation_offload/bytes_per_step"] > 0
        tensor(True)
    """

    def __init__(self, min_bytes: int = 1024, pin_memory: bool | None = None, prefetch: int = 2,
                 boundaries_only: bool = False) -> None:
        wrong_type, wrong_value = [], []
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
            wrong_type.append(f"Passed `min_bytes={min_bytes!r}`; expected an int number of bytes (0 or more).")
        elif min_bytes < 0:
            wrong_value.append(f"Passed `min_bytes={min_bytes}`; it must be 0 or more (0 offloads every saved tensor).")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int):
            wrong_type.append(f"Passed `prefetch={prefetch!r}`; expected an int (0 or more).")
        elif prefetch < 0:
            wrong_value.append(f"Passed `prefetch={prefetch}`; it must be 0 (restore on demand) or more.")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            wrong_type.append(f"Passed `pin_memory={pin_memory!r}`; expected True, False or None (pin on CUDA).")
        if not isinstance(boundaries_only, bool):
            wrong_type.append(f"Passed `boundaries_only={boundaries_only!r}`; expected True or False.")
        if wrong_type or wrong_value:
            error = TypeError if wrong_type else ValueError
            raise error("ActivationOffload: " + " ".join(wrong_type + wrong_value))
        self.min_bytes = min_bytes
        self.pin_memory = pin_memory
        self.prefetch = prefetch
        self.boundaries_only = boundaries_only
        self.engine: SavedTensorOffloader | None = None
        self.last_step = OffloadStats()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._new_window = True
        self._stepped = False
        self._host_budget: int | None = None
        self._warned_host_ram = False
        self._checked_boundaries = False

    # -- setup ----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_lightning_object(trainer, "the Trainer of ActivationOffload")
        if stage != "fit":
            return
        reason = _unsupported_strategy(trainer.strategy)
        if reason is not None:
            raise ValueError(f"ActivationOffload cannot run under this strategy: {reason}")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        self.engine = SavedTensorOffloader(device, self._make_copier(device), min_bytes=self.min_bytes,
                                           prefetch=self.prefetch, boundaries_only=self.boundaries_only,
                                           before_host_alloc=self._watch_host_ram)

    def _make_copier(self, device: torch.device) -> SyncCopier:
        if device.type != "cuda":
            if self.pin_memory:
                rank_zero_warn(
                    f"ActivationOffload(pin_memory=True): pinned memory speeds up copies from a CUDA device, but "
                    f"training runs on `{device}`; falling back to pageable host copies. "
                    "Pass `pin_memory=False` (or leave it None) to silence this."
                )
            ops = cpu_ops()
            return SyncCopier() if ops is None else StreamCopier(device, ops)
        pin = self.pin_memory is not False
        if pin:
            try:
                torch.empty(1, pin_memory=True)
            except RuntimeError as err:
                rank_zero_warn(
                    f"ActivationOffload: pinned host memory is unavailable here ({err}); falling back to pageable "
                    "host copies, which are synchronous. Raise the locked-memory limit (`ulimit -l`) to pin."
                )
                pin = False
        return StreamCopier(device, CudaOps(device, pin_memory=pin))

    # -- the training batch ----------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        engine = self._require_engine()
        keep = [*pl_module.parameters(), *pl_module.buffers(), *tensors_in(batch)]
        if self._new_window:
            engine.begin_step(keep)
            self._new_window = False
            self._stepped = False
            self._plan_host_budget(engine)
        else:
            engine.refresh_skip(keep)
        self._enter()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._exit()
        engine = self._require_engine()
        if self.boundaries_only and not self._checked_boundaries:
            self._checked_boundaries = True
            if engine.stats.boundary_saves == 0:
                rank_zero_warn(
                    "ActivationOffload(boundaries_only=True) saw no checkpointed block inputs in the first training "
                    "step, so it offloads nothing. Enable activation checkpointing (the ActivationCheckpointing "
                    "callback, or `model.gradient_checkpointing_enable()`), or pass `boundaries_only=False`."
                )

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # NOTE: with manual optimization a training_step may run another forward after `manual_backward`
        if not pl_module.automatic_optimization:
            self._enter()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.engine is not None and not self._stepped:
            self.last_step = dataclasses.replace(self.engine.stats)
            self._stepped = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._exit()
        if not self._stepped:
            return  # accumulating: the counts go on summing over the next micro-batch
        self._new_window = True
        s = self.last_step
        values = (s.bytes_offloaded, s.tensors_offloaded, s.bytes_kept, s.host_bytes_peak)
        for key, value in zip(METRIC_KEYS, values):
            pl_module.log(key, float(value), on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._exit()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._exit()

    # -- reporting -------------------------------------------------------------------------------------------
    def memory_breakdown(self) -> MemoryBreakdown:
        """Host-role activations: the host RAM the copies held in the current step, else the last (the most bytes alive
        at once; on CUDA as the pinned allocator holds them: rounded to powers of two and cached)."""
        out = MemoryBreakdown()
        stats = self.engine.stats if self.engine is not None and not self._new_window else self.last_step
        out.add("host", "activations", stats.host_bytes_reserved)
        return out

    # -- helpers ---------------------------------------------------------------------------------------------
    def _require_engine(self) -> SavedTensorOffloader:
        if self.engine is None:  # a hook called outside `fit` (e.g. a test driving hooks by hand)
            raise RuntimeError("ActivationOffload: `on_train_start` has not run; use the callback through `Trainer.fit`.")
        return self.engine

    def _enter(self) -> None:
        if self._hooks is None:
            self._hooks = self._require_engine().hooks()
            self._hooks.__enter__()

    def _exit(self) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def _plan_host_budget(self, engine: SavedTensorOffloader) -> None:
        """Host bytes the copies may reach before a warning; warn now if the last step already needed more."""
        mem = psutil.virtual_memory()
        self._host_budget = engine.host_bytes_reserved + int(mem.available - _HOST_RAM_RESERVE * mem.total)
        if self.last_step.host_bytes_reserved > self._host_budget:
            self._warn_host_ram(self.last_step.host_bytes_reserved, mem.available)

    def _watch_host_ram(self, new_bytes: int, reserved: int) -> None:
        if self._host_budget is not None and reserved + new_bytes > self._host_budget:
            self._warn_host_ram(reserved + new_bytes, psutil.virtual_memory().available)

    def _warn_host_ram(self, need: int, available: int) -> None:
        if self._warned_host_ram:
            return
        self._warned_host_ram = True
        rank_zero_warn(
            f"ActivationOffload: offloaded activations are about to need {need / 2**30:.2f} GiB of host RAM, which "
            f"would leave less than {_HOST_RAM_RESERVE:.0%} of it free ({available / 2**30:.2f} GiB available). "
            "Raise `min_bytes`, use `boundaries_only=True` with ActivationCheckpointing, or lower the batch size."
        )


__all__ = ["METRIC_KEYS", "ActivationOffload"]

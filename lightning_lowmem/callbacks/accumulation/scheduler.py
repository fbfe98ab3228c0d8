"""``AccumulationScheduler``: hold the effective batch, fit the micro-batch to memory, normalise the loss exactly."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, GradientAccumulationScheduler
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.callbacks.accumulation import progress as _progress
from lightning_lowmem.callbacks.accumulation import window as _aw
from lightning_lowmem.callbacks.accumulation.micro_batch_search import search
from lightning_lowmem.callbacks.accumulation.normalization import WindowNormalization, WindowStats
from lightning_lowmem.callbacks.accumulation.oom_split import OOMSplitter
from lightning_lowmem.callbacks.accumulation.window import (
    _divisibility_message,
    _int,
    _positive_int,
    lightning_accumulation,
)
from lightning_lowmem.callbacks.optimizer_in_backward import OptimizerInBackward
from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.units import fmt_bytes, parse_bytes

Normalization = Literal["tokens", "samples"]
Interval = Literal["step", "epoch"]
OnOOM = Literal["split", "raise"]
MicroBatch = int | Literal["auto"]


@dataclass
class Choice:
    """What the callback chose, and why (``peaks``: measured peak bytes per tried micro-batch, ``None``: OOM)."""

    effective_batch_size: int
    micro_batch_size: int
    accumulation: int
    world_size: int
    memory_budget: int | None = None
    peaks: dict[int, int | None] | None = None


class AccumulationScheduler(Reproducible, WindowNormalization, L.Callback):
    """Hold the effective batch (samples per optimizer step, all processes) and fit the micro-batch to memory.

    Memory: activations scale with the micro-batch, so a micro-batch ``k`` times smaller keeps ``1/k`` of the
    activation memory while the optimizer still steps on ``effective_batch_size`` samples. Cost: ``k`` times more
    forward/backward launches per step (smaller kernels; slower where the micro-batch no longer fills the device),
    and one ``all_reduce`` of a scalar count per optimizer step under DDP.

    The callback sets the data loader's micro-batch through the ``batch_size`` attribute of the LightningModule or
    LightningDataModule (``BatchSizeFinder``'s convention) and drives ``trainer.accumulate_grad_batches`` itself:
    accumulation = effective / (micro * world size). It logs what it chose and keeps it in :attr:`choice`.

    ``micro_batch_size="auto"`` tries micro-batches (divisors of effective / world size, binary search), and the
    largest that fits wins: on CUDA by trial steps with out-of-memory recovery under ``memory_budget`` (default 90%
    of the device), elsewhere by trial steps measured with :class:`~lightning_lowmem.measure.tracker.MemoryTracker`
    (device role) under ``memory_budget`` (required). A trial is the real training step (the strategy, precision
    and other callbacks applied) on the loader's first batch: forward + backward + an optimizer step at learning
    rate 0, after one warm-up step, so gradients and optimizer state are alive; the weights are untouched, and the
    optimizer state, gradients, learning rates and RNG are put back. Padded data: trials see the first batch;
    pad to a fixed length (or put the longest sequences first) so it is the largest.

    Loss normalisation (exact, with micro-batches of any size and a short last window):

    - ``"samples"``: ``training_step`` returns the mean loss of its micro-batch (a tensor or ``{"loss": ...}``);
      the step gets the gradient of the mean over every sample of the window. The sample count is
      ``output["num_samples"]`` if given, else the batch's size.
    - ``"tokens"``: ``training_step`` returns ``{"loss": sum_of_token_losses, "num_tokens": n}``
      (``CausalLMModule(loss_reduction="sum")`` does); the step gets the gradient of the mean over every token
      of the window, whatever the padding of each micro-batch.

    The last window of an epoch (Lightning steps at the end of an epoch) is averaged over what it really held,
    not divided by the full window as Lightning does (Lightning #19987).

    Schedule (batch-size warm-up): ``schedule={k: E}`` changes the effective batch to ``E`` from optimizer step
    ``k`` (``schedule_interval="step"``) or epoch ``k`` (``"epoch"``); ``effective_batch_size`` holds before the
    first key. The micro-batch stays fixed; accumulation changes at the next window boundary. Learning rate:
    untouched. ``trainer.global_step`` and step-interval LR schedulers count optimizer steps, so a warm-up phase
    takes more, smaller updates at the same learning rate per update; scale the LR in your own scheduler
    if you want the linear-scaling rule (``lr * E / E_final``).

    Strategies: single device, DDP (gradients averaged over processes; the count is all-reduced), ``lowmem_offload``
    (scales the host master gradients the optimizer steps), DeepSpeed (sets DeepSpeed's
    ``gradient_accumulation_steps`` through ``trainer.accumulate_grad_batches`` before the engine is built; only
    ``"samples"``, a fixed int micro-batch and no schedule: DeepSpeed owns the gradient buffers and the window).

    What other code sees: ``outputs["loss"]`` in ``on_train_batch_end`` is the micro-batch's mean loss as
    ``training_step`` computed it (``"tokens"``: its sum / its ``num_tokens``), *not* divided by the accumulation,
    on every strategy (plain Lightning's ``accumulate_grad_batches`` divides it). The callback puts itself first in
    ``trainer.callbacks``, so other callbacks' ``on_before_optimizer_step`` see the normalised gradients; only
    ``on_after_backward`` sees the scaled, not yet normalised, sums.

    Out of memory (``on_oom="split"``, the default for ``micro_batch_size="auto"``): a micro-batch whose forward or
    backward raises ``torch.OutOfMemoryError`` is released and run as two halves, and the window completes with the
    same samples and the same exact normalisation, so the optimizer step, the LR schedule, the reported loss and
    ``global_step`` are those of a run without the error (up to the fp32 order of additions of the split micro-batch).
    Later micro-batches run split to that size (a log line says so), and grow back after ``regrow_after`` clean
    optimizer steps. A single sample that does not fit saves an atomic emergency checkpoint of the last completed
    step and raises :class:`~lightning_lowmem.callbacks.accumulation.oom_split.MicroBatchOutOfMemoryError`. On CUDA the
    allocator cache is emptied once per recovery. Cost: nothing until an error (one Python hook call per parameter
    per backward); a recovery loses the failed micro-batch's work. Single process only (an error on one process
    would desynchronise the others' collectives), not with DeepSpeed (its engine owns the micro-batch loop) nor with
    an optimizer step inside backward. See :class:`~lightning_lowmem.callbacks.oom_recovery.OOMRecovery` for runs
    without accumulation.

    Checkpoints: one written inside a window (a time-based ``ModelCheckpoint``, a validation off the window's edge)
    holds the window (its counts and the gradients so far, copied to the host) and a resume in a new process continues
    it exactly; under DeepSpeed or several processes it cannot, and says so when it is written.

    Logged at each optimizer step: ``accumulation/micro_batches``, ``accumulation/samples`` and, with ``"tokens"``,
    ``accumulation/tokens`` (what the step held, all processes); with ``on_oom="split"`` also ``oom/recoveries`` and
    ``oom/bytes_freed`` (running totals, also :attr:`oom_recoveries` and :attr:`oom_bytes_freed`).

    Args:
        effective_batch_size: samples per optimizer step, summed over processes.
        micro_batch_size: samples per forward/backward per process, or ``"auto"``.
        schedule: ``{step_or_epoch: effective_batch_size}`` changes, or ``None``.
        schedule_interval: whether ``schedule`` keys are optimizer steps or epochs.
        loss_normalization: ``"samples"`` or ``"tokens"`` (see above).
        memory_budget: bytes (or a size such as ``"12GiB"``) a training step may peak at on the device role,
            for ``"auto"``; on CUDA ``None`` means 90% of the device's memory.
        batch_arg_name: the attribute that sets the loader's batch size.
        on_oom: ``"split"`` (recover from out-of-memory errors, above) or ``"raise"``; ``None``: ``"split"`` for
            ``micro_batch_size="auto"`` in a single process, else ``"raise"``.
        regrow_after: after a split, try twice the micro-batch again after this many optimizer steps without an
            error; ``None`` keeps the smaller one.

    Example (``tiny_model``/``tiny_data``: the demo ``CausalLMModule``/``StdlibTextDataModule``, small):

        >>> from lightning_lowmem import AccumulationScheduler
        >>> scheduler = AccumulationScheduler(effective_batch_size=4, micro_batch_size=2, loss_normalization="tokens")
        >>> trainer = L.Trainer(callbacks=[scheduler], max_steps=2, enable_progress_bar=False,
        ...                     enable_model_summary=False)
        >>> trainer.fit(tiny_model(loss_reduction="sum"), tiny_data(pack=False))
        >>> trainer.global_step, int(trainer.callback_metrics["accumulation/micro_batches"])
        (2, 2)
    """

    def __init__(
        self,
        effective_batch_size: int = 64,
        micro_batch_size: MicroBatch = "auto",
        schedule: dict[int, int] | None = None,
        schedule_interval: Interval = "step",
        loss_normalization: Normalization = "samples",
        memory_budget: int | str | None = None,
        batch_arg_name: str = "batch_size",
        on_oom: OnOOM | None = None,
        regrow_after: int | None = None,
    ) -> None:
        super().__init__()
        # NOTE: a wrong type is a TypeError, a right type with a bad value a ValueError; either message names all
        problems: list[str] = []
        wrong_type: list[str] = []
        if not _positive_int(effective_batch_size):
            (problems if _int(effective_batch_size) else wrong_type).append(
                f"`effective_batch_size={effective_batch_size!r}` must be a positive int")
        if micro_batch_size != "auto" and not _positive_int(micro_batch_size):
            (problems if _int(micro_batch_size) or isinstance(micro_batch_size, str) else wrong_type).append(
                f"`micro_batch_size={micro_batch_size!r}` must be a positive int or 'auto'")
        if schedule is not None and not isinstance(schedule, dict):
            wrong_type.append(f"`schedule={schedule!r}` must be a dict {{step or epoch: effective batch size}} or None")
            schedule = None
        schedule = dict(schedule or {})
        for key, value in schedule.items():
            if not (isinstance(key, int) and key >= 0) or not _positive_int(value):
                (problems if _int(key) and _int(value) else wrong_type).append(
                    f"`schedule` entry {key!r}: {value!r} must map an int >= 0 to a positive int")
        if schedule_interval not in ("step", "epoch"):
            problems.append(f"`schedule_interval={schedule_interval!r}`; expected 'step' or 'epoch'")
        if loss_normalization not in ("samples", "tokens"):
            problems.append(f"`loss_normalization={loss_normalization!r}`; expected 'samples' or 'tokens'")
        if isinstance(memory_budget, str):
            try:
                memory_budget = parse_bytes(memory_budget)
            except ValueError as err:
                problems.append(f"`memory_budget`: {err}")
                memory_budget = None
        elif memory_budget is not None and not _positive_int(memory_budget):
            (problems if _int(memory_budget) else wrong_type).append(
                f"`memory_budget={memory_budget!r}` must be a positive number of bytes, a size such as '12GiB', or None")
        if not isinstance(batch_arg_name, str):
            wrong_type.append(f"`batch_arg_name={batch_arg_name!r}` must be the name of an attribute (a str)")
        if on_oom not in (None, "split", "raise"):
            problems.append(f"`on_oom={on_oom!r}`; expected 'split', 'raise' or None")
        if regrow_after is not None and not _positive_int(regrow_after):
            (problems if _int(regrow_after) else wrong_type).append(
                f"`regrow_after={regrow_after!r}` must be a positive int (optimizer steps) or None")
        if not problems and not wrong_type and micro_batch_size != "auto":
            for e in sorted({effective_batch_size, *schedule.values()}):
                if e % micro_batch_size:
                    problems.append(_divisibility_message(e, micro_batch_size, 1))
        if problems or wrong_type:
            error = TypeError if wrong_type else ValueError
            raise error("AccumulationScheduler: " + "; ".join(wrong_type + problems) + ".")
        if micro_batch_size != "auto" and memory_budget is not None:
            rank_zero_warn(
                f"AccumulationScheduler: `memory_budget={memory_budget}` is used only to choose the micro-batch "
                f"(`micro_batch_size='auto'`); with `micro_batch_size={micro_batch_size}` it is ignored. Remove it, or "
                "pass `micro_batch_size='auto'`."
            )
        self.effective_batch_size = effective_batch_size
        self.micro_batch_size = micro_batch_size
        self.schedule = schedule
        self.schedule_interval = schedule_interval
        self.loss_normalization = loss_normalization
        self.memory_budget = memory_budget
        self.batch_arg_name = batch_arg_name
        self.on_oom = on_oom
        self.regrow_after = regrow_after
        self.choice: Choice | None = None
        self.last_window: WindowStats | None = None
        self._micro: int | None = micro_batch_size if isinstance(micro_batch_size, int) else None
        self._engine = False  # DeepSpeed owns the window and the gradients
        self._sets_loader = False
        self._warned_bn = False
        self._trainer_accumulation: int | None = None
        self._wrapped_step = False
        self._resume_window: dict[str, Any] | None = None  # a window saved mid-way, put back in `on_train_start`
        self._instance_step: Any = None  # a `training_step` the module instance had before ours (rare)
        self._counting = True  # False while a split micro-batch re-runs samples a completed forward counted
        self._last_count: Any = None  # what the last `_weigh` counted (samples or tokens), for the split's logging
        self._splitter: Any = None  # `_oom_split.OOMSplitter` with on_oom="split"
        self._reset_window()
        self._n_ref: torch.Tensor | None = None  # mean count per micro-batch, all processes: keeps grads O(mean)

    # --- configuration --------------------------------------------------------------------------------------------
    def effective_batch_at(self, step: int, epoch: int) -> int:
        """The effective batch the schedule gives at optimizer step ``step`` of epoch ``epoch``."""
        key = step if self.schedule_interval == "step" else epoch
        started = [k for k in self.schedule if k <= key]
        return self.schedule[max(started)] if started else self.effective_batch_size

    def _effective_batches(self) -> list[int]:
        return sorted({self.effective_batch_size, *self.schedule.values()})

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_lightning_object(trainer, "the Trainer")
        from lightning.pytorch.strategies import DeepSpeedStrategy

        self._engine = isinstance(trainer.strategy, DeepSpeedStrategy)
        world = trainer.world_size
        problems = []
        if trainer.accumulate_grad_batches not in (1, self._trainer_accumulation):
            problems.append(
                f"the Trainer has `accumulate_grad_batches={trainer.accumulate_grad_batches}`: remove it from the "
                "Trainer, AccumulationScheduler derives accumulation from `effective_batch_size`"
            )
        others = [type(c).__name__ for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]
        if others:
            problems.append(f"remove the `{others[0]}` callback: it also sets `accumulate_grad_batches`")
        if self.micro_batch_size == "auto" and any(isinstance(c, BatchSizeFinder) for c in trainer.callbacks):
            problems.append("remove `BatchSizeFinder` or pass an int `micro_batch_size`: both would set the batch size")
        if not pl_module.automatic_optimization:
            problems.append("manual optimization is not supported: the callback drives Lightning's automatic loop")
        if self._engine:
            if self.loss_normalization == "tokens":
                problems.append(
                    "`loss_normalization='tokens'` is not available with DeepSpeed (the engine owns the gradient "
                    "buffers, so they cannot be rescaled by the window's token count): use 'samples', or "
                    "`strategy='lowmem_offload'`/DDP for exact token normalisation"
                )
            if self.schedule and len(self._effective_batches()) > 1:
                problems.append("a `schedule` is not available with DeepSpeed: its accumulation is fixed at start-up")
            if self.micro_batch_size == "auto":
                problems.append("`micro_batch_size='auto'` is not available with DeepSpeed: pass an int")
        if self.micro_batch_size == "auto" and not lightning_hasattr(pl_module, self.batch_arg_name):
            problems.append(
                f"`micro_batch_size='auto'` needs a `{self.batch_arg_name}` attribute on the LightningModule or "
                "DataModule that `train_dataloader()` uses (like BatchSizeFinder), for the trials and the result"
            )
        if self.micro_batch_size == "auto" and trainer.strategy.root_device.type != "cuda" and self.memory_budget is None:
            problems.append(
                "`micro_batch_size='auto'` off CUDA needs `memory_budget` (bytes a training step may peak at)"
            )
        for e in self._effective_batches():
            if e % world:
                problems.append(f"`effective_batch_size` {e} is not divisible by the world size {world}")
            elif self._micro is not None and e % (self._micro * world):
                problems.append(_divisibility_message(e, self._micro, world))
        problems += self._check_on_oom(trainer)
        self._sets_loader = self._drives_loader and lightning_hasattr(pl_module, self.batch_arg_name)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems) + ".")
        if is_overridden("optimizer_step", pl_module) or is_overridden("optimizer_zero_grad", pl_module):
            rank_zero_warn(
                "AccumulationScheduler: the LightningModule overrides `optimizer_step`/`optimizer_zero_grad`; they "
                "are called once per optimizer step (window), not per micro-batch."
            )
        self._warn_batch_norm(pl_module)
        if self._micro is not None:
            self._apply(trainer, pl_module, self._micro)
        self._wrap_training_step(pl_module)
        if self._drives_loader and not self._engine:  # the bar counts optimizer steps, as at the effective batch
            _progress.count_optimizer_steps(trainer, self)
        # NOTE: first among the callbacks, so that every other callback's `on_before_optimizer_step` sees the
        # normalised gradients and its `on_train_batch_end` the reported loss (see [reported loss])
        if trainer.callbacks and trainer.callbacks[0] is not self:
            trainer.callbacks.remove(self)
            trainer.callbacks.insert(0, self)

    _drives_loader = True  # OOMRecovery: the loader's batch is the window, untouched
    _epoch_start_step = 0  # global_step when this epoch started (the progress bar's count; see `progress`)

    def _check_on_oom(self, trainer: L.Trainer) -> list[str]:
        """Resolve ``on_oom=None`` and say why an explicit ``"split"`` cannot run here."""
        explicit = self.on_oom == "split"
        if self.on_oom is None:
            split = self.micro_batch_size == "auto" and trainer.world_size == 1 and not self._engine
        else:
            split = explicit
        problems = []
        if explicit and self._engine:
            problems.append(
                "`on_oom='split'` is not available with DeepSpeed: its engine owns the micro-batch loop and the "
                "gradient buffers; pass `on_oom='raise'`, or use `strategy='lowmem_offload'`"
            )
        elif explicit and trainer.world_size > 1:
            problems.append(
                f"`on_oom='split'` needs a single process (world size {trainer.world_size}): an out-of-memory error "
                "on one process would leave the others waiting in a gradient all-reduce; pass `on_oom='raise'`"
            )
        in_backward = getattr(trainer.strategy, "optimizer_in_backward", False) or any(
            isinstance(c, OptimizerInBackward) for c in trainer.callbacks
        )
        if explicit and in_backward:
            problems.append(
                "`on_oom='split'` cannot recover when the optimizer steps inside backward (`optimizer_in_backward`): "
                "a failed backward has already stepped some parameters; pass `on_oom='raise'`"
            )
        split = split and not problems and not in_backward
        if split and self._splitter is None:
            self._splitter = OOMSplitter(self, self.regrow_after)
        elif not split:
            self._splitter = None
        return problems

    @property
    def oom_recoveries(self) -> int:
        """Micro-batches split after an out-of-memory error, this run (for ``MemoryReport``)."""
        return self._splitter.recoveries if self._splitter is not None else 0

    @property
    def oom_bytes_freed(self) -> int:
        """Bytes the allocator cache gave back after those recoveries (CUDA; 0 elsewhere)."""
        return self._splitter.bytes_freed if self._splitter is not None else 0

    @property
    def oom_micro_batch(self) -> int | None:
        """The largest micro-batch run since a recovery (the loader's batches split to it); None: not split."""
        return self._splitter.piece if self._splitter is not None else None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # NOTE: after the strategy's setup (its parameters and gradient hooks final) and the "auto" search
        if self._splitter is not None:
            self._splitter.install(trainer, pl_module)
        if self._resume_window:
            _aw.restore_window(self, trainer, self._resume_window)
        self._resume_window = None

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._micro is None:
            world = trainer.world_size
            per_process = math.gcd(*[e // world for e in self._effective_batches()])
            candidates = [d for d in range(1, per_process + 1) if per_process % d == 0]
            budget = self.memory_budget
            if budget is None:  # CUDA only (checked in setup)
                budget = int(0.9 * torch.cuda.get_device_properties(trainer.strategy.root_device).total_memory)
            peaks = search(trainer, pl_module, candidates, budget, self.batch_arg_name)
            self._apply(trainer, pl_module, max(m for m, p in peaks.items() if p is not None and p <= budget))
            self.choice = dataclasses.replace(self.choice, memory_budget=budget, peaks=peaks)
        elif self.choice is None:  # "auto" resumed from a checkpoint: the micro-batch it chose then
            self._apply(trainer, pl_module, self._micro)
        if self._engine:
            self._check_engine(trainer)
        if not self._drives_loader:
            return
        c = self.choice
        rank_zero_info(
            f"AccumulationScheduler: micro-batch {c.micro_batch_size} x accumulation {c.accumulation} x "
            f"{c.world_size} process(es) = effective batch {c.effective_batch_size}"
            + (f" (auto: peak {fmt_bytes(c.peaks[c.micro_batch_size])} within budget {fmt_bytes(c.memory_budget)})"
               if c.peaks else "")
        )

    @override
    def resolved(self) -> AccumulationScheduler:
        """A fresh copy; with ``micro_batch_size="auto"`` once it chose, the micro-batch it chose."""
        if self.micro_batch_size == "auto" and self.choice is not None:
            return self.fresh(micro_batch_size=self.choice.micro_batch_size, memory_budget=None)
        return self.fresh()

    def _apply(self, trainer: L.Trainer, pl_module: L.LightningModule, micro: int) -> None:
        self._micro = micro
        if self._sets_loader:
            lightning_setattr(pl_module, self.batch_arg_name, micro)
        world = trainer.world_size
        e = self.effective_batch_at(trainer.global_step, trainer.current_epoch)
        self._trainer_accumulation = trainer.accumulate_grad_batches = e // (micro * world)
        self.choice = Choice(e, micro, e // (micro * world), world)

    def _check_engine(self, trainer: L.Trainer) -> None:
        config = getattr(trainer.strategy, "config", None) or {}
        want = {"gradient_accumulation_steps": self.choice.accumulation, "train_micro_batch_size_per_gpu": self._micro}
        wrong = {k: config.get(k) for k, v in want.items() if config.get(k) not in (None, v)}
        if wrong:
            raise ValueError(
                f"AccumulationScheduler: the DeepSpeed config has {wrong}, but the callback needs {want}. Remove "
                "these keys from the DeepSpeed config; they follow the callback."
            )

    def _warn_batch_norm(self, pl_module: L.LightningModule) -> None:
        norms = {type(m).__name__ for m in pl_module.modules() if isinstance(m, torch_internals.BatchNormBase)}
        if norms and not self._warned_bn and self._drives_loader:  # OOMRecovery: no micro-batches (see callbacks.accumulation.oom_split)
            self._warned_bn = True
            rank_zero_warn(
                f"AccumulationScheduler: the model has {', '.join(sorted(norms))} layers; they normalise over each "
                "micro-batch, not the effective batch, so results differ from one large batch (use GroupNorm/"
                "LayerNorm, or SyncBatchNorm across processes, if that matters)."
            )

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._splitter is not None:
            self._splitter.remove()
        _progress.restore(trainer)
        if not self._wrapped_step:
            return
        if self._instance_step is not None:
            pl_module.training_step = self._instance_step  # type: ignore[method-assign]
        elif "training_step" in pl_module.__dict__:
            del pl_module.training_step
        self._wrapped_step, self._instance_step = False, None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self._micro, "n_ref": None if self._n_ref is None else float(self._n_ref),
            "oom_micro_batch": None if self._splitter is None else self._splitter.piece,
        }

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        window = _aw.window_state(self, trainer)  # NOTE: a checkpoint written inside a window (see the helper)
        if window is not None and self.state_key in checkpoint.get("callbacks", {}):
            checkpoint["callbacks"][self.state_key]["window"] = window

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_window = state_dict.get("window")
        # NOTE: a resumed run keeps the micro-batch it chose, so the loader's batches (and a mid-epoch position)
        # stay what they were; "auto" does not search again.
        if self.micro_batch_size == "auto" and state_dict.get("micro_batch_size"):
            self._micro = int(state_dict["micro_batch_size"])
        if state_dict.get("n_ref") is not None:
            self._n_ref = torch.tensor(state_dict["n_ref"], dtype=torch.float64)
        # NOTE: a run resumed after a split keeps the smaller micro-batch (Lightning restores callbacks after `setup`)
        if self._splitter is not None and state_dict.get("oom_micro_batch"):
            self._splitter.piece = int(state_dict["oom_micro_batch"])


__all__ = ["AccumulationScheduler", "Choice", "WindowStats", "lightning_accumulation"]

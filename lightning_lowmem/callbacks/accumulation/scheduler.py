"""``AccumulationScheduler``: hold the effective batch from micro-batches, the loss averaged over every sample or token."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, GradientAccumulationScheduler
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.callbacks.accumulation.counts import count_samples, labelled_tokens, loader_batch_size
from lightning_lowmem.callbacks.accumulation.micro_batch_search import largest_fitting
from lightning_lowmem.callbacks.accumulation.window import (
    Window,
    WindowStats,
    lightning_accumulation,
    restore_gradients,
    saved_gradients,
)
from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.units import fmt_bytes, parse_bytes

Normalization = Literal["tokens", "samples"]
Interval = Literal["step", "epoch"]
MicroBatch = int | Literal["auto"]
#: ``measure(trainer, pl_module, micro_batch)``: the peak bytes of a training step at that micro-batch (None: it fails)
Measure = Callable[[L.Trainer, L.LightningModule, int], int | None]


@dataclass
class Choice:
    """What the callback chose, and why (``peaks``: measured peak bytes per tried micro-batch, ``None``: fails)."""

    effective_batch_size: int
    micro_batch_size: int
    accumulation: int
    world_size: int
    memory_budget: int | None = None
    peaks: dict[int, int | None] | None = None


class AccumulationScheduler(Reproducible, L.Callback):
    """Hold the effective batch (samples per optimizer step, all processes) with micro-batches that fit memory.

    Memory: activations scale with the micro-batch, so a micro-batch ``k`` times smaller keeps ``1/k`` of the
    activation memory while the optimizer still steps on ``effective_batch_size`` samples. Cost: ``k`` times more
    forward/backward launches per step; under DDP one ``all_reduce`` of two scalars per optimizer step.

    It sets the loader's micro-batch through the ``batch_arg_name`` attribute (``BatchSizeFinder``'s convention) and
    ``trainer.accumulate_grad_batches``; :attr:`choice` says what it chose. The loss is normalised exactly, also for
    uneven micro-batches and an epoch's short last window: ``"samples"`` (``training_step`` returns the mean loss) or
    ``"tokens"`` (it returns ``{"loss": sum_of_token_losses, "num_tokens": n}``). Schedules, ``"auto"``, the
    strategies, checkpoints inside a window: docs/techniques/accumulation.md. Logged at each step:
    ``accumulation/micro_batches``, ``accumulation/samples`` and with ``"tokens"`` ``accumulation/tokens`` (all
    processes; also :attr:`last_window`).

    Args:
        effective_batch_size: samples per optimizer step, summed over processes.
        micro_batch_size: samples per forward/backward per process, or ``"auto"`` (with ``measure``).
        schedule: ``{step_or_epoch: effective_batch_size}`` changes, or ``None``.
        schedule_interval: whether ``schedule`` keys are optimizer steps or epochs.
        loss_normalization: ``"samples"`` or ``"tokens"`` (see above).
        memory_budget: bytes (or a size such as ``"12GiB"``) a training step may peak at, for ``"auto"`` (default on
            CUDA: 90% of the device).
        batch_arg_name: the attribute that sets the loader's batch size.
        on_oom: ``None`` or ``"raise"`` (``"split"`` was removed: refused).
        measure: for ``"auto"``, the peak bytes of a training step at a micro-batch (above).
        count_tokens: for ``"tokens"``, a function of the batch returning its token count (a 0-dim tensor or int).

    Example (``tiny_model``/``tiny_data``: the demo ``CausalLMModule``/``StdlibTextDataModule``, small):

        >>> from lightning_lowmem import AccumulationScheduler
        >>> scheduler = AccumulationScheduler(effective_batch_size=4, micro_batch_size=2, loss_normalization="tokens")
        >>> trainer = L.Trainer(callbacks=[scheduler], max_steps=2, enable_progress_bar=False,
        ...                     enable_model_summary=False)
        >>> trainer.fit(tiny_model(loss_reduction="sum"), tiny_data(pack=False))
        >>> trainer.global_step, int(trainer.callback_metrics["accumulation/micro_batches"])
        (2, 2)
    """

    def __init__(self, effective_batch_size: int = 64, micro_batch_size: MicroBatch = "auto",
                 schedule: dict[int, int] | None = None, schedule_interval: Interval = "step",
                 loss_normalization: Normalization = "samples", memory_budget: int | str | None = None,
                 batch_arg_name: str = "batch_size", on_oom: Literal["raise"] | None = None,
                 measure: Measure | None = None, count_tokens: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        # NOTE: a wrong type is a TypeError, a bad value a ValueError; either message names all
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
        if on_oom == "split":
            problems.append(
                "`on_oom='split'` was removed: Lightning has no hook around a failing `training_step`, and the split "
                "replaced the strategy's `training_step` and `backward`; pass an int `micro_batch_size` whose step fits "
                "(`lowmem plan` or `lowmem estimate` predicts the peak), and add Lightning's `OnExceptionCheckpoint` "
                "to resume after an out-of-memory error"
            )
        elif on_oom not in (None, "raise"):
            problems.append(f"`on_oom={on_oom!r}`; expected 'raise' or None")
        for name, fn in (("measure", measure), ("count_tokens", count_tokens)):
            if fn is not None and not callable(fn):
                wrong_type.append(f"`{name}={fn!r}` must be a function or None")
        if not problems and not wrong_type and micro_batch_size != "auto":
            for e in sorted({effective_batch_size, *schedule.values()}):
                if e % micro_batch_size:
                    problems.append(_divisibility_message(e, micro_batch_size, 1))
        if problems or wrong_type:
            error = TypeError if wrong_type else ValueError
            raise error("AccumulationScheduler: " + "; ".join(wrong_type + problems) + ".")
        if micro_batch_size != "auto" and (memory_budget is not None or measure is not None):
            rank_zero_warn(
                f"AccumulationScheduler: `memory_budget`/`measure` choose the micro-batch (`micro_batch_size='auto'`); "
                f"with `micro_batch_size={micro_batch_size}` they are ignored (`memory_budget={memory_budget}`). Remove "
                "them, or pass `micro_batch_size='auto'`."
            )
        self.effective_batch_size = effective_batch_size
        self.micro_batch_size = micro_batch_size
        self.schedule = schedule
        self.schedule_interval = schedule_interval
        self.loss_normalization = loss_normalization
        self.memory_budget = memory_budget
        self.batch_arg_name = batch_arg_name
        self.on_oom = on_oom
        self.measure = measure
        self.count_tokens = count_tokens
        self.choice: Choice | None = None
        self.last_window: WindowStats | None = None
        self.window = Window(tokens=loss_normalization == "tokens")
        self._micro: int | None = micro_batch_size if isinstance(micro_batch_size, int) else None
        self._engine = False  # DeepSpeed owns the window and the gradients
        self._sets_loader = False
        self._warned_bn = False
        self._trainer_accumulation: int | None = None  # the last value this callback gave the Trainer
        self._resume_window: dict[str, Any] | None = None  # a window saved mid-way, put back in `on_train_start`
        self._first_count: Any = None  # tokens counted in a micro-batch, checked against its output once per fit
        self._tokens_checked = False
        self._stepped = False  # an optimizer step closed the window under way: log its stats

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
        self._engine = isinstance(trainer.strategy, DeepSpeedStrategy)
        auto = self.micro_batch_size == "auto"
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
        if auto and any(isinstance(c, BatchSizeFinder) for c in trainer.callbacks):
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
            if len(self._effective_batches()) > 1:
                problems.append("a `schedule` is not available with DeepSpeed: its accumulation is fixed at start-up")
            if auto:
                problems.append("`micro_batch_size='auto'` is not available with DeepSpeed: pass an int")
        elif auto:
            if self.measure is None:
                problems.append(
                    "`micro_batch_size='auto'` needs `measure` (the peak bytes of a training step at a micro-batch; "
                    "the scheduler runs no trial step on your model): pass an int, chosen with `lowmem plan` or "
                    "`lowmem estimate` (dry runs on a fake copy), or pass `measure`"
                )
            if not lightning_hasattr(pl_module, self.batch_arg_name):
                problems.append(
                    f"`micro_batch_size='auto'` needs a `{self.batch_arg_name}` attribute on the LightningModule or "
                    "DataModule that `train_dataloader()` uses (like BatchSizeFinder), to set the result"
                )
            if trainer.strategy.root_device.type != "cuda" and self.memory_budget is None:
                problems.append("`micro_batch_size='auto'` off CUDA needs `memory_budget` (bytes a step may peak at)")
        for e in self._effective_batches():
            if e % world:
                problems.append(f"`effective_batch_size` {e} is not divisible by the world size {world}")
            elif self._micro is not None and e % (self._micro * world):
                problems.append(_divisibility_message(e, self._micro, world))
        if not self._engine:  # NOTE: [exact normalisation] in `window`: the gradients change in on_before_optimizer_step
            mine = next((i for i, c in enumerate(trainer.callbacks) if c is self), 0)
            readers = sorted({type(c).__name__ for c in trainer.callbacks[:mine]
                              if is_overridden("on_before_optimizer_step", c, L.Callback)})
            if readers:
                problems.append(
                    f"list it before {', '.join(f'`{n}`' for n in readers)} in `callbacks`: it normalises the window's "
                    "gradients in `on_before_optimizer_step`, where a callback listed before it would read them first"
                )
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems) + ".")
        self._sets_loader = lightning_hasattr(pl_module, self.batch_arg_name)
        if is_overridden("optimizer_step", pl_module) or is_overridden("optimizer_zero_grad", pl_module):
            rank_zero_warn(
                "AccumulationScheduler: the LightningModule overrides `optimizer_step`/`optimizer_zero_grad`; they "
                "are called once per optimizer step (window), not per micro-batch."
            )
        self._warn_batch_norm(pl_module)
        self.window = Window(tokens=self.loss_normalization == "tokens")
        self._first_count, self._tokens_checked = None, False
        if self._micro is not None:
            self._apply(trainer, pl_module, self._micro)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._micro is None:
            world = trainer.world_size
            per_process = math.gcd(*[e // world for e in self._effective_batches()])
            candidates = [d for d in range(1, per_process + 1) if per_process % d == 0]
            budget = self.memory_budget
            if budget is None:  # CUDA only (checked in setup)
                budget = int(0.9 * torch.cuda.get_device_properties(trainer.strategy.root_device).total_memory)
            measure = self.measure
            micro, peaks = largest_fitting(candidates, budget, lambda m: measure(trainer, pl_module, m))  # type: ignore[misc]
            self._apply(trainer, pl_module, micro)
            self.choice = dataclasses.replace(self.choice, memory_budget=budget, peaks=peaks)  # type: ignore[arg-type]
        elif self.choice is None:  # "auto" resumed from a checkpoint: the micro-batch it chose then
            self._apply(trainer, pl_module, self._micro)
        c = self.choice
        if self._engine:
            config = getattr(trainer.strategy, "config", None) or {}
            want = {"gradient_accumulation_steps": c.accumulation, "train_micro_batch_size_per_gpu": self._micro}
            wrong = {k: config.get(k) for k, v in want.items() if config.get(k) not in (None, v)}
            if wrong:
                raise ValueError(
                    f"AccumulationScheduler: the DeepSpeed config has {wrong}, but the callback needs {want}. Remove "
                    "these keys from the DeepSpeed config; they follow the callback."
                )
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
            return self.fresh(micro_batch_size=self.choice.micro_batch_size, memory_budget=None, measure=None)
        return self.fresh()

    def _apply(self, trainer: L.Trainer, pl_module: L.LightningModule, micro: int) -> None:
        self._micro = micro
        if self._sets_loader:
            lightning_setattr(pl_module, self.batch_arg_name, micro)
        world = trainer.world_size
        e = self.effective_batch_at(trainer.global_step, trainer.current_epoch)
        self._trainer_accumulation = trainer.accumulate_grad_batches = e // (micro * world)
        self.choice = Choice(e, micro, e // (micro * world), world)
        if not self.window.tokens:
            self.window.reference = micro

    def _warn_batch_norm(self, pl_module: L.LightningModule) -> None:
        norms = {type(m).__name__ for m in pl_module.modules() if isinstance(m, torch_internals.BatchNormBase)}
        if norms and not self._warned_bn:
            self._warned_bn = True
            rank_zero_warn(
                f"AccumulationScheduler: the model has {', '.join(sorted(norms))} layers; they normalise over each "
                "micro-batch, not the effective batch, so results differ from one large batch (use GroupNorm/"
                "LayerNorm, or SyncBatchNorm across processes, if that matters)."
            )

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._resume_window:  # NOTE: after the optimizers and their state are restored
            restore_gradients(trainer.optimizers, self._resume_window["grads"])
            self.window.load_state_dict(self._resume_window)
        self._resume_window = None

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.window.start_epoch()

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        w, loader = self.window, trainer.train_dataloader
        if w.pos == 0 and batch_idx == 0:
            self._check_loader(loader, batch)
        samples = count_samples(loader, batch, batch_idx)
        count: Any = samples
        if w.tokens:
            tokens = (self.count_tokens or labelled_tokens)(batch)
            count = torch.as_tensor(tokens, device=trainer.strategy.root_device).to(torch.float64)
            if not self._tokens_checked:
                self._first_count = count
        progress = trainer.fit_loop.epoch_loop.batch_progress
        ready = progress.current.ready
        epoch_end = ready == trainer.num_training_batches or progress.is_last_batch
        size = self.effective_batch_at(trainer.global_step, trainer.current_epoch) // (self._micro * trainer.world_size)
        value, zero_here = w.advance(size, batch_idx, ready, epoch_end, (samples, count))
        if self._engine:  # NOTE: DeepSpeed's engine keeps its own window
            return
        # NOTE: N is chosen per batch to give this window's edges (see `lightning_accumulation`); only a change is
        # written: SWA's forward-only epoch raises N to keep Lightning from stepping, and an aligned window leaves it
        if value != self._trainer_accumulation:
            self._trainer_accumulation = trainer.accumulate_grad_batches = value
        if zero_here:
            for optimizer in trainer.optimizers:
                pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)

    def _check_loader(self, loader: Any, batch: Any) -> None:
        """On an epoch's first batch: the loader gives the micro-batch the callback chose (a loader built with a
        fixed size ignores the attribute set, and the run would accumulate the wrong effective batch)."""
        said = loader_batch_size(loader)
        size = said or extract_batch_size(batch)
        if size == self._micro:
            return
        if said is None:
            rank_zero_warn(
                f"AccumulationScheduler cannot tell the train loader's batch size: it names none (`batch_size=None` or "
                f"a batch sampler without one), and the batch's first tensor has {size} rows, which need not be its "
                f"samples (a graph's nodes, packed tokens). If its batches hold {self._micro} samples, all is well; "
                f"otherwise build the loader with `batch_size=self.{self.batch_arg_name}`."
            )
            return
        where = f"set `{self.batch_arg_name}={self._micro}` on the LightningModule or DataModule, but"
        if not self._sets_loader:
            where = (f"needs micro-batches of {self._micro}, but neither the LightningModule nor the DataModule has a "
                     f"`{self.batch_arg_name}` attribute for it to set, and")
        raise ValueError(
            f"AccumulationScheduler {where} the train loader gives batches of {size}, so each optimizer step would "
            f"hold {size}/{self._micro} of `effective_batch_size`. Build the loader from that attribute "
            f"(`DataLoader(..., batch_size=self.{self.batch_arg_name})`, or `self.hparams.{self.batch_arg_name}` "
            "if it lives in the hyper-parameters), or pass `micro_batch_size` equal to the loader's batch size."
        )

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        w = self.window
        if w.pending is None or not loss.requires_grad:
            return
        n, size = trainer.accumulate_grad_batches, w.size
        if self._engine:
            # NOTE: Lightning divides the loss by n, stock DeepSpeed again (n is undone), `loss_divided_once` does not
            n, size = (1 if getattr(trainer.strategy, "loss_divided_once", False) else n), 1
        h = w.weigh(n, size, lambda t: trainer.strategy.reduce(t, reduce_op="mean"))
        if h is not None:
            h = h.to(loss.dtype) if isinstance(h, torch.Tensor) else h  # NOTE: a 0-dim product would promote
            loss.register_hook(lambda grad: grad * h)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        w = self.window
        if self._engine or w.micro_batches == 0:  # NOTE: nothing backpropagated (SWA's forward-only epoch)
            w.reset()
            return
        strategy = trainer.strategy
        factor = w.step_factor(trainer.world_size, lambda t: strategy.reduce(t, reduce_op="sum"), strategy.root_device)
        self.last_window, self._stepped = w.stats, True
        if factor is None:
            return
        per_device: dict[torch.device, Any] = {}
        # NOTE: the gradients of what the optimizer steps: under `lowmem_offload` these are the host masters
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if isinstance(factor, torch.Tensor) and p.grad.device not in per_device:
                        per_device[p.grad.device] = factor.to(p.grad.device)
                    p.grad.mul_(per_device.get(p.grad.device, factor))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._first_count is not None and isinstance(outputs, Mapping) and "loss" in outputs:
            counted, self._first_count, self._tokens_checked = self._first_count, None, True
            _check_token_count(outputs, counted)
        if not self._stepped:
            return
        self._stepped = False
        w = self.last_window
        metrics = {"accumulation/micro_batches": float(w.micro_batches), "accumulation/samples": float(w.samples)}
        if w.tokens is not None:
            metrics["accumulation/tokens"] = w.tokens
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, rank_zero_only=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        reference = self.window.reference if self.window.tokens else None
        return {"micro_batch_size": self._micro, "n_ref": None if reference is None else float(reference)}

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        w = self.window
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        # NOTE: nothing to keep at a window edge; inside a batch (`OnExceptionCheckpoint`) it resumes without it
        if w.pos == 0 or progress.ready != progress.processed or self.state_key not in checkpoint.get("callbacks", {}):
            return
        # NOTE: where the window's state cannot be written in one process's checkpoint
        reason = ("DeepSpeed keeps the window's gradients in its own buffers and does not checkpoint them"
                  if self._engine else "each process holds its own part of the window's gradients until the step, "
                  "and the checkpoint is written by one of them" if trainer.world_size > 1 else None)
        if reason is not None:
            rank_zero_warn(
                f"AccumulationScheduler: a checkpoint is being written inside an accumulation window ({w.pos} of "
                f"{w.size} micro-batches done), but {reason}: a resume from it continues the window "
                "without them, so its next optimizer step differs from an uninterrupted run's. Save on window edges "
                "(`ModelCheckpoint(every_n_train_steps=...)`)."
            )
            return
        checkpoint["callbacks"][self.state_key]["window"] = {**w.state_dict(), "grads": saved_gradients(trainer.optimizers)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_window = state_dict.get("window")
        # NOTE: a resumed run keeps the micro-batch it chose (the loader's batches, a mid-epoch position); no search
        if self.micro_batch_size == "auto" and state_dict.get("micro_batch_size"):
            self._micro = int(state_dict["micro_batch_size"])
        if self.window.tokens and state_dict.get("n_ref") is not None:
            self.window.reference = float(state_dict["n_ref"])


def _check_token_count(outputs: Mapping[str, Any], counted: torch.Tensor) -> None:
    """The first micro-batch's ``num_tokens`` is the count the normalisation used (a sync, once per fit)."""
    if "num_tokens" not in outputs:
        raise TypeError(
            "AccumulationScheduler(loss_normalization='tokens'): `training_step` must return "
            "`{'loss': sum_of_token_losses, 'num_tokens': n}` (CausalLMModule(loss_reduction='sum') does); it returned "
            f"keys {sorted(outputs)}. Or pass `loss_normalization='samples'` for a per-micro-batch mean loss."
        )
    returned = torch.as_tensor(outputs["num_tokens"]).to(counted.device, torch.float64)
    if bool(returned != counted):
        raise ValueError(
            f"AccumulationScheduler(loss_normalization='tokens'): the first micro-batch was normalised by "
            f"{int(counted)} tokens, counted from the batch before its forward (`count_tokens`, by default "
            f"`batch['labels'][..., 1:] != -100`), but `training_step` returned `num_tokens={int(returned)}`. Pass "
            "`count_tokens=<a function of the batch that counts the tokens your loss sums over>`."
        )


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _int(value) and value > 0


def _divisibility_message(effective: int, micro: int, world: int) -> str:
    """Say why ``effective`` does not split into micro-batches, and the nearest values that do."""
    unit = micro * world
    below, above = (effective // unit) * unit, (effective // unit + 1) * unit
    nearest = f"{below} or {above}" if below else f"{above}"
    msg = (
        f"`effective_batch_size` {effective} is not a multiple of micro-batch {micro} x world size {world} = {unit}: "
        f"the nearest valid effective batch sizes are {nearest}"
    )
    if effective % world == 0:
        per_process = effective // world
        divisors = [d for d in range(1, per_process + 1) if per_process % d == 0]
        options = [str(d) for d in ([d for d in divisors if d < micro][-1:] + [d for d in divisors if d > micro][:1])]
        msg += f", or keep {effective} with micro-batch {' or '.join(options)}"
    return msg


__all__ = ["AccumulationScheduler", "Choice", "WindowStats", "lightning_accumulation"]

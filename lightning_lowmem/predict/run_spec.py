"""``RunSpec``: one description of a training run, as the ``Trainer`` is given it.

The same description is trained by ``lowmem fit``, predicted by :func:`~lightning_lowmem.dry_run` and
:func:`~lightning_lowmem.estimate_memory`, and read back from a live Trainer by ``MemoryReport``:
strategy (a registered name or an object), precision, the technique callbacks, accumulation and
clipping. Objects are never shared between runs: each run gets :meth:`Reproducible.fresh` copies.

Example:
    >>> from lightning_lowmem import ActivationCheckpointing, LowBitOptimizer, RunSpec
    >>> spec = RunSpec(strategy="lowmem_offload", precision="bf16-true",
    ...                callbacks=[ActivationCheckpointing("all"), LowBitOptimizer("adamw8bit")])
    >>> trainer = L.Trainer(**spec.trainer_kwargs(), max_steps=100)
    >>> type(trainer.strategy).__name__, [type(c).__name__ for c in spec.callbacks]
    ('OffloadStrategy', ['ActivationCheckpointing', 'LowBitOptimizer'])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.callbacks import Checkpoint, LearningRateMonitor, ModelSummary, ProgressBar, Timer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_lowmem._registry import STRATEGIES, builds
from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.callbacks.adapters.callback import Adapters
from lightning_lowmem.callbacks.chunked_lm_loss.callback import ChunkedLMLoss
from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer
from lightning_lowmem.callbacks.optimizer_in_backward import OptimizerInBackward
from lightning_lowmem.core.reproducible import Reproducible, fresh
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

#: technique flags of :func:`~lightning_lowmem.estimate_memory`, for messages
SHORTHANDS = ("offload", "offload_params", "checkpointing", "activation_offload", "micro_batch_size", "optimizer",
              "optimizer_in_backward", "zero_stage", "chunked_loss", "adapters", "adapter_r", "quantize_base", "disk")
#: ``optimizer=`` shorthands that are ``LeanOptimizer(kind)`` (its defaults otherwise): its own kind names, except
#: torchao's 8-bit AdamW: "adamw8bit" is bitsandbytes' (``LowBitOptimizer``)
LEAN_OPTIMIZERS: dict[str, str] = {"galore": "galore", "apollo": "apollo", "apollo_mini": "apollo_mini",
                                   "adam_mini": "adam_mini", "adamw4bit": "adamw4bit",
                                   "torchao_adamw8bit": "adamw8bit"}


@dataclass
class ZeroPlan:
    """A DeepSpeed ZeRO run, predicted in closed form over a traced single-device run (see ``analytic.zero_states``)."""

    stage: int
    offload_optimizer: bool
    offload_parameters: bool
    world_size: int = 1
    #: the DeepSpeed config as far as known before the Trainer's settings: a ``ZeroStrategy``'s own; for a
    #: registered name its preset's offload sections (DeepSpeed's defaults, which ZeroStrategy's match, for the rest)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def nvme(self) -> bool:
        """ZeRO-Infinity: stage 3 with the optimizer state or the parameters swapped to NVMe."""
        zero = self.config.get("zero_optimization") or {}
        return self.stage == 3 and any((zero.get(k) or {}).get("device") == "nvme"
                                       for k in ("offload_optimizer", "offload_param"))


@dataclass
class RunSpec:
    """What the Trainer is given: ``strategy``, ``precision``, technique ``callbacks``, accumulation, clipping."""

    strategy: Any = "auto"
    precision: str = "32-true"
    callbacks: list[Any] = field(default_factory=list)
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    world_size: int = 1
    #: what the description leaves out (callbacks not part of a prediction, a strategy modelled as another)
    notes: list[str] = field(default_factory=list)
    #: the device type the run trains on ("cuda" or "cpu") where the description says (a YAML's
    #: ``trainer.accelerator``), with where it came from; None: the caller decides
    target: str | None = None
    target_source: str | None = None

    def trainer_kwargs(self) -> dict[str, Any]:
        """``Trainer`` arguments with fresh, unused strategy and callback objects (call once per run)."""
        kwargs: dict[str, Any] = {
            "strategy": fresh(self.strategy),
            "precision": self.precision,
            "callbacks": [fresh(c) for c in self.callbacks],
            "accumulate_grad_batches": self.accumulate_grad_batches,
        }
        if self.gradient_clip_val:
            kwargs["gradient_clip_val"] = self.gradient_clip_val
            kwargs["gradient_clip_algorithm"] = self.gradient_clip_algorithm
        return kwargs

    @property
    def strategy_name(self) -> str:
        s = self.strategy
        return s if isinstance(s, str) else (getattr(s, "strategy_name", None) or type(s).__name__)

    def zero(self) -> ZeroPlan | None:
        """The ZeRO layout of the strategy, or None when it is not a DeepSpeed strategy."""
        strategy = self.strategy
        if isinstance(strategy, str):
            if not builds(strategy, ZeroStrategy):
                if strategy.startswith("deepspeed"):
                    raise ValueError(
                        f"Passed `strategy={strategy!r}`; estimate DeepSpeed through the `lowmem_zero*` presets "
                        "(e.g. 'lowmem_zero3_offload') or a `ZeroStrategy(...)` object."
                    )
                return None
            preset = STRATEGIES[strategy][3]
            stage, device = preset.get("stage", 2), {"device": preset.get("offload_device", "cpu")}
            zero = {"stage": stage, **({"offload_optimizer": device} if preset.get("offload_optimizer") else {}),
                    **({"offload_param": device} if preset.get("offload_parameters") else {})}
            return ZeroPlan(stage, bool(preset.get("offload_optimizer")), bool(preset.get("offload_parameters")),
                            self.world_size, {"zero_optimization": zero})
        config = getattr(strategy, "config", None)
        if not isinstance(config, dict) or "zero_optimization" not in config:
            return None
        zero = config["zero_optimization"]
        device = lambda key: (zero.get(key) or {}).get("device", "none") not in (None, "none")
        return ZeroPlan(int(zero.get("stage", 0)), device("offload_optimizer"), device("offload_param"), self.world_size,
                        config)

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (names and constructor arguments)."""

        def name(obj: Any) -> Any:
            if isinstance(obj, str):
                return obj
            args, kwargs = getattr(obj, "_init_args", ((), {}))
            inner = ", ".join([*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
            return f"{type(obj).__name__}({inner})"

        out = {"strategy": name(self.strategy), "precision": self.precision,
               "callbacks": [name(c) for c in self.callbacks], "accumulate_grad_batches": self.accumulate_grad_batches}
        if self.gradient_clip_val:
            out["gradient_clip"] = f"{self.gradient_clip_val} ({self.gradient_clip_algorithm or 'norm'})"
        if self.world_size > 1:
            out["world_size"] = self.world_size
        return out

    @classmethod
    def from_trainer(cls, trainer: Any, exclude: tuple[Any, ...] = ()) -> RunSpec:
        """The run ``trainer`` is doing, with each decision made at run time fixed (:meth:`Reproducible.resolved`).

        The suite's strategies and technique callbacks are described; Lightning's single-device and DDP
        strategies are predicted as one device (DDP's gradient buckets are not modelled); other callbacks are
        left out (named in :attr:`notes`).
        """
        notes: list[str] = []
        strategy = trainer.strategy
        if isinstance(strategy, Reproducible):
            described: Any = strategy.resolved()
        elif isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            described = "auto"
            if isinstance(strategy, DDPStrategy):
                notes.append(f"{type(strategy).__name__} predicted per process as one device (gradient buckets not modelled)")
        else:
            raise ValueError(  # noqa: TRY004  (a strategy the dry run does not model, not a wrong argument type)
                f"The run uses `{type(strategy).__name__}`, which the dry run does not model; the suite's strategies "
                "(lowmem_offload, lowmem_zero*) and Lightning's single-device and DDP strategies are predicted."
            )
        callbacks, left_out = [], []
        for cb in trainer.callbacks:
            # NOTE: Lightning's bookkeeping callbacks hold no tensors of the step
            if any(cb is e for e in exclude) or isinstance(cb, (Checkpoint, LearningRateMonitor, ModelSummary,
                                                                ProgressBar, Timer)):
                continue
            if isinstance(cb, Reproducible):
                decided = cb.resolved()
                if decided is not None:
                    callbacks.append(decided)
            else:
                left_out.append(type(cb).__name__)
        if left_out:
            notes.append(f"callbacks not part of the prediction: {', '.join(sorted(set(left_out)))}")

        driven = any(isinstance(c, AccumulationScheduler) for c in callbacks)
        return cls(
            strategy=described,
            precision=str(trainer.precision),
            callbacks=callbacks,
            accumulate_grad_batches=1 if driven else int(trainer.accumulate_grad_batches),
            gradient_clip_val=trainer.gradient_clip_val or None,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            world_size=int(trainer.world_size),
            notes=notes,
        )

    @classmethod
    def from_flags(
        cls, *, precision: str = "32-true", offload: bool = False, offload_params: bool = False,
        checkpointing: str | None = None, checkpointing_every_n: int = 2, activation_offload: bool = False,
        batch_size: int | None = None, micro_batch_size: int | None = None, optimizer: str | None = None,
        optimizer_in_backward: bool = False, zero_stage: int = 0, world_size: int = 1, chunked_loss: int | None = None,
        adapters: str | None = None, adapter_r: int | None = None, quantize_base: str | None = None,
        disk: str | None = None,
    ) -> RunSpec:
        """The run that :func:`~lightning_lowmem.estimate_memory`'s keyword shorthands name (``disk``: a directory
        for ``OffloadStrategy(disk=...)``'s tier, with ``offload=True`` and ``optimizer_in_backward=True``)."""
        callbacks: list[Any] = []
        if disk is not None and not (offload and optimizer_in_backward and not zero_stage):
            flags = {"offload": offload, "optimizer_in_backward": optimizer_in_backward, "zero_stage": zero_stage}
            given = ", ".join(f"`{k}={v!r}`" for k, v in flags.items())
            raise ValueError(f"Passed `disk={disk!r}` with {given}; the disk tier is part of `lowmem_offload` and "
                             "steps each parameter as its gradient lands: pass `offload=True, "
                             "optimizer_in_backward=True` (no `zero_stage`; strategy='lowmem_offload_disk'), or leave "
                             "`disk` out.")
        if adapters is not None:
            # NOTE: first, as a user lists it: the other techniques see the model with its adapters (the Adapters
            # callback's own code adds them; its defaults otherwise: alpha, dropout, all-linear targets)
            callbacks.append(Adapters(adapters, **({} if adapter_r is None else {"r": adapter_r}),  # type: ignore[arg-type]
                                      quantize_base=quantize_base))  # type: ignore[arg-type]
        elif adapter_r is not None or quantize_base is not None:
            given = ", ".join(f"`{k}={v!r}`" for k, v in (("adapter_r", adapter_r), ("quantize_base", quantize_base))
                              if v is not None)
            raise ValueError(f"Passed {given} without `adapters`; they describe the adapters' rank and base: add "
                             "`adapters='lora'` (or 'dora'), or leave them out for a full fine-tune.")
        if micro_batch_size is not None and batch_size is not None and micro_batch_size != batch_size:
            # NOTE: before the callbacks that read the window's gradients (it weighs them first; it refuses otherwise)
            callbacks.append(AccumulationScheduler(effective_batch_size=batch_size * world_size,
                                                   micro_batch_size=micro_batch_size))
        if checkpointing is not None:
            n = checkpointing_every_n if checkpointing == "every_n" else None
            callbacks.append(ActivationCheckpointing(policy=checkpointing, n=n))  # type: ignore[arg-type]
        if activation_offload:
            callbacks.append(ActivationOffload())
        if chunked_loss:
            callbacks.append(ChunkedLMLoss(chunk_tokens=chunked_loss))
        if optimizer == "adamw8bit":
            callbacks.append(LowBitOptimizer("adamw8bit"))
        elif optimizer in LEAN_OPTIMIZERS:
            callbacks.append(LeanOptimizer(LEAN_OPTIMIZERS[optimizer]))  # type: ignore[arg-type]
        strategy: Any = "auto"
        if zero_stage:
            strategy = {(2, False): "lowmem_zero2", (2, True): "lowmem_zero2_offload", (3, False): "lowmem_zero3",
                        (3, True): "lowmem_zero3_offload"}[(zero_stage, offload)]
        elif offload:
            strategy = OffloadStrategy(optimizer_in_backward=optimizer_in_backward, offload_params=offload_params,
                                       **({} if disk is None else {"disk": disk}))
        if offload_params and not offload:
            raise ValueError("Passed `offload_params=True` without `offload=True`: parameter streaming is part of "
                             "`lowmem_offload` (strategy='lowmem_offload_params').")
        if optimizer_in_backward and not offload:
            callbacks.append(OptimizerInBackward())
        return cls(strategy=strategy, precision=precision, callbacks=callbacks, world_size=world_size)


__all__ = ["LEAN_OPTIMIZERS", "SHORTHANDS", "RunSpec", "ZeroPlan"]

"""``OptimizerInBackward``: step each parameter as soon as its gradient is ready, and free the gradient."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, XLAStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.core.lightning_callbacks import lightning_callback_problems
from lightning_lowmem.core.reentrant import reentrant_fix
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.roles import HostMastersStrategy


class OptimizerInBackward(Reproducible, Callback):
    """Fuse the optimizer step into backward: gradients never all exist at once.

    A ``register_post_accumulate_grad_hook`` steps each parameter with the optimizer your LightningModule configured
    (the same object) as soon as its gradient is written, then sets ``.grad`` to ``None``; Lightning's own
    ``optimizer.step()`` finds no gradient, so its loops, schedulers, logging and checkpoints work unchanged.

    Memory saved: the gradients of all parameters but the few in flight, about 4 B per parameter in fp32 (where
    backward binds the step's peak it drops by less; ``tests/callbacks/test_memory_savings.py`` measures both).
    Cost: the optimizer runs one parameter at a time (no multi-tensor kernels) and scans its parameter list once per
    parameter (quadratic in the number of tensors). Bit-identical to the normal step for SGD and AdamW (tested).

    What is refused at fit start (accumulation, clipping by norm, every strategy but a single device: under
    ``lowmem_offload`` use ``OffloadStrategy(optimizer_in_backward=True)``, ...): docs/techniques/optimizer-in-backward.md.
    Gradients are ``None`` in ``on_after_backward`` and ``on_before_optimizer_step``.

    Example (any optimizer; combine with ``LowBitOptimizer`` for 8-bit state as well):

        >>> from lightning_lowmem import OptimizerInBackward
        >>> model = tiny_model()
        >>> trainer = L.Trainer(callbacks=[OptimizerInBackward()], max_steps=2,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(model, tiny_data())
        >>> trainer.global_step, all(p.grad is None for p in model.parameters())
        (2, True)
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._hooked: set[int] = set()  # ids of the parameters that have the hook
        self._stepped: set[int] = set()  # ids of the parameters stepped in this backward
        self._trainer: L.Trainer | None = None
        self._clip_value: float | None = None
        self._saved_clip_val: float | int | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_lightning_object(trainer, "the Trainer")
        if stage != "fit":
            return
        problems = self.conflicts(trainer, pl_module)
        if problems:
            raise ValueError("OptimizerInBackward cannot run with this Trainer:\n- " + "\n- ".join(problems))

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # NOTE: the hook reads `trainer.optimizers[0]` at call time: a LowBitOptimizer swap is followed either way
        if len(trainer.optimizers) != 1:
            raise ValueError(f"OptimizerInBackward needs exactly one optimizer; `configure_optimizers` returned "
                             f"{len(trainer.optimizers)}.")
        self._trainer = trainer
        clip = trainer.gradient_clip_val
        self._clip_value = float(clip) if clip else None
        if self._clip_value is not None:
            # NOTE: value clipping moves into the hook (torch's would fail on all-None gradients); back in teardown
            self._saved_clip_val = clip
            trainer.gradient_clip_val = None
        self._remove_hooks()
        self._hook_params(trainer)
        # NOTE: a gradient left from before fit would be stepped again by the first hook's optimizer.step()
        for group in trainer.optimizers[0].param_groups:
            for p in group["params"]:
                p.grad = None

    def _hook_params(self, trainer: L.Trainer) -> None:
        """Hook every trainable parameter of the optimizer that has no hook yet."""
        for group in trainer.optimizers[0].param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._hooked:
                    self._hooked.add(id(p))
                    self._handles.append(p.register_post_accumulate_grad_hook(self._step_param))

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        # NOTE: GradientAccumulationScheduler and AccumulationScheduler change this between epochs.
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"OptimizerInBackward: `accumulate_grad_batches` became {trainer.accumulate_grad_batches} at epoch "
                f"{trainer.current_epoch}; the step in backward cannot accumulate. Remove the accumulation "
                "scheduler or the callback."
            )
        # NOTE: a parameter made trainable in `on_train_epoch_start` (BackboneFinetuning) is hooked before its first
        # backward; unhooked, the next hook's step and Lightning's would both step it
        self._hook_params(trainer)

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._stepped.clear()

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_hooks()
        if self._saved_clip_val is not None:
            trainer.gradient_clip_val = self._saved_clip_val
            self._saved_clip_val = None
        self._trainer = None

    @torch.no_grad()
    def _step_param(self, p: torch.Tensor) -> None:
        trainer = self._trainer
        if trainer is None or p.grad is None:
            return
        if id(p) in self._stepped:
            name = next((n for n, q in trainer.lightning_module.named_parameters() if q is p), "a parameter")
            raise ValueError(
                f"OptimizerInBackward: the gradient of `{name}` arrived twice in one backward (a weight shared by two "
                "reentrant-checkpointed blocks: each block's inner backward hands over its part, and the second "
                "block's recompute already read the weight stepped at the first part), so this step cannot match "
                "plain Lightning's. " + reentrant_fix("remove the callback"))
        self._stepped.add(id(p))
        if self._clip_value is not None:
            p.grad.clamp_(-self._clip_value, self._clip_value)
        # NOTE: the user's whole optimizer steps only `p` (every other gradient is None here), so its groups, LR and
        # state_dict are the normal step's; updating `p` in place is safe: its graph uses are done
        trainer.optimizers[0].step()
        p.grad = None

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()

    @staticmethod
    def conflicts(trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """Every reason this Trainer/module cannot step in backward (empty when it can)."""
        problems = []
        strategy = trainer.strategy
        name = type(strategy).__name__
        if isinstance(strategy, HostMastersStrategy):
            problems.append(
                "under `strategy='lowmem_offload'` the optimizer steps host masters; use "
                "`OffloadStrategy(optimizer_in_backward=True)` instead of this callback"
            )
        elif not isinstance(strategy, SingleDeviceStrategy):
            reason = (
                "DDP reduces gradients in buckets after the per-parameter hook fires and keeps them in "
                "persistent buffers, so the step would see unreduced gradients and save no memory"
                if isinstance(strategy, DDPStrategy) and not isinstance(strategy, (DeepSpeedStrategy, XLAStrategy))
                else "it manages gradients or the optimizer itself"
            )
            problems.append(f"strategy `{name}` is not supported ({reason}); use a single device")
        if trainer.accumulate_grad_batches != 1:
            problems.append(
                f"`accumulate_grad_batches={trainer.accumulate_grad_batches}`: the step in backward cannot "
                "accumulate gradients; set it to 1"
            )
        if trainer.gradient_clip_val and (trainer.gradient_clip_algorithm or "norm") == "norm":
            problems.append(
                f"`gradient_clip_val={trainer.gradient_clip_val}` with clipping by norm: the global norm needs "
                "every gradient before the first step (a second backward pass, not implemented); remove it or "
                "use `gradient_clip_algorithm='value'`, which is applied per parameter"
            )
        if not pl_module.automatic_optimization:
            problems.append("manual optimization: you call `optimizer.step()` yourself; remove the callback")
        problems += lightning_callback_problems(trainer, pl_module, "the step in backward")
        for hook in ("optimizer_step", "configure_gradient_clipping"):
            if is_overridden(hook, pl_module):
                problems.append(
                    f"`{type(pl_module).__name__}.{hook}` is overridden, but the parameters are updated during "
                    "backward, before it runs; remove the override or the callback"
                )
        precision = trainer.precision_plugin
        if isinstance(precision, MixedPrecision) and precision.scaler is not None:
            problems.append(
                "`precision='16-mixed'` scales the loss and unscales gradients only before the normal step; "
                "use `precision='bf16-mixed'` or `'bf16-true'`"
            )
        return problems

"""The precision side of ``lowmem_offload``: Lightning's half and mixed precision, stepping fp32 host masters."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.roles import HostMastersStrategy
from lightning_lowmem.strategies.offload.loss_scaler import DynamicLossScaler

log = logging.getLogger(__name__)

PrecisionName = Literal["bf16-true", "16-true", "bf16-mixed", "16-mixed", "32-true"]
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}
_SCALER_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


def _grads_view(module: pl.LightningModule, *hooks: str) -> AbstractContextManager:
    """The strategy's view of the masters with their gradients, when the module or a callback overrides ``hooks``."""
    trainer = lightning_internals.attached_trainer(module)
    strategy = trainer.strategy if trainer is not None else None
    if not isinstance(strategy, HostMastersStrategy):
        return nullcontext()
    overridden = any(is_overridden(h, module, pl.LightningModule) for h in hooks) or any(
        is_overridden(h, cb, Callback) for cb in trainer.callbacks for h in hooks if h.startswith("on_"))
    return strategy.masters_view(grads=True) if overridden else nullcontext()


class MasterHalfPrecision(Reproducible, Precision):
    """Compute weights in the compute dtype on the device, fp32 masters on the host; fp16 dynamic loss scaling.

    * ``"bf16-true"`` / ``"16-true"``: the module (weights, buffers, inputs) in that dtype, as Lightning's
      ``HalfPrecision``: 2 B/param of device weights. The fp32 masters keep every update (an update below half a bf16
      ulp is lost by plain ``bf16-true``).
    * ``"bf16-mixed"`` / ``"16-mixed"``: Lightning's ``MixedPrecision`` (``torch.autocast``): the compute weights stay
      fp32 on the device (4 B/param), gradients bit for bit plain mixed precision's.
    * ``"32-true"``: no cast; only gradients and optimizer state leave the device.
    * fp16 (``"16-*"``): dynamic loss scaling; an overflow in any master gradient skips the step and multiplies the
      scale by ``backoff_factor``. The scaler's state is checkpointed; ``lowmem/loss_scale`` and
      ``lowmem/skipped_steps`` are logged every optimizer step.

    Memory: none of its own (the strategy keeps the masters). Cost: fp16 checks every master gradient for inf/nan at
    each step (one vectorised pass on the host).

    Args:
        precision: one of ``"bf16-true"``, ``"16-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``.
        init_scale, growth_factor, backoff_factor, growth_interval: the fp16 loss scaler (ignored
            otherwise), see :class:`~lightning_lowmem.strategies.offload.loss_scaler.DynamicLossScaler`.

    Example:
        >>> from lightning_lowmem import MasterHalfPrecision
        >>> trainer = L.Trainer(strategy="lowmem_offload", plugins=[MasterHalfPrecision("16-mixed", init_scale=2**12)])
        >>> trainer.precision_plugin  # doctest: +NORMALIZE_WHITESPACE
        MasterHalfPrecision(precision='16-mixed', scaler=DynamicLossScaler(scale=4096, growth_factor=2,
            backoff_factor=0.5, growth_interval=2000, overflows=0))
    """

    def __init__(
        self,
        precision: PrecisionName = "bf16-true",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"Passed `MasterHalfPrecision(precision={precision!r})`; expected one of {', '.join(map(repr, PRECISIONS))}."
            )
        self.precision = precision  # type: ignore[assignment]
        self.compute_dtype: torch.dtype = _DTYPES[precision.split("-")[0]]
        self.mixed = precision.endswith("-mixed")
        self.scaler: DynamicLossScaler | None = (
            DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval)
            if self.compute_dtype == torch.float16 else None
        )
        given = {k: v for k, v in zip(_SCALER_DEFAULTS, (init_scale, growth_factor, backoff_factor, growth_interval))
                 if v != _SCALER_DEFAULTS[k]}
        if given and self.scaler is None:
            rank_zero_warn(
                f"MasterHalfPrecision: {', '.join(f'`{k}={v!r}`' for k, v in given.items())} set the fp16 loss scaler; "
                f"`precision={precision!r}` has none (bf16 and fp32 have fp32's range), so they are ignored. Remove "
                "them, or use a '16-true'/'16-mixed' precision."
            )
        # the device type autocast runs on; the strategy sets it in `setup` (it knows the root device)
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._view: Any = None  # while the gradient hooks run: the strategy's open view of the masters (or None)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the compute weights on the device: the compute dtype under ``*-true``, fp32 otherwise."""
        return torch.float32 if self.mixed else self.compute_dtype

    @override
    def connect(self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> tuple[Module, list[Optimizer], list[Any]]:
        trainer = lightning_internals.attached_trainer(model)
        if trainer is None or not isinstance(trainer.strategy, HostMastersStrategy):
            raise ValueError(
                "`MasterHalfPrecision` keeps no fp32 masters itself; without them the optimizer would step the "
                "half-precision weights directly. Use it with `strategy='lowmem_offload'` (or use Lightning's own "
                "`precision='bf16-true'` with another strategy)."
            )
        return model, optimizers, lr_schedulers

    @override
    def convert_module(self, module: Module) -> Module:
        """Cast ``module`` in place to the compute dtype under ``*-true`` (the Parameter objects are kept)."""
        if self.weight_dtype != torch.float32:
            module.to(dtype=self.compute_dtype)
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        # NOTE: modules are built in fp32: masters copied from a half-precision init would have lost their low bits
        return nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return nullcontext()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.mixed:
            # NOTE: cache_enabled=False as in Lightning's MixedPrecision
            with torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False):
                yield
            return
        # NOTE: "32-true" casts nothing, so it does not touch the default dtype either (a user's float64 default stays)
        with lightning_internals.DtypeContextManager(self.compute_dtype) if self.compute_dtype != torch.float32 else nullcontext():
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.weight_dtype == torch.float32:
            return data  # autocast casts per op
        return apply_to_collection(data, function=lightning_internals.convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    @override
    def main_params(self, optimizer: Optimizer) -> list[Tensor]:  # type: ignore[override]
        """The parameters the optimizer steps: under ``lowmem_offload``, the fp32 host masters."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run the closure, unscale and check (fp16), call ``on_before_optimizer_step`` and clip, then step (an overflow
        or a skipped backward skips the step, as Lightning's ``MixedPrecision``)."""
        closure_result = closure()
        found_inf = self.scaler is not None and self.scaler.unscale_(
            [p.grad for p in self.main_params(optimizer) if p.grad is not None])
        self._after_closure(model, optimizer)
        if found_inf:
            self._overflowed(optimizer, model)
            return closure_result
        if closure_result is None and model.automatic_optimization:
            return closure_result
        out = optimizer.step(**kwargs)
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
            self._log_scale(model)
        return closure_result if out is None else out

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        with _grads_view(module, "on_after_backward"):
            return super().post_backward(tensor, module)

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Optimizer) -> None:  # type: ignore[override]
        # NOTE: user code in `on_before_optimizer_step`/`configure_gradient_clipping` must see the masters' gradients
        with _grads_view(model, "on_before_optimizer_step", "configure_gradient_clipping") as view:
            self._view = view
            try:
                lightning_internals.precision_after_closure(self, model, optimizer)
            finally:
                self._view = None

    @override
    def clip_gradients(self, optimizer: Optimizer, clip_val: float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if self._view is not None:
            self._view.sync_grads()  # NOTE: a gradient a hook dropped or replaced through the module's parameter
        # NOTE: no gradient left (``optimizer_in_backward``): torch's foreach clip refuses an empty list
        if any(p.grad is not None for p in self.main_params(optimizer)):
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def _overflowed(self, optimizer: Optimizer, model: pl.LightningModule) -> None:
        assert self.scaler is not None
        old = self.scaler.scale
        self.scaler.update(found_inf=True)
        log.info(
            "fp16 gradient overflow (inf/nan): skipped the optimizer step at global step %s and lowered the loss scale "
            "from %g to %g (%d step(s) skipped so far).",
            model.trainer.global_step if lightning_internals.attached_trainer(model) is not None else "?",
            old, self.scaler.scale, self.scaler.overflows,
        )  # fmt: skip
        for p in self.main_params(optimizer):
            p.grad = None  # NOTE: never let an inf/nan gradient reach the masters or the optimizer state
        self._log_scale(model)

    def _log_scale(self, model: pl.LightningModule) -> None:
        if self.scaler is None or lightning_internals.attached_trainer(model) is None:
            return
        model.log("lowmem/loss_scale", self.scaler.scale, on_step=True, on_epoch=False, batch_size=1)
        model.log("lowmem/skipped_steps", float(self.scaler.overflows), on_step=True, on_epoch=False, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, scaler={self.scaler!r})"

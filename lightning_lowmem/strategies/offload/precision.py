"""The precision side of ``lowmem_offload``: compute dtype on the device, fp32 masters on the host.

:class:`MasterHalfPrecision` casts the module to the compute dtype, runs forward under that dtype
(``*-true``) or under autocast (``*-mixed``), scales the loss for fp16, and at the optimizer step
unscales the *master* gradients, skips the step on an overflow and clips on the masters. It never
allocates the masters itself: :class:`~lightning_lowmem.strategies.offload.strategy.OffloadStrategy` keeps
them and re-points the optimizer at them, so ``main_params(optimizer)`` are the masters.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.nn import Module, Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.optional import loaded_class
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.strategies.offload.loss_scaler import DynamicLossScaler

if TYPE_CHECKING:
    from lightning_lowmem.strategies.offload.masters_view import MastersView

log = logging.getLogger(__name__)

PrecisionName = Literal["bf16-true", "16-true", "bf16-mixed", "16-mixed", "32-true"]
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONV_FORWARDS = tuple(c.forward for c in _CONV)
_MHA_PROJECTIONS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _casts_at_every_use(module: Module, name: str) -> bool:
    """Whether ``module``'s own forward passes its parameter ``name`` only to ops in autocast's lower-precision list."""
    forward = type(module).forward
    if isinstance(module, nn.Linear):
        return forward is nn.Linear.forward and name in ("weight", "bias")
    if isinstance(module, _CONV):
        return forward in _CONV_FORWARDS and name in ("weight", "bias")
    if isinstance(module, nn.MultiheadAttention):
        # NOTE: only the input projections (F.linear); `bias_k`/`bias_v` are concatenated, not multiplied
        return forward is nn.MultiheadAttention.forward and name in _MHA_PROJECTIONS
    # Hugging Face's GPT-2-style `Conv1D` is `torch.addmm(bias, x, weight)` (NOTE: a module holding one has imported
    # transformers' `pytorch_utils`; looked up there, never imported)
    conv1d = loaded_class("transformers.pytorch_utils", "Conv1D")
    return conv1d is not None and isinstance(module, conv1d) and forward is conv1d.forward and name in ("weight", "bias")


def _read_by_adapter_layers(module: Module) -> set[int]:
    """Ids of the parameters that a PEFT adapter layer's own forward reads directly (their ``dtype`` or values).

    PEFT's LoRA layer casts its input to ``lora_A.weight.dtype`` before the adapter's dropout (so the dropout
    would run in bf16 here and in fp32 under plain mixed precision), its variants (DoRA) read the base layer's
    weight to build the update, and other adapter types compute with their weights outside ``F.linear``. So every
    parameter of an adapter layer keeps fp32 except a plain LoRA layer's base layer, which the layer only calls
    (``self.base_layer(x)``): that one follows the usual rule (its ``nn.Linear`` weight in the compute dtype).
    """
    # NOTE: looked up in `sys.modules`, never imported: a module holding PEFT layers has imported peft already
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:
        return set()
    lora = sys.modules.get("peft.tuners.lora.layer")
    read: set[int] = set()
    for sub in module.modules():
        if not isinstance(sub, tuners.BaseTunerLayer):
            continue
        base = sub.get_base_layer()
        plain_lora = (lora is not None and isinstance(sub, lora.LoraLayer) and not getattr(sub, "lora_variant", None)
                      and not any(getattr(sub, "use_dora", {}).values()))
        called_only = {id(p) for p in base.parameters()} if plain_lora and base is not sub else set()
        read |= {id(p) for p in sub.parameters() if id(p) not in called_only}
    return read


def _compiled_params(module: Module) -> set[int]:
    """Ids of the parameters of ``torch.compile``-d modules (``torch.compile(m)`` wrappers and ``m.compile()``).

    NOTE: inductor compiles autocast's cast of an fp32 weight together with its use: the fused kernel may add an
    fp32 bias without rounding it to bf16 first, so plain compiled mixed precision is not eager autocast's rounding,
    and a bf16 copy of the weight would give another result (|diff|/|update| ~5e-4 after 3 steps). These keep fp32:
    the compiled graph is traced on the same fp32 weights as under plain mixed precision.
    NOTE: private torch API behind ``_internals.torch.is_compiled_module``; no public way to ask.
    """
    out: set[int] = set()
    for sub in module.modules():
        if torch_internals.is_compiled_module(sub):
            out |= {id(p) for p in sub.parameters()}
    return out


def _dtype_pinning_params(module: Module) -> set[int]:
    """Ids of the parameters under modules that pin their own floating dtype (a ``torch.dtype`` in their ``dtype``
    attribute: Hugging Face's Switch/MoE routers keep ``router_dtype`` and run ``self.classifier.to(self.dtype)`` and
    ``x.to(self.dtype)`` in forward).

    NOTE: under plain mixed precision those weights are fp32 and such a module computes exactly in fp32; a
    compute-dtype copy would be cast up from its bf16 rounding by the module's own ``.to`` (|diff|/|update| 0.63 on
    Switch Transformers' router after 3 steps). They keep fp32.
    """
    out: set[int] = set()
    for sub in module.modules():
        pinned = sub.__dict__.get("dtype")
        if isinstance(pinned, torch.dtype) and pinned.is_floating_point:
            out |= {id(p) for p in sub.parameters()}
    return out


def autocast_cast_params(module: Module) -> list[Parameter]:
    """The floating-point parameters of ``module`` that ``torch.autocast`` casts to the compute dtype at every use.

    A parameter qualifies when every module that owns it (tied weights have several owners) hands it only to
    an op of autocast's lower-precision list (linear, convolution, addmm; the same on CPU and CUDA). Storing
    such a parameter in the compute dtype changes nothing in the forward: autocast would round it the same way.
    A parameter used elsewhere too (an embedding tied to an LM head, a LayerNorm weight, ``x * self.scale``)
    does not qualify and keeps fp32, where plain mixed precision keeps it; so do the parameters of PEFT adapter
    layers, whose forward reads their dtype (see :func:`_read_by_adapter_layers`), and those of modules that pin
    their own dtype (:func:`_dtype_pinning_params`).

    NOTE: other code that reads a qualifying ``linear.weight`` directly (its ``dtype``, or its values outside
    ``linear(x)``) sees the compute dtype here and fp32 under plain mixed precision; a use of its values in the first
    training step is refused (:mod:`~lightning_lowmem.strategies.offload.mixed_check`), its ``dtype`` is the difference.
    """
    yes: dict[int, Parameter] = {}
    no: set[int] = _read_by_adapter_layers(module) | _compiled_params(module) | _dtype_pinning_params(module)
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            if p.is_floating_point() and _casts_at_every_use(sub, name):
                yes[id(p)] = p
            else:
                no.add(id(p))
    return [p for key, p in yes.items() if key not in no]


def _overridden(module: pl.LightningModule, hooks: tuple[str, ...]) -> bool:
    """Whether ``module`` or one of its Trainer's callbacks implements one of ``hooks``."""
    callbacks = module.trainer.callbacks if lightning_internals.attached_trainer(module) is not None else []
    return any(is_overridden(h, module, pl.LightningModule) for h in hooks) or any(
        is_overridden(h, cb, Callback) for cb in callbacks for h in hooks if h.startswith("on_"))


_SCALER_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


class MasterHalfPrecision(Reproducible, Precision):
    """Half-precision compute weights with fp32 masters kept by the strategy; fp16 dynamic loss scaling.

    Memory: the device holds only the compute weights (2 B/param for bf16/fp16); the fp32 masters
    (4 B/param), their gradients and the optimizer state are on the host (see ``OffloadStrategy``).
    Cost: fp16 runs a host-side inf/nan check over every gradient at each step.

    * ``"bf16-true"`` / ``"16-true"``: weights, activations and inputs in that dtype.
    * ``"bf16-mixed"`` / ``"16-mixed"``: plain Lightning mixed precision (fp32 module under
      ``torch.autocast``), with the weights autocast would cast at every use stored in the compute dtype:
      the parameters of ``nn.Linear``, ``nn.Conv*``/``nn.ConvTranspose*`` (forward not overridden), the
      input projections of ``nn.MultiheadAttention`` and Hugging Face's ``Conv1D`` (see
      :func:`autocast_cast_params`). Everything else stays fp32: norm layers, embeddings, tied weights,
      custom parameters, the weights of PEFT adapter layers (LoRA reads ``lora_A.weight.dtype``), the weights of
      ``torch.compile``-d modules (inductor fuses the cast with its use) and every buffer. The forward is therefore the same computation as plain ``*-mixed`` (the stored copy is the
      rounding autocast would make), and a module that runs under plain mixed precision runs here (an fp32
      buffer or tensor meets fp32 LayerNorm weights, as there). Gradients are bit-identical to plain mixed
      precision, also for a layer called several times in one step (a GAN's discriminator on real and
      fake images, ALBERT's shared layer): its contributions are summed in fp32 as there
      (:mod:`~lightning_lowmem.strategies.offload.reused_grads`), except where other code reads a stored weight's
      ``dtype`` or values outside its layer's call (a wrapper's forward casting its input to
      ``linear.weight.dtype`` before other ops): it sees the compute dtype here, fp32 there.
      Device weights: 2 B/param for those layers, 4 B/param for the rest.
    * ``"32-true"``: no cast; only gradients and optimizer state leave the device.
    * fp16 (``"16-*"``): the loss is multiplied by a dynamic scale; an overflow (an inf or nan in
      any master gradient after accumulation) skips the step, multiplies the scale by
      ``backoff_factor`` and is logged; the masters never see an inf or nan. The scaler's state is
      saved in the checkpoint under the key ``"MasterHalfPrecision"`` and restored on resume.

    Logged metrics (fp16 only, every optimizer step): ``lowmem/loss_scale``, ``lowmem/skipped_steps``.

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
            if self.compute_dtype == torch.float16
            else None
        )
        given = {k: v for k, v in (("init_scale", init_scale), ("growth_factor", growth_factor),
                                   ("backoff_factor", backoff_factor), ("growth_interval", growth_interval))
                 if v != _SCALER_DEFAULTS[k]}
        if given and self.scaler is None:
            rank_zero_warn(
                f"MasterHalfPrecision: {', '.join(f'`{k}={v!r}`' for k, v in given.items())} set the fp16 loss scaler; "
                f"`precision={precision!r}` has none (bf16 and fp32 have fp32's range), so they are ignored. Remove "
                "them, or use a '16-true'/'16-mixed' precision."
            )
        # the device type autocast runs on; the strategy sets it in `setup` (it knows the root device)
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.last_step_skipped = False
        self._skip_clipping = False
        # the overlapped host pass (strategies/offload/host_pass.py): whether it stood in for the clip / the unscale
        self.clip_check: Callable[[float, Any], bool] | None = None
        self.unscale_check: Callable[[], bool] | None = None
        self._attached = False  # see `attach`: OffloadStrategy keeps the masters this plugin steps
        self._drain: Callable[[], None] | None = None
        self._view: MastersView | None = None
        self.cast_params: list[Parameter] = []  # under *-mixed: the weights stored in the compute dtype

    def attach(self, *, drain: Callable[[], None], view: MastersView) -> None:
        """Called by ``OffloadStrategy.setup``, which keeps the fp32 masters this plugin steps.

        ``drain`` folds every gradient still in flight into the masters (called before ``on_after_backward``);
        ``view`` shows the masters and their gradients through the module's parameters while the gradient hooks
        run (``strategies/offload/masters_view.py``).
        """
        self._attached = True
        self._drain = drain
        self._view = view

    def step_hooks(self, model: pl.LightningModule, optimizer: Optimizer, *, clip: bool = True) -> None:
        """Run what Lightning runs between the closure and the step: ``on_before_optimizer_step`` and the gradient
        clipping (``configure_gradient_clipping``), on the masters; ``clip=False`` leaves the clipping out (the
        strategy's ``optimizer_in_backward`` clips each gradient by value before its step)."""
        self._skip_clipping = not clip
        try:
            self._after_closure(model, optimizer)
        finally:
            self._skip_clipping = False

    @override
    def connect(self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> tuple[Module, list[Optimizer], list[Any]]:
        if not self._attached:
            raise ValueError(
                "`MasterHalfPrecision` keeps no fp32 masters itself; without them the optimizer would step the "
                "half-precision weights directly. Use it with `strategy='lowmem_offload'` (or use Lightning's own "
                "`precision='bf16-true'` with another strategy)."
            )
        return model, optimizers, lr_schedulers

    # --- the module and the forward ---------------------------------------------------------------
    @override
    def convert_module(self, module: Module) -> Module:
        """Cast ``module`` in place: all of it under ``*-true``; under ``*-mixed`` only :func:`autocast_cast_params`.

        NOTE: in place (the Parameter objects are kept), so optimizers and hooks that hold them stay valid;
        strategies that ignore the return value (DDP's) still see the cast.
        """
        if self.compute_dtype == torch.float32:
            return module
        if not self.mixed:
            module.to(dtype=self.compute_dtype)
            return module
        self.cast_params = autocast_cast_params(module)  # NOTE: their uses are checked on the first step (mixed_check.py)
        with torch.no_grad():
            for p in self.cast_params:
                p.data = p.data.to(self.compute_dtype)
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        # NOTE: modules are built in fp32 on purpose: the masters are copied from them, and a model
        # initialised in half precision would give masters that already lost their low bits.
        return nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return nullcontext()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.mixed:
            # NOTE: cache_enabled=False as in Lightning's MixedPrecision: a cached cast would outlive an in-place
            # update of its fp32 weight inside one training_step (manual optimization), and the same fp32 tensor
            # cast at each use has its gradients summed in fp32, as under plain mixed precision.
            with torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False):
                yield
            return
        # NOTE: "32-true" casts nothing, so it does not touch the default dtype either (a user's float64 default stays)
        with lightning_internals.DtypeContextManager(self.compute_dtype) if self.compute_dtype != torch.float32 else nullcontext():
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.mixed or self.compute_dtype == torch.float32:
            return data  # autocast casts per op
        return apply_to_collection(data, function=lightning_internals.convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype)

    # --- backward and step ---------------------------------------------------------------------------
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self._drain is not None:
            self._drain()  # NOTE: [drain before user code] before Lightning's `on_after_backward` hooks run
        with self._grad_view(module, "on_after_backward"):
            return super().post_backward(tensor, module)

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Optimizer) -> None:  # type: ignore[override]
        # NOTE: `on_before_optimizer_step` and `configure_gradient_clipping` run here: user code in them reads and
        # clips `p.grad` of the module's parameters, which must be the gradients the optimizer steps (the masters')
        with self._grad_view(model, "on_before_optimizer_step", "configure_gradient_clipping"):
            lightning_internals.precision_after_closure(self, model, optimizer)

    def _grad_view(self, module: pl.LightningModule, *hooks: str) -> AbstractContextManager:
        """Under ``OffloadStrategy``, while ``hooks`` run, the module's parameters show the fp32 masters and their
        gradients (strategies/offload/masters_view.py); only when the module or a callback overrides one of them."""
        if self._view is None or not _overridden(module, hooks):
            return nullcontext()
        return self._view.view(grads=True)

    @override
    def main_params(self, optimizer: Optimizer) -> list[Tensor]:  # type: ignore[override]
        """The parameters the optimizer steps: under ``lowmem_offload``, the fp32 host masters."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> bool:
        """Unscale the gradients of ``optimizer``'s parameters (fp16); return whether one overflowed."""
        if self.scaler is None:
            return False
        if self.unscale_check is not None and self.unscale_check():
            return False  # NOTE: the host pass unscaled copies and found no overflow; a restore unscales these then
        return self.scaler.unscale_([p.grad for p in self.main_params(optimizer) if p.grad is not None])

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        step_fn: Callable[[Optimizer], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure, unscale and check (fp16), call ``on_before_optimizer_step`` and clip, then step.

        ``step_fn(optimizer)`` replaces ``optimizer.step()`` (the strategy's host step); an overflow or a
        skipped backward (``training_step`` returned None) skips it.
        """
        closure_result = closure()
        found_inf = self.unscale_gradients(optimizer)
        # NOTE: a norm over inf/nan gradients is meaningless; the step is skipped
        self.step_hooks(model, optimizer, clip=not found_inf)
        skipped_backward = closure_result is None and model.automatic_optimization
        self.last_step_skipped = found_inf or skipped_backward
        if found_inf:
            assert self.scaler is not None
            old = self.scaler.scale
            self.scaler.update(found_inf=True)
            log.info(
                "fp16 gradient overflow (inf/nan): skipped the optimizer step at global step %s and lowered the loss "
                "scale from %g to %g (%d step(s) skipped so far).",
                model.trainer.global_step if lightning_internals.attached_trainer(model) is not None else "?",
                old,
                self.scaler.scale,
                self.scaler.overflows,
            )
            for p in self.main_params(optimizer):
                p.grad = None  # NOTE: never let an inf/nan gradient reach the masters or the optimizer state
            self._log_scale(model)
            return closure_result
        if skipped_backward:
            return closure_result
        out = step_fn(optimizer) if step_fn is not None else optimizer.step(**kwargs)
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
            self._log_scale(model)
        return closure_result if out is None else out

    def _log_scale(self, model: pl.LightningModule) -> None:
        if self.scaler is None or lightning_internals.attached_trainer(model) is None:
            return
        model.log("lowmem/loss_scale", self.scaler.scale, on_step=True, on_epoch=False, batch_size=1)
        model.log("lowmem/skipped_steps", float(self.scaler.overflows), on_step=True, on_epoch=False, batch_size=1)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if self._skip_clipping:
            return
        if self.clip_check is not None and clip_val > 0 and self.clip_check(clip_val, gradient_clip_algorithm):
            return  # NOTE: the host pass stepped already and this clip would multiply by 1.0 (no bit changes)
        if self._view is not None:
            self._view.sync_grads()  # NOTE: a gradient a hook replaced through the module's parameter is clipped
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    # --- checkpoint -------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, scaler={self.scaler!r})"

"""``lowmem_offload``: half-precision compute weights on the accelerator; fp32 masters, gradients and optimizer on the host.

The flow of one optimizer step (see ``DESIGN.md``):

1. ``setup``: the user's optimizer is built by ``configure_optimizers`` over the fp32 module; the fp32
   weights are copied once to the host as masters; the optimizer's param groups are re-pointed at
   the masters (same optimizer object, so LR schedulers keep working); the module is cast to the
   compute dtype and moved to the accelerator.
2. Forward and backward run on the accelerator. As each parameter's gradient is ready
   (``register_post_accumulate_grad_hook``) it leaves the device (pinned staging + side stream on
   CUDA) and is added into an fp32 host buffer, the master's ``.grad``; the device gradient is freed
   at once. Accumulation over ``accumulate_grad_batches`` adds on the host; nothing goes back.
3. Step (``MasterHalfPrecision.optimizer_step``): unscale and check for inf/nan (fp16), clip on the
   masters, run the optimizer on the host, copy the masters back into the compute weights.
4. Checkpoints are Lightning's single file holding the fp32 masters and the host optimizer state.
"""

from __future__ import annotations

import functools
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem._compat import Reproducible
from lightning_lowmem.memory.categories import (
    MemoryBreakdown,
    mark_host,
    module_grad_bytes,
    module_weight_bytes,
    optimizer_state_bytes,
    unique_storage_bytes,
)
from lightning_lowmem.precision.master_half import PRECISIONS, MasterHalfPrecision
from lightning_lowmem.strategies import _host_optimizer
from lightning_lowmem.strategies._atomic_checkpoint_io import AtomicCheckpointIO
from lightning_lowmem.strategies._host_optimizer import HOST_OPTIMIZERS, HostOptimizer
from lightning_lowmem.strategies._host_transfer import HostTransfer, transfer_for

_GiB = 1024**3


class OffloadStrategy(Reproducible, SingleDeviceStrategy):
    """CPU-master training on one device: only the compute weights (and activations) stay on the accelerator.

    Memory on the device: 2 B/param for bf16/fp16 compute weights (4 B for ``"32-true"``) plus
    activations and one parameter's gradient at a time, against 16 B/param for plain fp32 AdamW.
    On the host: fp32 masters (4 B/param), fp32 gradient buffers (4 B/param, none with
    ``optimizer_in_backward``), the optimizer state (8 B/param for Adam), and on CUDA pinned staging
    buffers in the compute dtype (2 B/param). Cost: 2 B/param over PCIe each way per step and the
    host optimizer step (memory-bandwidth bound, ~28 B touched per parameter for AdamW).

    Precision is the Trainer's ``precision`` flag: ``"bf16-true"``, ``"16-true"``, ``"bf16-mixed"``,
    ``"16-mixed"`` or ``"32-true"`` (see :class:`~lightning_lowmem.precision.master_half.MasterHalfPrecision`;
    fp16 uses dynamic loss scaling that skips overflowing steps). Any torch optimizer and LR scheduler
    from ``configure_optimizers`` keeps working; gradient clipping (norm and value) and gradient
    accumulation work on the masters. Manual optimization works (``manual_backward``,
    ``opt.step()``, ``opt.zero_grad()``, ``self.clip_gradients``) in bf16 and fp32; the module's own
    parameters never hold a ``.grad`` (read the masters' gradients through :attr:`masters`).

    Args:
        optimizer_in_backward: step each master on the host as soon as its gradient is ready and
            free that gradient (no host gradient buffers: -4 B/param of host memory). Needs
            ``accumulate_grad_batches=1``, no norm clipping (value clipping works), bf16 or fp32, and
            automatic optimization.
        host_optimizer: ``"auto"`` runs ``torch.optim.Adam``/``AdamW`` with torch's fused CPU kernel
            (same update rule, rounding differs by a few ulp; ~5x the for-loop kernel on the host);
            ``"as_is"`` runs the user's optimizer bit for bit as configured; ``"torch_fused"`` is
            ``"auto"`` but refuses optimizers it cannot fuse.
        check_host_memory: refuse to start when the host lacks the RAM for masters, gradient buffers
            and (estimated) optimizer state, instead of being killed mid-setup.

    Example::

        import lightning as L
        import lightning_lowmem  # registers "lowmem_offload"

        trainer = L.Trainer(strategy="lowmem_offload", precision="bf16-true", accumulate_grad_batches=4,
                            gradient_clip_val=1.0)
        trainer.fit(model)
    """

    strategy_name = "lowmem_offload"

    def __init__(
        self,
        *,
        optimizer_in_backward: bool = False,
        host_optimizer: HostOptimizer = "auto",
        check_host_memory: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if not isinstance(optimizer_in_backward, bool):
            raise TypeError(f"Passed `optimizer_in_backward={optimizer_in_backward!r}`; expected True or False.")
        if host_optimizer not in HOST_OPTIMIZERS:
            raise ValueError(
                f"Passed `host_optimizer={host_optimizer!r}`; expected one of {', '.join(map(repr, HOST_OPTIMIZERS))}."
            )
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.optimizer_in_backward = optimizer_in_backward
        self.host_optimizer = host_optimizer
        self.check_host_memory = check_host_memory
        # NOTE: Lightning fills `parallel_devices` (the accelerator's device) only on strategies that have the
        # attribute; without it a strategy picked by name stays on "cpu" even with accelerator="cuda".
        self.parallel_devices: list[torch.device] | None = None
        self._reset()

    def _reset(self) -> None:
        self._names: list[str] = []
        self._p_device: list[Parameter] = []
        self._p_host: list[Parameter] = []
        self._grad_host: list[Tensor | None] = []
        self._device_index: dict[int, int] = {}  # id(module parameter) -> i
        self._host_index: dict[int, int] = {}  # id(master) -> i
        self._buffers: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (fp32 original on host, value after the cast)
        self._hooks: list[Any] = []
        self._transfer: HostTransfer | None = None
        self._fused: dict[int, tuple[Optimizer, list[dict[str, Any]]]] = {}
        self._owner_cache: tuple[tuple[int, ...], dict[int, tuple[Optimizer, dict[str, Any]]]] | None = None
        self._clip_value: float | None = None
        # NOTE: ids of the masters whose optimizer state is marked host; `mark_host` must not see a tensor twice
        self._state_marked: dict[int, set[int]] = {}

    # --- where things run ------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else self._root_device

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = MasterHalfPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # NOTE: the Trainer's connector assigns its own plugin (HalfPrecision, MixedPrecision, Precision) to a
        # strategy picked by name; translating it here, at assignment, also makes `configure_model` build the
        # module in fp32 (the masters' source) and reports an unsupported precision when the Trainer is built.
        self._precision_plugin = _to_master_precision(plugin)

    @property  # type: ignore[override]
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()  # sets the inner IO only if unset
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    # --- setup -----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._check_trainer(trainer)
        self.accelerator.setup(trainer)
        precision = self.precision_plugin
        assert isinstance(precision, MasterHalfPrecision)
        precision.device_type = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # NOTE: configure_optimizers sees the fp32 module (still on the host); the param groups are
            # re-pointed at the masters below, matching the parameters by identity.
            self.setup_optimizers(trainer)
            for opt in self.optimizers:
                _check_host_can_run(opt, self.host_optimizer)
        self._build_masters(self.model, self.optimizers if fitting else [], with_grads=fitting)
        if fitting:
            for opt in self.optimizers:
                self._repoint(opt)
        self.model = precision.convert_module(self.model)
        for name, (original, _) in self._buffers.items():
            self._buffers[name] = (original, self.model.get_buffer(name).detach().to("cpu", copy=True))
        self.model_to_device()
        self.model = self._setup_model(self.model)
        self._transfer = transfer_for(self.root_device, self._p_device)
        if fitting:
            self._clip_value = (
                float(trainer.gradient_clip_val)
                if self.optimizer_in_backward and trainer.gradient_clip_val
                else None
            )
            sink = self._step_in_backward if self.optimizer_in_backward else self._fold
            for i, p in enumerate(self._p_device):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i, sink)))
        precision._attached = True
        self.setup_precision_plugin()
        # NOTE: no `_optimizers_to_device(root_device)`: the optimizer state belongs on the host.

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._p_host:  # masters exist already (a later call): point the new optimizers at them
            for opt in self.optimizers:
                self._repoint(opt)

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        problems: list[str] = []
        module = self.lightning_module
        assert module is not None
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            problems.append(
                f"it runs on the 'cpu' or 'cuda' accelerator, got `{type(self.accelerator).__name__}`; "
                "pass `accelerator='cuda'` (or 'cpu')"
            )
        if self.parallel_devices and len(self.parallel_devices) > 1:
            problems.append(
                f"it trains on one device, got {len(self.parallel_devices)} ({self.parallel_devices}); pass `devices=1` "
                "(for several GPUs use `strategy='lowmem_zero2_offload'`)"
            )
        if not any(p.is_floating_point() for p in module.parameters()):
            problems.append(
                f"`{type(module).__name__}` has no floating-point parameters, so there are no weights to keep "
                "masters of; create the layers in `__init__` or `configure_model`"
            )
        fp16 = self.precision_plugin.precision.startswith("16-")  # type: ignore[union-attr]
        if fp16 and not module.automatic_optimization and trainer.state.fn == TrainerFn.FITTING:
            problems.append(
                "manual optimization with fp16 is not supported: your code would read loss-scaled gradients; "
                "use precision='bf16-true'/'bf16-mixed'/'32-true' (manual_backward, opt.step(), opt.zero_grad() and "
                "self.clip_gradients work there)"
            )
        if self.optimizer_in_backward and trainer.state.fn == TrainerFn.FITTING:
            if trainer.accumulate_grad_batches != 1:
                problems.append(
                    f"`optimizer_in_backward=True` steps each parameter during backward, so it cannot accumulate: "
                    f"remove `accumulate_grad_batches={trainer.accumulate_grad_batches}` or set `optimizer_in_backward=False`"
                )
            algorithm = trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM
            if trainer.gradient_clip_val and GradClipAlgorithmType(algorithm) == GradClipAlgorithmType.NORM:
                problems.append(
                    "`optimizer_in_backward=True` cannot clip by the global norm (it is known only after every "
                    f"parameter has stepped): remove `gradient_clip_val={trainer.gradient_clip_val}`, use "
                    "`gradient_clip_algorithm='value'`, or set `optimizer_in_backward=False`"
                )
            if fp16:
                problems.append(
                    "`optimizer_in_backward=True` cannot use fp16: an overflow must skip the whole step, but "
                    "parameters would already have stepped; use 'bf16-true'/'bf16-mixed'/'32-true'"
                )
            if not module.automatic_optimization:
                problems.append("`optimizer_in_backward=True` needs automatic optimization (the step happens in backward)")
        if problems:
            raise ValueError(
                f"`{type(self).__name__}` (strategy='lowmem_offload') cannot run this configuration:\n- "
                + "\n- ".join(problems)
            )

    # --- masters ---------------------------------------------------------------------------------------
    def _unique_params(self, module: torch.nn.Module) -> Iterator[tuple[str, Parameter]]:
        for name, p in module.named_parameters():  # NOTE: de-duplicates tied weights (GPT-2 wte/lm_head)
            if p.is_floating_point():
                yield name, p

    def host_bytes_needed(
        self, module: torch.nn.Module, optimizers: list[Optimizer], with_grads: bool = True
    ) -> dict[str, int]:
        """Host bytes the strategy will allocate for ``module`` and ``optimizers`` (state estimated), by part."""
        numel = sum(p.numel() for _, p in self._unique_params(module))
        trainable = sum(p.numel() for _, p in self._unique_params(module) if p.requires_grad)
        dtype = self.precision_plugin.compute_dtype  # type: ignore[attr-defined]
        parts = {
            "masters": 4 * numel,
            "gradient_buffers": 4 * trainable if with_grads and not self.optimizer_in_backward else 0,
            "optimizer_state": sum(_state_bytes_estimate(opt) for opt in optimizers),
            # on CUDA: pinned staging in the compute dtype; on CPU: the compute weights share host RAM
            "staging_or_compute_weights": torch.tensor([], dtype=dtype).element_size() * numel,
        }
        parts["total"] = sum(parts.values())
        return parts

    def _build_masters(self, module: torch.nn.Module, optimizers: list[Optimizer], with_grads: bool) -> None:
        if self.check_host_memory:
            need = self.host_bytes_needed(module, optimizers, with_grads)
            available = psutil.virtual_memory().available
            if need["total"] > available:
                detail = ", ".join(f"{k} {v / _GiB:.2f} GiB" for k, v in need.items() if k != "total")
                raise MemoryError(
                    f"`OffloadStrategy` needs {need['total'] / _GiB:.2f} GiB of host RAM for this model ({detail}) but "
                    f"only {available / _GiB:.2f} GiB is available. Free host memory, use a smaller model, use "
                    "`optimizer_in_backward=True` (no gradient buffers) or an 8-bit optimizer (`LowBitOptimizer`), "
                    "or pass `check_host_memory=False` to try anyway."
                )
        self._reset()
        for i, (name, p) in enumerate(self._unique_params(module)):
            p_host = Parameter(p.detach().to("cpu", torch.float32, copy=True), requires_grad=p.requires_grad)
            self._names.append(name)
            self._p_device.append(p)
            self._p_host.append(p_host)
            self._device_index[id(p)] = i
            self._host_index[id(p_host)] = i
            grad = torch.empty_like(p_host) if with_grads and p.requires_grad and not self.optimizer_in_backward else None
            self._grad_host.append(grad)
        mark_host(*self._p_host, *(g for g in self._grad_host if g is not None))
        precision = self.precision_plugin
        # NOTE: under "*-mixed" buffers keep fp32 (see MasterHalfPrecision.convert_module): nothing to restore
        if precision.compute_dtype != torch.float32 and not precision.mixed:  # type: ignore[attr-defined]
            for name, b in module.named_buffers():
                if b.is_floating_point():
                    self._buffers[name] = (b.detach().to("cpu", copy=True), b)

    def _repoint(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s param groups at the masters; move any state it has to the host."""
        for g, group in enumerate(optimizer.param_groups):
            params = []
            for p in group["params"]:
                if id(p) in self._host_index:
                    params.append(p)
                    continue
                i = self._device_index.get(id(p))
                if i is None:
                    raise ValueError(
                        f"`{type(optimizer).__name__}` param group {g} holds a tensor of shape {tuple(p.shape)} that is "
                        "not a parameter of the LightningModule; `lowmem_offload` can only optimize the module's "
                        "parameters (build the optimizer from `self.parameters()` in `configure_optimizers`)."
                    )
                params.append(self._p_host[i])
            group["params"] = params
        if optimizer.state:
            state: defaultdict[Any, Any] = defaultdict(dict)
            for p, s in optimizer.state.items():
                i = self._device_index.get(id(p), self._host_index.get(id(p)))
                key = self._p_host[i] if i is not None else p
                state[key] = {k: v.to("cpu") if isinstance(v, Tensor) else v for k, v in s.items()}
            optimizer.state = state
        if self.host_optimizer != "as_is" and id(optimizer) not in self._fused:
            if _host_optimizer.why_not_fused(optimizer) is None:
                self._fused[id(optimizer)] = (optimizer, _host_optimizer.enable_fused(optimizer))

    @property
    def masters(self) -> dict[str, Parameter]:
        """``{parameter name: fp32 host master}`` (empty outside ``fit``/``validate``/``test``)."""
        return dict(zip(self._names, self._p_host))

    def master_of(self, p_host: Tensor) -> Parameter | None:
        """The module parameter that ``p_host`` is the master of (None if it is not a master)."""
        i = self._host_index.get(id(p_host))
        return self._p_device[i] if i is not None else None

    # --- gradients ---------------------------------------------------------------------------------------
    def _grad_ready(self, i: int, sink: Callable[[int, Tensor], None], p_device: Tensor) -> None:
        grad = p_device.grad
        if grad is None:
            return
        if not self._p_host[i].requires_grad:
            # NOTE: `LightningModule.toggle_optimizer` (manual optimization, e.g. a GAN) turns off `requires_grad`
            # on the parameters of the *optimizers*, i.e. on the masters, not on these device weights; plain Lightning
            # would compute no gradient for them, so the one backward produced here must not reach the master.
            p_device.grad = None
            return
        assert self._transfer is not None
        self._transfer.grad_to_host(i, grad, sink)
        p_device.grad = None  # NOTE: the device gradient is freed here, one parameter at a time

    @torch.no_grad()
    def _fold(self, i: int, grad: Tensor) -> None:
        """Add a gradient (compute dtype, on the host) into master ``i``'s fp32 buffer."""
        p_host = self._p_host[i]
        if p_host.grad is None:  # first micro-batch of the window: the optimizer's zero_grad set it to None
            buf = self._grad_host[i]
            assert buf is not None
            buf.copy_(grad)
            p_host.grad = buf
        else:
            p_host.grad.add_(grad)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # NOTE: sync point (CUDA): every gradient of this backward is on the host before user code
        # (on_after_backward, manual clip_gradients, the step) can read the masters' gradients.
        if self._transfer is not None:
            self._transfer.synchronize()

    # --- the step --------------------------------------------------------------------------------------------
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        precision = self.precision_plugin
        assert isinstance(precision, MasterHalfPrecision)
        if self.optimizer_in_backward:
            out = closure()  # each parameter steps inside backward (see `_step_in_backward`)
            precision._skip_clipping = True  # value clipping happened per parameter; norm clipping is refused
            try:
                precision._after_closure(model, optimizer)  # on_before_optimizer_step hooks; masters hold no gradient
            finally:
                precision._skip_clipping = False
            precision.last_step_skipped = out is None
        else:
            out = precision.optimizer_step(optimizer, model=model, closure=closure, step_fn=self._host_step, **kwargs)
        if not precision.last_step_skipped:
            self._weights_to_device(optimizer)
        return out

    def _host_step(self, optimizer: Optimizer) -> Any:
        """``optimizer.step()`` on the host (with the fused kernel where it applies)."""
        if self.host_optimizer != "as_is" and id(optimizer) not in self._fused:
            # an optimizer swapped in after setup (e.g. by a callback in on_fit_start)
            reason = _host_optimizer.why_not_fused(optimizer)
            if reason is None:
                self._fused[id(optimizer)] = (optimizer, _host_optimizer.enable_fused(optimizer))
            elif self.host_optimizer == "torch_fused":
                raise ValueError(f"`host_optimizer='torch_fused'` cannot run the optimizer: {reason}. Use 'auto'.")
        out = optimizer.step()
        self._mark_state(optimizer)
        return out

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
                f"Master of `{self._names[self._host_index[id(p_host)]]}` is in no optimizer of the strategy; an optimizer "
                "swapped in after setup must hold the masters (`trainer.strategy.optimizers[i].param_groups`)."
            )
        return found

    @torch.no_grad()
    def _step_in_backward(self, i: int, grad: Tensor) -> None:
        """Step master ``i`` alone, now, with the user's optimizer; then free its gradient."""
        p_host = self._p_host[i]
        p_host.grad = grad.to(torch.float32)  # NOTE: a copy for half gradients; aliases an fp32 one (freed below)
        if self._clip_value is not None:
            p_host.grad.clamp_(-self._clip_value, self._clip_value)  # what clip_grad_value_ does, per parameter
        optimizer, group = self._owner(p_host)
        params = group["params"]
        # NOTE: torch optimizers step every parameter of a group that has a gradient; giving the group this
        # one parameter for the call makes the update (state, hyperparameters, schedulers) exactly the usual one.
        group["params"] = [p_host]
        try:
            self._host_step(optimizer)
        finally:
            group["params"] = params
            p_host.grad = None

    def _weights_to_device(self, optimizer: Optimizer) -> None:
        assert self._transfer is not None
        pairs = []
        for group in optimizer.param_groups:
            for p_host in group["params"]:
                i = self._host_index.get(id(p_host))
                if i is None:
                    raise RuntimeError(
                        f"`{type(optimizer).__name__}` holds a tensor of shape {tuple(p_host.shape)} that is not a master "
                        "of `lowmem_offload`; an optimizer swapped in after setup must be built over the masters "
                        "(the param groups of `trainer.strategy.optimizers`)."
                    )
                pairs.append((i, p_host, self._p_device[i]))
        self._transfer.weights_to_device(pairs)

    # --- checkpoints -------------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict with the fp32 masters for the weights (a plain fp32 module loads it)."""
        module = self.lightning_module
        assert module is not None
        state = module.state_dict(keep_vars=True)
        if not self._p_host:
            return OrderedDict((k, v.detach() if isinstance(v, Tensor) else v) for k, v in state.items())
        out: OrderedDict[str, Any] = OrderedDict()
        for key, value in state.items():
            i = self._device_index.get(id(value))
            if i is not None:
                out[key] = self._p_host[i].detach()
            elif key in self._buffers:
                out[key] = self._buffer_fp32(key, value.detach())
            else:
                out[key] = value.detach() if isinstance(value, Tensor) else value
        return out

    def _buffer_fp32(self, name: str, current: Tensor) -> Tensor:
        original, cast = self._buffers[name]
        # NOTE: a buffer unchanged since the cast goes back to its exact fp32 value; one the model updated
        # (running statistics) can only be upcast from its half-precision value.
        if torch.equal(current.to("cpu"), cast):
            return original
        return current.to("cpu", torch.float32)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._p_host:  # loaded after setup: the masters take the checkpoint's fp32 values too
            state = checkpoint["state_dict"]
            with torch.no_grad():
                for name, p_host in zip(self._names, self._p_host):
                    if name in state:
                        p_host.copy_(state[name])

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # NOTE: unlike Strategy's, no `_optimizer_to_device(root_device)`: torch puts the state next to its
        # parameters, which are the host masters.
        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(opt_state)
            if id(optimizer) in self._fused:
                # NOTE: load_state_dict restores the groups' saved `fused`/`foreach` flags too; keep the host kernel
                # this run chose, so a resumed run steps exactly like an uninterrupted one.
                _host_optimizer.enable_fused(optimizer)
            self._mark_state(optimizer, reset=True)  # load_state_dict made new state tensors

    # --- memory report ------------------------------------------------------------------------------------------
    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes of compute weights and gradients on the device; masters, gradients, optimizer state on the host."""
        out = MemoryBreakdown()
        module = self.lightning_module
        if module is not None:
            out.add("device", "weights", module_weight_bytes(module))
            out.add("device", "gradients", module_grad_bytes(module))
        out.add("host", "optimizer_state", unique_storage_bytes(self._p_host))  # fp32 masters
        for opt in self.optimizers:
            out.add("host", "optimizer_state", optimizer_state_bytes(opt))
        host_grads = [g for g in self._grad_host if g is not None] + [p.grad for p in self._p_host if p.grad is not None]
        out.add("host", "gradients", unique_storage_bytes(host_grads))
        if self._transfer is not None:
            out.add("host", "other", unique_storage_bytes(self._transfer.staging()))
        return out

    # --- teardown ----------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        for handle in self._hooks:
            handle.remove()
        if self._transfer is not None:
            self._transfer.synchronize()
        for optimizer, flags in self._fused.values():
            _host_optimizer.restore(optimizer, flags)
        module = self.lightning_module
        if module is not None and self._p_host:
            self._give_back_fp32(module)
        self._reset()
        super().teardown()

    @torch.no_grad()
    def _give_back_fp32(self, module: pl.LightningModule) -> None:
        """Leave the user an fp32 module holding the masters' values, and optimizers pointing at its parameters."""
        for name in self._buffers:
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner)
            sub._buffers[attr] = self._buffer_fp32(name, sub._buffers[attr])  # type: ignore[index]
        for p_device, p_host in zip(self._p_device, self._p_host):
            # NOTE: the master's storage becomes the module's weight (no copy); masters are never pinned.
            p_device.data = p_host.detach()
            p_device.grad = None
        back = {id(h): d for d, h in zip(self._p_device, self._p_host)}
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["params"] = [back.get(id(p), p) for p in group["params"]]
            opt.state = defaultdict(dict, {back.get(id(p), p): s for p, s in opt.state.items()})


def _to_master_precision(plugin: Precision | None) -> Precision | None:
    if plugin is None or isinstance(plugin, MasterHalfPrecision):
        return plugin
    name = getattr(plugin, "precision", None)
    if type(plugin) in (Precision, HalfPrecision, MixedPrecision) and name in PRECISIONS:
        return MasterHalfPrecision(name)  # type: ignore[arg-type]
    raise ValueError(
        f"`strategy='lowmem_offload'` got `precision={name!r}` (`{type(plugin).__name__}`); it supports "
        f"{', '.join(map(repr, PRECISIONS))}: compute weights in that dtype on the device and fp32 masters on the host. "
        "Pass one of these as `Trainer(precision=...)`, or `plugins=[MasterHalfPrecision(...)]` to set the loss scaler."
    )


_CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


def _check_host_can_run(optimizer: Optimizer, host_optimizer: str) -> None:
    """Refuse optimizers that cannot step fp32 masters on the host, naming why and what to use instead."""
    problems = []
    name = type(optimizer).__name__
    if isinstance(optimizer, _CLOSURE_OPTIMIZERS):
        problems.append(f"`{name}` re-evaluates the loss inside `step()`; `lowmem_offload` steps once per backward")
    if isinstance(optimizer, torch.optim.SparseAdam):
        problems.append("`SparseAdam` needs sparse gradients; host gradient buffers are dense (use `AdamW`)")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("capturable"):
            problems.append(f"param group {i} has `capturable=True` (CUDA graphs); the host step cannot capture")
        if group.get("fused") and type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
            problems.append(f"param group {i} has `fused=True`, which torch has no CPU kernel for in `{name}`")
    reason = _host_optimizer.why_not_fused(optimizer) if host_optimizer == "torch_fused" else None
    if reason is not None:
        problems.append(f"`host_optimizer='torch_fused'` cannot fuse it ({reason}); use 'auto' or 'as_is'")
    if problems:
        raise ValueError(
            f"The host cannot run the optimizer `{name}` under `lowmem_offload`: " + "; ".join(problems) + "."
        )


def _state_bytes_estimate(optimizer: Optimizer) -> int:
    """Bytes of fp32 optimizer state ``optimizer`` will create for its parameters (an estimate for unknown classes)."""
    total = 0
    for group in optimizer.param_groups:
        n = sum(p.numel() for p in group["params"] if p.requires_grad)
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            per = 8 + (4 if group.get("amsgrad") else 0)
        elif isinstance(optimizer, torch.optim.SGD):
            per = 4 if group.get("momentum") else 0
        elif isinstance(optimizer, (torch.optim.Adagrad, torch.optim.Adadelta)):
            per = 4 if isinstance(optimizer, torch.optim.Adagrad) else 8
        elif isinstance(optimizer, torch.optim.RMSprop):
            per = 4 + (4 if group.get("momentum") else 0) + (4 if group.get("centered") else 0)
        else:
            per = 8  # NOTE: unknown optimizer: assume Adam-sized state
        total += per * n
    return total

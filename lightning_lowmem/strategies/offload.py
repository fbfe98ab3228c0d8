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
import logging
import math
import os
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, get_args

import lightning.pytorch as pl
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

from lightning_lowmem import _host_memory
from lightning_lowmem._compat import Reproducible
from lightning_lowmem.memory.analytic import optimizer_state_bytes_per_param
from lightning_lowmem.memory.categories import (
    MemoryBreakdown,
    mark_host,
    module_grad_bytes,
    module_weight_bytes,
    optimizer_state_bytes,
    storage_key,
    unique_storage_bytes,
)
from lightning_lowmem.memory.units import fmt_size, parse_bytes
from lightning_lowmem.precision.master_half import PRECISIONS, MasterHalfPrecision, autocast_cast_params
from lightning_lowmem.strategies import _host_optimizer, hf_weights
from lightning_lowmem.strategies._atomic_checkpoint_io import AtomicCheckpointIO
from lightning_lowmem.strategies._host_optimizer import HOST_OPTIMIZERS, HostOptimizer
from lightning_lowmem.strategies._host_transfer import HostTransfer, planned_staging_bytes, transfer_for
from lightning_lowmem.strategies.param_stream import (
    OFFLOAD_PARAMS,
    OffloadParams,
    ParamStream,
    block_params,
    default_budget,
    plan_resident,
)

log = logging.getLogger(__name__)

NonFinite = Literal["skip", "raise", "ignore"]
NONFINITE: tuple[str, ...] = get_args(NonFinite)


class NonFiniteGradientError(FloatingPointError):
    """``lowmem_offload`` refused to step on non-finite (inf/nan) gradients (``nonfinite="raise"``, or too many skips)."""


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
        check_host_memory: refuse to start when the host lacks the RAM for masters, gradient buffers,
            the state of the optimizer actually configured (8-bit under ``LowBitOptimizer``, none for SGD
            without momentum, ...) and pinned staging, instead of being killed mid-setup. The RAM counted
            is what this process may allocate: the least of the machine's available memory, its cgroup
            (container) limit and ``ulimit -v``/``-d``.
        nonfinite: what a non-finite (inf/nan) fp32 master gradient does in bf16 and fp32 (fp16 always
            skips through its loss scaler). ``"skip"`` (default): skip that optimizer step (masters and
            optimizer state untouched, gradients dropped), log ``lowmem/skipped_steps``, warn once, and raise
            :class:`NonFiniteGradientError` naming the parameter after ``max_consecutive_skips`` skips in a
            row; ``"raise"``: raise at the first; ``"ignore"``: step anyway (plain Lightning's behaviour: the
            masters become nan for good). Cost: one vectorised norm over the host gradients per step
            (``torch._foreach_norm``). With ``optimizer_in_backward`` the loss is checked before backward
            (a non-finite loss skips the whole step) and each gradient before its parameter steps.
        max_consecutive_skips: with ``nonfinite="skip"``, raise after this many skipped steps in a row.
        offload_params: ``True`` (``strategy="lowmem_offload_params"``) streams the compute weights of every repeated
            block (GPT-2's ``transformer.h``, LLaMA's ``model.layers``) from host copies in the compute dtype (pinned on
            CUDA, +2 B/param of host memory in bf16): on the device only the non-block weights (embeddings, LM head,
            final norm) and ``prefetch + 1`` blocks at a time. Cost: each block's weights cross PCIe once in forward and
            once in backward, overlapped with compute on a side stream (see
            :class:`~lightning_lowmem.strategies.param_stream.ParamStream`). ``"auto"``: the first blocks stay resident
            as far as ``device_budget`` allows, the rest stream (the choice is logged). ``False``: all resident.
        prefetch: how many streamed blocks are copied ahead of the one computing (0: fetch on use).
        device_budget: with ``offload_params="auto"``, the device bytes the compute weights may take (an int or a
            size such as ``"6GiB"``): the non-block weights, ``prefetch + 1`` streamed blocks and the resident blocks
            must fit; activations need room beside it. Default on CUDA: the free memory minus 25 % (at least 2 GiB);
            required on the CPU.
        load_weights: a local Hugging Face ``save_pretrained`` directory in safetensors: its tensors are read one at a
            time straight into the fp32 masters of a module built without weights (on the ``meta`` device, or under
            ``trainer.init_module(empty_init=True)``, whose fp32 storage becomes the masters), so the host never holds
            a second fp32 copy (see :mod:`~lightning_lowmem.strategies.hf_weights`). Not read when resuming from
            ``ckpt_path`` (the checkpoint's weights win).

    Example::

        import lightning as L
        import lightning_lowmem  # registers "lowmem_offload"

        trainer = L.Trainer(strategy="lowmem_offload", precision="bf16-true", accumulate_grad_batches=4,
                            gradient_clip_val=1.0)
        trainer.fit(model)

        # the blocks' weights on the host too, two blocks on the device at a time
        trainer = L.Trainer(strategy=OffloadStrategy(offload_params=True, prefetch=1), precision="bf16-true")
    """

    strategy_name = "lowmem_offload"

    def __init__(
        self,
        *,
        optimizer_in_backward: bool = False,
        host_optimizer: HostOptimizer = "auto",
        check_host_memory: bool = True,
        nonfinite: NonFinite = "skip",
        max_consecutive_skips: int = 10,
        offload_params: OffloadParams = False,
        prefetch: int = 1,
        device_budget: int | str | None = None,
        load_weights: str | os.PathLike | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        _check_flags(
            optimizer_in_backward=optimizer_in_backward,
            host_optimizer=host_optimizer,
            check_host_memory=check_host_memory,
            nonfinite=nonfinite,
            max_consecutive_skips=max_consecutive_skips,
            offload_params=offload_params,
            prefetch=prefetch,
            device_budget=device_budget,
            load_weights=load_weights,
        )
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.optimizer_in_backward = optimizer_in_backward
        self.host_optimizer = host_optimizer
        self.check_host_memory = check_host_memory
        self.nonfinite = nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.offload_params = offload_params
        self.load_weights = load_weights
        self.load_report: dict[str, int] | None = None  # what `load_weights` read (files, tensors)
        self._loading = False
        self.prefetch = prefetch
        self.device_budget = None if device_budget is None else parse_bytes(device_budget, "`device_budget`")
        self.resident_blocks: int | None = None  # with offload_params: how many blocks stayed resident (after setup)
        self.skipped_steps = 0  # steps skipped by the non-finite guard (bf16/fp32), over the strategy's life
        self._consecutive_skips = 0
        self._warned_nonfinite = False
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
        self._stream: ParamStream | None = None
        self._fused: dict[int, tuple[Optimizer, list[dict[str, Any]]]] = {}
        self._owner_cache: tuple[tuple[int, ...], dict[int, tuple[Optimizer, dict[str, Any]]]] | None = None
        self._clip_value: float | None = None
        self._skip_backward = False  # optimizer_in_backward: this backward's loss was not finite
        self._bad_in_backward: list[str] = []  # optimizer_in_backward: parameters whose gradient was not finite
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
        if self._loading:
            hf_weights.materialize_meta(self.model)  # NOTE: before the optimizers are built over the parameters
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
        if self.offload_params is not False:
            self._stream = self._plan_stream(self.model)
            self._stream.detach_weights()  # NOTE: before the move: the streamed weights never reach the device whole
        self.model_to_device()
        if self._stream is not None:
            self._stream.attach()
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
        precision._drain = self.drain_transfers
        self.setup_precision_plugin()
        # NOTE: no `_optimizers_to_device(root_device)`: the optimizer state belongs on the host.

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._stream is not None:
            self._stream.hook_blocks()  # NOTE: after the callbacks' hooks of `on_train_start` (see ParamStream.hook_blocks)

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
        problems += self._check_streaming(module)
        problems += self._check_loading(module, trainer)
        if problems:
            raise ValueError(
                f"`{type(self).__name__}` (strategy='lowmem_offload') cannot run this configuration:\n- "
                + "\n- ".join(problems)
            )

    # --- parameter streaming (see lightning_lowmem/strategies/param_stream.py) ---------------------------------
    def _check_streaming(self, module: torch.nn.Module) -> list[str]:
        if self.offload_params is False:
            return []
        problems = []
        _, per_block, _ = block_params(module)
        if self.offload_params is True and not any(per_block):
            names = [n for n, _ in module.named_parameters()]
            shown = ", ".join(f"`{n}`" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            problems.append(
                f"`offload_params=True` streams the weights of repeated blocks (the children of an `nn.ModuleList` of two "
                f"or more modules of one class), and `{type(module).__name__}` has none: no parameter would stream, all "
                f"{len(names)} ({shown}) would stay on the device. Put the repeated layers in an `nn.ModuleList`, or pass "
                "`offload_params='auto'` (streams what it finds, here nothing) or `offload_params=False`"
            )
        if self.offload_params == "auto" and self.device_budget is None and self.root_device.type != "cuda":
            problems.append(
                f"`offload_params='auto'` on the '{self.root_device.type}' device needs `device_budget` (bytes for the "
                "compute weights, e.g. `device_budget='6GiB'`); only on CUDA does it default to the free memory"
            )
        return problems

    def _check_loading(self, module: torch.nn.Module, trainer: pl.Trainer) -> list[str]:
        """Decide whether ``load_weights`` is read (not on resume: the checkpoint's weights win); what cannot work."""
        meta_params = [n for n, p in module.named_parameters() if p.is_meta]
        meta_buffers = [n for n, b in module.named_buffers() if b.is_meta]
        resuming = getattr(trainer, "ckpt_path", None) is not None
        self._loading = self.load_weights is not None and not resuming
        problems = []
        if meta_params and not self._loading:
            why = "resuming from `ckpt_path` (the checkpoint loads into real tensors only)" if resuming else (
                "no `load_weights` to fill them")
            problems.append(
                f"{len(meta_params)} parameters are on the meta device (`{meta_params[0]}`, ...) and {why}: pass "
                "`OffloadStrategy(load_weights=<save_pretrained directory>)`, or build the module under "
                "`trainer.init_module(empty_init=True)` to resume"
            )
        if meta_buffers:
            problems.append(
                f"buffers on the meta device ({', '.join(f'`{n}`' for n in meta_buffers[:3])}): checkpoints do not hold "
                "computed buffers (rotary `inv_freq`); build the module under `trainer.init_module(empty_init=True)` "
                "instead of the meta device (its weights still come from `load_weights` without an fp32 copy)"
            )
        return problems

    def _plan_stream(self, module: torch.nn.Module) -> ParamStream:
        """Which blocks stream (all with ``True``; under ``"auto"`` the ones that do not fit the budget), logged."""
        _, per_block, rest = block_params(module)
        sizes = [sum(p.numel() * p.element_size() for p in ps) for ps in per_block]
        other = sum(p.numel() * p.element_size() for p in rest)
        if self.offload_params is True:
            resident = 0
        else:
            budget = self.device_budget if self.device_budget is not None else default_budget(self.root_device)
            resident = plan_resident(sizes, other, budget, self.prefetch)
            log.info(
                "lowmem_offload(offload_params='auto'): %d of %d blocks resident, %d streamed (budget %s for the compute "
                "weights: %s outside the blocks, %s per block; predicted weights on the device at most %s)",
                resident, len(sizes), len(sizes) - resident, fmt_size(budget), fmt_size(other),
                fmt_size(max(sizes, default=0)),
                fmt_size(other + sum(sizes[:resident]) + sum(sorted(sizes[resident:])[-(self.prefetch + 1):])),
            )
        self.resident_blocks = resident
        streamed = [b >= resident and bool(ps) for b, ps in enumerate(per_block)]
        return ParamStream(module, streamed, self.prefetch, self.root_device)

    # --- masters ---------------------------------------------------------------------------------------
    def _unique_params(self, module: torch.nn.Module) -> Iterator[tuple[str, Parameter]]:
        for name, p in module.named_parameters():  # NOTE: de-duplicates tied weights (GPT-2 wte/lm_head)
            if p.is_floating_point():
                yield name, p

    def host_bytes_needed(
        self,
        module: torch.nn.Module,
        optimizers: list[Optimizer],
        with_grads: bool = True,
        callbacks: Sequence[Any] = (),
    ) -> dict[str, int]:
        """Host bytes the strategy will allocate for ``module`` and ``optimizers``, by part.

        The optimizer state is that of the optimizer that will step: ``optimizers`` as configured, or the
        bitsandbytes 8-bit one when ``callbacks`` hold a ``LowBitOptimizer`` (see :func:`expected_state_bytes`).
        """
        numel = sum(p.numel() for _, p in self._unique_params(module))
        trainable = sum(p.numel() for _, p in self._unique_params(module) if p.requires_grad)
        dtype = self.precision_plugin.compute_dtype  # type: ignore[attr-defined]
        low_bit = next((cb for cb in callbacks if type(cb).__name__ == "LowBitOptimizer"), None)
        embeddings = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
        precision = self.precision_plugin
        half = {id(p) for p in autocast_cast_params(module)} if precision.mixed else None  # type: ignore[attr-defined]
        specs = [
            (p.numel(), dtype if half is None or id(p) in half else torch.float32) for _, p in self._unique_params(module)
        ]
        parts = {
            "masters": 4 * numel,
            "gradient_buffers": 4 * trainable if with_grads and not self.optimizer_in_backward else 0,
            "optimizer_state": sum(expected_state_bytes(opt, low_bit, embeddings) for opt in optimizers),
            # on CUDA: pinned staging in the compute dtype, flat buckets as torch's pinned allocator reserves them
            # (see [staging buckets]); on CPU: the compute weights share host RAM
            "staging_or_compute_weights": planned_staging_bytes(self.root_device, specs),
            "streamed_weights": self._streamed_host_bytes(module, dtype),
        }
        parts["total"] = sum(parts.values())
        return parts

    def _streamed_host_bytes(self, module: torch.nn.Module, dtype: torch.dtype) -> int:
        """Host copies of the streamed blocks (all blocks under ``True``; counted for all under ``"auto"`` too)."""
        if self.offload_params is False:
            return 0
        _, per_block, _ = block_params(module)
        size = torch.empty((), dtype=dtype).element_size()
        return sum(p.numel() * size for ps in per_block for p in ps)

    def _master_storage(self, p: Tensor) -> Tensor:
        """The fp32 host tensor of a new master: a copy of ``p``, or (loading weights) room for them."""
        if not self._loading:
            return p.detach().to("cpu", torch.float32, copy=True)
        precision = self.precision_plugin
        if (p.device.type == "cpu" and p.dtype == torch.float32 and not p.is_meta and not precision.mixed  # type: ignore[attr-defined]
                and precision.compute_dtype != torch.float32):  # type: ignore[attr-defined]
            # NOTE: an empty_init module's fp32 storage becomes the master (no second fp32 copy on the host); the
            # cast to the compute dtype right after gives the module parameter a storage of its own.
            return p.detach()
        return torch.empty(p.shape, dtype=torch.float32)

    def _build_masters(self, module: torch.nn.Module, optimizers: list[Optimizer], with_grads: bool) -> None:
        if self.check_host_memory:
            trainer = getattr(self.lightning_module, "_trainer", None)
            need = self.host_bytes_needed(module, optimizers, with_grads, trainer.callbacks if trainer else ())
            need.pop("total")
            low_bit = any(type(cb).__name__ == "LowBitOptimizer" for cb in (trainer.callbacks if trainer else ()))
            fixes = []
            if need["optimizer_state"] and not low_bit:
                fixes.append("8-bit optimizer state (`callbacks=[LowBitOptimizer()]`, ~2 B/param for Adam instead of 8)")
            if need["gradient_buffers"]:
                fixes.append("`OffloadStrategy(optimizer_in_backward=True)` (no gradient buffers)")
            fixes += [
                "a smaller model, or a machine/container with more RAM (or raise the limit named above)",
                "`OffloadStrategy(check_host_memory=False)` to try anyway",
            ]
            _host_memory.check_host_memory(
                {k.replace("_", " "): v for k, v in need.items()}, who="`OffloadStrategy` (strategy='lowmem_offload')",
                fixes=fixes,
            )
        self._reset()
        for i, (name, p) in enumerate(self._unique_params(module)):
            p_host = Parameter(self._master_storage(p), requires_grad=p.requires_grad)
            self._names.append(name)
            self._p_device.append(p)
            self._p_host.append(p_host)
            self._device_index[id(p)] = i
            self._host_index[id(p_host)] = i
            grad = torch.empty_like(p_host) if with_grads and p.requires_grad and not self.optimizer_in_backward else None
            self._grad_host.append(grad)
        if self._loading:
            self.load_report = hf_weights.load_into(dict(zip(self._names, self._p_host)), self.load_weights)
            with torch.no_grad():
                for p, p_host in zip(self._p_device, self._p_host):
                    if not p.is_meta and storage_key(p) != storage_key(p_host):
                        p.detach().copy_(p_host)  # NOTE: an empty_init module whose storage the master could not reuse
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
    def pre_backward(self, closure_loss: Tensor) -> None:
        # NOTE: with optimizer_in_backward each parameter steps inside backward: a non-finite loss must be caught
        # before the first one does (one scalar; a device sync on CUDA).
        self._skip_backward = bool(
            self.optimizer_in_backward and self._guarding() and not torch.isfinite(closure_loss.detach()).all()
        )

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.drain_transfers()  # NOTE: a no-op here in `Trainer.fit`: the precision plugin drained (see below)

    def drain_transfers(self) -> None:
        """Fold every gradient queued by the backwards so far into the masters (a sync point on CUDA).

        NOTE: [drain before user code] Lightning calls ``on_after_backward`` from the precision plugin's
        ``post_backward``, *before* the strategy's: ``MasterHalfPrecision.post_backward`` calls this first, so
        every gradient of the backward is on the masters before user code (``on_after_backward``, manual
        ``clip_gradients``, the step) reads them. Code that runs ``backward()`` outside Lightning's loop (the
        micro-batch search's trial steps) must call it too, or its queued copies reach the next real step.
        """
        if self._transfer is not None:
            self._transfer.synchronize()
        if self._stream is not None:
            self._stream.release_all()  # NOTE: backward is over: the next forward fetches from the first block

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
            self._bad_in_backward = []
            out = closure()  # each parameter steps inside backward (see `_step_in_backward`)
            precision._skip_clipping = True  # value clipping happened per parameter; norm clipping is refused
            try:
                precision._after_closure(model, optimizer)  # on_before_optimizer_step hooks; masters hold no gradient
            finally:
                precision._skip_clipping = False
            precision.last_step_skipped = out is None or self._skip_backward
            if self._skip_backward or self._bad_in_backward:
                where = self._bad_in_backward or ["the loss"]
                self._skip_backward = False
                self._nonfinite_step(where[:3], len(where), model, whole=precision.last_step_skipped)
            elif out is not None:
                self._consecutive_skips = 0
        else:
            out = precision.optimizer_step(optimizer, model=model, closure=closure, step_fn=self._host_step, **kwargs)
        if not precision.last_step_skipped:
            self._weights_to_device(optimizer)
        if self._guarding() and model._trainer is not None and model._current_fx_name is not None:
            # NOTE: only inside a loop hook (training_step, optimizer_step): `log` refuses elsewhere
            model.log("lowmem/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1)
        return out

    # --- the non-finite guard (bf16 / fp32) ---------------------------------------------------------------------
    def _guarding(self) -> bool:
        """Whether the guard runs: ``nonfinite != "ignore"`` and no fp16 loss scaler (which skips overflows itself)."""
        return self.nonfinite != "ignore" and getattr(self.precision_plugin, "scaler", None) is None

    def _nonfinite_grads(self, optimizer: Optimizer) -> tuple[list[str], int] | None:
        """None if every master gradient of ``optimizer`` is finite; else (names of the first bad ones, how many)."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return None
        # NOTE: one vectorised pass (an L2 norm per tensor) instead of an isfinite mask per tensor; a norm that
        # overflows fp32 (|g| ~ 1e19) counts as non-finite too, which AdamW's g*g would have turned into inf state.
        if bool(torch.stack(torch._foreach_norm(grads)).isfinite().all()):
            return None
        bad = [
            self._names[self._host_index[id(p)]] if id(p) in self._host_index else f"tensor of shape {tuple(p.shape)}"
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]
        return bad[:3], len(bad) or 1

    def _nonfinite_step(self, names: list[str], count: int, model: pl.LightningModule, whole: bool = True) -> None:
        """Count a step skipped for non-finite gradients; warn once; raise per ``nonfinite``/``max_consecutive_skips``."""
        self.skipped_steps += 1
        self._consecutive_skips += 1
        step = model.trainer.global_step if model._trainer is not None else "?"
        what = ", ".join(f"`{n}`" if not n.startswith(("the ", "tensor ")) else n for n in names)
        more = f" and {count - len(names)} more" if count > len(names) else ""
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"lowmem_offload: non-finite (inf/nan) gradient at global step {step} in {what}{more} "
                "(`OffloadStrategy(nonfinite='raise')`). Look for the batch or loss that produced it "
                "(`Trainer(detect_anomaly=True)`), or pass `nonfinite='skip'` to skip such steps."
            )
        if self._consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteGradientError(
                f"lowmem_offload: {self._consecutive_skips} optimizer steps in a row had non-finite (inf/nan) gradients "
                f"(the last at global step {step}, in {what}{more}); training is not progressing. Lower the learning "
                "rate, check the data and the loss for inf/nan (`Trainer(detect_anomaly=True)`), or raise "
                f"`OffloadStrategy(max_consecutive_skips={self.max_consecutive_skips})`."
            )
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            partial = "" if whole else " (optimizer_in_backward: only those parameters' updates were skipped)"
            warnings.warn(
                f"lowmem_offload: non-finite (inf/nan) gradient at global step {step} in {what}{more}: skipped the "
                f"optimizer step{partial}; the masters and the optimizer state are unchanged. Skips are counted in "
                "`lowmem/skipped_steps`; this warning is shown once. "
                f"{self.max_consecutive_skips} skips in a row raise an error.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _host_step(self, optimizer: Optimizer) -> Any:
        """The step function of ``MasterHalfPrecision``: the non-finite guard, then :meth:`_raw_step`."""
        if self._guarding():
            found = self._nonfinite_grads(optimizer)
            if found is not None:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None  # NOTE: the inf/nan gradient must not reach the next accumulation window
                self.precision_plugin.last_step_skipped = True  # type: ignore[attr-defined]
                self._nonfinite_step(*found, self.lightning_module)  # type: ignore[arg-type]
                return None
            self._consecutive_skips = 0
        return self._raw_step(optimizer)

    def _raw_step(self, optimizer: Optimizer) -> Any:
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
        if self._skip_backward:
            return  # NOTE: the loss was not finite (see `pre_backward`): no parameter steps in this backward
        if self._guarding() and not bool(torch._foreach_norm([grad])[0].isfinite()):
            self._bad_in_backward.append(self._names[i])
            return
        p_host.grad = grad.to(torch.float32)  # NOTE: a copy for half gradients; aliases an fp32 one (freed below)
        if self._clip_value is not None:
            p_host.grad.clamp_(-self._clip_value, self._clip_value)  # what clip_grad_value_ does, per parameter
        optimizer, group = self._owner(p_host)
        params = group["params"]
        # NOTE: torch optimizers step every parameter of a group that has a gradient; giving the group this
        # one parameter for the call makes the update (state, hyperparameters, schedulers) exactly the usual one.
        group["params"] = [p_host]
        try:
            self._raw_step(optimizer)
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
        if self._stream is not None:
            # NOTE: a streamed weight's compute copy is its host copy: the step rounds the master into it (the
            # same fp32 -> compute dtype rounding as the device path); the next fetch carries it to the device.
            host = self._stream.host_of()
            self._stream.update_host([(p_host, host[id(p)]) for _, p_host, p in pairs if id(p) in host])
            pairs = [pair for pair in pairs if id(pair[2]) not in host]
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
        if self._stream is not None:
            with self._stream.host_view():  # NOTE: streamed weights load into their host copies
                super().load_model_state_dict(checkpoint, strict=strict)
        else:
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
            out.add("host", "other", self._transfer.staging_bytes())
        if self._stream is not None:
            out.add("host", "weights", self._stream.host_bytes())  # the streamed blocks' compute copies
        return out

    def host_bytes_per_param(self) -> dict[str, float]:
        """Host bytes per parameter of the module, by part of :meth:`memory_breakdown` (``"total"`` included).

        ``weights`` is the streamed blocks' compute copies (``offload_params``), ``optimizer_state`` the fp32 masters
        plus the optimizer's state, ``other`` the pinned staging (CUDA).
        """
        numel = sum(p.numel() for p in self._p_host)
        host = self.memory_breakdown().host
        out = {k: v / numel for k, v in host.items() if v} if numel else {}
        out["total"] = sum(out.values())
        return out

    # --- teardown ----------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        for handle in self._hooks:
            handle.remove()
        if self._transfer is not None:
            self._transfer.synchronize()
        if self._stream is not None:
            self._stream.remove()
        for optimizer, flags in self._fused.values():
            _host_optimizer.restore(optimizer, flags)
        module = self.lightning_module
        if module is not None and self._p_host:
            self._give_back_fp32(module)
        self._reset()
        if module is not None and any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            # NOTE: setup refused a meta-device module before materializing it: Strategy.teardown's `.cpu()` would fail
            # on it and hide the ValueError that says why
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
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


def _check_flags(**flags: Any) -> None:
    """TypeError/ValueError for every bad constructor argument at once, each naming the value and what is expected."""
    problems: list[str] = []
    type_error = False
    for name in ("optimizer_in_backward", "check_host_memory"):
        if not isinstance(flags[name], bool):
            problems.append(f"`{name}={flags[name]!r}`; expected True or False")
            type_error = True
    if flags["host_optimizer"] not in HOST_OPTIMIZERS:
        problems.append(f"`host_optimizer={flags['host_optimizer']!r}`; expected one of {', '.join(map(repr, HOST_OPTIMIZERS))}")
    if flags["nonfinite"] not in NONFINITE:
        problems.append(f"`nonfinite={flags['nonfinite']!r}`; expected one of {', '.join(map(repr, NONFINITE))}")
    if not any(flags["offload_params"] is v or (isinstance(v, str) and flags["offload_params"] == v) for v in OFFLOAD_PARAMS):
        problems.append(f"`offload_params={flags['offload_params']!r}`; expected False, True or 'auto'")
    prefetch = flags["prefetch"]
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        problems.append(f"`prefetch={prefetch!r}`; expected an int >= 0 (how many blocks to copy ahead)")
        type_error |= isinstance(prefetch, bool) or not isinstance(prefetch, int)
    if flags["load_weights"] is not None and not isinstance(flags["load_weights"], (str, os.PathLike)):
        problems.append(f"`load_weights={flags['load_weights']!r}`; expected a directory (str or os.PathLike)")
        type_error = True
    elif flags["load_weights"] is not None:
        try:
            hf_weights.shard_files(flags["load_weights"])
        except ValueError as err:
            problems.append(str(err).removeprefix("Passed "))
    if flags["device_budget"] is not None:
        try:
            parse_bytes(flags["device_budget"], "`device_budget`")
        except (TypeError, ValueError) as err:
            problems.append(f"`device_budget={flags['device_budget']!r}` ({err})")
            type_error |= isinstance(err, TypeError)
    skips = flags["max_consecutive_skips"]
    if isinstance(skips, bool) or not isinstance(skips, int):
        problems.append(f"`max_consecutive_skips={skips!r}`; expected an int >= 1")
        type_error = True
    elif skips < 1:
        problems.append(f"`max_consecutive_skips={skips!r}`; expected an int >= 1")
    if problems:
        raise (TypeError if type_error else ValueError)("OffloadStrategy: passed " + "; passed ".join(problems) + ".")


def expected_state_bytes(
    optimizer: Optimizer, low_bit: Any | None = None, keep_32bit: set[int] | frozenset[int] = frozenset()
) -> int:
    """Host bytes of the state ``optimizer`` will create for its fp32 masters (before its first step).

    ``low_bit``: a ``LowBitOptimizer`` callback that will swap an Adam/Lion optimizer for its bitsandbytes
    8-bit version in ``on_fit_start`` (tensors under its ``min_8bit_size``, and ``keep_32bit`` ids with
    ``stable_embedding``, keep 32-bit state). The per-tensor rules are
    :func:`lightning_lowmem.memory.analytic.optimizer_state_bytes_per_param`'s; unknown optimizer classes
    count as Adam (8 B/param).
    """
    name = type(optimizer).__name__
    eight_bit = "8bit" in name
    min_8bit = getattr(getattr(optimizer, "args", None), "min_8bit_size", 4096)
    lion = "lion" in name.lower()
    if low_bit is not None and (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or name in _LION_32BIT):
        eight_bit, min_8bit = True, low_bit.min_8bit_size
        if not low_bit.stable_embedding:
            keep_32bit = frozenset()
    total = 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            n = p.numel()
            if eight_bit:
                if n < min_8bit or id(p) in keep_32bit:
                    per = optimizer_state_bytes_per_param("adamw", 4, n)
                else:
                    per = optimizer_state_bytes_per_param("adamw8bit", 4, n)
                total += per / 2 if lion else per  # NOTE: Lion keeps one moment, Adam two
            elif lion:
                total += optimizer_state_bytes_per_param("sgd", 4, n)  # one fp32 moment
            elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                total += optimizer_state_bytes_per_param("adamw", 4, n) + (4 * n if group.get("amsgrad") else 0)
            elif isinstance(optimizer, torch.optim.SGD):
                total += optimizer_state_bytes_per_param("sgd", 4, n) if group.get("momentum") else 0
            elif isinstance(optimizer, (torch.optim.Adagrad, torch.optim.ASGD)):
                total += 4 * n
            elif isinstance(optimizer, torch.optim.RMSprop):
                total += 4 * n * (1 + bool(group.get("momentum")) + bool(group.get("centered")))
            elif isinstance(optimizer, torch.optim.Adafactor):
                rows, cols = (p.shape[0], math.prod(p.shape[1:])) if p.dim() >= 2 else (n, 0)
                total += 4 * (rows + cols) if cols else 4 * n
            else:  # Adadelta, Adamax, NAdam, RAdam, Rprop, and unknown classes: two fp32 tensors per parameter
                total += optimizer_state_bytes_per_param("adamw", 4, n)
    return int(total)


_LION_32BIT = ("Lion", "Lion32bit", "PagedLion", "PagedLion32bit")

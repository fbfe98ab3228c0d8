"""``lowmem_offload``: :class:`OffloadStrategy`, Lightning glue over its parts (docs/design.md, "The offload core")."""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core import host_memory, preflight
from lightning_lowmem.core import resume_checks as _resume_checks
from lightning_lowmem.core.accounting import (
    MemoryBreakdown,
    mark_disk,
    mark_host,
    mark_host_state,
    module_grad_bytes,
    module_weight_bytes,
    optimizer_state_bytes,
    unique_storage_bytes,
)
from lightning_lowmem.core.checkpoint_io import AtomicCheckpointIO
from lightning_lowmem.core.optimizer_state import expected_state_bytes
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.roles import HostMastersStrategy, LeanOptimizerSwap, LowBitOptimizerSwap
from lightning_lowmem.core.units import parse_bytes
from lightning_lowmem.strategies.offload import checks, hf_weights, stream_values
from lightning_lowmem.strategies.offload.disk_tier import DiskTier
from lightning_lowmem.strategies.offload.host_optimizer import HostKernel, HostOptimizer
from lightning_lowmem.strategies.offload.manual_grads import ManualGrads
from lightning_lowmem.strategies.offload.masters import HostMasters, frozen_without_master
from lightning_lowmem.strategies.offload.masters_view import MastersView
from lightning_lowmem.strategies.offload.nonfinite import NonFinite, NonFiniteGradientError, NonFiniteGuard
from lightning_lowmem.strategies.offload.packed_weights import give_back_streamed
from lightning_lowmem.strategies.offload.param_stream import OffloadParams, ParamStream, streamed_host_bytes
from lightning_lowmem.strategies.offload.precision import MasterHalfPrecision
from lightning_lowmem.strategies.offload.step_schedule import SerialStep, StepInBackward, in_backward_problems
from lightning_lowmem.strategies.offload.stream_plan import default_budget, plan_stream, stream_problems
from lightning_lowmem.strategies.offload.transfer import HostTransfer, planned_staging_bytes, transfer_for

log = logging.getLogger(__name__)

class OffloadStrategy(Reproducible, HostMastersStrategy, SingleDeviceStrategy):
    """CPU-master training on one device: only the compute weights (and activations) stay on the accelerator.

    Memory on the device: the compute weights (2 B/param under ``"bf16-true"``/``"16-true"``, 4 B under ``"32-true"`` and
    ``"*-mixed"``, whose weights stay fp32 as in plain Lightning) plus activations and one parameter's gradient at a
    time, against 16 B/param for plain fp32 AdamW. On the host: fp32 masters (4 B/param), fp32 gradient buffers
    (4 B/param, none with ``optimizer_in_backward``), the optimizer state (8 B/param for Adam), and on CUDA pinned
    staging buffers in the compute weights' dtype. Cost: the weights' bytes over PCIe each way per step and the host
    optimizer step (memory-bandwidth bound, ~28 B touched per parameter for AdamW).

    Precision is the Trainer's flag (fp16: dynamic loss scaling, see
    :class:`~lightning_lowmem.strategies.offload.precision.MasterHalfPrecision`); any torch optimizer, scheduler,
    clipping and accumulation work on the masters, which the gradient hooks (and your code, in
    ``trainer.strategy.masters_view()``) see through the module's parameters (docs/techniques/offload.md). Refused at
    setup: ``BaseFinetuning`` callbacks; weight averaging with ``offload_params``.

    Args:
        optimizer_in_backward: step each master as soon as its gradient reaches the host; no host gradient buffers
            (-4 B/param; :class:`~lightning_lowmem.strategies.offload.step_schedule.StepInBackward`). Needs
            ``accumulate_grad_batches=1``, no norm clipping, bf16 or fp32, and automatic optimization.
        host_optimizer: ``"auto"``: Adam/AdamW with torch's fused CPU kernel (a few ulp apart, ~5x faster);
            ``"as_is"``: as configured; ``"torch_fused"``: ``"auto"`` refusing optimizers it cannot fuse.
        check_host_memory: refuse to start when the RAM this process may allocate (available memory, cgroup limit,
            ``ulimit -v``/``-d``) cannot hold masters, gradient buffers, the configured optimizer's state and staging
            (with ``disk``: when its directory's free space cannot hold the masters and optimizer state).
        nonfinite: on an inf/nan master gradient in bf16/fp32 (fp16 skips through its scaler): ``"skip"`` the step
            (logged as ``lowmem/skipped_steps``, warned once, :class:`NonFiniteGradientError` after
            ``max_consecutive_skips`` in a row); ``"raise"``; ``"ignore"`` (the masters become nan). Cost: a norm/step.
        max_consecutive_skips: with ``nonfinite="skip"``, raise after this many skipped steps in a row.
        offload_params: ``True`` (``strategy="lowmem_offload_params"``) streams the compute weights of every repeated
            block, rounded from their masters at each fetch (a frozen one from a host copy, +2 B/param in bf16; on the
            device ``prefetch + 1`` blocks at a time;
            cost: each block crosses PCIe twice a step, overlapped with compute); ``"auto"``: the first blocks stay
            resident as far as ``device_budget`` allows. See docs/techniques/param-streaming.md.
        prefetch: how many streamed blocks are copied ahead of the one computing (0: fetch on use).
        device_budget: with ``offload_params="auto"``, the device bytes the compute weights may take (an int or
            ``"6GiB"``; default on CUDA: free memory minus 25 %, at least 2 GiB; required on the CPU).
        load_weights: a local Hugging Face ``save_pretrained`` safetensors directory read straight into the fp32
            masters of a module built without weights (no second fp32 copy on the host; not read when resuming).
        disk: a directory on a local disk (``True``: the Trainer's ``default_root_dir``) for the masters and the
            optimizer state (``strategy="lowmem_offload_disk"``; needs ``optimizer_in_backward=True``): host RAM
            keeps only ``disk_buffer`` bytes of them, read ahead and written behind as each gradient lands
            (:class:`~lightning_lowmem.strategies.offload.disk_tier.DiskTier`, docs/techniques/offload.md, "Disk tier").
        disk_buffer: with ``disk``, the host RAM of the tier's parameters in flight (an int or ``"1GiB"``; at least
            one parameter's master and state are read at a time, however large); ``"auto"``: 64 B per element of the
            largest parameter (four of its master and state), at most 1 GiB.

    Example:
        >>> import lightning as L
        >>> import lightning_lowmem  # registers "lowmem_offload"
        >>> model = tiny_model()
        >>> trainer = L.Trainer(strategy="lowmem_offload", precision="bf16-true", accumulate_grad_batches=4,
        ...                     gradient_clip_val=1.0, max_steps=1, enable_progress_bar=False,
        ...                     enable_model_summary=False)
        >>> trainer.fit(model, tiny_data())
        >>> trainer.global_step, {p.dtype for p in model.parameters()}  # fp32 again after fit: the masters' values
        (1, {torch.float32})

        >>> # the blocks' weights on the host too, two blocks on the device at a time
        >>> trainer = L.Trainer(strategy=OffloadStrategy(offload_params=True, prefetch=1), precision="bf16-true")
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
        disk: str | os.PathLike | bool | None = None,
        disk_buffer: int | str = "auto",
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        checks.check_flags(
            optimizer_in_backward=optimizer_in_backward, host_optimizer=host_optimizer,
            check_host_memory=check_host_memory, nonfinite=nonfinite, max_consecutive_skips=max_consecutive_skips,
            offload_params=offload_params, prefetch=prefetch, device_budget=device_budget, load_weights=load_weights,
            disk=disk, disk_buffer=disk_buffer,
        )
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.optimizer_in_backward = optimizer_in_backward
        self.host_optimizer = host_optimizer
        self.check_host_memory = check_host_memory
        self.nonfinite = nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.offload_params = offload_params
        self.prefetch = prefetch
        self.device_budget = None if device_budget is None else parse_bytes(device_budget, "`device_budget`")
        self.load_weights = load_weights
        self.disk = disk
        self.disk_buffer = disk_buffer if disk_buffer == "auto" else parse_bytes(disk_buffer, "`disk_buffer`")
        self.load_report: dict[str, int] | None = None  # what `load_weights` read (files, tensors)
        self.resident_blocks: int | None = None  # with offload_params: how many blocks stayed resident (after setup)
        self._guard = NonFiniteGuard(nonfinite, max_consecutive_skips)
        # NOTE: Lightning fills `parallel_devices` only on strategies that have it (else "cpu" even on CUDA)
        self.parallel_devices: list[torch.device] | None = None
        self._loading = False
        self._reset()

    def _reset(self) -> None:
        """The parts, empty until ``setup`` builds them for one fit."""
        self._masters = HostMasters()
        self._tier: DiskTier | None = None
        self._transfer: HostTransfer | None = None
        self._stream: ParamStream | None = None
        self._schedule: SerialStep | StepInBackward = SerialStep(self._masters, None)
        self._kernel = HostKernel(self.host_optimizer)
        self._view: MastersView | None = None
        self._manual = ManualGrads()
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()  # the masters whose module parameter has the gradient hook
        self._marked: dict[int, int] = {}  # optimizer state marked host, per optimizer (`mark_host_state`)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped by the non-finite guard (bf16/fp32), over the strategy's life."""
        return self._guard.skipped_steps

    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else super().root_device

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = MasterHalfPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # NOTE: translated at assignment (the connector's own plugin for a strategy picked by name): `configure_model`
        # builds the module in fp32 and an unsupported precision is reported when the Trainer is built.
        self._precision_plugin = checks.to_master_precision(plugin, self._name)

    @property  # type: ignore[override]
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # NOTE: with the disk tier a resume maps the checkpoint (its tensors go to the tier's files page by page)
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO(self._on_disk)
        elif isinstance(self._checkpoint_io, lightning_internals.WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO(self._on_disk)  # sets the inner IO only if unset
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._check(trainer)
        if self._loading:
            hf_weights.materialize_meta(self.model)  # NOTE: before the optimizers are built over the parameters
        self.accelerator.setup(trainer)
        precision = self.precision_plugin
        assert isinstance(precision, MasterHalfPrecision)
        precision.device_type = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # NOTE: configure_optimizers sees the fp32 module; the groups are re-pointed at the masters below
            self.setup_optimizers(trainer)
            for opt in self.optimizers:
                checks.check_host_can_run(opt, self.host_optimizer)
        self._build_masters(trainer, fitting)
        self._repoint()
        self.model = precision.convert_module(self.model)
        self._masters.note_cast_buffers(self.model)
        if self.offload_params is not False:
            auto = self.offload_params == "auto" and self.device_budget is None
            budget = default_budget(self.root_device) if auto else self.device_budget
            self._stream, self.resident_blocks = plan_stream(self.model, self.offload_params, budget, self.prefetch,
                                                             self.root_device, log)
            # NOTE: before the move: the streamed weights never reach the device whole; a mastered one keeps no host copy
            masters = self._masters
            self._stream.detach_weights({k: masters.p_host[i] for k, i in masters.device_index.items()})
            self._masters.streamed = frozenset(self._stream.shapes)
        self.model_to_device()
        if self._stream is not None:
            self._stream.attach()
        self.model = lightning_internals.setup_model(self, self.model)
        self._transfer = transfer_for(self.root_device, self._masters.p_device, ring=self.optimizer_in_backward)
        self._view = MastersView(self._masters, self.lightning_module, self._to_compute, self._stream)  # type: ignore[arg-type]
        if fitting:
            if not self.lightning_module.automatic_optimization:  # type: ignore[union-attr]
                self._manual.attach(self._view, self.lightning_module)  # type: ignore[arg-type]
            guard = self._guard if self.nonfinite != "ignore" and precision.scaler is None else None
            if self.optimizer_in_backward:
                clip = trainer.gradient_clip_val
                self._schedule = StepInBackward(self._masters, guard, float(clip) if clip else None, lambda: self.optimizers,
                                                self._tier)
            else:
                self._schedule = SerialStep(self._masters, guard)
            self._follow_trainable()
        self._masters.note_device()
        self.setup_precision_plugin()
        # NOTE: no `_optimizers_to_device(root_device)`: the optimizer state belongs on the host.

    def _check(self, trainer: pl.Trainer) -> None:
        """Every problem this strategy sees in the Trainer, module and flags, raised together (see ``checks.py``)."""
        module = self.lightning_module
        assert module is not None
        precision = self.precision_plugin
        fitting = trainer.state.fn == TrainerFn.FITTING
        problems = checks.trainer_problems(self.accelerator, self.parallel_devices, module, trainer, precision,
                                          self.offload_params)
        problems += stream_problems(self.offload_params, self.device_budget, module, self.root_device)
        if self.optimizer_in_backward and fitting:
            problems += in_backward_problems(trainer, module, precision)  # type: ignore[arg-type]
        problems += preflight.checkpoint_dir_problems(trainer)  # NOTE: a save that would fail after the first step
        self._loading, loading = hf_weights.loading_problems(self.load_weights, module, trainer)
        problems += loading
        if problems:
            raise ValueError(f"`{type(self).__name__}` (strategy='{self._name}') cannot run this configuration:\n- "
                             + "\n- ".join(problems))

    @property
    def _name(self) -> str:
        """The registered name, for messages (NOTE: read by ``Strategy.__init__`` before ``offload_params`` is set)."""
        if self._on_disk:
            return "lowmem_offload_disk"
        return "lowmem_offload_params" if getattr(self, "offload_params", False) is True else "lowmem_offload"

    @property
    def _on_disk(self) -> bool:
        disk = getattr(self, "disk", None)  # NOTE: read by `_name` before `disk` is set
        return disk is not None and disk is not False

    def _build_masters(self, trainer: pl.Trainer, fitting: bool) -> None:
        module = self.lightning_module
        assert module is not None
        if self.check_host_memory:
            self._check_host_ram(module, self.optimizers if fitting else [], fitting, trainer.callbacks)  # type: ignore[arg-type]
        self._reset()
        precision = self.precision_plugin
        frozen = frozen_without_master(module, precision, self._loading, resuming=trainer.ckpt_path is not None)
        grad_buffers = fitting and not self.optimizer_in_backward
        if self._on_disk:
            directory = trainer.default_root_dir if self.disk is True else os.fspath(self.disk)
            self._check_disk(directory, module, self.optimizers if fitting else [], trainer.callbacks)  # type: ignore[arg-type]
            self._tier = DiskTier(directory, self._buffer_bytes(module))
        self._masters.build(module, self._loading, precision, grad_buffers=grad_buffers, frozen=frozen,
                            place=None if self._tier is None else self._tier.store)
        if self._loading:
            self.load_report = self._masters.load(self.load_weights)  # type: ignore[arg-type]
        if self._tier is None:
            mark_host(*self._masters.p_host, *(g for g in self._masters.grad_host if g is not None))
        else:
            mark_disk(*self._masters.p_host)  # NOTE: the Parameters, which outlive the tensors the tier marked
        self._masters.keep_buffers(module, precision)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._masters.p_host:  # masters exist already (a later call): point the new optimizers at them
            self._repoint()

    def _repoint(self) -> None:
        """Point every optimizer's param groups at the masters (making masters for the parameters unfrozen since setup),
        its state to the host; choose its host kernel."""
        self._masters_added(self._masters.master_unfrozen(stream_values.value_of(self._stream)))
        for optimizer in self.optimizers:
            self._masters.repoint(optimizer)
            self._kernel.choose(optimizer)

    def _masters_added(self, new: Sequence[int]) -> None:
        """Masters ``new`` were made after setup: their compute weights match them; the transfer learns of them."""
        if not new:
            return
        self._masters.note_device(new)
        if self._transfer is not None:
            self._transfer.synchronize()
            self._transfer = transfer_for(self.root_device, self._masters.p_device, ring=self.optimizer_in_backward)

    def host_bytes_needed(
        self, module: torch.nn.Module, optimizers: list[Optimizer], with_grads: bool = True, callbacks: Sequence[Any] = ()
    ) -> dict[str, int]:
        """Host bytes the strategy will allocate for ``module`` and ``optimizers``, by part (``"total"`` included):
        ``masters``, ``gradient_buffers``, ``optimizer_state`` (of the optimizer that will step, 8-bit when
        ``callbacks`` hold a ``LowBitOptimizer``), ``staging_or_compute_weights`` (pinned staging on CUDA, the compute
        weights on the CPU) and ``streamed_weights`` (host copies of streamed weights without a master; on CUDA the
        pinned ring the others' fetches are rounded into); with ``disk``, ``disk_tier_buffers`` (its budget) instead
        of masters and optimizer state, which ``disk`` counts (not in ``total``)."""
        precision = self.precision_plugin
        frozen = frozen_without_master(module, precision, self._loading)
        params = [p for _, p in HostMasters.unique_params(module)]
        mastered = [p for p in params if id(p) not in frozen]
        low_bit = next((cb for cb in callbacks if isinstance(cb, LowBitOptimizerSwap)), None)
        lean = next((cb for cb in callbacks if isinstance(cb, LeanOptimizerSwap)), None)
        embeddings = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
        if lean is not None:
            state = sum(lean.expected_state_bytes(opt, module) for opt in optimizers)
        else:
            state = sum(expected_state_bytes(opt, low_bit, embeddings) for opt in optimizers)
        dtype = precision.weight_dtype  # type: ignore[attr-defined]
        # NOTE: on CUDA the staging covers the mastered parameters only; on the CPU every compute weight is host RAM
        staged = mastered if self.root_device.type == "cuda" else params
        trainable = sum(p.numel() for p in mastered if p.requires_grad)
        on_disk = self._on_disk
        parts = {
            "masters": 4 * sum(p.numel() for p in mastered),
            "gradient_buffers": 4 * trainable if with_grads and not self.optimizer_in_backward else 0,
            "optimizer_state": state,
            "disk_tier_buffers": self._buffer_bytes(module) if on_disk else 0,
            "staging_or_compute_weights": planned_staging_bytes(self.root_device, [(p.numel(), dtype) for p in staged],
                                                                ring=self.optimizer_in_backward),
            "streamed_weights": streamed_host_bytes(self.offload_params, module, dtype, {id(p) for p in mastered},
                                                    self.prefetch + 2 if self.root_device.type == "cuda" else 0),
        }
        if on_disk:
            parts["disk"] = parts["masters"] + parts["optimizer_state"]
            parts["masters"] = parts["optimizer_state"] = 0
        parts["total"] = sum(v for k, v in parts.items() if k != "disk")
        return parts

    def _buffer_bytes(self, module: torch.nn.Module) -> int:
        """``disk_buffer`` in bytes (``"auto"``: 64 B per element of the largest parameter, at most 1 GiB)."""
        if self.disk_buffer != "auto":
            return self.disk_buffer  # type: ignore[return-value]
        return min(2**30, 64 * max((p.numel() for _, p in HostMasters.unique_params(module)), default=0))

    @property
    def tier_buffer_bytes(self) -> int:
        """The disk tier's budget of host RAM in flight (0 without a tier, or outside a fit)."""
        return self._tier.budget if self._tier is not None else 0

    def _check_disk(self, directory: str, module: torch.nn.Module, optimizers: list[Optimizer],
                    callbacks: Sequence[Any]) -> None:
        """Refuse a tier directory that is missing or (with ``check_host_memory``: not in a dry run, which predicts a
        run that may be on another machine) cannot hold the masters and optimizer state, naming both."""
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
            raise ValueError(f"`OffloadStrategy(disk={self.disk!r})`: {directory!r} is not a writable directory; "
                             "create it, or pass a directory on a local disk (an NVMe SSD is best).")
        if not self.check_host_memory:
            return
        need, free = self.host_bytes_needed(module, optimizers, False, callbacks)["disk"], shutil.disk_usage(directory).free
        if need > free:
            raise ValueError(
                f"`OffloadStrategy(disk={self.disk!r})`: the disk tier needs {need / 2**30:.2f} GiB in {directory!r} "
                f"(fp32 masters and optimizer state), and {free / 2**30:.2f} GiB are free there; free space, pass a "
                "directory on a larger disk, or use 8-bit optimizer state (`callbacks=[LowBitOptimizer()]`).")

    def _check_host_ram(self, module: torch.nn.Module, optimizers: list[Optimizer], with_grads: bool,
                        callbacks: Sequence[Callback]) -> None:
        """Raise (naming the parts and the fixes) when the host cannot hold what this strategy is about to allocate."""
        need = self.host_bytes_needed(module, optimizers, with_grads, callbacks)
        need.pop("total")
        need.pop("disk", None)
        swapped = any(isinstance(cb, (LowBitOptimizerSwap, LeanOptimizerSwap)) for cb in callbacks)
        fixes = []
        if need["optimizer_state"] and not swapped:
            fixes.append("8-bit optimizer state (`callbacks=[LowBitOptimizer()]`, ~2 B/param for Adam instead of 8) or a "
                         "lean optimizer (`callbacks=[LeanOptimizer(kind='galore')]`, 'apollo_mini', 'adamw4bit', ...)")
        if need["gradient_buffers"]:
            fixes.append("`OffloadStrategy(optimizer_in_backward=True)` (no gradient buffers)")
        fixes += ["a smaller model, or a machine/container with more RAM (or raise the limit named above)",
                  "`OffloadStrategy(check_host_memory=False)` to try anyway"]
        host_memory.check_host_memory({k.replace("_", " "): v for k, v in need.items()},
                                      who=f"`OffloadStrategy` (strategy='{self._name}')", fixes=fixes)

    @property
    def masters(self) -> dict[str, Parameter]:
        """``{parameter name: fp32 host master}`` (empty outside ``fit``/``validate``/``test``)."""
        return dict(zip(self._masters.names, self._masters.p_host))

    @property
    def ring_bytes(self) -> int:
        """Pinned host bytes of the streamed weights' upload ring on CUDA (:meth:`ParamStream.ring_bytes`; 0 without)."""
        return self._stream.ring_bytes() if self._stream is not None else 0

    @override
    def master_of(self, p_host: Tensor) -> Parameter | None:
        return self._masters.master_of(p_host)

    @override
    def masters_view(self, *, grads: bool = False, write_back: bool = False) -> AbstractContextManager:
        """Inside, the module's own parameters are the fp32 masters (``grads``: with their gradients), for code written
        for the fp32 module; ``write_back`` if it writes them. A frozen weight without a master shows its value: its
        compute weight, or a streamed block's host copy."""
        return self._view.view(grads=grads, buffers=True, write_back=write_back) if self._view else nullcontext()

    def _follow_trainable(self) -> None:
        """Hook the gradient of every trainable parameter that has no hook yet (e.g. unfrozen after setup)."""
        self._repoint()
        masters = self._masters
        for i, p in enumerate(masters.p_device):
            if not p.requires_grad or i in self._hooked:
                continue
            self._hooked.add(i)
            self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i)))
            masters.p_host[i].requires_grad_(True)  # NOTE: a no-op at setup (the master copied the flag)
            if self._schedule.grad_buffers and masters.grad_host[i] is None:
                masters.grad_host[i] = torch.empty_like(masters.p_host[i])
                mark_host(masters.grad_host[i])

    def _grad_ready(self, i: int, p_device: Tensor) -> None:
        """The gradient hook of module parameter ``i``: its gradient leaves the device for the step schedule."""
        grad = p_device.grad
        if grad is None:
            return
        self._manual.grad_ready()
        if not self._masters.p_host[i].requires_grad:
            # NOTE: `toggle_optimizer` (manual optimization) froze the master, not this weight: plain Lightning
            # would compute no gradient for it, so none reaches the master.
            p_device.grad = None
            return
        assert self._transfer is not None
        self._transfer.grad_to_host(i, grad, self._schedule.on_grad)
        p_device.grad = None  # NOTE: the device gradient is freed here, one parameter at a time

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._stream is not None:
            self._stream.hook_blocks()  # NOTE: after the callbacks' hooks of `on_train_start` (see ParamStream.hook_blocks)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._follow_trainable()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        assert module is not None
        self._manual.before_backward()  # NOTE: backward needs the compute weights (the gradients accumulate on the masters)
        self._adopt_writes()
        self._schedule.before_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        # NOTE: [drain before user code] every gradient is on the masters before `on_after_backward`
        if self._transfer is not None:
            self._transfer.synchronize()
        self._schedule.drain()
        if self._stream is not None:
            self._stream.release_all()  # NOTE: backward is over: the next forward fetches from the first block
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self._manual.after_backward()  # manual optimization: `p.grad` is the master's until the step
        return closure_loss

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        self._manual.before_step()
        self._adopt_writes()
        self._kernel.choose(optimizer)  # NOTE: an optimizer swapped in after setup (a callback's, in on_fit_start)

        def closure_then_guard() -> Any:
            out = closure()
            self._schedule.after_closure(optimizer, model)  # the non-finite guard
            return out

        out = self._schedule.step(self.precision_plugin, optimizer, model, closure_then_guard, **kwargs)
        mark_host_state(optimizer, self._marked)
        upload = functools.partial(self._to_compute, self._masters.pairs(optimizer))
        if self._manual.attached:  # NOTE: code after `opt.step()` may write the stepped masters (manual_grads.py)
            self._manual.after_step(upload)
        else:
            upload()
        if (self._schedule.guard is not None and lightning_internals.attached_trainer(model) is not None
                and lightning_internals.current_hook(model) is not None):
            # NOTE: only inside a loop hook (training_step, optimizer_step): `log` refuses elsewhere
            model.log("lowmem/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1)
        return out

    def _adopt_writes(self) -> None:
        """Copy compute weights other code wrote into their masters (outside a view, which shows the masters)."""
        if self._view is None or not self._view.depth:
            self._masters.adopt_writes()

    def _to_compute(self, pairs: Sequence[tuple[int, Parameter, Parameter]]) -> None:
        """Round masters into their compute weights (a streamed one: into its host copy); with the disk tier, one
        master at a time, read ahead."""
        assert self._transfer is not None
        tier = self._tier
        if tier is None:
            stream_values.copy_to_compute(self._transfer, self._stream, pairs)
        else:
            tier.plan((i for i, _, _ in pairs), master_only=True)
            for pair in pairs:
                tier.acquire(pair[0])
                stream_values.copy_to_compute(self._transfer, self._stream, [pair])
                tier.release(pair[0], wrote=False)
        self._masters.note_device([i for i, _, _ in pairs])

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._stream.first_use_check("train") if self._stream is not None else nullcontext():
                return super().training_step(*args, **kwargs)
        finally:
            self._manual.close()  # NOTE: a `manual_backward` whose step comes in a later batch (manual accumulation)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._stream.first_use_check("validate") if self._stream is not None else nullcontext():
            return super().validation_step(*args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        module = self.lightning_module
        if (module is not None and module.trainer.state.fn == TrainerFn.FITTING
                and not is_overridden("on_validation_model_zero_grad", module, pl.LightningModule)):
            # NOTE: Lightning's default `on_validation_model_zero_grad` clears the parameters' gradients: here the
            # masters' (a step without backward after it, SWA's BatchNorm epoch, must find none).
            for p_host in self._masters.p_host:
                p_host.grad = None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict with the fp32 masters for the weights (a plain fp32 module loads it)."""
        module = self.lightning_module
        assert module is not None
        self._adopt_writes()
        state = self._masters.state_dict(module)
        if self._stream is not None:
            # NOTE: streamed weights without a master are saved from their host copies, not through `host_view`
            # (leaving it releases every block: a checkpoint taken mid-fit would leave the next forward's NaN).
            host = self._stream.host_of()
            for key, value in module.state_dict(keep_vars=True).items():
                if id(value) in host and id(value) not in self._masters.device_index:
                    state[key] = host[id(value)].detach()
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        _resume_checks.check_model(checkpoint, self.lightning_module)  # NOTE: another model's checkpoint, named
        with self._stream.host_view() if self._stream is not None else nullcontext():  # streamed: into the host copies
            super().load_model_state_dict(checkpoint, strict=strict)
        # NOTE: [resumed after an unfreeze] in masters.py (a checkpoint loaded after setup)
        new = self._masters.master_from_checkpoint(checkpoint["state_dict"])
        if new:
            self._masters_added(new)
            self._repoint()
        if self._masters.p_host:  # loaded after setup: the masters take the checkpoint's fp32 values too
            self._masters.load_state_dict(checkpoint["state_dict"])
            self._masters.note_device()  # NOTE: the load wrote the compute weights: not a write to adopt

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # NOTE: no `_optimizer_to_device(root_device)`: torch puts the state next to its parameters, the masters
        self._repoint()
        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            _resume_checks.load_optimizer(optimizer, opt_state, _resume_checks.where(self.lightning_module.trainer))
            self._kernel.reloaded(optimizer)
            if self._tier is not None:  # NOTE: the loaded state goes to the tier's files, one master at a time
                for p_host, state in optimizer.state.items():
                    i = self._masters.host_index.get(id(p_host))
                    if i is not None:
                        self._tier.place_state(i, state, at_once=True)
            self._marked.pop(id(optimizer), None)
            mark_host_state(optimizer, self._marked)  # load_state_dict made new state tensors

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self._tier is not None:
            self._tier.release_all()  # NOTE: the save read every master and state: their pages leave RAM again

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes of compute weights and gradients on the device; masters, gradients, optimizer state on the host (on
        the disk with the disk tier, its buffers in flight on the host as ``other``)."""
        out = MemoryBreakdown()
        module = self.lightning_module
        if module is not None:
            with self._view.hidden() if self._view is not None else nullcontext():  # NOTE: called in a hook's view
                out.add("device", "weights", module_weight_bytes(module))
                out.add("device", "gradients", module_grad_bytes(module))
        masters = self._masters
        state = unique_storage_bytes(masters.p_host) + sum(optimizer_state_bytes(opt) for opt in self.optimizers)
        if self._tier is not None:  # NOTE: state tensors smaller than a page stay in RAM
            out.add("disk", "optimizer_state", self._tier.bytes_on_disk)
            out.add("host", "other", self._tier.bytes_in_ram)
            state -= self._tier.placed_bytes
        out.add("host", "optimizer_state", state)  # fp32 masters and the optimizer's state
        host_grads = [g for g in masters.grad_host if g is not None] + [p.grad for p in masters.p_host if p.grad is not None]
        out.add("host", "gradients", unique_storage_bytes(host_grads))
        if self._transfer is not None:
            out.add("host", "other", self._transfer.staging_bytes())
        if self._stream is not None:
            out.add("host", "weights", self._stream.host_bytes())  # the streamed blocks' compute copies
        return out

    def host_bytes_per_param(self) -> dict[str, float]:
        """Host bytes per parameter of the module, by part of :meth:`memory_breakdown` (``"total"`` included)."""
        numel = sum(p.numel() for p in self._masters.p_host)
        host = self.memory_breakdown().host
        out = {k: v / numel for k, v in host.items() if v} if numel else {}
        out["total"] = sum(out.values())
        return out

    @override
    def teardown(self) -> None:
        self._manual.detach()
        for handle in self._hooks:
            handle.remove()
        if self._transfer is not None:
            self._transfer.synchronize()
        if self._tier is not None:
            self._tier.close()  # NOTE: the files stay mapped: the fp32 module given back holds the masters' maps
        if self._stream is not None:
            self._stream.remove()
            give_back_streamed(self._stream, self._masters.device_index)  # NOTE: packed 4-bit and frozen: no master
        self._kernel.restore()
        module = self.lightning_module
        if module is not None and self._masters.p_host:
            self._masters.adopt_writes()  # NOTE: an `on_train_end` / `on_fit_end` that wrote the weights
            self._masters.adopt_untracked_writes()  # NOTE: and one that wrote them through `.data` (WeightAveraging)
            self._masters.give_back_fp32(module, self.optimizers)
        self._reset()
        if module is not None and any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            # NOTE: a meta-device module refused by setup: Strategy.teardown's `.cpu()` would fail and hide why
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()


__all__ = ["NonFiniteGradientError", "OffloadStrategy"]

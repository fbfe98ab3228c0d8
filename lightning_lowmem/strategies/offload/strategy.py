"""``lowmem_offload``: half-precision compute weights on the accelerator; fp32 masters, gradients and optimizer on the host.

The flow of one optimizer step (for users: docs/techniques/offload.md; docs/design.md tells it as well):

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

import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core import preflight as _preflight
from lightning_lowmem.core.checkpoint_io import AtomicCheckpointIO
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.roles import HostMastersStrategy
from lightning_lowmem.core.units import parse_bytes
from lightning_lowmem.strategies.offload import checks as _offload_checks
from lightning_lowmem.strategies.offload import hf_weights
from lightning_lowmem.strategies.offload import host_bytes as _offload_host_bytes
from lightning_lowmem.strategies.offload import host_optimizer as _host_optimizer
from lightning_lowmem.strategies.offload.checks import NONFINITE, NonFinite  # noqa: F401
from lightning_lowmem.strategies.offload.delayed_step import delayed_problems
from lightning_lowmem.strategies.offload.host_pass import HostPass, HostPassMode
from lightning_lowmem.strategies.offload.host_pass_copies import WorkingGrads
from lightning_lowmem.strategies.offload.host_state import HostState
from lightning_lowmem.strategies.offload.host_step import HostStep, NonFiniteGradientError  # noqa: F401  (imported from here too)
from lightning_lowmem.strategies.offload.manual_grads import ManualGrads
from lightning_lowmem.strategies.offload.masters import HostMasters, frozen_without_master
from lightning_lowmem.strategies.offload.masters_view import MastersView, wrap_finetuning, wrap_hooks
from lightning_lowmem.strategies.offload.packed_weights import give_back_streamed
from lightning_lowmem.strategies.offload.param_stream import OffloadParams, ParamStream
from lightning_lowmem.strategies.offload.precision import MasterHalfPrecision
from lightning_lowmem.strategies.offload.reused_grads import ReusedGrads
from lightning_lowmem.strategies.offload.stream_plan import default_budget, plan_stream
from lightning_lowmem.strategies.offload.transfer import HostTransfer

log = logging.getLogger(__name__)

class OffloadStrategy(Reproducible, HostMastersStrategy, HostStep, HostState, SingleDeviceStrategy):
    """CPU-master training on one device: only the compute weights (and activations) stay on the accelerator.

    Memory on the device: 2 B/param for bf16/fp16 compute weights (4 B for ``"32-true"``) plus
    activations and one parameter's gradient at a time, against 16 B/param for plain fp32 AdamW.
    On the host: fp32 masters (4 B/param), fp32 gradient buffers (4 B/param, none with
    ``optimizer_in_backward``), the optimizer state (8 B/param for Adam), and on CUDA pinned staging
    buffers in the compute dtype (2 B/param). Cost: 2 B/param over PCIe each way per step and the
    host optimizer step (memory-bandwidth bound, ~28 B touched per parameter for AdamW).

    Precision is the Trainer's ``precision`` flag: ``"bf16-true"``, ``"16-true"``, ``"bf16-mixed"``,
    ``"16-mixed"`` or ``"32-true"`` (see :class:`~lightning_lowmem.strategies.offload.precision.MasterHalfPrecision`;
    fp16 uses dynamic loss scaling that skips overflowing steps). Any torch optimizer and LR scheduler
    from ``configure_optimizers`` keeps working; gradient clipping (norm and value) and gradient
    accumulation work on the masters. Code written for the fp32 module sees the fp32 masters through the module's
    own parameters (``.data`` swapped for the call, see ``strategies/offload/masters_view.py``): the gradient hooks
    (``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``) with their ``.grad``, every
    hook of Lightning's weight averaging (``StochasticWeightAveraging``, ``WeightAveraging``), the user's own
    ``on_train_batch_start``/``on_train_batch_end``/``on_train_epoch_end``/``on_before_zero_grad`` with the last step's
    ``.grad``, ``zero_grad()`` of the module, and in manual optimization ``training_step`` from each ``manual_backward`` or ``opt.step()`` to the next
    forward (``strategies/offload/manual_grads.py``); your own such code: ``with trainer.strategy.masters_view():``.
    Elsewhere the parameters hold the compute weights and no ``.grad`` (the masters: :attr:`masters`).

    Args:
        optimizer_in_backward: step each master on the host as soon as its gradient is ready (on CUDA on a host
            worker while backward goes on, ``strategies/offload/host_worker.py``; on the CPU in the gradient hook) and
            free that gradient (no host gradient buffers: -4 B/param of host memory). Needs ``accumulate_grad_batches=1``, no norm clipping (value
            clipping works), bf16 or fp32, and automatic optimization.
        host_optimizer: ``"auto"`` runs ``torch.optim.Adam``/``AdamW`` with torch's fused CPU kernel
            (same update rule, rounding differs by a few ulp; ~5x the for-loop kernel on the host);
            ``"as_is"`` runs the user's optimizer bit for bit as configured; ``"torch_fused"`` is
            ``"auto"`` but refuses optimizers it cannot fuse.
        host_pass: ``"overlap"`` steps the masters bucket by bucket on a host worker during the last backward of each
            window (uploading each into its compute weights, from the second window on), then checks the clip and the
            non-finite guard and redoes the step serially where they change it: bit-identical to ``"serial"`` (the default), +4 B/param of host RAM plus a copy of the optimizer state
            (see :mod:`~lightning_lowmem.strategies.offload.host_pass`, which names the cases that stay serial).
            ``"delayed"`` (opt in; DeepSpeed's delayed parameter update) steps each window on a host worker during the
            next window's forward and backward, which therefore compute on the weights before that step (one step
            stale: this changes what is trained), +4 B/param of host RAM (on CUDA +2 B/param more, pinned, in bf16; see
            :mod:`~lightning_lowmem.strategies.offload.delayed_step`, which says when the step lands early).
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
            (one ``torch._foreach_norm``). With ``optimizer_in_backward`` the loss is checked before backward
            (a non-finite loss skips the whole step) and each gradient before its parameter steps.
        max_consecutive_skips: with ``nonfinite="skip"``, raise after this many skipped steps in a row.
        offload_params: ``True`` (``strategy="lowmem_offload_params"``) streams the compute weights of every repeated
            block (GPT-2's ``transformer.h``, LLaMA's ``model.layers``) from host copies in the compute dtype (pinned on
            CUDA, +2 B/param of host memory in bf16): on the device only the non-block weights (embeddings, LM head,
            final norm) and ``prefetch + 1`` blocks at a time (on CUDA one more, released, that the GPU may still read). Cost: each block's weights cross PCIe once in forward and
            once in backward, overlapped with compute on a side stream (see
            :class:`~lightning_lowmem.strategies.offload.param_stream.ParamStream`). ``"auto"``: the first blocks stay resident
            as far as ``device_budget`` allows, the rest stream (the choice is logged). ``False``: all resident.
        prefetch: how many streamed blocks are copied ahead of the one computing (0: fetch on use).
        device_budget: with ``offload_params="auto"``, the device bytes the compute weights may take (an int or a
            size such as ``"6GiB"``): the non-block weights, ``prefetch + 1`` streamed blocks (+ 1 on CUDA) and the resident blocks
            must fit; activations need room beside it. Default on CUDA: the free memory minus 25 % (at least 2 GiB);
            required on the CPU.
        load_weights: a local Hugging Face ``save_pretrained`` directory in safetensors: its tensors are read one at a
            time straight into the fp32 masters of a module built without weights (on the ``meta`` device, or under
            ``trainer.init_module(empty_init=True)``, whose fp32 storage becomes the masters), so the host never holds
            a second fp32 copy (see :mod:`~lightning_lowmem.strategies.offload.hf_weights`). Not read when resuming from
            ``ckpt_path`` (the checkpoint's weights win).

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
        host_optimizer: _host_optimizer.HostOptimizer = "auto",
        host_pass: HostPassMode = "serial",
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
        _offload_checks.check_flags(
            optimizer_in_backward=optimizer_in_backward,
            host_optimizer=host_optimizer,
            host_pass=host_pass,
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
        self.host_pass = host_pass
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
        self._warned_rounded_write = False  # [writes outside the hooks] into a half compute weight: warned once
        self._warned_serial_pass = False  # host_pass="overlap" asked for where the step must stay serial
        # NOTE: Lightning fills `parallel_devices` (the accelerator's device) only on strategies that have the
        # attribute; without it a strategy picked by name stays on "cpu" even with accelerator="cuda".
        self.parallel_devices: list[torch.device] | None = None
        self._reset()

    def _reset(self) -> None:
        self._masters = HostMasters()
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()  # the masters whose module parameter has the gradient hook
        self._transfer: HostTransfer | None = None
        self._stream: ParamStream | None = None
        self._reused: ReusedGrads | None = None  # *-mixed: fp32 sums of a repeatedly called layer's half weights
        self._view: MastersView | None = None  # see strategies/offload/masters_view.py
        self._manual = ManualGrads()  # manual optimization: the gradients until the step (strategies/offload/manual_grads.py)
        self._unwrap: Callable[[], None] = lambda: None
        self._fused: dict[int, tuple[Optimizer, list[dict[str, Any]]]] = {}
        self._owner_cache: tuple[tuple[int, ...], dict[int, tuple[Optimizer, dict[str, Any]]]] | None = None
        self._clip_value: float | None = None
        self._pass: HostPass | None = None  # host_pass="overlap" (strategies/offload/host_pass.py), made at the first step
        self._skip_backward = False  # optimizer_in_backward: this backward's loss was not finite
        self._bad_in_backward: list[str] = []  # optimizer_in_backward: parameters whose gradient was not finite
        self._stepped_in_backward: set[int] = set()  # optimizer_in_backward: masters stepped in this backward
        self._cast_use_checked = False  # *-mixed: the first training step checked (strategies/offload/mixed_check.py)
        self._grad_fp32 = WorkingGrads()  # optimizer_in_backward: half gradients widened into a reused fp32 buffer
        self._state_marked: dict[int, set[int]] = {}  # NOTE: masters whose state is marked host (`mark_host` once each)

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
        self._precision_plugin = _offload_checks.to_master_precision(plugin)

    @property  # type: ignore[override]
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, lightning_internals.WrappingCheckpointIO):
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
                _offload_checks.check_host_can_run(opt, self.host_optimizer)
        self._build_masters(self.model, self.optimizers if fitting else [], with_grads=fitting)
        if fitting:
            for opt in self.optimizers:
                self._repoint(opt)
        self.model = precision.convert_module(self.model)
        if fitting and precision.mixed and precision.compute_dtype != torch.float32:
            half = [p for p in self._masters.p_device if p.dtype == precision.compute_dtype]
            self._reused = ReusedGrads(self.model, half, self._masters.device_index)
        self._masters.note_cast_buffers(self.model)
        if self.offload_params is not False:
            auto = self.offload_params == "auto" and self.device_budget is None
            budget = default_budget(self.root_device) if auto else self.device_budget
            self._stream, self.resident_blocks = plan_stream(self.model, self.offload_params, budget, self.prefetch,
                                                             self.root_device, log)
            self._stream.detach_weights()  # NOTE: before the move: the streamed weights never reach the device whole
        self.model_to_device()
        if self._stream is not None:
            self._stream.attach()
        self.model = lightning_internals.setup_model(self, self.model)
        self._transfer = self._new_transfer()
        self._view = MastersView(self._masters, self.lightning_module, self._to_compute, self._stream)  # type: ignore[arg-type]
        self._view.before_show, self._view.after_restore = self.adopt_device_writes, self._note_device
        undo = (wrap_hooks(trainer.callbacks, self.lightning_module, self._view),  # type: ignore[arg-type]
                wrap_finetuning(trainer.callbacks, self._masters, lambda: self.optimizers, self._repoint),
                self._land_early(trainer))

        def unwrap() -> None:
            for u in undo:
                u()

        self._unwrap = unwrap
        if fitting and not self.lightning_module.automatic_optimization:  # type: ignore[union-attr]
            self._manual.attach(self._view, self.lightning_module)  # type: ignore[arg-type]
        if fitting:
            clip = trainer.gradient_clip_val
            self._clip_value = float(clip) if self.optimizer_in_backward and clip else None
            self._follow_trainable()
        self._note_device()
        precision.attach(drain=self.drain_transfers, view=self._view)  # NOTE: the gradient hooks see the masters
        self.setup_precision_plugin()
        # NOTE: no `_optimizers_to_device(root_device)`: the optimizer state belongs on the host.

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._stream is not None:
            self._stream.hook_blocks()  # NOTE: after the callbacks' hooks of `on_train_start` (see ParamStream.hook_blocks)
        if self._reused is not None:
            self._reused.hook()  # NOTE: after the stream's hooks: its views are taken of fetched weights

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._follow_trainable()
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if self.optimizer_in_backward and trainer.accumulate_grad_batches != 1:
            # NOTE: an accumulation scheduler setup did not know (Lightning's is refused there)
            raise ValueError(
                f"`OffloadStrategy(optimizer_in_backward=True)`: `accumulate_grad_batches` became "
                f"{trainer.accumulate_grad_batches} at epoch {trainer.current_epoch}; the step in backward cannot "
                "accumulate. Remove the accumulation scheduler, or set `optimizer_in_backward=False`."
            )

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._masters.p_host:  # masters exist already (a later call): point the new optimizers at them
            for opt in self.optimizers:
                self._repoint(opt)

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        problems = _offload_checks.trainer_problems(self, module, trainer)
        problems += _offload_checks.streaming_problems(self, module) + delayed_problems(self, module)
        problems += _preflight.checkpoint_dir_problems(trainer)  # NOTE: a save that would fail after the first step
        self._loading, loading = _offload_checks.loading_problems(self.load_weights, module, trainer)
        problems += loading
        if problems:
            raise ValueError(
                f"`{type(self).__name__}` (strategy='lowmem_offload') cannot run this configuration:\n- "
                + "\n- ".join(problems)
            )

    # --- masters and their host RAM (see strategies/offload/masters.py, strategies/offload/host_bytes.py) -------
    def host_bytes_needed(
        self,
        module: torch.nn.Module,
        optimizers: list[Optimizer],
        with_grads: bool = True,
        callbacks: Sequence[Any] = (),
    ) -> dict[str, int]:
        """Host bytes the strategy will allocate for ``module`` and ``optimizers``, by part.

        The optimizer state is that of the optimizer that will step: ``optimizers`` as configured, the
        bitsandbytes 8-bit one when ``callbacks`` hold a ``LowBitOptimizer`` (see :func:`lightning_lowmem.core.optimizer_state.expected_state_bytes`),
        or a ``LeanOptimizer``'s own figure; ``host_pass_copies``: what ``host_pass="overlap"`` keeps.
        """
        return _offload_host_bytes.host_bytes_needed(self, module, optimizers, with_grads, callbacks)

    def _build_masters(self, module: torch.nn.Module, optimizers: list[Optimizer], with_grads: bool) -> None:
        if self.check_host_memory:
            _offload_host_bytes.check_host_ram(self, module, optimizers, with_grads)
        self._reset()
        masters = self._masters
        precision = self.precision_plugin
        trainer = lightning_internals.attached_trainer(self.lightning_module)
        frozen = frozen_without_master(module, precision, self._loading,
                                       resuming=trainer is not None and trainer.ckpt_path is not None)
        masters.build(module, self._loading, precision, grad_buffers=with_grads and not self.optimizer_in_backward,
                      frozen=frozen)
        if self._loading:
            self.load_report = masters.load(self.load_weights)  # type: ignore[arg-type]
        masters.mark_host()
        masters.keep_buffers(module, precision)

    def _repoint(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s param groups at the masters; move any state it has to the host."""
        self._master_unfrozen(repoint=False)  # NOTE: a group added with unfrozen parameters (BackboneFinetuning)
        self._masters.repoint(optimizer)
        if id(optimizer) in self._fused:  # NOTE: groups added since (`add_param_group`) take the host kernel too
            saved = self._fused[id(optimizer)][1]
            for group in optimizer.param_groups[len(saved):]:
                saved.append({"fused": group.get("fused"), "foreach": group.get("foreach")})
                group["fused"], group["foreach"] = True, False
        if (self.host_optimizer != "as_is" and id(optimizer) not in self._fused
                and _host_optimizer.why_not_fused(optimizer) is None):
            self._fused[id(optimizer)] = (optimizer, _host_optimizer.enable_fused(optimizer))

    @property
    def masters(self) -> dict[str, Parameter]:
        """``{parameter name: fp32 host master}`` (empty outside ``fit``/``validate``/``test``)."""
        self._delayed.land()  # NOTE: host_pass="delayed": the step on the worker writes them
        return self._masters.as_dict()

    @override
    def master_of(self, p_host: Tensor) -> Parameter | None:
        """The module parameter that ``p_host`` is the master of (None if it is not a master)."""
        return self._masters.master_of(p_host)

    def masters_view(self, *, grads: bool = False, write_back: bool = False) -> AbstractContextManager:
        """Inside, the module's own parameters are the fp32 masters (``grads``: with their gradients as ``.grad``), for
        code written for the fp32 module (your own weight averaging callback); ``write_back`` if it writes them. A
        frozen weight without a master shows its value: its compute weight, or a streamed block's host copy."""
        return self._view.view(grads=grads, buffers=True, write_back=write_back) if self._view else nullcontext()

    # --- gradients ---------------------------------------------------------------------------------------
    def _grad_ready(self, i: int, sink: Callable[[int, Tensor], None], p_device: Tensor) -> None:
        grad = p_device.grad
        if grad is None:
            return
        if self._pass is not None:
            self._pass.arrived(i)  # NOTE: as the hook fires (the gradient may reach the pass later: see `HostPass.arrived`)
        self._manual.grad_ready()
        if not self._masters.p_host[i].requires_grad:
            # NOTE: `LightningModule.toggle_optimizer` (manual optimization, e.g. a GAN) turns off `requires_grad`
            # on the parameters of the *optimizers*, i.e. on the masters, not on these device weights; plain Lightning
            # would compute no gradient for them, so the one backward produced here must not reach the master.
            p_device.grad = None
            return
        assert self._transfer is not None
        if self._reused is not None:
            summed = self._reused.take(i, grad)
            if summed is not grad:  # NOTE: an fp32 sum (a layer called several times): straight to the host
                p_device.grad = None
                sink(i, summed.to(self._masters.p_host[i].device))
                return
        self._transfer.grad_to_host(i, grad, sink)
        p_device.grad = None  # NOTE: the device gradient is freed here, one parameter at a time

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self._manual.before_backward()  # NOTE: backward needs the compute weights (the gradients accumulate on the masters)
        self.adopt_device_writes(land=False)  # NOTE: optimizer_in_backward steps the masters inside this backward
        # NOTE: with optimizer_in_backward each parameter steps inside backward: a non-finite loss must be caught
        # before the first one does (one scalar; a device sync on CUDA).
        self._skip_backward = bool(
            self.optimizer_in_backward and self._guarding() and not torch.isfinite(closure_loss.detach()).all()
        )

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.drain_transfers()  # NOTE: a no-op here in `Trainer.fit`: the precision plugin drained (see below)
        self._manual.after_backward()  # manual optimization: `p.grad` is the master's until the step

    # --- teardown ----------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        self._manual.detach()
        self._unwrap()
        for handle in self._hooks:
            handle.remove()
        if self._transfer is not None:
            self._transfer.synchronize()
        self._close_workers()
        if self._stream is not None:
            self._stream.remove()
            give_back_streamed(self._stream, self._masters.device_index)  # NOTE: packed 4-bit and frozen: no master
        if self._reused is not None:
            self._reused.remove()
        for optimizer, flags in self._fused.values():
            _host_optimizer.restore(optimizer, flags)
        module = self.lightning_module
        if module is not None and self._masters.p_host:
            self.adopt_device_writes()  # NOTE: an `on_train_end` / `on_fit_end` that wrote the weights
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

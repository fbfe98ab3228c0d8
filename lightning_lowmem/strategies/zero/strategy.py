"""``ZeroStrategy``: the ``lowmem_zero*`` DeepSpeed ZeRO presets, with the reference settings of Hugging Face's
DeepSpeed integration docs (https://huggingface.co/docs/transformers/main/en/deepspeed), on CUDA or the CPU
(docs/techniques/zero.md).
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem._internals import deepspeed as deepspeed_internals
from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core import atomic as _atomic
from lightning_lowmem.core import preflight as _preflight
from lightning_lowmem.core import trusted_load as _trusted_load
from lightning_lowmem.core import warning_filters as _warnings
from lightning_lowmem.core.optional import require
from lightning_lowmem.core.reentrant import reentrant_fix
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.schedulers import repoint_scheduler
from lightning_lowmem.strategies.zero import checkpoint as zckpt
from lightning_lowmem.strategies.zero import config as zc
from lightning_lowmem.strategies.zero import resume as _zero_resume
from lightning_lowmem.strategies.zero.after_fit import PartitionWarning, gather_full_weights
from lightning_lowmem.strategies.zero.checks import batching_loader, loader_problem, module_problems, setup_problems
from lightning_lowmem.strategies.zero.consolidation import consolidate  # noqa: F401 (re-exported)
from lightning_lowmem.strategies.zero.host_bytes import check_zero_host_memory, check_zero_nvme_space

_FEATURE = "The `lowmem_zero*` strategies (ZeroStrategy)"


class ZeroStrategy(Reproducible, DeepSpeedStrategy):
    """DeepSpeed ZeRO with Hugging Face's reference settings, Trainer flags flowing in, on CUDA or the CPU.

    Memory saved (per process, ``N`` processes, ``P`` parameters, fp16/bf16 training): stage 2 shards the fp32 masters,
    Adam moments and gradients (``16P -> 2P + 14P/N`` bytes of model state on the device); stage 3 shards the 16-bit
    weights too (``16P/N``). ``offload_optimizer`` moves the sharded fp32 state and the Adam step to host memory,
    ``offload_parameters`` (stage 3) the weights as well; ``offload_device="nvme"`` puts both on a local SSD. The
    cost: gradients cross to the host and weights back every step, and the step runs on the CPU.

    The Trainer's accumulation, clipping, precision and batch size go into the DeepSpeed config; ``config=`` is
    deep-merged over it (a contradiction with what Lightning applies too is an error). Checkpoints are atomic and read
    weights-only; skipped inf/nan steps are logged as ``lowmem/skipped_steps``.

    Example:
        >>> trainer = L.Trainer(strategy="lowmem_zero3_offload", precision="bf16-mixed", accumulate_grad_batches=4)
        >>> type(trainer.strategy).__name__
        'ZeroStrategy'
        >>> nvme = ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True,  # doctest: +SKIP
        ...                     offload_device="nvme", nvme_path="/local_nvme")  # a directory on a local NVMe drive
        >>> trainer = L.Trainer(strategy=nvme)  # doctest: +SKIP

    Args:
        stage: ZeRO stage (1: optimizer state sharded, 2: + gradients, 3: + parameters).
        offload_optimizer: keep optimizer state and its step on ``offload_device``.
        offload_parameters: keep the parameters on ``offload_device`` (stage 3 only).
        offload_device: ``"cpu"`` or ``"nvme"``; ``nvme`` needs stage 3 and ``nvme_path`` (or ``LOWMEM_NVME_PATH``),
            whose free space is checked at fit start against what DeepSpeed will swap there.
        nvme_path: an existing, writable directory on a fast local drive.
        pin_memory: page-locked host buffers for the offloaded state (faster copies on CUDA).
        overlap_comm, contiguous_gradients, reduce_bucket_size, allgather_bucket_size, sub_group_size:
            DeepSpeed's ``zero_optimization`` keys; ``reduce_bucket_size=None`` means 2e8 (stage 1/2) or
            ``hidden_size**2`` (stage 3, as Hugging Face's ``"auto"``).
        gather_16bit_weights_on_model_save: ``stage3_gather_16bit_weights_on_model_save``.
        cpu_optimizer: with offload, replace ``torch.optim.Adam``/``AdamW`` by ``DeepSpeedCPUAdam``.
        check_host_memory: with offload, refuse to start when the host RAM DeepSpeed will allocate on this machine
            (every local process's buffers and optimizer state) is more than this process may use.
        gather_on_fit_end: stage 3 only: at the end of ``fit`` put each parameter's full fp32 value back into the
            module for ``module.state_dict()`` (else they stay partitioned, and it warns); the partitions are kept.
        config: a DeepSpeed config dict or JSON path merged over everything above.
        **kwargs: other ``DeepSpeedStrategy`` arguments (``parallel_devices``, ``cluster_environment``,
            ``process_group_backend``, ``timeout``, ``load_full_weights``, ``remote_device``, ...).
    """

    strategy_name = "lowmem_zero"

    def __init__(
        self,
        stage: Literal[1, 2, 3] = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_device: zc.OffloadDevice = "cpu",
        nvme_path: str | os.PathLike | None = None,
        pin_memory: bool = True,
        overlap_comm: bool = True,
        contiguous_gradients: bool = True,
        reduce_bucket_size: int | None = None,
        allgather_bucket_size: int = int(2e8),
        sub_group_size: int = int(1e9),
        gather_16bit_weights_on_model_save: bool = True,
        cpu_optimizer: bool = True,
        check_host_memory: bool = True,
        config: dict[str, Any] | str | os.PathLike | None = None,
        gather_on_fit_end: bool = False,
        **kwargs: Any,
    ) -> None:
        require("deepspeed", _FEATURE)
        flags = {"offload_optimizer": offload_optimizer, "offload_parameters": offload_parameters, "pin_memory": pin_memory,
                 "cpu_optimizer": cpu_optimizer, "check_host_memory": check_host_memory,
                 "gather_on_fit_end": gather_on_fit_end}
        problems = [f"Passed `{k}={v!r}`; expected True or False." for k, v in flags.items() if not isinstance(v, bool)]
        bad_type = bool(problems)
        if gather_on_fit_end is True and stage != 3:
            problems.append(
                f"Passed `gather_on_fit_end=True` with `stage={stage}`; only stage 3 partitions the module's "
                "parameters (remove it, or use stage=3)."
            )
        # NOTE: LightningCLI passes every DeepSpeedStrategy default through **kwargs: those are dropped
        kwargs = {k: v for k, v in kwargs.items() if k in _PASSTHROUGH or _PARENT_DEFAULTS.get(k, _MISSING) != v}
        if stage not in (1, 2, 3):
            problems.append(f"Passed `stage={stage!r}`; expected 1, 2 or 3.")
        if offload_device not in ("cpu", "nvme"):
            problems.append(f"Passed `offload_device={offload_device!r}`; expected 'cpu' or 'nvme'.")
        if offload_parameters and stage != 3:
            problems.append(f"Passed `offload_parameters=True` with `stage={stage}`; parameter offload needs stage 3.")
        if offload_device == "nvme" and stage != 3:
            problems.append(f"Passed `offload_device='nvme'` with `stage={stage}`; DeepSpeed swaps to NVMe only at stage "
                            "3 (stages 1 and 2 keep the optimizer state in host RAM): use stage=3, or 'cpu'.")
        unknown = set(kwargs) - _PASSTHROUGH
        if unknown:
            replaced = sorted(unknown & set(_PARENT_DEFAULTS))
            problems.append(
                f"Passed argument(s) {sorted(unknown)}: "
                + (f"{replaced} are DeepSpeedStrategy config-building arguments that ZeroStrategy replaces by its own "
                   "(`stage`, `offload_*`, `pin_memory`, ...) and `config=`; " if replaced else "")
                + f"ZeroStrategy also passes on {sorted(_PASSTHROUGH)}. Other DeepSpeed keys go in `config=`."
            )
        sizes = {"reduce_bucket_size": reduce_bucket_size, "allgather_bucket_size": allgather_bucket_size,
                 "sub_group_size": sub_group_size}
        wrong_size, bad_size, ignored = zc.size_arguments(stage, sizes, _OWN_DEFAULTS)
        problems += wrong_size + bad_size
        if problems:
            raise (TypeError if bad_type or wrong_size else ValueError)(" ".join(problems))
        for message in ignored:
            rank_zero_warn(f"ZeroStrategy: {message}")
        if offload_device == "nvme":
            nvme_path = zc.check_nvme_path(nvme_path or os.environ.get("LOWMEM_NVME_PATH"))
            kwargs.setdefault("remote_device", "nvme")
        self.gather_on_fit_end = gather_on_fit_end
        self._warning_filters: list[Any] = []
        self._partition_warning = PartitionWarning()
        self._batching_loader: type | None = None  # see `process_dataloader`
        self._warned_skip = False
        self._user_config = zc.load_user_config(config)
        if config_problems := zc.config_problems(self._user_config):
            raise ValueError(f"ZeroStrategy(config=...): {' '.join(config_problems)}")
        self._cpu_optimizer = cpu_optimizer
        self.check_host_memory = check_host_memory
        self._offload_optimizer = offload_optimizer
        preset = zc.reference_config(
            stage=stage, offload_optimizer=offload_optimizer, offload_parameters=offload_parameters,
            offload_device=offload_device, nvme_path=None if nvme_path is None else str(nvme_path),
            pin_memory=pin_memory, overlap_comm=overlap_comm, contiguous_gradients=contiguous_gradients,
            reduce_bucket_size=int(reduce_bucket_size) if reduce_bucket_size else ("auto" if stage == 3 else int(2e8)),
            allgather_bucket_size=int(allgather_bucket_size), sub_group_size=int(sub_group_size),
            gather_16bit_weights_on_model_save=gather_16bit_weights_on_model_save, zero_force_ds_cpu_optimizer=True,
        )
        # NOTE: merged now: `zero_stage_3` and `model_sharded_context` (before `setup`) see the final ZeRO section
        super().__init__(config=zc.merge(preset, self._user_config), **kwargs)

    @override
    def setup_environment(self) -> None:
        # NOTE: the parent refuses every accelerator but CUDA; DeepSpeed itself picks its CPU accelerator.
        _preflight.check_start(self)  # a stray LOCAL_RANK, a stale op-build lock: refused instead of waiting forever
        DDPStrategy.setup_environment(self)

        _warnings.remove(self._warning_filters)
        specs = [_warnings.DEEPSPEED_COLLECTIVES] + ([_warnings.SYNC_DIST_ONE_PROCESS] if self.world_size == 1 else [])
        self._warning_filters = _warnings.install(*specs)  # removed in `teardown`

    @override
    def setup(self, trainer: Any) -> None:
        self._partition_warning.remove()
        if self.config is not None and self.lightning_module is not None:
            # NOTE: the layers `configure_model` built (after the config was checked) are checked now
            self._refuse(module_problems(self, self.lightning_module, str(self.precision_plugin.precision), self.config))
        super().setup(trainer)

    def _refuse(self, problems: list[str | None]) -> None:
        """One ``ValueError`` listing every problem (None entries are none)."""
        problems = [p for p in problems if p is not None]
        if problems:
            raise ValueError(f"{type(self).__name__} cannot run this configuration:\n- " + "\n- ".join(problems))

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        module = self.lightning_module
        if not self.zero_stage_3 or module is None:
            return

        if self.gather_on_fit_end:
            gather_full_weights(module)
        # NOTE: also after a gather: the next forward under DeepSpeed partitions the weights again
        self._partition_warning.watch(module)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # NOTE: Lightning's checkpoint dict (DeepSpeed writes the partitions itself): no partition warning
        with self._partition_warning.quiet():
            return super().lightning_module_state_dict()

    @override
    def teardown(self) -> None:
        super().teardown()
        if self.zero_stage_3:
            deepspeed_internals.undo_zero3_linear()

        _warnings.remove(self._warning_filters)
        self._warning_filters = []

    @override
    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            return super().setup_distributed()
        # NOTE: `_validate_device_index_selection` fails on the CPU device's `None` index; the rest is kept.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()
        return None

    @override
    def _init_deepspeed_distributed(self) -> None:
        deepspeed_internals.drop_stale_process_groups()  # NOTE: a second fit in the same process
        with _preflight.rendezvous_notice(self):
            super()._init_deepspeed_distributed()

    @property
    def _device_rank(self) -> int:
        # NOTE: DeepSpeed compares `device_rank` with 0; the CPU device's index is None.
        index = self.root_device.index
        return self.local_rank if index is None else index

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:  # (a DeepSpeedEngine, its optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        return self._initialize(model, self.config, optimizer, lr_scheduler, params)

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        # NOTE: the parent's, with `_device_rank` for the device's index (None on the CPU)
        assert isinstance(self.config, dict)
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        config.update({key: self.config[key] for key in ("fp16", "bf16") if key in self.config})
        if self.zero_stage_3:
            config.update({key: self.config[key] for key in ("zero_allow_untested_optimizer", "zero_optimization")})
        remove_module_hooks(model)
        self.model, _ = self._initialize(model, config)

    def _initialize(self, model: Module, config: Any, optimizer: Any = None, lr_scheduler: Any = None,
                    params: list[Any] | None = None) -> tuple[Any, Any]:
        """``deepspeed.initialize`` as the parent calls it, with a ``CheckedCheckpointEngine``."""
        import deepspeed

        from lightning_lowmem.strategies.zero import checkpoint_engine  # NOTE: imports DeepSpeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank), config=config, model=model,
            model_parameters=params or [], optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False,
        )
        self._checkpoints = checkpoint_engine.install(engine)
        return engine, ds_optimizer

    def _writes_shared_files(self) -> bool:
        """Whether this process writes the checkpoint's shared files (``latest``, the swap): DeepSpeed's rank 0."""
        engine = self.model
        if engine is not None and engine.use_node_local_storage():
            return self.local_rank == 0
        return self.is_global_zero

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: lightning_internals.PATH, storage_options: Any | None = None) -> None:
        """DeepSpeed's directory checkpoint, written to ``.NAME.tmp-PID/`` beside ``filepath``, fsync-ed, swapped in
        (a process killed midway leaves the previous checkpoint and at most the temp directory)."""
        if storage_options is not None or not lightning_internals.is_local_file_protocol(filepath):
            with self._partition_warning.quiet():
                super().save_checkpoint(checkpoint, filepath, storage_options)  # the parent refuses storage_options
            return
        target = Path(self.broadcast(str(Path(filepath).absolute())))
        tmp = Path(self.broadcast(str(_atomic.temp_path(target))))
        writer = self._writes_shared_files()
        if writer:
            target.parent.mkdir(parents=True, exist_ok=True)
            _atomic.clean_orphans(target, keep=tmp)
            if tmp.exists():
                shutil.rmtree(tmp)  # an earlier save of this process that failed midway
        self.barrier("lowmem_zero_save_begin")
        # NOTE: DeepSpeed takes the module's state dict: the partition warning is for the user's own
        with self._partition_warning.quiet(), zckpt.recorded_saves(self._checkpoints, tmp, target):
            super().save_checkpoint(checkpoint, tmp)  # every process writes its shards (DeepSpeed ends with a barrier)
            if writer:
                zckpt.write_manifest(tmp)  # last
                _atomic.fsync_tree(tmp)
        if writer:
            _atomic.replace_dir(tmp, target)
        self.barrier("lowmem_zero_save_end")

    @override
    def load_checkpoint(self, checkpoint_path: lightning_internals.PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if (self.load_full_weights and self.zero_stage_3) or not lightning_internals.is_local_file_protocol(checkpoint_path):
            # NOTE: explicit, so that neither TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD nor Lightning's remote-URL default unpickles
            return super().load_checkpoint(checkpoint_path, True if weights_only is None else weights_only)
        path = Path(checkpoint_path)
        if self._writes_shared_files():
            _atomic.recover(path)  # a previous version left under `.NAME.old-PID` by a kill mid-swap
        self.barrier("lowmem_zero_load")
        problem = zckpt.zero_checkpoint_problem(path, stage=3 if self.zero_stage_3 else 2)
        if problem is not None:
            raise (FileNotFoundError if not path.exists() else ValueError)(
                f"Cannot resume from `ckpt_path={str(checkpoint_path)!r}` with `{type(self).__name__}`: {problem}"
            )
        try:
            # NOTE: weights-only unless the caller passed `weights_only=False` (DeepSpeed's own engine unpickles fully)
            with self._checkpoints.reading(path, trusted=weights_only is False, opt_in=_trusted_load.TRAINER_OPT_IN):
                checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        except (RuntimeError, KeyError) as err:  # NOTE: another model shape / optimizer: say so, naming the file
            readable = _zero_resume.load_error(err, self.model.optimizer, f"`ckpt_path={str(path)!r}`")
            if readable is None:
                raise
            raise readable from err
        _zero_resume.replay_cpu_adam_steps(self.model.optimizer)  # NOTE: see `strategies.zero.resume`
        return checkpoint

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # NOTE: Lightning rebuilt the loader (its distributed sampler) before this hook: see `checks.loader_problem`
        if self._batching_loader is not None and isinstance(dataloader, self._batching_loader):
            self._refuse([loader_problem(dataloader)])
        return super().process_dataloader(dataloader)

    @override
    def _format_config(self) -> None:
        assert self.lightning_module is not None and self.config is not None
        trainer = self.lightning_module.trainer
        precision = str(self.precision_plugin.precision)
        source = lightning_internals.fit_data_source(trainer)
        loader = source.dataloader() if source.is_defined() else None  # NOTE: as given, before Lightning rebuilds it
        self._batching_loader = batching_loader(loader)
        trainer_cfg = zc.trainer_settings(
            accumulate_grad_batches=trainer.accumulate_grad_batches, gradient_clip_val=trainer.gradient_clip_val,
            precision=precision, micro_batch_size=_micro_batch_size(loader),
            fp16={k: getattr(self, k) for k in zc.FP16_REFERENCE},
        )
        errors, warnings = zc.conflicts(trainer_cfg, self._user_config, precision)
        merged = zc.merge(zc.merge(self.config, trainer_cfg), self._user_config)
        if not errors:
            zc.resolve_auto(merged, zc.hidden_size_of(self.lightning_module), self.world_size)
        self._refuse(errors + setup_problems(self, trainer, precision, merged) + _preflight.checkpoint_dir_problems(trainer))
        for message in warnings:
            rank_zero_warn(f"{type(self).__name__}: {message}.")
        self.config.clear()
        self.config.update(merged)

    @override
    def _init_optimizers(self) -> tuple[Optimizer, Any]:
        optimizer, scheduler_config = super()._init_optimizers()
        if self.check_host_memory:
            check_zero_host_memory(self, optimizer)  # NOTE: before DeepSpeedCPUAdam and the engine allocate anything
        check_zero_nvme_space(self, optimizer)
        if not (self._offload_optimizer and self._cpu_optimizer):
            return optimizer, scheduler_config

        from lightning_lowmem.strategies.zero.optim import to_cpu_optimizer  # NOTE: imports DeepSpeed

        with _preflight.SlowStartNotice("Creating DeepSpeedCPUAdam", _preflight.OP_BUILD_HINT):
            cpu_optimizer, message = to_cpu_optimizer(optimizer, self.config)
        if cpu_optimizer is not optimizer:
            rank_zero_info(message)
            if scheduler_config is not None:
                repoint_scheduler(scheduler_config.scheduler, optimizer, cpu_optimizer)
        return cpu_optimizer, scheduler_config

    #: A micro-batch's loss is divided by the accumulation once (by Lightning's loop), not again by DeepSpeed.
    loss_divided_once = True

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # NOTE: Lightning's loop already divides the loss by `accumulate_grad_batches` (not again: 1/k^2)
        kwargs.setdefault("scale_wrt_gas", False)
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        except AssertionError as err:
            asserted = deepspeed_internals.reduced_twice(err)
            if asserted is None:
                raise
            raise ValueError(
                f"lowmem_zero (DeepSpeed ZeRO-{self.config['zero_optimization']['stage']}): a parameter's gradient arrived twice in one backward "
                "(a block shared by two reentrant-checkpointed segments: each inner backward hands over its part), "
                f"and DeepSpeed reduces each gradient once per backward (it asserted: {asserted}). "
                + reentrant_fix("use `strategy='lowmem_offload'`, which sums the parts")) from err

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # NOTE: DeepSpeed skips inf/nan steps silently under bf16/fp32: logged, and the first one warns
        engine = self.deepspeed_engine
        before = int(getattr(engine, "skipped_steps", 0) or 0)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if engine is None:
            return out
        skipped, module = int(engine.skipped_steps or 0), model or self.lightning_module
        trainer = lightning_internals.attached_trainer(module)
        if skipped > before and not self._warned_skip and not engine.fp16_enabled():
            self._warned_skip = True
            warnings.warn(
                f"ZeroStrategy: DeepSpeed skipped the optimizer step at global step "
                f"{trainer.global_step if trainer is not None else '?'}: the gradients held inf/nan. The weights and "
                "the optimizer state are unchanged. Skips are counted in `lowmem/skipped_steps`; this warning is shown "
                "once. Look for the batch or loss that produced it (`Trainer(detect_anomaly=True)`), or lower the "
                "learning rate if it keeps happening.",
                RuntimeWarning,
                stacklevel=2,
            )
        if trainer is not None and lightning_internals.current_hook(module) is not None:
            # NOTE: only inside a loop hook (`optimizer_step`): `log` refuses elsewhere
            module.log("lowmem/skipped_steps", float(skipped), on_step=True, on_epoch=False, batch_size=1)
        return out


def _micro_batch_size(loader: Any) -> int:
    # NOTE: the parent's `_auto_select_batch_size` fails on loaders with `batch_size=None` (no batch sampler).
    size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or getattr(loader, "batch_size", None)
    return int(size) if isinstance(size, int) and size > 0 else 1


_MISSING = object()
_OWN_DEFAULTS = {name: p.default for name, p in inspect.signature(ZeroStrategy.__init__).parameters.items()}
_PARENT_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(DeepSpeedStrategy.__init__).parameters.items()
    if p.default is not inspect.Parameter.empty
}
_PASSTHROUGH = {
    "accelerator", "remote_device", "zero_allow_untested_optimizer", "logging_batch_size_per_gpu", "logging_level",
    "parallel_devices", "cluster_environment", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
    "min_loss_scale", "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
    "synchronize_checkpoint_boundary", "load_full_weights", "precision_plugin", "process_group_backend", "timeout",
    "exclude_frozen_parameters",
}

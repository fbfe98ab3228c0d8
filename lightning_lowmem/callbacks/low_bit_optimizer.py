"""``LowBitOptimizer``: swap the LightningModule's optimizer for its bitsandbytes 8-bit equivalent, by flag."""

from __future__ import annotations

import warnings
from typing import Any, Literal, get_args

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from typing_extensions import override

from lightning_lowmem.core.accounting import mark_host_state
from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.core.optimizer_state import optimizer_family
from lightning_lowmem.core.optional import require
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.roles import LowBitOptimizerSwap, module_param_of
from lightning_lowmem.core.schedulers import repoint_scheduler

Kind = Literal["adamw8bit", "paged_adamw8bit", "lion8bit", "adam8bit"]
KINDS: tuple[str, ...] = get_args(Kind)

# kind -> (bitsandbytes.optim class, algorithm family)
_TARGETS: dict[str, tuple[str, str]] = {
    "adamw8bit": ("AdamW8bit", "adam"),
    "paged_adamw8bit": ("PagedAdamW8bit", "adam"),
    "adam8bit": ("Adam8bit", "adam"),
    "lion8bit": ("Lion8bit", "lion"),
}
# family -> what a source optimizer of that family is, for messages
_FAMILY_SOURCES = {
    "adam": "torch.optim.AdamW, torch.optim.Adam, or a bitsandbytes Adam/AdamW",
    "lion": "a Lion optimizer (bitsandbytes.optim.Lion/Lion32bit, lion_pytorch.Lion)",
}
# param-group keys of torch optimizers that bitsandbytes has no use for (dropped from the groups)
_TORCH_ONLY_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")
# hyper-parameters carried into the new optimizer's defaults (for groups added later)
_DEFAULT_KEYS = ("lr", "betas", "eps", "weight_decay")


def _describe(optimizer: torch.optim.Optimizer) -> str:
    return f"`{type(optimizer).__module__}.{type(optimizer).__qualname__}`"


class LowBitOptimizer(Reproducible, LowBitOptimizerSwap, Callback):
    """Replace the optimizer your LightningModule configured by its bitsandbytes 8-bit equivalent.

    Memory saved: Adam/AdamW's two fp32 moments (8 B per parameter) become 1 B each plus one fp32 absmax per 256
    values, about 2.03 B per parameter: 75 % of the optimizer state (Lion: 4 B -> ~1.02 B). Tensors with fewer than
    ``min_8bit_size`` elements keep 32-bit state. Cost: the update is quantized (it tracks fp32 AdamW closely); on
    CPU each tensor's state is dequantized into fp32 temporaries for the update (8 B per element of the largest).

    The swap (in ``on_fit_start``, before a checkpoint is restored) and ``lowmem_offload``:
    docs/techniques/low-bit-optimizers.md.

    Args:
        kind: ``"adamw8bit"``/``"adam8bit"`` replace a ``torch.optim.AdamW``/``Adam`` (decoupled weight decay: an
            ``Adam`` with L2 ``weight_decay > 0`` is refused); ``"paged_adamw8bit"`` adds CUDA unified-memory paging;
            ``"lion8bit"`` replaces a Lion optimizer.
        min_8bit_size: tensors with fewer elements keep 32-bit state (bitsandbytes' default 4096).
        stable_embedding: keep every ``nn.Embedding`` weight's state in 32 bit (the optimizer half of bitsandbytes'
            ``StableEmbedding``; the module is left as it is).

    Refused at fit start: an optimizer with no 8-bit equivalent, options bitsandbytes cannot honour, a DeepSpeed or
    FSDP strategy.

    Example (the demo module's ``configure_optimizers()`` returns ``torch.optim.AdamW(...)``):

        >>> from lightning_lowmem import LowBitOptimizer
        >>> trainer = L.Trainer(callbacks=[LowBitOptimizer(kind="adamw8bit")], max_steps=1,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(tiny_model(), tiny_data())
        >>> type(trainer.optimizers[0]).__name__
        'AdamW8bit'
    """

    def __init__(self, kind: Kind = "adamw8bit", min_8bit_size: int = 4096, stable_embedding: bool = False) -> None:
        problems, wrong_type = [], False
        if kind not in KINDS:
            problems.append(f"`kind={kind!r}`; expected one of {', '.join(repr(k) for k in KINDS)}")
        if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
            problems.append(f"`min_8bit_size={min_8bit_size!r}`; expected an int >= 0 (elements of a tensor)")
            wrong_type |= isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int)
        if not isinstance(stable_embedding, bool):
            problems.append(f"`stable_embedding={stable_embedding!r}`; expected True or False")
            wrong_type = True
        if problems:
            raise (TypeError if wrong_type else ValueError)("LowBitOptimizer: passed " + "; passed ".join(problems) + ".")
        self.kind = kind
        self.min_8bit_size = min_8bit_size
        self.stable_embedding = stable_embedding
        # NOTE: bitsandbytes' override registry is process-wide, by id(param): ours are removed in teardown
        self._override_ids: list[int] = []
        self._n_state_marked: dict[int, int] = {}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(kind={self.kind!r}, min_8bit_size={self.min_8bit_size}, "
                f"stable_embedding={self.stable_embedding})")

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_lightning_object(trainer, "the Trainer")
        if stage != "fit":
            return
        require("bitsandbytes", f"LowBitOptimizer(kind={self.kind!r})")
        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy):
            raise ValueError(  # noqa: TRY004  (a strategy this callback cannot work with, not a wrong argument type)
                f"LowBitOptimizer cannot be used with `{type(strategy).__name__}`: DeepSpeed wraps the optimizer "
                "in its engine (and offloads it with its own CPU Adam). Remove the callback, or use "
                "`strategy='lowmem_offload'`, whose host optimizer it can replace."
            )
        if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            raise ValueError(  # noqa: TRY004  (as above)
                f"LowBitOptimizer cannot be used with `{type(strategy).__name__}`: bitsandbytes' 8-bit state is "
                "block-quantized per whole tensor and cannot follow sharded parameters (bitsandbytes#89). Use "
                "`strategy='ddp'`, a single device, or `strategy='lowmem_offload'`."
            )

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # NOTE: before `restore_training_state`: a checkpoint's optimizer state loads into the 8-bit optimizer
        strategy = trainer.strategy
        new_optimizers = [self.convert(opt) for opt in strategy.optimizers]
        for old, new in zip(strategy.optimizers, new_optimizers):
            if new is not old:
                for config in strategy.lr_scheduler_configs:
                    repoint_scheduler(config.scheduler, old, new)
        strategy.optimizers = new_optimizers  # the setter rebuilds Lightning's LightningOptimizer wrappers
        if self.stable_embedding:  # every nn.Embedding weight's state in 32 bit
            manager = require("bitsandbytes", "LowBitOptimizer").optim.GlobalOptimManager.get_instance()
            embeddings = {id(m.weight) for m in pl_module.modules() if isinstance(m, torch.nn.Embedding)}
            # NOTE: under lowmem_offload the optimizer steps host masters (`module_param_of` maps them)
            params = [p for optimizer in new_optimizers for group in optimizer.param_groups for p in group["params"]]
            for p in params:
                if id(module_param_of(pl_module, p)) in embeddings:
                    manager.override_config(p, key_value_dict={"optim_bits": 32})
                    self._override_ids.append(id(p))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for optimizer in trainer.optimizers:
            mark_host_state(optimizer, self._n_state_marked)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._override_ids:
            manager = require("bitsandbytes", "LowBitOptimizer").optim.GlobalOptimManager.get_instance()
            for pid in self._override_ids:
                manager.pid2config.pop(pid, None)
            self._override_ids.clear()

    def target_class(self) -> type[torch.optim.Optimizer]:
        """The ``bitsandbytes.optim`` class of ``kind``."""
        bnb = require("bitsandbytes", f"LowBitOptimizer(kind={self.kind!r})")
        return getattr(bnb.optim, _TARGETS[self.kind][0])

    def convert(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The 8-bit equivalent of ``optimizer`` over the same param groups (``optimizer`` itself if it is one)."""
        cls = self.target_class()
        if type(optimizer) is cls:
            return optimizer
        self.check_convertible(optimizer)
        if any(len(s) for s in optimizer.state.values()):
            warnings.warn(
                f"LowBitOptimizer: {_describe(optimizer)} already holds state; it is not carried into the 8-bit "
                "optimizer, which starts from zero moments.",
                stacklevel=2,
            )
        # NOTE: every key is kept: schedulers store `initial_lr` and momentums in the groups
        groups = [{k: v for k, v in group.items() if k not in _TORCH_ONLY_KEYS} for group in optimizer.param_groups]
        defaults = {k: optimizer.defaults[k] for k in _DEFAULT_KEYS if k in optimizer.defaults}
        if _TARGETS[self.kind][1] == "lion":
            defaults.pop("eps", None)
        new = cls(groups, min_8bit_size=self.min_8bit_size, **defaults)
        if getattr(new, "is_paged", False) and any(p.device.type == "cpu" for g in groups for p in g["params"]):
            # bitsandbytes warns once itself at the first step; say it where the choice is made too.
            warnings.warn(
                "LowBitOptimizer(kind='paged_adamw8bit'): the parameters are on the CPU, where bitsandbytes "
                "does not page; it runs as 'adamw8bit'.",
                stacklevel=2,
            )
        return new

    def check_convertible(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise ``ValueError`` naming every reason ``optimizer`` has no exact 8-bit equivalent of ``kind``."""
        family = _TARGETS[self.kind][1]
        source = optimizer_family(optimizer)
        if source is None:
            raise ValueError(
                f"LowBitOptimizer(kind={self.kind!r}) cannot replace {_describe(optimizer)}: it has no 8-bit "
                "equivalent here. The kinds that exist are " + "; ".join(
                    f"{k!r} (replaces {_FAMILY_SOURCES[f]})" for k, (_, f) in _TARGETS.items()
                ) + ". Configure one of those optimizers in `configure_optimizers`, or remove the callback."
            )
        if source != family:
            fitting = [k for k, (_, f) in _TARGETS.items() if f == source]
            raise ValueError(
                f"LowBitOptimizer(kind={self.kind!r}) replaces {_FAMILY_SOURCES[family]}, not "
                f"{_describe(optimizer)}: swapping it would change the algorithm. For this optimizer use "
                f"kind={' or '.join(repr(k) for k in fitting)}."
            )
        problems = []
        for i, group in enumerate(optimizer.param_groups):
            problems += [f"param group {i} has `{key}=True`, which bitsandbytes does not implement"
                         for key in ("amsgrad", "maximize") if group.get(key)]
            l2 = isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW)
            if l2 and group.get("weight_decay", 0) and not group.get("decoupled_weight_decay", False):
                problems.append(
                    f"param group {i} has `weight_decay={group['weight_decay']}` on `torch.optim.Adam`, i.e. L2 "
                    "added to the gradient; bitsandbytes decays the weights decoupled (AdamW). Use "
                    "`torch.optim.AdamW` (a different regulariser) or weight_decay=0"
                )
            wide = sum(p.dtype == torch.float64 for p in group["params"])
            if wide:
                problems.append(f"param group {i} holds {wide} float64 parameter(s), which bitsandbytes' kernels do not "
                                "step (float32, bfloat16 and float16 only): cast them to float32, or remove the callback")
        if problems:
            raise ValueError(f"LowBitOptimizer(kind={self.kind!r}) cannot replace {_describe(optimizer)}: "
                             + "; ".join(problems) + ".")

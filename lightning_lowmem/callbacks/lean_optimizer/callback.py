"""``LeanOptimizer``: swap the LightningModule's AdamW for a memory-lean optimizer (GaLore, APOLLO, APOLLO-Mini,
Adam-mini, torchao's 4-/8-bit AdamW), by flag."""

from __future__ import annotations

import functools
from typing import Any, Literal, get_args

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from typing_extensions import override

from lightning_lowmem.callbacks.lean_optimizer import build
from lightning_lowmem.callbacks.lean_optimizer.state_bytes import lean_state_bytes
from lightning_lowmem.core.accounting import mark_host_state
from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.roles import LeanOptimizerSwap, LowBitOptimizerSwap, module_param_of
from lightning_lowmem.core.schedulers import repoint_scheduler

Kind = Literal["galore", "apollo", "apollo_mini", "adam_mini", "adamw4bit", "adamw8bit"]
KINDS: tuple[str, ...] = get_args(Kind)
ProjType = Literal["std", "reverse_std", "left", "right"]
PROJ_TYPES: tuple[str, ...] = get_args(ProjType)
PROJECTED = ("galore", "apollo", "apollo_mini")
TORCHAO = ("adamw4bit", "adamw8bit")
# Adam-mini partitions queries/keys per head: these names (its own list) need the head count
_ADAM_MINI_QK = ("k_proj", "q_proj", "wq", "wk", "query", "key")


def _is_int(x: Any, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


class LeanOptimizer(Reproducible, LeanOptimizerSwap, Callback):
    """Replace the ``torch.optim.AdamW``/``Adam`` your LightningModule configured by a memory-lean optimizer.

    What it saves (optimizer state per parameter, AdamW: 8 B): ``"galore"`` (``galore-torch``) and ``"apollo"``
    (``apollo-torch``) keep Adam's moments of each projected ``m x n`` weight in rank ``r``: ``8 r max(m, n)`` B
    plus the projection (GaLore ``4 r min(m, n)``, APOLLO the same, regenerated from a seed); ``"apollo_mini"`` is
    APOLLO at rank 1 (tensor-wise scaling); ``"adam_mini"`` (``adam-mini``) keeps one second moment per head /
    neuron / tensor instead of per value (~4 B); torchao's ``"adamw8bit"``/``"adamw4bit"`` keep block-quantized
    moments (~2 B / ~1 B). Weights that are not projected (embeddings, the output head, norms, biases) keep full
    Adam state in the same optimizer. Cost: the maths changes (a low-rank or shared second moment, quantized
    state); GaLore runs an SVD per projected weight every ``update_proj_gap`` steps; torchao compiles its step.

    The swap (in ``on_fit_start``), which weights are projected, ``lowmem_offload`` and what is refused:
    docs/techniques/lean-optimizers.md.

    Args:
        kind: the optimizer (its package is an extra: ``galore``, ``apollo``, ``adam-mini``, ``torchao``).
        rank: the projection rank (GaLore 128, APOLLO 256, APOLLO-Mini 1 by default).
        update_proj_gap: steps between new projections (200, the packages' default).
        scale: the low-rank update's scale (GaLore 0.25, APOLLO 1, APOLLO-Mini 128 by default).
        proj_type: which side is projected (the packages' ``proj_type``; ``"std"``: the smaller one).
        dim, n_heads, n_kv_heads: Adam-mini's transformer shape (read from the model's Hugging Face config when
            not given).
        block_size: torchao's quantization block (its defaults: 256 for 8-bit, 128 for 4-bit).

    Example (the demo module's ``configure_optimizers()`` returns ``torch.optim.AdamW(...)``):

        >>> from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
        >>> trainer = L.Trainer(callbacks=[LeanOptimizer(kind="galore", rank=8)], max_steps=1,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(tiny_model(), tiny_data())
        >>> type(trainer.optimizers[0]).__module__
        'galore_torch.adamw'
    """

    def __init__(self, kind: Kind = "galore", rank: int | None = None, update_proj_gap: int = 200,
                 scale: float | None = None, proj_type: ProjType = "std", dim: int | None = None,
                 n_heads: int | None = None, n_kv_heads: int | None = None, block_size: int | None = None) -> None:
        problems: list[str] = []
        wrong_type = False
        if kind not in KINDS:
            problems.append(f"`kind={kind!r}`; expected one of {', '.join(repr(k) for k in KINDS)}")
        ints = {"rank": (rank, PROJECTED), "dim": (dim, ("adam_mini",)), "n_heads": (n_heads, ("adam_mini",)),
                "n_kv_heads": (n_kv_heads, ("adam_mini",)), "block_size": (block_size, TORCHAO)}
        for name, (value, kinds) in ints.items():
            if value is None:
                continue
            if not _is_int(value, 1):
                problems.append(f"`{name}={value!r}`; expected an int >= 1")
                wrong_type |= not isinstance(value, int) or isinstance(value, bool)
            elif kind in KINDS and kind not in kinds:
                problems.append(f"`{name}={value!r}` with kind={kind!r}; it applies to kind={' or '.join(map(repr, kinds))}")
        if not _is_int(update_proj_gap, 1):
            problems.append(f"`update_proj_gap={update_proj_gap!r}`; expected an int >= 1 (steps)")
            wrong_type |= not isinstance(update_proj_gap, int) or isinstance(update_proj_gap, bool)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
            problems.append(f"`scale={scale!r}`; expected a number > 0")
            wrong_type |= isinstance(scale, bool) or not isinstance(scale, (int, float))
        elif scale is not None and kind in KINDS and kind not in PROJECTED:
            problems.append(f"`scale={scale!r}` with kind={kind!r}; it applies to kind='galore', 'apollo' or "
                            "'apollo_mini'")
        if proj_type not in PROJ_TYPES:
            problems.append(f"`proj_type={proj_type!r}`; expected one of {', '.join(map(repr, PROJ_TYPES))}")
        if _is_int(n_heads, 1) and _is_int(n_kv_heads, 1) and n_heads % n_kv_heads:
            problems.append(f"`n_heads={n_heads}`, `n_kv_heads={n_kv_heads}`; n_heads must be a multiple of n_kv_heads")
        if problems:
            raise (TypeError if wrong_type else ValueError)("LeanOptimizer: passed " + "; passed ".join(problems) + ".")
        self.kind = kind
        default_rank, default_scale = build.PROJECTION_DEFAULTS.get(kind, (None, None))
        self.rank = rank if rank is not None else default_rank
        self.update_proj_gap = update_proj_gap
        self.scale = float(scale) if scale is not None else default_scale
        self.proj_type = proj_type
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.block_size = block_size
        self._hooks: list[Any] = []
        self._n_state_marked: dict[int, int] = {}

    def __repr__(self) -> str:
        shown = {"rank": self.rank, "update_proj_gap": self.update_proj_gap, "scale": self.scale,
                 "proj_type": self.proj_type} if self.kind in PROJECTED else {}
        if self.kind == "adam_mini":
            shown = {"dim": self.dim, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads}
        if self.kind in TORCHAO:
            shown = {"block_size": self.block_size}
        return f"{type(self).__name__}(kind={self.kind!r}" + "".join(f", {k}={v!r}" for k, v in shown.items() if v is not None) + ")"

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_lightning_object(trainer, "the Trainer")
        if stage != "fit":
            return
        build.import_package(self.kind, repr(self))
        strategy = trainer.strategy
        if isinstance(strategy, (DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy)):
            raise ValueError(  # noqa: TRY004  (a strategy this callback cannot work with, not a wrong argument type)
                f"{self!r} cannot be used with `{type(strategy).__name__}`: DeepSpeed builds its own optimizer in "
                "its engine, and FSDP shards the weights that a projection or a per-head moment needs whole. Use a "
                "single device, `strategy='ddp'`, or `strategy='lowmem_offload'` (the optimizer state on the host)."
            )
        others = [cb for cb in trainer.callbacks if isinstance(cb, (LowBitOptimizerSwap, LeanOptimizer)) and cb is not self]
        if others:
            raise ValueError(f"{self!r} and {others[0]!r} both replace the configured optimizer; keep one of them.")

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # NOTE: before `restore_training_state`: a checkpoint's optimizer state loads into the lean optimizer
        strategy = trainer.strategy
        converted = [self.convert(opt, pl_module) for opt in strategy.optimizers]
        for old, (new, sources) in zip(strategy.optimizers, converted):
            for config in strategy.lr_scheduler_configs:
                if config.scheduler.optimizer is old:
                    build.expand_scheduler(config.scheduler, sources)
                repoint_scheduler(config.scheduler, old, new)
        strategy.optimizers = [new for new, _ in converted]

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for optimizer in trainer.optimizers:
            mark_host_state(optimizer, self._n_state_marked)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @override
    def expected_state_bytes(self, optimizer: object, module: object) -> int:
        """Bytes of the state this kind will keep for ``optimizer``'s trainable parameters as fp32 masters (the
        host-RAM check of ``lowmem_offload``, before the swap; see :mod:`.state_bytes`)."""
        assert isinstance(optimizer, torch.optim.Optimizer) and isinstance(module, torch.nn.Module)
        return lean_state_bytes(self, optimizer, module)

    def convert(self, optimizer: torch.optim.Optimizer,
                pl_module: L.LightningModule) -> tuple[torch.optim.Optimizer, list[int]]:
        """Build the lean optimizer over ``optimizer``'s param groups (the module's, or lowmem_offload's masters);
        with, for each of its groups, the index of the configured group it came from."""
        self.check_convertible(optimizer)
        module_param = functools.partial(module_param_of, pl_module)
        if self.kind in PROJECTED:
            rank = int(self.rank or 1)  # NOTE: never None here: set from the kind's defaults
            projected = build.projection_plan(optimizer, module_param, pl_module, rank, repr(self))
            options = {"rank": rank, "update_proj_gap": self.update_proj_gap, "scale": self.scale,
                       "proj_type": self.proj_type}
            new, sources = build.build_projected(self.kind, optimizer, projected, options, repr(self))
            self._hooks += [new.register_step_post_hook(build.compact_projections),
                            new.register_state_dict_post_hook(build.projectors_to_plain),
                            new.register_load_state_dict_post_hook(build.projectors_from_plain)]
        elif self.kind == "adam_mini":
            names = {id(p): n for n, p in pl_module.named_parameters()}
            new, sources = build.build_adam_mini(
                optimizer, lambda p: names.get(id(module_param(p)), f"param_{id(p)}"), self._adam_mini_shape(pl_module),
                repr(self),
            )
        else:
            new, sources = build.build_torchao(self.kind, optimizer, self.block_size, repr(self))
            self._hooks += build.eager_on_fake_tensors(new)
        return new, sources

    def check_convertible(self, optimizer: torch.optim.Optimizer) -> None:
        """``ValueError`` naming every reason ``optimizer`` is not a torch AdamW/Adam this kind can stand in for."""
        what = f"`{type(optimizer).__module__}.{type(optimizer).__qualname__}`"
        if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
            raise ValueError(
                f"{self!r} replaces the `torch.optim.AdamW` (or `Adam`) that `configure_optimizers` returns, but "
                f"yours returns {what}: swapping it would change the algorithm and its hyper-parameters' meaning. "
                "Return `torch.optim.AdamW(...)` from `configure_optimizers`, or remove the callback."
            )
        problems = []
        for i, group in enumerate(optimizer.param_groups):
            for key in ("amsgrad", "maximize"):
                if group.get(key):
                    problems.append(f"param group {i} has `{key}=True`, which {self.kind} does not implement")
            l2 = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
            if l2 and group.get("weight_decay", 0):
                problems.append(f"param group {i} has `weight_decay={group['weight_decay']}` on `torch.optim.Adam` "
                                "(L2 added to the gradient); the lean optimizers decay decoupled (AdamW). Use "
                                "`torch.optim.AdamW` or weight_decay=0")
        if problems:
            raise ValueError(f"{self!r} cannot replace {what}: " + "; ".join(problems) + ".")

    def _adam_mini_shape(self, pl_module: L.LightningModule) -> dict[str, int | None]:
        shape = {"dim": self.dim, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads}
        config = next((m.config for m in pl_module.modules() if hasattr(getattr(m, "config", None), "hidden_size")), None)
        names = {"dim": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads"}
        for key, attr in names.items():
            shape[key] = shape[key] or getattr(config, attr, None)
        qk = [n for n, _ in pl_module.named_parameters() if any(k in n.lower() for k in _ADAM_MINI_QK)]
        if qk and (shape["dim"] is None or shape["n_heads"] is None):
            raise ValueError(
                f"{self!r}: Adam-mini keeps one second moment per attention head of the query/key weights "
                f"({qk[0]}, ...), so it needs the model's `dim` and `n_heads`, which it found in no Hugging Face "
                "config on the module. Pass them: LeanOptimizer(kind='adam_mini', dim=..., n_heads=...)."
            )
        return shape

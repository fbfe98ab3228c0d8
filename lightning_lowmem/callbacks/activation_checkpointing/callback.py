"""``ActivationCheckpointing``: a checkpointing policy for any LightningModule under any strategy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.callbacks.activation_checkpointing.hooks import (
    BlockCheckpoint,
    CheckpointInfo,
    checkpoint_info,
    checkpointed_modules,
    remove_checkpointing,
)
from lightning_lowmem.callbacks.activation_checkpointing.probe import (
    choose_submodules,
    measure_saved_bytes,
    measure_submodules,
)
from lightning_lowmem.callbacks.activation_checkpointing.segments import CloseSegments, Segment, wrap_segment
from lightning_lowmem.callbacks.activation_checkpointing.selective import holds_recurrent_layer, selective_contexts
from lightning_lowmem.core.blocks import (
    compiled_names,
    find_repeated_blocks,
    in_compiled,
    outside_compiled,
    owner_of,
    select_modules,
)
from lightning_lowmem.core.hooks import check_lightning_object
from lightning_lowmem.core.reproducible import Reproducible
from lightning_lowmem.core.units import parse_bytes

__all__ = ["ActivationCheckpointing", "CheckpointInfo", "checkpoint_info", "checkpointed_modules", "find_repeated_blocks"]

PolicyName = Literal["all", "every_n", "sqrt", "selective", "budget"]
POLICIES: tuple[str, ...] = get_args(PolicyName)


class ActivationCheckpointing(Reproducible, Callback):
    """Recompute the activations of chosen blocks in backward instead of keeping them: a policy for any model.

    Saves activation memory (the tensors autograd keeps for backward) at the cost of recomputing forward work in
    backward; gradients are bit-identical, dropout included. Blocks are found (the longest ``nn.ModuleList`` of
    same-class modules), named with ``blocks``, or measured on the first training batch on a fake copy of the module
    (:attr:`chosen_by_measurement`). Applied at the first training batch through forward hooks, removed at the end of
    ``fit`` (docs/techniques/activation-checkpointing.md). ``torch.compile``-d modules are not checkpointed (a
    warning); a Hugging Face model's own checkpointing is turned off, ``config.use_cache`` False while fitting.

    Policies (``policy=``): ``"all"``; ``"every_n"`` with ``n`` (blocks 0, n, 2n, ...); ``"sqrt"`` (segments of about
    sqrt(L) blocks, each recomputed as one unit); ``"selective"`` (matmul and attention outputs kept, element-wise ops
    recomputed); ``"budget"`` with ``budget`` (bytes, or ``"2GiB"``: the fewest blocks that bring the measured
    activations under it); a list of module classes, class names or ``fnmatch`` patterns on module names.

    Example:
        >>> from lightning_lowmem import ActivationCheckpointing
        >>> checkpointing = ActivationCheckpointing(policy="selective")
        >>> trainer = L.Trainer(callbacks=[checkpointing], max_steps=1, enable_progress_bar=False,
        ...                     enable_model_summary=False)
        >>> trainer.fit(tiny_model(), tiny_data())
        >>> checkpointing.wrapped
        ['model.transformer.h.0', 'model.transformer.h.1']
        >>> trainer = L.Trainer(callbacks=[ActivationCheckpointing(policy="budget", budget="6GiB")])

    Attributes:
        wrapped: qualified names of the checkpointed modules (from the first training batch).
        measured: for ``"budget"``, the measured bytes (``outside``, per-block ``blocks``, ``block_inputs``).
        chosen_by_measurement: for a model without repeated blocks, ``{module name: bytes its checkpointing
            frees}`` of the modules chosen on the first batch (``None`` otherwise).
    """

    def __init__(self, policy: PolicyName | Sequence[str | type] = "all", n: int | None = None,
                 budget: int | str | None = None, blocks: str | Sequence[str] | None = None) -> None:
        self.targets: list[str | type] | None = None
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(
                    f"Passed `policy={policy!r}`; expected one of {', '.join(map(repr, POLICIES))}, "
                    "or a list of module classes / class names / name patterns to checkpoint."
                )
        elif isinstance(policy, Sequence) and all(isinstance(p, (str, type)) for p in policy):
            if not policy:
                raise ValueError("Passed `policy=[]`; name at least one module class, class name or name pattern.")
            self.targets = list(policy)
        else:
            raise TypeError(
                f"Passed `policy={policy!r}`; expected one of {', '.join(map(repr, POLICIES))}, or a non-empty "
                "list of module classes, class names (e.g. 'GPT2Block') or name patterns (e.g. 'model.layers.*')."
            )
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
            raise TypeError(f"Passed `n={n!r}`; expected an integer >= 1 (checkpoint every n-th block).")
        if blocks is not None and not (
            isinstance(blocks, str) or (isinstance(blocks, Sequence) and all(isinstance(b, str) for b in blocks))
        ):
            raise TypeError(f"Passed `blocks={blocks!r}`; expected a name pattern such as 'model.layers.*', or a list of them.")
        if policy == "every_n":
            if n is None or n < 1:
                raise ValueError(f"Passed `n={n!r}` with policy='every_n'; `n` must be an integer >= 1 (1 means 'all').")
        elif n is not None:
            raise ValueError(f"Passed `n={n!r}` with `policy={policy!r}`; `n` is only used by policy='every_n'.")
        if policy == "budget":
            if budget is None:
                raise ValueError("Passed policy='budget' without `budget`; give the activation budget, e.g. budget='4GiB'.")
            self.budget: int | None = parse_bytes(budget, "`budget`")
            if self.budget <= 0:
                raise ValueError(f"Passed `budget={budget!r}`; it must be positive.")
        elif budget is not None:
            raise ValueError(f"Passed `budget={budget!r}` with `policy={policy!r}`; `budget` is only used by policy='budget'.")
        else:
            self.budget = None
        if self.targets is not None and blocks is not None:
            raise ValueError("Passed both an explicit `policy` list and `blocks`; the list already names the modules.")
        self.policy = "explicit" if self.targets is not None else policy
        self.n = n
        self.blocks = [blocks] if isinstance(blocks, str) else (list(blocks) if blocks is not None else None)
        self.wrapped: list[str] = []
        self.measured: dict[str, Any] | None = None
        self._root: nn.Module | None = None
        self._block_list: list[tuple[str, nn.Module]] = []
        self._hook_handles: list[Any] = []
        self._use_cache: list[tuple[Any, Any]] = []
        self._pending_choice = False  # no repeated blocks: choose submodules on the first training batch
        self.chosen_by_measurement: dict[str, int] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_lightning_object(trainer, "the Trainer of ActivationCheckpointing")
        self._check_strategy(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._root, self.wrapped, self.measured, self.chosen_by_measurement = None, [], None, None  # a fit of its own

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        # NOTE: at the first batch, not in setup: a model built in `configure_model` exists, and the strategy's hooks
        # on the blocks (gather, unshard, fetch) are registered before ours, so they run outside the region, once
        if self._root is None:
            self._apply(pl_module)
            if self._measures() and isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
                raise ValueError(
                    f"ActivationCheckpointing(policy={self.policy!r}) would measure `{type(pl_module).__name__}` on a "
                    f"fake copy, which `{type(trainer.strategy).__name__}`'s sharded parameters do not allow; name the "
                    "blocks to checkpoint: `ActivationCheckpointing(policy='all', blocks=['model.layers'])` (module "
                    "names, patterns or class names), or `policy=['MyBlock']`."
                )
        if self._pending_choice:
            self._choose_by_measurement(trainer, pl_module, batch, batch_idx)
        if self.policy == "budget" and self.measured is None:
            self._measure_and_choose(trainer, pl_module, batch, batch_idx)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # NOTE: as soon as training ends: a MemoryReport's teardown then copies the model as built
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._root is None:
            return
        for name in self.wrapped:
            remove_checkpointing(self._root.get_submodule(name))
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        for config, value in self._use_cache:
            config.use_cache = value
        self._use_cache = []

    @override
    def resolved(self) -> ActivationCheckpointing | None:
        """A fresh copy; with ``policy="budget"`` once it chose, the blocks it chose (None: it chose none)."""
        if self.policy == "budget" and self.measured is not None:
            return ActivationCheckpointing(policy=list(self.wrapped)) if self.wrapped else None
        return self.fresh()

    @staticmethod
    def remove(root: nn.Module) -> int:
        """Undo this callback's checkpointing on ``root`` (every block and segment, their hooks); returns how many
        (the end of ``fit`` does this; so does a copy of a module taken during a fit, a dry run's)."""
        count = 0
        for module in root.modules():
            count += remove_checkpointing(module)
            for key, hook in list(torch_internals.forward_hooks(module).items()):
                if isinstance(hook, CloseSegments):
                    torch_internals.remove_forward_hook(module, key)
        return count

    def _check_strategy(self, trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        problems = []
        # NOTE: DeepSpeed composes: the region is the block's forward, inside ZeRO-3's fetch hooks
        config = getattr(strategy, "config", None) if isinstance(strategy, DeepSpeedStrategy) else None
        zero = config.get("zero_optimization") if isinstance(config, dict) else None
        stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
        if self.policy == "sqrt" and stage == 3:
            problems.append(
                f"policy='sqrt' replays several blocks at once in backward without their module hooks, and under "
                f"`{type(strategy).__name__}` (ZeRO stage 3) a block's own parameters are gathered only by those "
                "hooks; use policy='all', 'every_n', 'selective' or 'budget', or ZeRO stage 1/2."
            )
        if isinstance(strategy, FSDPStrategy) and lightning_internals.fsdp_checkpointing_policy(strategy):
            problems.append(
                "FSDPStrategy(activation_checkpointing_policy=...) is set as well; use one of the two, not both."
            )
        if self.policy == "sqrt" and isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            problems.append(
                f"policy='sqrt' recomputes several blocks at once, which FSDP's per-block parameter gathering does not "
                f"allow under `{type(strategy).__name__}`; use policy='all', 'every_n', 'selective' or 'budget'."
            )
        if problems:
            raise ValueError("ActivationCheckpointing cannot run here:\n- " + "\n- ".join(problems))

    def _find_blocks(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        if self.targets is not None:
            found = select_modules(root, self.targets)
            what = f"the modules named by `policy={self.targets!r}`"
        elif self.blocks is not None:
            found = select_modules(root, self.blocks)
            what = f"the blocks named by `blocks={self.blocks!r}`"
        else:
            found = find_repeated_blocks(root)  # none: chosen by measurement (`_choose_by_measurement`)
            return _outside_compiled(root, found) if found else []
        if not found:
            raise ValueError(
                f"ActivationCheckpointing found none of {what} in `{type(root).__name__}`. Name the blocks to checkpoint: "
                "`ActivationCheckpointing(blocks='model.layers')` (a ModuleList or module name, a pattern such as "
                "'encoder.*.block' or a class name such as 'MyBlock'), or pass them as the policy: "
                "`ActivationCheckpointing(policy=['MyBlock'])`."
            )
        return _outside_compiled(root, found)

    def _measures(self) -> bool:
        """Whether the first training batch measures (``"budget"``, or no repeated blocks found)."""
        return self._pending_choice or (self.policy == "budget" and bool(self._block_list))

    def _apply(self, pl_module: nn.Module) -> None:
        if self._root is not None:
            return
        self._root = pl_module
        blocks = self._find_blocks(pl_module)
        if any(torch_internals.is_checkpoint_wrapper(m) for _, b in blocks for m in b.modules()):
            rank_zero_warn(
                "ActivationCheckpointing: the model is already checkpointed by torch.distributed's CheckpointWrapper "
                "(e.g. `apply_activation_checkpointing`); leaving it as it is (checkpointing it twice would "
                "recompute twice)."
            )
            return
        self._block_list, self._pending_choice = blocks, not blocks
        if self._measures() and not getattr(pl_module, "automatic_optimization", True):
            children = [n for n, m in pl_module.named_children() if any(True for _ in m.parameters())]
            what = "found no repeated blocks (no `nn.ModuleList` of at least two same-class modules)" if not blocks \
                else "was given policy='budget'"
            raise ValueError(
                f"ActivationCheckpointing {what} in `{type(pl_module).__name__}`, and cannot measure which modules "
                "to checkpoint: that runs `training_step` once on a copy of the module, where a manual-optimization "
                f"step cannot step its optimizers. Name the blocks: `ActivationCheckpointing(blocks={children!r})` "
                "(module names, patterns such as 'encoder.*' or class names)."
            )
        self._prepare_hf(pl_module)
        if blocks and self.policy != "budget":  # NOTE: else chosen on the first training batch, from measured sizes
            self._apply_policy()

    def _apply_policy(self) -> None:
        blocks = self._block_list
        L = len(blocks)
        if self.policy == "sqrt":
            size = max(1, round(math.sqrt(L)))
            groups = [blocks[i : i + size] for i in range(0, L, size)]
            segments: list[Segment] = []
            for index, group in enumerate(groups):
                segment, ok = wrap_segment([m for _, m in group], index)
                if ok:
                    segments.append(segment)
                    self.wrapped.extend(name for name, _ in group)
            owners = {id(o): o for o in (owner_of(self._root, name) for group in groups for name, _ in group)}  # type: ignore[arg-type]
            for owner in owners.values():
                self._hook_handles.append(owner.register_forward_hook(CloseSegments(segments), always_call=True))
            self._log(segments=[len(g) for g in groups])
            return
        step = self.n if self.policy == "every_n" else 1
        self._wrap_blocks(list(range(0, L, step)), selective=self.policy == "selective")  # type: ignore[arg-type]

    def _wrap_blocks(self, indices: list[int], selective: bool = False) -> None:
        for segment, i in enumerate(indices):
            name, module = self._block_list[i]
            whole = holds_recurrent_layer(module) if selective else None
            if whole is not None:
                rank_zero_info(f"ActivationCheckpointing(policy='selective'): `{name}` holds an {whole}, whose "
                               "kernel modifies its matmul outputs in place; it is recomputed whole instead.")
            keep = selective and whole is None
            info = CheckpointInfo("block", segment, 0, is_boundary=True, selective=keep)
            if BlockCheckpoint(info, selective_contexts if keep else None).attach(module):
                self.wrapped.append(name)
        self._log()

    def _log(self, segments: list[int] | None = None) -> None:
        kinds = sorted({type(m).__name__ for _, m in self._block_list})
        how = f" in {len(segments)} segments of {segments}" if segments else ""
        rank_zero_info(f"ActivationCheckpointing(policy={self.policy!r}): checkpointing {len(self.wrapped)} of "
                       f"{len(self._block_list)} blocks ({', '.join(kinds)}){how}: {', '.join(self.wrapped) or 'none'}")

    def _prepare_hf(self, root: nn.Module) -> None:
        """Hugging Face models: no double checkpointing, no KV cache while training."""
        for module in root.modules():
            config = getattr(module, "config", None)
            # NOTE: transformers 5 renamed gradient_* to activation_* (the old names warn); accept both.
            is_on = getattr(module, "is_activation_checkpointing", None)
            is_on = getattr(module, "is_gradient_checkpointing", False) if is_on is None else is_on
            disable = getattr(module, "activation_checkpointing_disable", None) or getattr(
                module, "gradient_checkpointing_disable", None
            )
            if is_on and disable is not None:
                rank_zero_warn(
                    f"ActivationCheckpointing: turning off `{type(module).__name__}`'s own activation checkpointing "
                    "(`gradient_checkpointing_enable()` was called); the callback's policy replaces it."
                )
                disable()
            if config is not None and getattr(config, "use_cache", False) and disable is not None:
                self._use_cache.append((config, config.use_cache))
                config.use_cache = False

    def _choose_by_measurement(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """Blocks for a model with no repeated blocks: the largest submodules whose checkpointing frees memory."""
        self._pending_choice = False
        with trainer.precision_plugin.train_step_context():
            measured, total = measure_submodules(pl_module, batch, batch_idx)  # type: ignore[arg-type]
        # NOTE: every rank must wrap the same modules: rank 0's measurement decides
        compiled = compiled_names(pl_module)
        measured = {n: a for n, a in measured.items() if in_compiled(n, compiled) is None}  # NOTE: see _outside_compiled
        names = trainer.strategy.broadcast(choose_submodules(pl_module, measured, total), src=0)
        self.chosen_by_measurement = {n: measured[n].saving for n in names if n in measured}
        if not names:
            rank_zero_warn(
                f"ActivationCheckpointing: `{type(pl_module).__name__}` has no repeated blocks and no submodule whose "
                "checkpointing frees activation memory (measured on the first training batch); training continues "
                "without checkpointing. Name modules with `blocks=` to checkpoint them anyway."
            )
            return
        self._block_list = [(n, pl_module.get_submodule(n)) for n in names]
        if self.policy != "budget":
            self._apply_policy()

    def _measure_and_choose(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._block_list:
            self.measured = {}
            return
        with trainer.precision_plugin.train_step_context():
            measured = measure_saved_bytes(pl_module, [n for n, _ in self._block_list], batch, batch_idx)
        # NOTE: every rank must wrap the same blocks; the largest measurement of any rank decides.
        values = torch.tensor([measured["outside"], *measured["blocks"], *measured["block_inputs"]], dtype=torch.float64)
        values = trainer.strategy.reduce(values.to(trainer.strategy.root_device), reduce_op="max").cpu()
        L = len(self._block_list)
        outside, blocks, inputs = int(values[0]), [int(v) for v in values[1 : L + 1]], [int(v) for v in values[L + 1 :]]
        self.measured = {"outside": outside, "blocks": blocks, "block_inputs": inputs}
        chosen, minimum = choose_for_budget(outside, blocks, inputs, self.budget)  # type: ignore[arg-type]
        if chosen is None:
            raise ValueError(
                f"Passed `budget={self.budget}` bytes ({self.budget / 2**20:.1f} MiB) for activations, below the minimum "
                f"possible for this model and batch: {minimum} bytes ({minimum / 2**20:.1f} MiB), measured with every "
                f"block checkpointed ({outside} bytes outside the blocks, {sum(inputs)} of block inputs, "
                f"{max(blocks)} to recompute the largest block). Raise the budget or reduce the batch size."
            )
        self._wrap_blocks(chosen)


def _outside_compiled(root: nn.Module, found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``found`` without the modules running ``torch.compile``-d code (``core.blocks.outside_compiled``): warned
    about; refused when nothing is left."""
    kept, dropped = outside_compiled(root, found)
    if not dropped:
        return kept
    names = "; ".join(f"`{outer}` holds {', '.join(f'`{n}`' for n in inner)}" for outer, inner in dropped.items())
    why = ("checkpointing inside a torch.compile-d module changes inductor's kernels and their rounding, and "
           "around it torch's recompute of the compiled code can save other tensors (CheckpointError)")
    fix = ("compile the blocks one by one after checkpointing them (`torch.compile` each block, not their "
           "parent), or leave the compiled module's memory to torch.compile's own recomputation")
    if not kept:
        raise ValueError(f"ActivationCheckpointing cannot checkpoint the blocks it found: {names} (torch.compile-d); "
                         f"{why}. Fix: {fix}.")
    rank_zero_warn(f"ActivationCheckpointing: not checkpointing inside torch.compile-d modules ({names}): {why}. "
                   f"To checkpoint them: {fix}.")
    return kept


def choose_for_budget(outside: int, blocks: list[int], inputs: list[int], budget: int) -> tuple[list[int] | None, int]:
    """The fewest blocks to checkpoint so that the kept activations fit ``budget``; and the minimum possible.

    Kept bytes with the set ``S`` checkpointed: ``outside + sum(blocks[i], i not in S) + sum(inputs[i], i in S)
    + max(blocks[i], i in S)`` (the last term: one block's activations exist while it is recomputed).
    Blocks are added largest saving first. Returns ``(None, minimum)`` when even all of them do not fit.
    """
    order = sorted(range(len(blocks)), key=lambda i: blocks[i] - inputs[i], reverse=True)

    def kept(chosen: list[int]) -> int:
        c = set(chosen)
        recompute = max((blocks[i] for i in c), default=0)
        return outside + sum(b for i, b in enumerate(blocks) if i not in c) + sum(inputs[i] for i in c) + recompute

    minimum = kept(list(range(len(blocks))))
    chosen: list[int] = []
    for i in [None, *order]:
        if i is not None:
            chosen.append(i)
        if kept(chosen) <= budget:
            return sorted(chosen), minimum
    return None, minimum

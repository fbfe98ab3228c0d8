"""``AutoStrategy`` (``strategy="lowmem_auto"``): plan at fit start, then train with the chosen recipe."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core.reproducible import Reproducible, fresh
from lightning_lowmem.core.units import parse_bytes
from lightning_lowmem.plan.hardware import PROFILES
from lightning_lowmem.plan.output import trainer_yaml
from lightning_lowmem.plan.recipes import BASES, DISK, IN_BACKWARD, disk_problems, optimizer_choices, technique_field
from lightning_lowmem.plan.search import NoRecipeFitsError, plan
from lightning_lowmem.plan.source import effective_batch
from lightning_lowmem.strategies.offload import checks as offload_checks
from lightning_lowmem.strategies.offload.precision import MasterHalfPrecision
from lightning_lowmem.strategies.offload.step_schedule import in_backward_problems

#: what a device budget leaves free by default (CUDA context growth, allocator slack, fragmentation)
DEFAULT_MARGIN = 0.1


class AutoStrategy(Reproducible, SingleDeviceStrategy):
    """Choose the fastest recipe of the suite that fits the device, when ``fit`` starts, and train with it.

    Memory: whatever the chosen recipe saves (see ``lowmem plan``): the plan is made for this module, its data
    and the device's free memory by dry runs of the real run on fake tensors. Cost: the planning (seconds to a
    minute, once per fit; nothing is allocated on the device), and each chosen technique's own cost.

    At fit start the plan's strategy takes over (``trainer.strategy`` is the chosen one from then on), its
    technique callbacks are added, except those of a kind the user already passed (a user's own
    ``ActivationCheckpointing`` is kept, and the plan is made with it), and the choice is printed once with
    the YAML lines that reproduce it. The Trainer's ``precision`` flag is replaced by the plan's (every recipe keeps
    fp32 master weights unless ``pure_half=True``).

    Args:
        device_budget: bytes or a size (``"10GB"``) for the device peak. Default: the device's free memory minus
            10 % (on CUDA); required on CPU.
        host_budget: bytes or a size for the host peak. Default: the host's available memory minus 10 %.
        hardware: the profile the cost model prices steps with (``lightning_lowmem.plan.PROFILES``, ``"measure"``);
            default: this machine's measured rates on a CPU, the ``rtx3060-12gb`` rates on CUDA.
        pure_half: also consider half weights without fp32 master weights.
        optimizers: the optimizers allowed, in order of preference (``plan``'s ``optimizers``): ``("adamw",)``, the
            module's own, by default; add ``"adamw8bit"`` (``LowBitOptimizer``) or a ``LeanOptimizer`` kind to let
            the plan use it where nothing fits with the one before (it trains with other maths).
        disk_dir: a directory on a local disk the plan may put the disk tier in (``plan``'s ``disk_dir``: the fp32
            masters and optimizer state in files, chosen only where nothing fits in RAM). Default: no disk tier.
        disk_budget: with ``disk_dir``, bytes or a size for the tier's bytes. Default: the free space there minus 10 %.

    Example:
        >>> from lightning_lowmem import AutoStrategy
        >>> trainer = L.Trainer(strategy="lowmem_auto", max_steps=1000)
        >>> trainer = L.Trainer(strategy=AutoStrategy(device_budget="10GB", hardware="rtx3060-12gb"))
        >>> type(trainer.strategy).__name__
        'AutoStrategy'
    """

    strategy_name = "lowmem_auto"

    def __init__(self, device_budget: int | str | None = None, host_budget: int | str | None = None,
                 hardware: str | None = None, pure_half: bool = False, optimizers: tuple[str, ...] = ("adamw",),
                 disk_dir: str | os.PathLike | None = None, disk_budget: int | str | None = None) -> None:
        super().__init__()
        problems, wrong_type = [], False
        for name, value in (("device_budget", device_budget), ("host_budget", host_budget),
                            ("disk_budget", disk_budget)):
            if value is not None:
                try:
                    parse_bytes(value, f"`{name}`")
                except (TypeError, ValueError) as err:
                    problems.append(str(err))
                    wrong_type |= isinstance(err, TypeError)
        if not isinstance(pure_half, bool):
            problems.append(f"Passed `pure_half={pure_half!r}`; expected True or False.")
            wrong_type = True
        if hardware is not None and not isinstance(hardware, (str, os.PathLike)):
            problems.append(f"Passed `hardware={hardware!r}`; expected a profile name, 'measure' or a YAML file.")
            wrong_type = True
        elif hardware is not None and hardware not in PROFILES and hardware != "measure" \
                and not str(hardware).endswith((".yaml", ".yml")):
            problems.append(f"Passed `hardware={hardware!r}`; expected one of {', '.join(PROFILES)}, 'measure' "
                            "or a YAML file.")
        wrong_type |= optimizer_choices(optimizers, (), problems)[1]
        wrong_type |= disk_problems(disk_dir, disk_budget, problems)
        if problems:
            raise (TypeError if wrong_type else ValueError)("\n- ".join(["AutoStrategy:", *problems]))
        self.device_budget, self.host_budget, self.hardware, self.pure_half = device_budget, host_budget, hardware, \
            pure_half
        self.allowed_optimizers = tuple(optimizers)  # NOTE: `optimizers` is the strategy's own property
        self.disk_dir, self.disk_budget = disk_dir, disk_budget
        self.plan: Any = None
        self.chosen_strategy: Any = None

    def _budgets(self, device: torch.device) -> tuple[int, int]:
        import psutil

        if self.device_budget is not None:
            device_budget = parse_bytes(self.device_budget, "`device_budget`")
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            device_budget = int(free * (1 - DEFAULT_MARGIN))
        else:
            raise ValueError(
                f"`strategy='lowmem_auto'` on {device.type!r} has no device memory to plan for; pass "
                "`AutoStrategy(device_budget='8GB')` (the memory the run may use)."
            )
        host_budget = (parse_bytes(self.host_budget, "`host_budget`") if self.host_budget is not None
                       else int(psutil.virtual_memory().available * (1 - DEFAULT_MARGIN)))
        return device_budget, host_budget

    @override
    def connect(self, model: L.LightningModule) -> None:
        trainer = model.trainer
        if self.chosen_strategy is not None:  # a second fit with the same Trainer: the plan stands
            lightning_internals.keep_strategy(trainer, self.chosen_strategy)
            self.chosen_strategy.connect(model)
            return

        device_budget, host_budget = self._budgets(self.root_device)
        # NOTE: a user's own technique callback fixes its recipe field: the plan keeps it and adds none of its kind
        user = [c for c in trainer.callbacks if technique_field(c) is not None and isinstance(c, Reproducible)]
        data = lightning_internals.fit_data_source(trainer).instance
        data = None if data is model else data
        loader = getattr(data if hasattr(data, "batch_size") else model, "batch_size", None)
        effective = effective_batch(user, loader, trainer.accumulate_grad_batches)
        # NOTE: the dry runs run fake copies of the module, on forked random generators (`dry_run`): the module and
        # the random streams training starts from are as the user left them
        refused = refused_bases(trainer, model)
        bases = [b for b in BASES if b not in refused and (self.pure_half or b != "half")
                 and (self.disk_dir is not None or b not in DISK)] if refused else None
        disk_budget = self.disk_budget
        if self.disk_dir is not None and disk_budget is None:
            disk_budget = int(shutil.disk_usage(self.disk_dir).free * (1 - DEFAULT_MARGIN))
        not_planned = "".join(f"\n  not planned: {BASES[b][0].format(h='bf16')}: {why}" for b, why in refused.items())
        try:
            self.plan = plan(model, effective, data=data, device_memory=device_budget, host_memory=host_budget,
                             hardware=self.hardware, pure_half=self.pure_half, fixed_callbacks=user, bases=bases,
                             target="cuda" if self.root_device.type == "cuda" else "cpu",
                             optimizers=self.allowed_optimizers, disk_dir=self.disk_dir, disk_budget=disk_budget)
        except NoRecipeFitsError as err:
            if not refused:
                raise
            raise NoRecipeFitsError(f"{err}{not_planned}") from err
        run = self.plan.run
        added = [c for c in run.callbacks if not any(type(u) is type(c) for u in user)]
        strategy = self._build(trainer, run.strategy, run.precision)
        lightning_internals.replace_strategy(trainer, strategy)
        trainer.callbacks[:0] = added  # NOTE: before the user's own: MemoryReport moves itself last at setup
        self.chosen_strategy = strategy
        import yaml

        described = trainer_yaml(run)
        described["callbacks"] = [d for d, c in zip(described["callbacks"], run.callbacks) if c in added]
        dropped = "".join(f"\n  dropped {r.name}: {r.why}" for r in self.plan.rows if r.status == "refused")
        dropped += not_planned
        rank_zero_info(f"lowmem_auto: {self.plan.summary()}{dropped}\nreproduce it with (trainer: in a YAML):\n"
                       + yaml.safe_dump(described, sort_keys=False).rstrip())
        strategy.connect(model)

    def _build(self, trainer: L.Trainer, strategy: Any, precision: str) -> Any:
        """The chosen strategy, set up by Lightning's own connector (accelerator, device, precision plugin)."""
        devices = [self.root_device.index or 0] if self.root_device.type == "cuda" else 1
        quiet = logging.getLogger("lightning.pytorch")
        level = quiet.level
        quiet.setLevel(logging.WARNING)  # NOTE: this Trainer only builds the strategy ("GPU available" said once)
        try:
            built = L.Trainer(accelerator=self.root_device.type, devices=devices, strategy=fresh(strategy),
                              precision=precision, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False)
        finally:
            quiet.setLevel(level)
        return built.strategy


def refused_bases(trainer: L.Trainer, module: L.LightningModule) -> dict[str, str]:
    """The recipe bases whose strategy refuses this Trainer's own callbacks and settings, with its reasons (the
    strategies' own checks: a plan must not choose a run that refuses at setup)."""
    out = {}
    for base in ("offload", "offload_params", *IN_BACKWARD):
        problems = offload_checks.callback_problems(trainer, base.startswith("offload_params"))
        if base in IN_BACKWARD:
            with warnings.catch_warnings():  # NOTE: its warnings are for a run that steps in backward, not a plan
                warnings.simplefilter("ignore")
                problems += in_backward_problems(trainer, module, MasterHalfPrecision("bf16-true"))
        if problems:
            out[base] = "; ".join(problems)
    return out


__all__ = ["AutoStrategy", "refused_bases"]

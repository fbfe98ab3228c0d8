"""``LowMemCLI``: LightningCLI whose YAML names the suite's strategies and callbacks by short name.

What ``lowmem fit`` runs and a dry run of a YAML (:mod:`lightning_lowmem.predict.run_config`) reads, so one file
means the same to both. Kept out of :mod:`lightning_lowmem.cli` so that ``lowmem --help`` imports neither Lightning
nor torch.
"""

from __future__ import annotations

import difflib
import importlib
import os
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

import lightning_lowmem
from lightning_lowmem.core.checkpoint_io import torch_file_problem
from lightning_lowmem.core.digest import file_problem


def check_strategy_name(strategy: Any) -> None:
    """Refuse an unknown strategy string before Lightning does, suggesting the nearest registered names."""
    if not isinstance(strategy, str) or strategy.lower() in ("auto", *StrategyRegistry.available_strategies()):
        return
    names = ["auto", *StrategyRegistry.available_strategies()]
    close = difflib.get_close_matches(strategy.lower(), names, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    ours = ", ".join(n for n in StrategyRegistry.available_strategies() if n.startswith("lowmem_"))
    raise ValueError(
        f"Passed `trainer.strategy={strategy!r}`, which is not a registered strategy name.{hint} "
        f"lightning_lowmem registers: {ours}; Lightning's own names (ddp, fsdp, deepspeed_stage_2, ...) work too."
    )


def import_public_classes() -> None:
    """Import every public class, so YAML can name callbacks and strategies by short name.

    NOTE: jsonargparse resolves a short ``class_path`` only among subclasses already imported, and the
    package exports its classes lazily; a module whose optional extra is missing is skipped here and
    says which extra to install when it is used.
    """
    for module in sorted(set(lightning_lowmem._LAZY.values())):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name not in ("deepspeed", "bitsandbytes"):
                raise


class LowMemCLI(LightningCLI):
    """LightningCLI whose model and data are any LightningModule / LightningDataModule given by ``class_path``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import_public_classes()
        super().__init__(*args, **{"save_config_kwargs": {"overwrite": True}, "subclass_mode_model": True,
                                   "subclass_mode_data": True, **kwargs})

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # NOTE: jsonargparse would print 60 lines of usage around a bad value and exit; raising lets `lowmem` say
        # what is wrong in one line (see `_cli_errors.explain`).
        kwargs.setdefault("exit_on_error", False)
        return super().init_parser(**kwargs)

    @override
    def _parse_ckpt_path(self) -> None:
        # NOTE: LightningCLI torch.loads `--ckpt_path` itself (for the hyperparameters) before any strategy sees it;
        # a damaged file must be named here, not surface as a bare EOFError.
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path") if self.config.get("subcommand") else None
        if ckpt_path and os.path.isfile(ckpt_path):
            reason = torch_file_problem(ckpt_path) or file_problem(ckpt_path)
            if reason is not None:
                raise ValueError(
                    f"Passed `--ckpt_path {ckpt_path}`, which {reason}. Pass another checkpoint (an earlier one), or "
                    "leave `--ckpt_path` out to start from scratch."
                )
        super()._parse_ckpt_path()

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_strategy_name(config.get("trainer", {}).get("strategy"))


__all__ = ["LowMemCLI", "check_strategy_name", "import_public_classes"]

"""The ``lowmem`` command: Lightning's LightningCLI with the ``lowmem_*`` names registered.

    lowmem fit --config configs/demo.yaml      # any LightningCLI subcommand: fit, validate, test, predict
    lowmem estimate --model gpt2-xl --batch-size 4 --seq-len 1024 --budget 12GB
    lowmem consolidate CHECKPOINT_DIR OUT_FILE  # DeepSpeed directory checkpoint -> plain fp32 state dict

A YAML file may name strategies as registered strings (``strategy: lowmem_offload``) or in
``class_path:`` form, and callbacks by their short names (``class_path: ActivationCheckpointing``).
Bad input ends with one ``lowmem: error: ...`` line naming the value and the fix; set
``LOWMEM_TRACEBACK=1`` to see the full traceback instead.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem import _cli_errors
from lightning_lowmem._host_memory import HostMemoryError

# extra subcommands: name -> (module, function taking argv and returning an exit code)
_TOOLS = {
    "estimate": ("lightning_lowmem.memory.estimate", "main"),
    "consolidate": ("lightning_lowmem.strategies.zero", "consolidate_main"),
}
# errors that mean "bad input": shown as one line, not a traceback
_USER_ERRORS = (
    ValueError,
    TypeError,
    FileNotFoundError,
    IsADirectoryError,
    ModuleNotFoundError,
    MisconfigurationException,
    HostMemoryError,
    _cli_errors.ArgumentError,
    _cli_errors.NonFiniteGradientError,
)


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
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # NOTE: jsonargparse would print 60 lines of usage around a bad value and exit; raising lets `main` say
        # what is wrong in one line (see `_cli_errors.explain`).
        kwargs.setdefault("exit_on_error", False)
        return super().init_parser(**kwargs)

    def _parse_ckpt_path(self) -> None:
        # NOTE: LightningCLI torch.loads `--ckpt_path` itself (for the hyperparameters) before any strategy sees it;
        # a damaged file must be named here, not surface as a bare EOFError.
        from lightning_lowmem.strategies._atomic_checkpoint_io import torch_file_problem

        ckpt_path = self.config[self.config.subcommand].get("ckpt_path") if self.config.get("subcommand") else None
        if ckpt_path and os.path.isfile(ckpt_path):
            reason = torch_file_problem(ckpt_path)
            if reason is not None:
                raise ValueError(
                    f"Passed `--ckpt_path {ckpt_path}`, which {reason}. Pass another checkpoint (an earlier one), or "
                    "leave `--ckpt_path` out to start from scratch."
                )
        super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_strategy_name(config.get("trainer", {}).get("strategy"))


def _root_cause(err: BaseException) -> BaseException:
    """The innermost bad-input error behind ``err`` (jsonargparse wraps a constructor's error in its own)."""
    found, seen = err, set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, _USER_ERRORS):
            found = err
        err = err.__cause__ or err.__context__
    return found


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] in _TOOLS:
            module, function = _TOOLS[args[0]]
            return int(getattr(importlib.import_module(module), function)(args[1:]) or 0)
        _cli_errors.check_config_files(args)
        LowMemCLI(args=argv)
    except _USER_ERRORS as err:
        if os.environ.get("LOWMEM_TRACEBACK"):
            raise
        cause = err if isinstance(err, _cli_errors.ArgumentError) else _root_cause(err)
        message = _cli_errors.explain(cause, args) if isinstance(cause, _cli_errors.ArgumentError) else str(cause)
        print(f"lowmem: error: {message}\n(set LOWMEM_TRACEBACK=1 to see the full traceback)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

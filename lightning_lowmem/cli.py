"""The ``lowmem`` command: Lightning's LightningCLI with the ``lowmem_*`` names registered.

    lowmem fit --config configs/demo.yaml      # any LightningCLI subcommand: fit, validate, test, predict
    lowmem estimate --model gpt2-xl --batch-size 4 --seq-len 1024 --budget 12GB
    lowmem consolidate CHECKPOINT_DIR OUT_FILE  # DeepSpeed directory checkpoint -> plain fp32 state dict

A YAML file may name strategies as registered strings (``strategy: lowmem_offload``) or in
``class_path:`` form, and callbacks by their short names (``class_path: ActivationCheckpointing``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning.pytorch.cli import LightningCLI

import lightning_lowmem  # noqa: F401  (registers the strategy names)

# extra subcommands: name -> (module, function taking argv)
_TOOLS = {
    "estimate": ("lightning_lowmem.memory.estimate", "main"),
    "consolidate": ("lightning_lowmem.strategies.zero", "consolidate_main"),
}


class LowMemCLI(LightningCLI):
    """LightningCLI whose model and data are any LightningModule / LightningDataModule given by ``class_path``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        super().__init__(*args, **kwargs)


def main(argv: list[str] | None = None) -> Any:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _TOOLS:
        module, function = _TOOLS[argv[0]]
        return getattr(importlib.import_module(module), function)(argv[1:])
    return LowMemCLI(args=argv)


if __name__ == "__main__":
    main()

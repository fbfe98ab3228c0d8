"""The ``lowmem`` command (``lowmem = lightning_lowmem.cli:main``): the top layer, importing any layer below.

Importing this package imports neither Lightning nor torch (``lowmem --help`` answers at once); ``LowMemCLI``,
``check_strategy_name`` and ``import_public_classes`` are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_lowmem.cli.commands import CALLBACKS, SUBCOMMANDS, TOOLS
from lightning_lowmem.cli.main import main, print_help

_LAZY_NAMES = {"LowMemCLI", "check_strategy_name", "import_public_classes"}

__all__ = ["CALLBACKS", "SUBCOMMANDS", "TOOLS", "LowMemCLI", "check_strategy_name", "import_public_classes", "main", "print_help"]


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        # NOTE: the YAML dialect lives with the run description it parses (predict/lightning_cli.py)
        return getattr(importlib.import_module("lightning_lowmem.predict.lightning_cli"), name)
    raise AttributeError(f"module 'lightning_lowmem.cli' has no attribute {name!r}")

"""DeepSpeed ZeRO presets, short import path: ``from lightning_lowmem.zero import ZeroStrategy, consolidate``."""

from lightning_lowmem.cli.consolidate import consolidate_main
from lightning_lowmem.strategies.zero.consolidation import consolidate
from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

__all__ = ["ZeroStrategy", "consolidate", "consolidate_main"]

"""DeepSpeed ZeRO presets, short import path: ``from lightning_lowmem.zero import ZeroStrategy, consolidate``."""

from lightning_lowmem.strategies.zero import ZeroStrategy, consolidate, consolidate_main

__all__ = ["ZeroStrategy", "consolidate", "consolidate_main"]

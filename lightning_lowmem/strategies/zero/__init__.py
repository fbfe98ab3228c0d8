"""The ``lowmem_zero*`` presets: ``ZeroStrategy`` (DeepSpeed ZeRO with the reference settings) and ``consolidate``."""

from lightning_lowmem.strategies.zero.consolidation import consolidate
from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

__all__ = ["ZeroStrategy", "consolidate"]

"""``lowmem_offload``: one technique in one folder; ``strategy`` (``OffloadStrategy``) owns its parts and ``precision``
(``MasterHalfPrecision``) casts, scales and clips (docs/design.md, "The offload core")."""

from lightning_lowmem.strategies.offload.nonfinite import NonFiniteGradientError
from lightning_lowmem.strategies.offload.precision import MasterHalfPrecision
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

__all__ = ["MasterHalfPrecision", "NonFiniteGradientError", "OffloadStrategy"]

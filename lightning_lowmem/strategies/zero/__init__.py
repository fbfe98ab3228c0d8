"""The ``lowmem_zero*`` presets: ``ZeroStrategy`` (DeepSpeed ZeRO with the reference settings) and ``consolidate``.

``strategy`` is the strategy; ``config`` builds the DeepSpeed config, ``checks`` refuses what it cannot run,
``checkpoint``/``checkpoint_engine``/``consolidation``/``resume`` write, read and convert its checkpoints,
``host_bytes`` checks the host RAM, ``optim`` swaps in DeepSpeed's CPU Adam, ``after_fit`` the weights after fit.
"""

from lightning_lowmem.strategies.zero.consolidation import consolidate
from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

__all__ = ["ZeroStrategy", "consolidate"]

"""``LeanOptimizer``: memory-lean optimizers (GaLore, APOLLO, APOLLO-Mini, Adam-mini, torchao 4-/8-bit AdamW) by flag.

``callback.py`` is the callback (validation, the swap at fit start); ``build.py`` the parameter-group rules (which
weights are projected) and the packages' optimizers built over the configured groups.
"""

from lightning_lowmem.callbacks.lean_optimizer.callback import KINDS, LeanOptimizer

__all__ = ["KINDS", "LeanOptimizer"]

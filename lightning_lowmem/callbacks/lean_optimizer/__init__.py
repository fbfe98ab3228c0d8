"""``LeanOptimizer``: memory-lean optimizers (GaLore, APOLLO, APOLLO-Mini, Adam-mini, torchao 4-/8-bit AdamW)."""

from lightning_lowmem.callbacks.lean_optimizer.callback import KINDS, LeanOptimizer

__all__ = ["KINDS", "LeanOptimizer"]

"""``Adapters``: LoRA/DoRA adapters (PEFT) on a frozen base, optionally quantized with bitsandbytes.

``callback`` is the callback; ``quantize_base`` replaces the frozen base's linears by 4-/8-bit ones.
"""

from lightning_lowmem.callbacks.adapters.callback import Adapters

__all__ = ["Adapters"]

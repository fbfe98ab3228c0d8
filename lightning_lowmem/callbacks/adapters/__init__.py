"""``Adapters``: LoRA/DoRA adapters (PEFT) on a frozen base, optionally quantized with bitsandbytes."""

from lightning_lowmem.callbacks.adapters.callback import Adapters

__all__ = ["Adapters"]

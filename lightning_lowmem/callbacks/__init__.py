"""The technique callbacks, one per module or folder; each importable from here (a YAML ``class_path``) on first use,
so importing one technique does not import the others."""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_LAZY = {
    "AccumulationScheduler": "lightning_lowmem.callbacks.accumulation.scheduler",
    "ActivationCheckpointing": "lightning_lowmem.callbacks.activation_checkpointing.callback",
    "ActivationOffload": "lightning_lowmem.callbacks.activation_offload.callback",
    "ChunkedLMLoss": "lightning_lowmem.callbacks.chunked_lm_loss.callback",
    "chunked_causal_lm_loss": "lightning_lowmem.callbacks.chunked_lm_loss.callback",
    "LeanOptimizer": "lightning_lowmem.callbacks.lean_optimizer.callback",
    "LowBitOptimizer": "lightning_lowmem.callbacks.low_bit_optimizer",
    "OptimizerInBackward": "lightning_lowmem.callbacks.optimizer_in_backward",
}

__all__ = sorted(_LAZY)  # noqa: PLE0605  (built from the lazy table)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

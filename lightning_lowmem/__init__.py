"""lightning_lowmem: train and fine-tune models larger than your GPU's memory, by Lightning flags.

``import lightning_lowmem`` registers the ``lowmem_*`` strategy names with Lightning (``Trainer(strategy=
"lowmem_offload")``, also in LightningCLI YAML); public classes are imported lazily, the optional extras never. A
``pytorch_lightning.Trainer`` takes the same names from ``lightning_lowmem.pl`` (docs/lightning-packages.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_lowmem._registry import register_strategies, serve_pytorch_lightning_build

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "OffloadStrategy": "lightning_lowmem.strategies.offload.strategy",
    "ZeroStrategy": "lightning_lowmem.strategies.zero.strategy",
    "MasterHalfPrecision": "lightning_lowmem.strategies.offload.precision",
    "ActivationCheckpointing": "lightning_lowmem.callbacks.activation_checkpointing.callback",
    "ActivationOffload": "lightning_lowmem.callbacks.activation_offload.callback",
    "AccumulationScheduler": "lightning_lowmem.callbacks.accumulation.scheduler",
    "LowBitOptimizer": "lightning_lowmem.callbacks.low_bit_optimizer",
    "LeanOptimizer": "lightning_lowmem.callbacks.lean_optimizer.callback",
    "Adapters": "lightning_lowmem.callbacks.adapters",
    "OptimizerInBackward": "lightning_lowmem.callbacks.optimizer_in_backward",
    "ChunkedLMLoss": "lightning_lowmem.callbacks.chunked_lm_loss.callback",
    "chunked_causal_lm_loss": "lightning_lowmem.callbacks.chunked_lm_loss.callback",
    "MemoryReport": "lightning_lowmem.report.memory_report",
    "MemoryBreakdown": "lightning_lowmem.core.accounting",
    "estimate_memory": "lightning_lowmem.predict.estimate",
    "dry_run": "lightning_lowmem.predict.dry_run",
    "dry_run_peak": "lightning_lowmem.predict.micro_batch",
    "DryRunUnsupportedError": "lightning_lowmem.predict.unsupported",
    "MemoryEstimate": "lightning_lowmem.predict.result",
    "RunSpec": "lightning_lowmem.predict.run_spec",
    "StepMemoryRecorder": "lightning_lowmem.measure.recorder",
    "AutoStrategy": "lightning_lowmem.plan.auto",
    "plan": "lightning_lowmem.plan.search",
    "CausalLMModule": "lightning_lowmem.demo.module",
    "StdlibTextDataModule": "lightning_lowmem.demo.data",
    "ByteTokenizer": "lightning_lowmem.demo.tokenizer",
}
# public submodule aliases, e.g. ``lightning_lowmem.zero.consolidate(...)``
_SUBMODULES = {"zero": "lightning_lowmem.zero", "pl": "lightning_lowmem.pl"}

__all__ = sorted([*_LAZY, *_SUBMODULES, "register_strategies"])  # noqa: PLE0605  (built from the lazy table)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(f"module 'lightning_lowmem' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


serve_pytorch_lightning_build()
register_strategies()

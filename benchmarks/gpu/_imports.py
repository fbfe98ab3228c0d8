"""The one place where the GPU stages import pieces of ``lightning_lowmem`` that are not public names.

Everything else in ``benchmarks/gpu/`` imports ``from lightning_lowmem import ...`` only, and nothing here is a
private name of the offload strategy (its internals are being rewritten). When the package's internal modules move,
this file is the one to update (``tests/test_gpu_stages.py`` imports it, so a move that forgets it fails there, not
on the GPU machine).
"""

from __future__ import annotations

# NOTE: the bytes of a quantized (bitsandbytes) base layer as stored: stage 3 reports the nf4 base's packed bytes
from lightning_lowmem.callbacks.adapters.quantize_base import packed_bytes

# NOTE: the transfers' CPU stand-in: the CUDA stream logic of lowmem_offload / ActivationOffload / parameter
# streaming, run on the CPU with deferred copies (the rehearsal's stand-in for the GPU)
from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in

__all__ = ["DeferredOps", "cpu_stand_in", "packed_bytes"]

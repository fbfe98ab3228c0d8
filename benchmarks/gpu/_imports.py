"""The one place where the GPU stages import pieces of ``lightning_lowmem`` that are not public names.

Everything else in ``benchmarks/gpu/`` imports ``from lightning_lowmem import ...`` only. When the package's
internal modules move, this file is the one to update (``tests/test_gpu_stages.py`` imports it, so a move that
forgets it fails there, not on the GPU machine).
"""

from __future__ import annotations

# NOTE: the bytes of a quantized (bitsandbytes) base layer as stored: stage 4 derives the nf4 rows of the dry run
from lightning_lowmem.callbacks.adapters.quantize_base import packed_bytes

# NOTE: the transfers' CPU stand-in: the CUDA stream logic of lowmem_offload / ActivationOffload / parameter
# streaming, run on the CPU with deferred copies (the rehearsal's stand-in for the GPU)
from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in

# NOTE: the fused host AdamW that lowmem_offload(host_optimizer="auto") switches the user's AdamW to
from lightning_lowmem.strategies.offload.host_optimizer import enable_fused, why_not_fused

# NOTE: the overlapped host pass: stage 5 arms it without its uploader too (every upload at the step), to compare
from lightning_lowmem.strategies.offload.host_pass import HostPass

# NOTE: the size of lowmem_offload's pinned staging buckets (the bandwidth entry copies at that size)
from lightning_lowmem.strategies.offload.transfer import BUCKET_BYTES

__all__ = ["BUCKET_BYTES", "DeferredOps", "HostPass", "cpu_stand_in", "enable_fused", "packed_bytes", "why_not_fused"]

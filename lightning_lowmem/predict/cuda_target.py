"""What a dry run with ``target="cuda"`` changes: CUDA's choices counted on a CPU trace, and the corrections added.

CPU's kernels run on fake CPU tensors (fake CUDA ones abort a CPU-only build); dropout masks count at CUDA's 1 B an
element, device optimizers take ``foreach``, the CUDA context and pinned staging are added, each listed in the
estimate's ``corrections`` (docs/estimate.md).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_lowmem.core.accounting import host_storage_keys, storage_key
from lightning_lowmem.core.roles import HostMastersStrategy
from lightning_lowmem.predict.result import Correction, MemoryEstimate
from lightning_lowmem.predict.run_spec import RunSpec
from lightning_lowmem.strategies.offload.transfer import pinned_staging_bytes

#: CUDA context + cuBLAS workspace on a recent driver with lazy module loading (uncalibrated)
CUDA_CONTEXT_BYTES = 512 * 2**20


class CudaOptimizerDefaults(L.Callback):
    """``target="cuda"``: torch optimizers of the device role take CUDA's default, ``foreach`` (+4 B/param transient)."""

    def __init__(self, counts: dict[str, Any]) -> None:
        self.counts = counts

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if isinstance(trainer.strategy, HostMastersStrategy):
            # NOTE: the pinned staging covers the parameters with a master, as the strategy built them (a frozen
            # base has none): counted from the traced strategy, not from the parameters before the callbacks ran
            self.counts["staged_numels"] = [m.numel() for m in getattr(trainer.strategy, "masters", {}).values()]
            self.counts["ring_bytes"] = getattr(trainer.strategy, "ring_bytes", 0)
            self.counts["staging_ring"] = bool(getattr(trainer.strategy, "optimizer_in_backward", False))
            self.counts["disk_buffer"] = getattr(trainer.strategy, "tier_buffer_bytes", 0)
            self.counts["traced_params"] = sum(p.numel() for p in pl_module.parameters())
        host = host_storage_keys()
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                on_device = any(storage_key(p) not in host for p in group["params"])
                if on_device and group.get("foreach", False) is None and not group.get("fused"):
                    group["foreach"] = True
                    self.counts["foreach_groups"] += 1




def cuda_corrections(counts: dict[str, Any], estimate: MemoryEstimate, run: RunSpec, numels: list[int],
                      extrapolated: bool) -> list[Correction]:
    scale = " (counted in the traced blocks)" if extrapolated else ""
    out = [
        Correction("dropout_mask_1_byte", 0, True,
                   f"dropout masks counted as CUDA's fused dropout keeps them: {counts['dropout_mask_elements']:,} "
                   f"mask elements{scale} at 1 B instead of the input's dtype (CPU)"),
        Correction("foreach_optimizer", 0, True,
                   f"{counts['foreach_groups']} device optimizer param groups traced with foreach=True, CUDA's default"),
        Correction("cuda_context", CUDA_CONTEXT_BYTES, False,
                   "CUDA context + cuBLAS workspace added to every phase's device `other` (lazy loading; "
                   "driver-dependent, 300-600 MiB)"),
    ]
    calls, nbytes = counts["sdpa_math"]
    if calls:
        out.append(Correction("sdpa_math_kernel", 0, False,
                              f"{calls} scaled_dot_product_attention calls{scale} traced with CPU's math kernel "
                              "(dropout > 0, or inputs CPU's flash kernel refuses): each keeps its s x s probabilities "
                              f"for backward ({nbytes // calls:,} B a call), which CUDA's flash/memory-efficient kernels "
                              "do not; the prediction is high by that much for each call whose activations are kept at "
                              "the peak"))
    offload = "offload" in run.strategy_name and run.zero() is None
    staging = 0
    if offload:
        # NOTE: the compute weights' dtype: fp32 under "32-true" and "*-mixed" (autocast casts per op)
        dtype = torch.float32 if run.precision == "32-true" or run.precision.endswith("-mixed") else torch.bfloat16
        staged = counts.get("staged_numels")
        ring = counts.get("staging_ring", False)  # NOTE: the step in backward's one ring: the same at any depth
        staging = pinned_staging_bytes([(n, dtype) for n in (numels if staged is None else staged)], ring=ring)
        if not ring and staged is not None and extrapolated and counts.get("traced_params") and estimate.num_params:
            staging = int(staging * estimate.num_params / counts["traced_params"])  # NOTE: traced at a lower depth
        staging += counts.get("ring_bytes", 0)  # NOTE: slots of the largest block: the same at any depth
    pages = min(counts.get("disk_buffer", 0), estimate.peak_disk)  # NOTE: the tier holds no more than its files
    for bd in estimate.phases.values():
        bd.add("device", "other", CUDA_CONTEXT_BYTES)
        bd.add("host", "other", staging + pages)
    if staging:
        out.append(Correction("pinned_staging", staging, False,
                              "OffloadStrategy's pinned host staging buckets in the compute dtype, and a streamed "
                              f"model's upload ring ({counts.get('ring_bytes', 0):,} B) (CUDA only, as the pinned "
                              "allocator rounds them), added to every phase's host `other`"))
    if pages:
        out.append(Correction("disk_tier_pages", pages, False,
                              f"the disk tier's pages read ahead or in use ({pages:,} B, its `disk_buffer`: page cache, "
                              "which the fake tensors of the trace do not hold), added to every phase's host `other`"))
    out.append(Correction("allocator_rounding", 0, False,
                          "the caching allocator rounds blocks to 512 B and reserves more than it allocates; "
                          "fragmentation is not modelled (size: to be calibrated on a GPU)"))
    if any(n.startswith(str(torch.ops.aten.mkldnn_rnn_layer.default)) for n in estimate.notes):
        # NOTE: the trace runs CPU kernels: nn.LSTM keeps oneDNN's workspace, whose size differs from cuDNN's reserve
        out.append(Correction("rnn_workspace", 0, False,
                              "nn.LSTM traced with the CPU (oneDNN) kernel's workspace; a CUDA run keeps cuDNN's "
                              "reserve space instead, of another size (not modelled)"))
    return out


__all__ = ["CUDA_CONTEXT_BYTES", "CudaOptimizerDefaults", "cuda_corrections"]

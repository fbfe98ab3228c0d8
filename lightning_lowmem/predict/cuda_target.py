"""What a dry run with ``target="cuda"`` changes: CUDA's kernel choices traced on CPU, and the corrections added.

The trace runs on fake CPU tensors (fake CUDA tensors abort a CPU-only build at the first autograd edge), with
CUDA's kernel choices emulated (1-byte dropout masks, flash attention, foreach optimizers) and the CUDA context
and pinned staging added; each is listed in the estimate's ``corrections``, uncalibrated until a GPU run
confirms it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from typing_extensions import override

from lightning_lowmem.core.accounting import host_storage_keys, storage_key
from lightning_lowmem.core.roles import HostMastersStrategy
from lightning_lowmem.predict.result import Correction, MemoryEstimate
from lightning_lowmem.predict.run_spec import RunSpec
from lightning_lowmem.strategies.offload.transfer import pinned_staging_bytes

#: CUDA context + cuBLAS workspace on a recent driver with lazy module loading (uncalibrated)
CUDA_CONTEXT_BYTES = 512 * 2**20


@contextlib.contextmanager
def cuda_kernels(counts: dict[str, int]) -> Iterator[None]:
    """Trace CUDA's kernel choices on CPU: fused dropout with a 1-byte mask, SDPA with O(s) saved state.

    NOTE: one of the dry run's two global swaps (two ``torch.nn.functional`` attributes; the other is
    ``nn.Module._apply`` in :func:`.fake.fake_execution`), where a ``TorchFunctionMode`` is the seam both functions
    offer: the autograd engine does not carry torch function modes into backward, so a checkpointed block's
    recompute (``torch.utils.checkpoint``, ours and Hugging Face's) would take CPU's kernels and save other tensors
    than the forward did (``CheckpointError``; tried again 2026-12-02 on torch 2.13). Hazard: another thread calling these functions during a ``target="cuda"`` dry run
    (a ``MemoryReport`` or ``lowmem_auto`` inside a fit) gets the emulation; no thread of this package does.
    """
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def cuda_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if training and 0.0 < p < 1.0 and input.numel():
            # NOTE: CUDA's at::dropout runs native_dropout (bool mask); CPU's keeps a float mask of 4 B/elem
            if torch.is_grad_enabled() and input.requires_grad:
                counts["dropout_mask_elements"] += input.numel()
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    def cuda_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        # NOTE: CPU falls back to the math kernel (s^2 probabilities kept) when dropout_p > 0; CUDA's flash /
        # memory-efficient kernels keep O(s) state with dropout too. Values are fake, so dropping p is exact.
        if kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0):
            counts["sdpa_dropout_calls"] += 1
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        return sdpa(*args, **kwargs)

    F.dropout, F.scaled_dot_product_attention = cuda_dropout, cuda_sdpa
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa


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
                   f"F.dropout traced as CUDA's native_dropout: bool masks, {counts['dropout_mask_elements']:,} "
                   f"mask elements{scale} at 1 B instead of 4 B (CPU)"),
        Correction("sdpa_flash_kernel", 0, True,
                   f"{counts['sdpa_dropout_calls']} SDPA calls with dropout traced without the CPU math fallback "
                   "(no s^2 probabilities kept), as CUDA's flash/memory-efficient kernels"),
        Correction("foreach_optimizer", 0, True,
                   f"{counts['foreach_groups']} device optimizer param groups traced with foreach=True, CUDA's default"),
        Correction("cuda_context", CUDA_CONTEXT_BYTES, False,
                   "CUDA context + cuBLAS workspace added to every phase's device `other` (lazy loading; "
                   "driver-dependent, 300-600 MiB)"),
    ]
    offload = "offload" in run.strategy_name and run.zero() is None
    staging = 0
    if offload:
        # NOTE: the compute weights' dtype: fp32 under "32-true" and "*-mixed" (autocast casts per op)
        dtype = torch.float32 if run.precision == "32-true" or run.precision.endswith("-mixed") else torch.bfloat16
        staged = counts.get("staged_numels")
        staging = pinned_staging_bytes([(n, dtype) for n in (numels if staged is None else staged)])
        if staged is not None and extrapolated and counts.get("traced_params") and estimate.num_params:
            staging = int(staging * estimate.num_params / counts["traced_params"])  # NOTE: traced at a lower depth
    for bd in estimate.phases.values():
        bd.add("device", "other", CUDA_CONTEXT_BYTES)
        bd.add("host", "other", staging)
    if staging:
        out.append(Correction("pinned_staging", staging, False,
                              "OffloadStrategy's pinned host staging buckets in the compute dtype (CUDA only, as "
                              "the pinned allocator rounds them), added to every phase's host `other`"))
    out.append(Correction("allocator_rounding", 0, False,
                          "the caching allocator rounds blocks to 512 B and reserves more than it allocates; "
                          "fragmentation is not modelled (size: to be calibrated on a GPU)"))
    if any(n.startswith(str(torch.ops.aten.mkldnn_rnn_layer.default)) for n in estimate.notes):
        # NOTE: the trace runs CPU kernels: nn.LSTM keeps oneDNN's workspace, whose size differs from cuDNN's reserve
        out.append(Correction("rnn_workspace", 0, False,
                              "nn.LSTM traced with the CPU (oneDNN) kernel's workspace; a CUDA run keeps cuDNN's "
                              "reserve space instead, of another size (not modelled)"))
    return out


__all__ = ["CUDA_CONTEXT_BYTES", "CudaOptimizerDefaults", "cuda_corrections", "cuda_kernels"]

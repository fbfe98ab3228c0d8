"""What ``lowmem_offload`` keeps on the host, as checkpoints and memory reports see it (a part of
:class:`~lightning_lowmem.strategies.offload.strategy.OffloadStrategy`).

Checkpoints hold the fp32 masters (a plain fp32 module loads them) and the host optimizer state; the memory breakdown
counts compute weights and gradients on the device, masters, their gradients, the optimizer state and the staging on
the host. :class:`HostState` is a base of ``OffloadStrategy`` and reads its state; it is not used on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

from typing_extensions import override

from lightning_lowmem.core import resume_checks as _resume_checks
from lightning_lowmem.core.accounting import (
    MemoryBreakdown,
    module_grad_bytes,
    module_weight_bytes,
    optimizer_state_bytes,
    unique_storage_bytes,
)
from lightning_lowmem.strategies.offload import host_optimizer as _host_optimizer


class HostState:
    """Checkpoints and the memory breakdown of ``OffloadStrategy`` (see the module docstring)."""

    # --- checkpoints -------------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict with the fp32 masters for the weights (a plain fp32 module loads it)."""
        module = self.lightning_module
        assert module is not None
        self.adopt_device_writes()
        self._land_delayed()  # NOTE: host_pass="delayed": a run resumed from here starts on the landed weights, as this one
        state = self._masters.state_dict(module)
        if self._stream is not None:
            # NOTE: streamed weights without a master (packed 4-bit ones, frozen) are saved from their host copies.
            # Not through the stream's host view: leaving it releases every block, and a checkpoint or a weight
            # average taken in a hook mid-fit would leave the blocks fetched for the next forward released (NaN).
            host = self._stream.host_of()
            for key, value in module.state_dict(keep_vars=True).items():
                if id(value) in host and id(value) not in self._masters.device_index:
                    state[key] = host[id(value)].detach()
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        _resume_checks.check_model(checkpoint, self.lightning_module)  # NOTE: another model's checkpoint, named
        if self._stream is not None:
            with self._stream.host_view():  # NOTE: streamed weights load into their host copies
                super().load_model_state_dict(checkpoint, strict=strict)
        else:
            super().load_model_state_dict(checkpoint, strict=strict)
        # NOTE: [resumed after an unfreeze] in masters.py (a checkpoint loaded after setup)
        self._new_masters(self._masters.master_from_checkpoint(checkpoint["state_dict"]))
        if self._masters.p_host:  # loaded after setup: the masters take the checkpoint's fp32 values too
            self._masters.load_state_dict(checkpoint["state_dict"])
            self._note_device()  # NOTE: the load wrote the compute weights: not a write to adopt

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # NOTE: unlike Strategy's, no `_optimizer_to_device(root_device)`: torch puts the state next to its
        # parameters, which are the host masters.
        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            _resume_checks.load_optimizer(optimizer, opt_state, _resume_checks.where(self.lightning_module.trainer))
            if id(optimizer) in self._fused:
                # NOTE: load_state_dict restores the groups' saved `fused`/`foreach` flags too; keep the host kernel
                # this run chose, so a resumed run steps exactly like an uninterrupted one.
                _host_optimizer.enable_fused(optimizer)
            self._mark_state(optimizer, reset=True)  # load_state_dict made new state tensors

    # --- memory report ------------------------------------------------------------------------------------------
    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes of compute weights and gradients on the device; masters, gradients, optimizer state on the host."""
        out = MemoryBreakdown()
        module = self.lightning_module
        if module is not None:
            with self._view.hidden() if self._view is not None else nullcontext():  # NOTE: called in a hook's view
                out.add("device", "weights", module_weight_bytes(module))
                out.add("device", "gradients", module_grad_bytes(module))
        out.add("host", "optimizer_state", unique_storage_bytes(self._masters.p_host))  # fp32 masters
        for opt in self.optimizers:
            out.add("host", "optimizer_state", optimizer_state_bytes(opt))
        masters = self._masters
        host_grads = [g for g in masters.grad_host if g is not None] + [p.grad for p in masters.p_host if p.grad is not None]
        out.add("host", "gradients", unique_storage_bytes(host_grads))
        if self._transfer is not None:
            out.add("host", "other", self._transfer.staging_bytes())
        if self._stream is not None:
            out.add("host", "weights", self._stream.host_bytes())  # the streamed blocks' compute copies
        return out

    def host_bytes_per_param(self) -> dict[str, float]:
        """Host bytes per parameter of the module, by part of :meth:`memory_breakdown` (``"total"`` included).

        ``weights`` is the streamed blocks' compute copies (``offload_params``), ``optimizer_state`` the fp32 masters
        plus the optimizer's state, ``other`` the pinned staging (CUDA).
        """
        numel = sum(p.numel() for p in self._masters.p_host)
        host = self.memory_breakdown().host
        out = {k: v / numel for k, v in host.items() if v} if numel else {}
        out["total"] = sum(out.values())
        return out


__all__ = ["HostState"]

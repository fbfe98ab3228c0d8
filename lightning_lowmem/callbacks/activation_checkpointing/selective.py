"""Selective activation checkpointing's policy: keep matmul-like outputs (``SELECTIVE_SAVE_OPS``), recompute the rest.
A kept output is an alias of the forward's tensor: blocks holding a recurrent layer (which changes them in place) are
recomputed whole; any other in-place change of a kept output is refused in its forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import storage_key

__all__ = ["SELECTIVE_SAVE_OPS", "SelectivePolicy", "holds_recurrent_layer", "selective_contexts"]


def _aten(*names: str) -> frozenset:
    ops = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            ops.append(op)
    return frozenset(ops)


# matmul-like ops whose outputs selective checkpointing keeps (everything else is recomputed)
SELECTIVE_SAVE_OPS = _aten(
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)  # fmt: skip

# NOTE: the CPU kernels of these decompose into addmm/mm and then modify those outputs in place (RNN, LSTM: torch's
# check fails in backward; GRU: through `unsafe_chunk` views, backward silently reads the modified gates).
RECURRENT_LAYERS = (nn.RNNBase, nn.RNNCellBase)


def holds_recurrent_layer(module: nn.Module) -> str | None:
    """The class name of the first recurrent layer (``nn.RNN``/``LSTM``/``GRU`` or a cell) in ``module``, if any."""
    return next((type(child).__name__ for child in module.modules() if isinstance(child, RECURRENT_LAYERS)), None)


def _written(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an in-place op writes (its arguments whose schema says ``Tensor(a!)``)."""
    written = []
    for i, arg in enumerate(torch_internals.op_arguments(op)):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written.extend(t for t in torch_internals.tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


class SelectivePolicy:
    """The policy of one checkpointed call: keep matmul-like outputs, refuse an in-place change of one of them (kept
    storages, by key, stay alive until backward: a key is not reused meanwhile)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int], str] = {}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        keep = op in SELECTIVE_SAVE_OPS
        if ctx.is_recompute:
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        if self._kept and torch_internals.op_is_mutable(op):
            for t in _written(op, args, kwargs):
                producer = self._kept.get(storage_key(t))
                if producer is not None:  # NOTE: a refusal of the module as written, in its first forward (no step yet)
                    raise ValueError(
                        f"ActivationCheckpointing(policy='selective'): `{op}` modifies in place the output of "
                        f"`{producer}`, which the selective policy keeps for backward; backward would read the "
                        "modified value. Make that op out of place (e.g. `nn.ReLU(inplace=False)`, `x = x + y` "
                        "instead of `x += y`), or use ActivationCheckpointing(policy='all'), which recomputes the "
                        "whole block."
                    )
        if not keep:
            return CheckpointPolicy.PREFER_RECOMPUTE
        self._kept.update({storage_key(t): str(op) for t in torch_internals.tree_leaves(ctx.op_output)
                           if isinstance(t, torch.Tensor)})
        return CheckpointPolicy.MUST_SAVE


def selective_contexts() -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` for the selective policy: a fresh :class:`SelectivePolicy` per call."""
    return create_selective_checkpoint_contexts(SelectivePolicy())

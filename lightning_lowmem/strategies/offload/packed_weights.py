"""bitsandbytes' packed 4-bit weights (``Params4bit``) in ``lowmem_offload``'s parameter streaming: the packed bytes
stream through ``p.data``, the absmax as a frozen parameter (:func:`quant_state_param`); never an fp32 master.

NOTE: [weight kept for backward] ``MatMul4Bit`` keeps the packed weight in ``ctx.tensors``, out of the saved-tensor
hooks' reach: while blocks stream, ``Linear4bit`` applies :func:`kept_by_hooks`' subclass (``save_for_backward``).
NOTE: ``Int8Params`` is not streamed: ``Linear8bitLt`` keeps its own reference to the int8 matrix (``state.CB``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from lightning_lowmem._internals import bitsandbytes as bnb_internals


def is_streamable_packed(p: nn.Parameter) -> bool:
    """``p`` is a bitsandbytes packed 4-bit weight (``Params4bit``; none when bitsandbytes is not loaded)."""
    if p.requires_grad:
        return False
    params4bit = getattr(sys.modules.get("bitsandbytes.nn"), "Params4bit", None)
    quant_state = getattr(sys.modules.get("bitsandbytes.functional"), "QuantState", None)
    # NOTE: the dry run's 4-bit weight is a plain parameter carrying its `quant_state` (no fake `Params4bit`)
    return ((params4bit is not None and isinstance(p, params4bit))
            or (quant_state is not None and isinstance(getattr(p, "quant_state", None), quant_state)))


def quant_state_param(p: nn.Parameter) -> list[nn.Parameter]:
    """The absmax of packed weight ``p``'s quantization state as a frozen parameter object (made one on first call;
    the state holds it): streamed with ``p``. Empty for any other parameter."""
    if not is_streamable_packed(p):
        return []
    state = p.quant_state
    if not isinstance(state.absmax, nn.Parameter):
        state.absmax = nn.Parameter(state.absmax, requires_grad=False)
    return [state.absmax]


class QuantStatePointers:
    """The absmax parameter each streamed packed weight's quantization state holds (taken before the module's move).

    NOTE: ``Params4bit.to(device)`` replaces the state's absmax by a moved copy: :meth:`repoint` after the move gives
    each state its streamed parameter back.
    """

    def __init__(self, params: Sequence[Sequence[nn.Parameter]]) -> None:
        self.pairs = [(p.quant_state, p.quant_state.absmax) for ps in params for p in ps if is_streamable_packed(p)]

    def repoint(self) -> None:
        for state, absmax in self.pairs:
            state.absmax = absmax


def streamable(p: nn.Parameter) -> bool:
    """A parameter of a repeated block that parameter streaming moves: floating point, or a packed 4-bit weight."""
    return p.is_floating_point() or is_streamable_packed(p)


def give_back_streamed(stream: Any, mastered: Mapping[int, int]) -> None:
    """After training: every streamed parameter without a master gets its host copy back as ``.data`` (cloned out of
    the pinned buckets on CUDA); a quantization state holds a plain absmax tensor again."""
    pinned, host = stream.ops is not None, stream.host_of()
    for ps in stream.params:
        for p in ps:
            if id(p) in host and id(p) not in mastered:
                p.data = host[id(p)].clone() if pinned else host[id(p)]
    for ps in stream.params:
        for p in ps:
            if is_streamable_packed(p) and isinstance(p.quant_state.absmax, nn.Parameter):
                p.quant_state.absmax = p.quant_state.absmax.data


@functools.cache
def _kept_by_hooks(base: type) -> type:
    class MatMul4BitKeptByHooks(base):  # type: ignore[valid-type, misc]
        """bitsandbytes' ``MatMul4Bit``, its packed weight kept through ``save_for_backward`` (see the module NOTE)."""

        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            out = base.forward(ctx, *args)
            kept = getattr(ctx, "tensors", (None, None))[1]
            if kept is not None:
                ctx.save_for_backward(kept)
                ctx.tensors = None
            return out

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            if getattr(ctx, "tensors", ()) is not None:
                return base.backward(ctx, *grads)
            ctx.tensors = (None, *ctx.saved_tensors)
            try:
                return base.backward(ctx, *grads)
            finally:
                ctx.tensors = None  # NOTE: the context outlives the backward (until the graph goes): not the weight

    return MatMul4BitKeptByHooks


def kept_by_hooks(params: Sequence[Sequence[nn.Parameter]]) -> contextlib.AbstractContextManager:
    """While entered, ``Linear4bit`` keeps its packed weight for backward where the stream's hooks see it, if any
    of ``params`` (the streamed weights, by block) is a packed 4-bit weight (see the module NOTE)."""
    if not any(is_streamable_packed(p) for ps in params for p in ps):
        return contextlib.nullcontext()
    return bnb_internals.applied_matmul_4bit(_kept_by_hooks(bnb_internals.matmul_4bit_function()))

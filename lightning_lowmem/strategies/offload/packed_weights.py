"""bitsandbytes' packed 4-bit weights in ``lowmem_offload``'s parameter streaming (private helper).

A ``bitsandbytes.nn.Params4bit`` (``Adapters(quantize_base="nf4"/"fp4")``, a QLoRA base) is a frozen ``uint8``
parameter: two 4-bit values per byte. Its quantization state (one absmax per 64 values, double-quantized: about
1/64 B per value, and a 16-value code book) is a Python attribute of the parameter, not a parameter. Streaming moves
the packed bytes like any block weight (their storage is swapped through ``p.data``, which keeps the parameter object
and its ``quant_state``). The per-block part of the quantization state, one 8-bit absmax per 64 values (1/32 of the
packed bytes; 1.1 GB at LLaMA-70B), streams with it: :func:`quant_state_param` makes it a frozen parameter object
that the stream moves like a weight, the quantization state keeping that object; the rest (the code books and the
double quantization's few fp32 values) stays with the layer. A packed weight never has an fp32 master (it is not
floating point, and frozen).

NOTE: [weight kept for backward] bitsandbytes' ``MatMul4Bit`` keeps a view of the packed weight as a Python attribute
of its autograd context (``ctx.tensors``), out of reach of autograd's saved-tensor hooks: each block's fetched copy
would stay on the device until its backward, every block at once (the whole base, as if resident). While blocks
stream, ``Linear4bit`` applies :func:`kept_by_hooks`' subclass instead, which keeps that view with
``save_for_backward``: the stream's hooks see it as a streamed weight and fetch it again for the backward.

NOTE: an ``Int8Params`` (``quantize_base="int8"``) is not streamed: ``Linear8bitLt`` keeps its own reference to the
int8 matrix in its ``state`` (``state.CB``), so a swapped ``p.data`` would leave that reference on the device (no
memory freed) and stale; its blocks' 8-bit weights stay resident.
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
    """``p`` is a bitsandbytes packed 4-bit weight (``Params4bit``) that parameter streaming may move.

    Looked up through ``sys.modules``: if bitsandbytes is not loaded, no parameter is one.
    """
    if p.requires_grad:
        return False
    params4bit = getattr(sys.modules.get("bitsandbytes.nn"), "Params4bit", None)
    quant_state = getattr(sys.modules.get("bitsandbytes.functional"), "QuantState", None)
    # NOTE: the dry run's 4-bit weight is a plain parameter carrying its `quant_state` (a `Params4bit` cannot wrap a
    # fake tensor): recognised by that state, or the dry run would keep the packed weights resident
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

    NOTE: ``Params4bit.to(device)`` moves its quantization state with ``QuantState.to``, which replaces the absmax by a
    moved copy: after the module's move the state would read that copy (the emptied host tensor, moved), not the
    streamed parameter. :meth:`repoint` after the move gives each state its parameter back.
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
    """After training: every streamed parameter without a master (packed 4-bit weights and their absmax, frozen
    weights whose compute dtype holds their value) gets its host copy back as its ``.data`` (the others get their
    masters' values from ``HostMasters.give_back_fp32``); a quantization state holds a plain absmax tensor again.

    NOTE: on CUDA the host copy is a view of a pinned staging bucket: it is copied out, so no pinned memory is left
    to the user's module after the fit.
    """
    pinned = stream.ops is not None
    for p_id, h in stream.host_of().items():
        if p_id in mastered:
            continue
        for ps in stream.params:
            for p in ps:
                if id(p) == p_id:
                    p.data = h.clone() if pinned else h
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

"""bitsandbytes' packed 4-bit weights in ``lowmem_offload``'s parameter streaming (private helper).

A ``bitsandbytes.nn.Params4bit`` (``Adapters(quantize_base="nf4"/"fp4")``, a QLoRA base) is a frozen ``uint8``
parameter: two 4-bit values per byte. Its quantization state (one absmax per 64 values, double-quantized: about
1/64 B per value, and a 16-value code book) is a Python attribute of the parameter, not a parameter. Streaming moves
the packed bytes like any block weight (their storage is swapped through ``p.data``, which keeps the parameter object
and its ``quant_state``); the quantization state stays where the layer put it (on the device: 1.6 % of the packed
bytes). It never has an fp32 master (it is not floating point, and frozen).

NOTE: an ``Int8Params`` (``quantize_base="int8"``) is not streamed: ``Linear8bitLt`` keeps its own reference to the
int8 matrix in its ``state`` (``state.CB``), so a swapped ``p.data`` would leave that reference on the device (no
memory freed) and stale; its blocks' 8-bit weights stay resident.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from torch import nn


def is_streamable_packed(p: nn.Parameter) -> bool:
    """``p`` is a bitsandbytes packed 4-bit weight (``Params4bit``) that parameter streaming may move.

    Looked up through ``sys.modules``: if bitsandbytes is not loaded, no parameter is one.
    """
    bnb_nn = sys.modules.get("bitsandbytes.nn")
    params4bit = getattr(bnb_nn, "Params4bit", None) if bnb_nn is not None else None
    return params4bit is not None and isinstance(p, params4bit) and not p.requires_grad


def streamable(p: nn.Parameter) -> bool:
    """A parameter of a repeated block that parameter streaming moves: floating point, or a packed 4-bit weight."""
    return p.is_floating_point() or is_streamable_packed(p)


def give_back_streamed(stream: Any, mastered: Mapping[int, int]) -> None:
    """After training: every streamed parameter without a master (the packed 4-bit weights) gets its host copy back
    as its ``.data`` (the others get their masters' values from ``HostMasters.give_back_fp32``).

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

"""Quantize a frozen base model's linear layers with bitsandbytes (the base of a QLoRA fine-tune).

Each ``nn.Linear`` but the output head (Hugging Face's ``BitsAndBytesConfig`` skips it too: the logits are the
most precision-sensitive product) becomes a ``bitsandbytes.nn.Linear4bit`` (``"nf4"``/``"fp4"``, bitsandbytes'
defaults: blocks of 64 values, double-quantized absmax) or ``Linear8bitLt`` (``"int8"``, row-wise scales, no
outlier threshold), whose weight is quantized at once from the layer's current values on the layer's device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_lowmem._compat import require

QUANT_TYPES: tuple[str, ...] = ("nf4", "fp4", "int8")


def _head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        head = None
    return head if isinstance(head, nn.Module) else None


def _quantized(linear: nn.Linear, quant_type: str, bnb: Any) -> nn.Module:
    weight = linear.weight
    if weight.is_meta:
        raise ValueError(
            f"Passed `quantize_base={quant_type!r}` for a model whose weights are not loaded (on the meta device): "
            "bitsandbytes quantizes real values. Load the weights before `setup` (in `__init__` or `configure_model`)."
        )
    has_bias = linear.bias is not None
    if quant_type == "int8":
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False,
                                device="meta")
        q.weight = bnb.nn.Int8Params(weight.detach(), requires_grad=False, has_fp16_weights=False)
    else:
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias, quant_type=quant_type,
                              device="meta")
        q.weight = bnb.nn.Params4bit(weight.detach(), requires_grad=False, quant_type=quant_type, module=q)
    if has_bias:
        q.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    # NOTE: bitsandbytes quantizes a weight when it is moved to a (non-meta) device: here, to the one it is on
    q.weight = q.weight.to(weight.device)
    return q


def quantize_linears(model: nn.Module, quant_type: str) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` but its output head by its bitsandbytes quantized layer, in place.

    Returns the names of the layers replaced.

    Raises:
        ValueError: no ``nn.Linear`` to quantize (GPT-2's ``Conv1D`` layers are not linears), or weights on meta.
    """
    bnb = require("bitsandbytes", f"Adapters(quantize_base={quant_type!r})")
    head = _head(model)
    skip = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    replaced: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or isinstance(child, skip) or child is head:
                continue
            setattr(parent, child_name, _quantized(child, quant_type, bnb))
            replaced.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    if not replaced:
        kinds = sorted({type(m).__name__ for m in model.modules() if not list(m.children())})
        raise ValueError(
            f"Passed `quantize_base={quant_type!r}`, but the `{type(model).__name__}` has no `torch.nn.Linear` layer "
            f"to quantize besides its output head (its leaf layers: {', '.join(kinds)}). bitsandbytes quantizes "
            "`nn.Linear` only (GPT-2's `Conv1D` is not one): use `quantize_base=None`."
        )
    return replaced


def packed_bytes(module: nn.Module) -> int:
    """Bytes of a quantized layer's weight as stored: the packed values and their quantization state."""
    weight = module.weight
    total = weight.numel() * weight.element_size()
    state = getattr(weight, "quant_state", None) or getattr(module, "state", None)
    for t in _state_tensors(state):
        total += t.numel() * t.element_size()
    scb = getattr(weight, "SCB", None)
    if isinstance(scb, torch.Tensor):
        total += scb.numel() * scb.element_size()
    return total


def _state_tensors(state: Any) -> list[torch.Tensor]:
    if state is None or not hasattr(state, "absmax"):
        return []
    out = [t for t in (state.absmax, getattr(state, "code", None)) if isinstance(t, torch.Tensor)]
    nested = getattr(state, "state2", None)
    return out + _state_tensors(nested) if nested is not None else out

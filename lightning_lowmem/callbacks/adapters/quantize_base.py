"""Quantize a frozen base model's linear layers with bitsandbytes (the base of a QLoRA fine-tune): each ``nn.Linear``
but the output head (as ``BitsAndBytesConfig``) becomes a ``Linear4bit`` (``"nf4"``/``"fp4"``, bitsandbytes' defaults)
or ``Linear8bitLt`` (``"int8"``), quantized at once from its current values on its device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import storage_key
from lightning_lowmem.core.dry_run_refusal import DryRunUnsupportedError
from lightning_lowmem.core.optional import require

QUANT_TYPES: tuple[str, ...] = ("nf4", "fp4", "int8")


def _quantized(linear: nn.Linear, quant_type: str, bnb: Any, dtype: torch.dtype | None) -> nn.Module:
    weight = linear.weight
    if weight.is_meta:
        raise ValueError(
            f"Passed `quantize_base={quant_type!r}` for a model whose weights are not loaded (on the meta device): "
            "bitsandbytes quantizes real values. Load the weights before `setup` (in `__init__` or `configure_model`)."
        )
    if torch_internals.is_fake(weight):
        if quant_type == "int8":
            # NOTE: `Int8Params` is a tensor subclass built with `Tensor._make_subclass`, which cannot wrap a
            # FakeTensor, and `Linear8bitLt` keeps its own references to the int8 matrix (`state.CB`)
            raise DryRunUnsupportedError(
                "bitsandbytes Int8Params",
                "`Adapters(quantize_base='int8')` builds bitsandbytes' int8 parameters, which cannot wrap a fake "
                "tensor; dry-run a 4-bit base (`quantize_base='nf4'`) or `quantize_base=None`",
                None,
            )
        return _fake_4bit(linear, quant_type, bnb, dtype)
    has_bias = linear.bias is not None
    if quant_type == "int8":
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False,
                                device="meta")
        q.weight = bnb.nn.Int8Params(weight.detach().to(dtype), requires_grad=False, has_fp16_weights=False)
    else:
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias, quant_type=quant_type,
                              device="meta")
        q.weight = bnb.nn.Params4bit(weight.detach().to(dtype), requires_grad=False, quant_type=quant_type, module=q)
    if has_bias:
        q.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    # NOTE: bitsandbytes quantizes a weight when it is moved to a (non-meta) device: here, to the one it is on
    q.weight = q.weight.to(weight.device)
    if quant_type != "int8":
        q.register_load_state_dict_pre_hook(_load_quant_state)
    return q


def _fake_4bit(linear: nn.Linear, quant_type: str, bnb: Any, dtype: torch.dtype | None) -> nn.Module:
    """The dry run's ``Linear4bit``: bitsandbytes' quantize op on a fake weight, held by a frozen ``uint8`` parameter
    carrying its ``quant_state`` (the forward reads only those, and bitsandbytes' ops have fake kernels)."""
    with torch_internals.unset_fake_temporarily():
        # NOTE: built outside the fake mode, on meta: `Params4bit`'s `Tensor._make_subclass` cannot wrap a fake
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              quant_type=quant_type, device="meta")
        # NOTE: bitsandbytes caches its 8-bit code book at first use: filled with the real map here, or a fake one
        # would stay there and poison every later real quantization
        bnb.functional.name2qmap.setdefault("dynamic", bnb.functional.create_dynamic_map())
    like = q.weight  # a meta `Params4bit`: the layer's own blocksize, statistics compression and storage dtype
    packed, state = bnb.functional.quantize_4bit(linear.weight.detach().to(dtype), blocksize=like.blocksize,
                                                 compress_statistics=like.compress_statistics,
                                                 quant_type=quant_type, quant_storage=like.quant_storage)
    weight = nn.Parameter(packed, requires_grad=False)
    for name in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
        setattr(weight, name, getattr(like, name))  # NOTE: PEFT's 4-bit LoRA layer reads them from the weight
    weight.quant_state, weight.bnb_quantized, weight.module = state, True, q
    q.weight = weight
    q.quant_state = state
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    return q


def _load_quant_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Restore a 4-bit layer's quantization state from the entries its ``state_dict`` wrote beside its weight
    (``Linear4bit`` has no loader for them: a strict ``load_state_dict`` would refuse them as unexpected)."""
    import bitsandbytes as bnb

    start = prefix + "weight."
    entries = {k[len(start):]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(start)]}
    if entries:
        state = bnb.functional.QuantState.from_dict(entries, device=module.weight.device)
        module.weight.quant_state = state
        module.quant_state = state


def quantize_linears(model: nn.Module, quant_type: str, dtype: torch.dtype | None = None) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` but its output head by its bitsandbytes quantized layer, in place;
    returns the names replaced. ``dtype``: quantize the weights as rounded to it, so the layer dequantizes to it (a
    ``*-true`` half precision's compute dtype; from fp32 it would dequantize to fp32 and cast, 6 B per value)."""
    bnb = require("bitsandbytes", f"Adapters(quantize_base={quant_type!r})")
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        head = None
    skip = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    replaced: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or isinstance(child, skip) or child is head:
                continue
            setattr(parent, child_name, _quantized(child, quant_type, bnb, dtype))
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
    """Bytes of a quantized layer's weight as stored, by storage: the packed values and their quantization state."""
    weight = module.weight
    tensors = [weight.data, *_state_tensors(getattr(weight, "quant_state", None))]
    scb = getattr(weight, "SCB", None)
    if isinstance(scb, torch.Tensor):
        tensors.append(scb)
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def _state_tensors(state: Any) -> list[torch.Tensor]:
    if state is None or not hasattr(state, "absmax"):
        return []
    out = [t for t in (state.absmax, getattr(state, "code", None), getattr(state, "offset", None))
           if isinstance(t, torch.Tensor)]
    nested = getattr(state, "state2", None)
    return out + _state_tensors(nested) if nested is not None else out

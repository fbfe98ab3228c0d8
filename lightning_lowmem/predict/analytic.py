"""Closed-form memory bounds for decoder-only transformers: the sanity check beside the dry run.

The published rules at the run's element sizes: per-parameter model states (AdamW, bitsandbytes' 8-bit state, SGD
momentum) and Korthikanti et al. 2022 (arXiv 2205.05198) for saved activations, with the LM head's logits terms. On
Hugging Face models they come out up to 21 % low (``benchmarks/results/estimate.md``): they miss HF's Python GELU
intermediates, fp32 dropout masks on CPU, view-vs-copy effects and optimizer temporaries. So they are only a bound
beside the traced figure, and the fallback when a model cannot be traced (the estimate's notes say so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_lowmem.core.accounting import MemoryBreakdown
from lightning_lowmem.core.optimizer_state import optimizer_state_bytes_per_param
from lightning_lowmem.core.units import fmt_bytes
from lightning_lowmem.strategies.zero.host_bytes import (
    DISK_PARTS,
    HOST_CATEGORIES,
    zero_nvme_disk_bytes,
    zero_offload_host_bytes,
)

#: bytes of one element of a compute dtype named by a Lightning precision string
_PARAM_BYTES = {"32-true": 4, "bf16-true": 2, "16-true": 2, "bf16-mixed": 4, "16-mixed": 4}
_ACT_BYTES = {"32-true": 4, "bf16-true": 2, "16-true": 2, "bf16-mixed": 2, "16-mixed": 2}


@dataclass(frozen=True)
class TransformerShape:
    """The few numbers of a decoder-only transformer that the formulas need."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated_mlp: bool
    dropout: bool
    num_params: int
    largest_param: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def transformer_shape(config: Any, num_params: int | None = None, largest_param: int | None = None) -> TransformerShape:
    """Read layer count, widths and vocabulary from a Hugging Face config (object or dict).

    ``num_params`` and ``largest_param`` are exact counts when the caller has a (meta) model; without
    them the GPT-2 / LLaMA closed forms are used.

    Raises:
        ValueError: the config lacks a layer count, a hidden size or a head count.
    """
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head", "num_heads")
    if not (layers and hidden and heads):
        raise ValueError(
            "The analytic bound needs a decoder-only transformer config with a layer count "
            "(`num_hidden_layers`/`n_layer`), a width (`hidden_size`/`n_embd`) and a head count "
            f"(`num_attention_heads`/`n_head`); got {type(config).__name__} without them."
        )
    model_type = _first(config, "model_type", default="")
    gated = model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3") or (
        _first(config, "hidden_act", default="") in ("silu", "swiglu") and model_type != "opt"
    )
    ffn = _first(config, "intermediate_size", "ffn_dim", "n_inner", "d_ff") or 4 * hidden
    kv_heads = _first(config, "num_key_value_heads", default=heads)
    vocab = _first(config, "vocab_size", default=50257)
    dropout = any((_first(config, n, default=0.0) or 0.0) > 0
                  for n in ("resid_pdrop", "attn_pdrop", "dropout", "hidden_dropout"))
    if num_params is None:
        num_params = _closed_form_params(model_type, int(layers), int(hidden), int(heads), int(kv_heads), int(ffn),
                                         int(vocab), gated, config)
    if largest_param is None:
        largest_param = max(vocab * hidden, hidden * ffn)
    return TransformerShape(
        num_layers=int(layers), hidden=int(hidden), heads=int(heads), kv_heads=int(kv_heads), ffn=int(ffn),
        vocab=int(vocab), gated_mlp=bool(gated), dropout=dropout,
        num_params=int(num_params), largest_param=int(largest_param),
    )


def _closed_form_params(model_type: str, L: int, h: int, heads: int, kv: int, f: int, V: int, gated: bool,
                        config: Any) -> int:
    """Parameters of a GPT-2 / OPT / LLaMA-style decoder (biases and norms included), embeddings tied or not."""
    hd = h // heads
    attn = h * (heads * hd + 2 * kv * hd) + heads * hd * h
    if model_type in ("gpt2", "opt"):
        layer = attn + 4 * h + 2 * h * f + f + h + 4 * h  # biased projections, two LayerNorms (weight + bias)
        positions = _first(config, "n_positions", "max_position_embeddings", default=1024)
        positions += 2 if model_type == "opt" else 0  # OPT's learned positions are offset by 2
        extra = positions * h + 2 * h
    else:
        layer = attn + (3 if gated else 2) * h * f + 2 * h  # no biases, two RMSNorms
        extra = h
    total = V * h + L * layer + extra
    if not _first(config, "tie_word_embeddings", default=True):
        total += V * h
    return total


def layer_activation_bytes(shape: TransformerShape, b: int, s: int, act_bytes: int, mask_bytes: int,
                           *, keep_scores: bool = True) -> int:
    """Saved activations of one layer, Korthikanti et al.'s decomposition at the given element sizes.

    Attention: 5 sbh tensors (QKV input, Q, K, V, projection input) + the residual dropout mask +
    ``a s^2 b`` scores (softmax output, dropout output and mask). MLP: input, 2 (3 gated) ffn-wide
    tensors, dropout mask. Two norms. ``keep_scores=False`` drops the s^2 terms (flash attention,
    or selective recompute).
    """
    sbh = s * b * shape.hidden
    kv = 2 * shape.kv_heads * shape.head_dim * s * b
    m = mask_bytes if shape.dropout else 0
    attn = (3 * sbh + kv) * act_bytes + sbh * m
    if keep_scores:
        scores = shape.heads * s * s * b
        attn += scores * (2 * act_bytes + m) if shape.dropout else scores * act_bytes
    ffn_width = shape.ffn * s * b
    mlp = sbh * act_bytes + (3 if shape.gated_mlp else 2) * ffn_width * act_bytes + sbh * m
    norms = 2 * sbh * act_bytes
    return attn + mlp + norms


def analytic_phases(
    config: Any, batch_size: int, seq_len: int, *, precision: str = "32-true", optimizer: str = "adamw",
    checkpointing: str | None = None, checkpointing_every_n: int = 2, num_params: int | None = None,
    largest_param: int | None = None, flash_attention: bool | None = None, offload: bool = False,
) -> dict[str, MemoryBreakdown]:
    """Peak bytes per phase (forward, backward, optimizer) by category, device role, in closed form.

    Phases: the forward ends with weights, last step's gradients, optimizer state, saved activations and the fp32
    logits; backward has gradients freed and the head's 2 x fp32 ``b s V`` transient on top; the optimizer step holds
    weights + gradients + state (+ 2 x the largest parameter for single-tensor AdamW). ``flash_attention``: no s^2
    scores kept (default: the CPU's choice, scores kept when dropout is on). ``offload``: CPU-master offload (the
    device keeps the compute weights and one gradient; masters, gradients and state on the host).
    """
    if precision not in _PARAM_BYTES:
        raise ValueError(f"Passed `precision={precision!r}`; expected one of {sorted(_PARAM_BYTES)}.")
    shape = transformer_shape(config, num_params, largest_param)
    p_bytes, a_bytes = _PARAM_BYTES[precision], _ACT_BYTES[precision]
    P = shape.num_params
    weights = grads = P * p_bytes
    state = int(optimizer_state_bytes_per_param(optimizer, p_bytes, P))
    b, s, L = batch_size, seq_len, shape.num_layers
    keep_scores = shape.dropout if flash_attention is None else not flash_attention
    per_layer = layer_activation_bytes(shape, b, s, a_bytes, 1, keep_scores=keep_scores)
    layer_input = s * b * shape.hidden * a_bytes
    if checkpointing is None:
        acts = L * per_layer
    elif checkpointing == "all":
        acts = L * layer_input + per_layer
    elif checkpointing == "every_n":
        n_ckpt = math.ceil(L / max(1, checkpointing_every_n))
        acts = n_ckpt * layer_input + (L - n_ckpt) * per_layer + per_layer
    elif checkpointing == "sqrt":
        k = max(1, round(math.sqrt(L)))
        acts = math.ceil(L / k) * layer_input + k * per_layer
    elif checkpointing == "selective":
        acts = L * layer_activation_bytes(shape, b, s, a_bytes, 1, keep_scores=False)
    else:
        raise ValueError(
            f"Passed `checkpointing={checkpointing!r}`; expected one of 'all', 'every_n', 'sqrt', 'selective' or None."
        )
    bsv = b * s * shape.vocab
    logits = bsv * 4  # NOTE: the loss upcasts logits to fp32; log_softmax keeps one fp32 b*s*V tensor
    head_saved = logits + b * s * shape.hidden * a_bytes
    temporaries = 2 * shape.largest_param * p_bytes if optimizer == "adamw" else 0

    host = {}
    if offload:
        host = {"gradients": 4 * P, "optimizer_state": 4 * P + int(optimizer_state_bytes_per_param(optimizer, 4, P))}
        grads, state, temporaries = shape.largest_param * p_bytes, 0, 0

    def breakdown(**device: int) -> MemoryBreakdown:
        out = MemoryBreakdown()
        for cat, nbytes in device.items():
            out.add("device", cat, int(nbytes))  # type: ignore[arg-type]
        for cat, nbytes in host.items():
            out.add("host", cat, int(nbytes))  # type: ignore[arg-type]
        return out

    return {
        "forward": breakdown(weights=weights, gradients=grads, optimizer_state=state,
                             activations=acts + head_saved, other=logits),
        "backward": breakdown(weights=weights, optimizer_state=state, activations=acts + head_saved,
                              other=2 * logits),
        "optimizer": breakdown(weights=weights, gradients=grads, optimizer_state=state, other=temporaries),
    }


def zero_states(estimate: Any, plan: Any, *, precision: str, gathered_params: int | None,
                numels: Sequence[int] | None = None, frozen: Sequence[int] = ()) -> None:
    """Replace a single-device trace's model states by DeepSpeed ZeRO's partitioned ones, in place.

    Per rank, P parameters, N ranks, h = 2 B (half precision) or 4 B (fp32): weights hP (stage 3: hP/N), gradients
    hP/N, optimizer state (fp32 masters 4P when h = 2, plus Adam's 8P) over N; reduce/all-gather buckets not modelled.
    ``offload_optimizer``: state and fp32 gradients on the host. ``offload_parameters`` (stage 3): the device holds
    two modules' gathered parameters (``2 x gathered_params``), the host the partitioned half-precision weights.
    NVMe offload (``plan.nvme``): the host and disk bytes of ``host_bytes`` from the plan's config, for the trainable
    parameters' element counts ``numels`` (one of P without them) and the ``frozen`` ones'; its parts named in a note.
    """
    P, N = estimate.num_params or 0, plan.world_size
    h = 4 if precision == "32-true" else 2
    state = (4 * P if h == 2 else 0) + int(optimizer_state_bytes_per_param("adamw", 4, P))
    weights = h * P if plan.stage < 3 else h * P // N
    if plan.stage == 3 and plan.offload_parameters:
        weights = 2 * h * gathered_params if gathered_params else 0
    grads = h * P // N if plan.stage >= 2 else h * P
    offload = plan.offload_optimizer
    nvme = _nvme_parts(estimate, plan, h, [list(numels or [P])], frozen) if plan.nvme else None
    for phase, bd in estimate.phases.items():
        dev = bd.device
        dev["weights"] = weights
        dev["gradients"] = grads if dev["gradients"] > 0 and not offload else 0
        dev["optimizer_state"] = 0 if offload else state // N
        if phase == "optimizer" and offload:
            dev["other"] = 0
        bd.host = dict.fromkeys(bd.host, 0)
        if nvme is not None:
            bd.host.update(nvme[0])
            bd.disk = {**dict.fromkeys(bd.disk, 0), **nvme[1]}
            continue
        if offload:
            bd.host["optimizer_state"] = state // N
            bd.host["gradients"] = 4 * P // N
        if plan.stage == 3 and plan.offload_parameters:
            bd.host["weights"] = h * P // N
    estimate.method = "dry_run+zero_closed_form"
    estimate.steps = []
    estimate.notes.append(
        f"ZeRO-{plan.stage} over {N} rank(s): traced on one device, model states from DeepSpeed's partitioning in "
        f"closed form ({precision} compute weights{', fp32 masters in the optimizer' if h == 2 else ''}"
        f"{'; optimizer offloaded' if offload else ''}{'; parameters offloaded' if plan.offload_parameters else ''}); "
        "reduce/all-gather buckets not modelled"
    )
    if nvme is not None:
        estimate.notes.append(nvme[2])


def _nvme_parts(estimate: Any, plan: Any, h: int, groups: list[list[int]], frozen: Sequence[int]
                ) -> tuple[dict[str, int], dict[str, int], str]:
    """ZeRO-Infinity's host and disk bytes per rank by category, and a note naming each part."""

    config = {**plan.config, "fp16": {"enabled": False}, "bf16": {"enabled": h == 2}}
    per_element = optimizer_state_bytes_per_param("adamw", 4, 1)
    host_parts = {k: v for k, v in zero_offload_host_bytes(
        config, groups, world_size=plan.world_size, cuda=estimate.target == "cuda", state_bytes_per_element=per_element
    ).items() if k in HOST_CATEGORIES}
    disk_parts = zero_nvme_disk_bytes(config, groups, world_size=plan.world_size, state_bytes_per_element=per_element,
                                      frozen=frozen)
    host: dict[str, int] = {}
    disk: dict[str, int] = {}
    for name, nbytes in host_parts.items():
        host[HOST_CATEGORIES[name]] = host.get(HOST_CATEGORIES[name], 0) + nbytes
    for name, nbytes in disk_parts.items():
        disk[DISK_PARTS[name][0]] = disk.get(DISK_PARTS[name][0], 0) + nbytes

    def listed(parts: dict[str, int]) -> str:
        return ", ".join(f"{name} {fmt_bytes(n)}" for name, n in parts.items()) or "nothing"

    return host, disk, (
        f"NVMe offload (ZeRO-Infinity), per rank: on disk {listed(disk_parts)}; in host RAM {listed(host_parts)} "
        "(buffer counts and sizes from the DeepSpeed config; a tensor under max(1 MiB, aio.block_size) is not swapped)"
    )

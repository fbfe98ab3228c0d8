"""The planner's cost model: predicted seconds of one optimizer step of a recipe, on a hardware profile.

Compute (``6 N T`` plus attention, recomputation included), bytes over the host link (overlapping compute), the
host and device optimizer steps at memory bandwidth, the disk tier's reads and writes at disk bandwidth, and the
adapters' smaller gradients and dequantized base.
Only ratios between recipes rank them; ``benchmarks/results/plan_cost.md`` compares it with measured step times.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from lightning_lowmem.plan.hardware import GB, HardwareProfile
from lightning_lowmem.plan.recipes import DISK, IN_BACKWARD, Recipe

#: bytes of activations a transformer block keeps for backward per token per hidden unit, in 16-bit
#: (Korthikanti et al. 2022, table 2: 34 s b h without recomputation; with flash attention no s^2 term)
_SAVED_PER_TOKEN_HIDDEN = 34
#: AdamW on the host: read param, grad, exp_avg, exp_avg_sq (16 B) and write param, exp_avg, exp_avg_sq (12 B)
ADAMW_BYTES = 28
#: with 8-bit state: 2 B of state read and written instead of 8
ADAMW_8BIT_BYTES = 16
#: ``sum(in + out)`` of a transformer block's linears per hidden unit: 4 attention projections (2 d each) and an MLP
#: of 4 d (GPT-2: 2 x 5 d) or SwiGLU of about 2.7 d (LLaMA: 3 x 3.7 d): about 18 d either way
_LINEAR_IN_OUT_PER_HIDDEN = 18
#: a packed 4-bit (8-bit) base linear's bytes per parameter read, plus 2 B of 16-bit weight written, per dequantize
_DEQUANT_BYTES = {"nf4": 0.5 + 2, "fp4": 0.5 + 2, "int8": 1 + 2}


def trainable_params(recipe: Recipe, shape: ModelShape) -> int:
    """Parameters the optimizer updates: all of them, or the adapters': ``18 r d`` per block (DoRA: plus a magnitude
    per output feature), 1 % of the parameters where the shape does not say."""
    if recipe.adapters is None:
        return shape.num_params
    if shape.num_blocks and shape.hidden:
        per = recipe.adapter_r * _LINEAR_IN_OUT_PER_HIDDEN * shape.hidden
        if recipe.adapters == "dora":
            per += _LINEAR_IN_OUT_PER_HIDDEN * shape.hidden // 2  # a magnitude per output feature
        return min(shape.num_blocks * per, shape.num_params)
    return max(shape.num_params // 100, 1)


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a model; ``None`` where a module does not say (its terms are left out)."""

    num_params: int
    num_blocks: int | None = None
    hidden: int | None = None
    seq_len: int | None = None
    vocab: int | None = None

    @classmethod
    def of(cls, num_params: int, config: Any = None, seq_len: int | None = None, num_blocks: int | None = None
           ) -> ModelShape:
        def field(*names: str) -> int | None:
            return next((int(getattr(config, n)) for n in names if isinstance(getattr(config, n, None), int)), None)

        return cls(num_params, field("num_hidden_layers", "n_layer", "num_layers") or num_blocks,
                   field("hidden_size", "n_embd", "d_model"), seq_len, field("vocab_size"))


@dataclass
class StepCost:
    """Predicted seconds of one optimizer step, by part; ``total`` is what recipes are ranked by."""

    compute_s: float
    link_s: float
    link_serial_s: float
    host_optimizer_s: float
    device_optimizer_s: float
    total_s: float
    flops: float
    link_bytes: float
    #: the disk tier's seconds and bytes read and written per step (all of it, hidden or not)
    disk_s: float = 0.0
    disk_bytes: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def step_cost(recipe: Recipe, shape: ModelShape, batch_size: int, profile: HardwareProfile) -> StepCost:
    """Seconds of one optimizer step of ``recipe`` (effective batch ``batch_size``) on ``profile``."""
    n = shape.num_params
    layers, d, s = shape.num_blocks or 0, shape.hidden or 0, shape.seq_len or 1
    tokens = batch_size * s
    micro = math.ceil(batch_size / recipe.micro_batch_size)
    head = (shape.vocab or 0) * d
    block_params = max(n - head, 0)
    attention = 4 * layers * s * tokens * d  # forward: QK^T and AV
    trained = trainable_params(recipe, shape)
    # NOTE: weight gradients only for what is trained (a frozen base still passes input gradients back): 6 N T in full
    flops = (4 * n + 2 * trained) * tokens + 3 * attention
    recompute = {None: 0.0, "every_n": 0.5, "all": 1.0}[recipe.checkpointing]
    flops += recompute * (2 * block_params * tokens + attention)
    if recipe.chunked_loss:
        flops += 2 * head * tokens
    half = recipe.base != "fp32"
    rate = (profile.half_tflops if half else profile.fp32_tflops) * 1e12 * profile.efficiency
    compute = flops / rate + micro * max(layers, 1) * profile.launch_s_per_block
    if recipe.quantize_base is not None:
        # NOTE: each base linear is dequantized in forward, backward and every recomputed forward of every micro-batch
        compute += micro * (2 + recompute) * block_params * _DEQUANT_BYTES[recipe.quantize_base] / (
            profile.device_gbps * GB)

    weight_bytes = 2 if half else 4
    link, serial = 0.0, 0.0
    if recipe.base in ("offload", "offload_obw", "offload_disk", "zero2_offload"):
        serial = trained * weight_bytes  # the updated weights, before the next forward
        link += micro * trained * weight_bytes  # gradients, per micro-batch
    elif recipe.base.startswith("offload_params"):
        # the blocks' weights fetched in forward, in backward and for each recomputed forward, per micro-batch; the
        # rest (embeddings, head) after the step as under lowmem_offload; gradients out per micro-batch
        serial = min(head, trained) * weight_bytes
        link += micro * (block_params * weight_bytes * (2 + recompute) + trained * weight_bytes)
    elif recipe.base == "zero3_offload":
        # weights in forward and in backward, the blocks' weights again for each recomputed forward, gradients out
        link += micro * (2 * n + trained + recompute * block_params) * weight_bytes
    if recipe.activation_offload and layers and d:
        inputs_only = d * weight_bytes  # a checkpointed block keeps its input
        everything = _SAVED_PER_TOKEN_HIDDEN * d * weight_bytes / 2
        per_token_block = {None: everything, "every_n": (inputs_only + everything) / 2,
                           "all": inputs_only}[recipe.checkpointing]
        link += 2 * layers * tokens * per_token_block  # out in forward, back in backward
    link_s, serial_s = link / (profile.link_gbps * GB), serial / (profile.link_gbps * GB)

    state = ADAMW_8BIT_BYTES if recipe.optimizer == "adamw8bit" else ADAMW_BYTES
    host_opt = dev_opt = 0.0
    if recipe.base not in ("fp32", "mixed", "half"):
        host_opt = trained * state / (profile.host_gbps * GB)
    else:
        dev_opt = trained * state / ((profile.device_optimizer_gbps or profile.device_gbps) * GB)
    disk = _disk_bytes(recipe, trained, block_params, head, micro, recompute)
    disk_s = [b / (profile.disk_gbps * GB) for b in disk]
    # NOTE: on a GPU the copies run on copy engines beside the kernels; where one processor does both, they add up
    gpu = max(compute, link_s, disk_s[2]) if profile.overlap else compute + link_s + disk_s[2]
    if recipe.base in IN_BACKWARD:
        # NOTE: the host step of each parameter runs while backward goes on, the disk tier's reads ahead and writes
        # behind beside it (threads): what is left after the last micro-batch's backward (two thirds of its compute)
        # is paid; the tier reads the masters to upload while the link copies them
        step = max(host_opt, disk_s[0])
        total = gpu + max(serial_s, disk_s[1]) + max(0.0, step - (2 / 3) * compute / micro)
    else:
        total = gpu + serial_s + host_opt + dev_opt
    return StepCost(compute, link_s, serial_s, host_opt, dev_opt, total, flops, link + serial, sum(disk_s), sum(disk))


def _disk_bytes(recipe: Recipe, trained: int, block_params: int, head: int, micro: int, recompute: float
                ) -> tuple[float, float, float]:
    """The disk tier's bytes per step: ``(around the step in backward, after the step, in the passes)``.

    Around each trained parameter's step its fp32 master (4 B) and optimizer state (AdamW 8 B, 8-bit ~2 B) are read
    ahead and written behind; after the step the masters are read once more for the upload. With ``offload_params``
    a streamed block's weights are rounded from their masters at each fetch (forward, backward, each recomputed
    forward, per micro-batch), read from the disk there; only the rest (embeddings, head) is uploaded after the step.
    """
    if recipe.base not in DISK:
        return 0.0, 0.0, 0.0
    state = 2 if recipe.optimizer == "adamw8bit" else 8
    around = 2.0 * trained * (4 + state)
    if recipe.base == "offload_params_disk":
        return around, 4.0 * min(head, trained), 4.0 * micro * min(block_params, trained) * (2 + recompute)
    return around, 4.0 * trained, 0.0


__all__ = ["ADAMW_8BIT_BYTES", "ADAMW_BYTES", "ModelShape", "StepCost", "step_cost", "trainable_params"]

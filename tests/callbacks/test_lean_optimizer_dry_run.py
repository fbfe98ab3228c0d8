"""LeanOptimizer in the dry run: the package's own optimizer runs on fake tensors; its state counts at its size."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
from lightning_lowmem.callbacks.lean_optimizer.build import projectable_weights
from lightning_lowmem.demo.module import CausalLMModule

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]
CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64}
RANK = 8


def module() -> CausalLMModule:
    return CausalLMModule(model_type="llama", config=CONFIG)


def galore_state_bytes(model: torch.nn.Module, rank: int) -> int:
    """GaLore's state, derived: a projected m x n weight keeps two rank-r moments (r x max(m, n)) and its projection
    (min(m, n) x r), fp32; every other parameter Adam's two fp32 moments."""
    projected, _ = projectable_weights(model)
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        if id(p) in projected and min(p.shape) > rank:
            m, n = p.shape
            total += 4 * (2 * rank * max(m, n) + rank * min(m, n))
        else:
            total += 8 * p.numel()
    return total


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None, reason="galore-torch is not installed")
def test_dry_run_counts_galore_state_at_its_projected_size():
    from lightning_lowmem import dry_run

    est = dry_run(module, batch_size=2, seq_len=16, callbacks=[LeanOptimizer("galore", rank=RANK)], extrapolate=False)
    predicted = est.steps[-1]["live_at_end"]["device"]["optimizer_state"]
    expected = galore_state_bytes(module(), RANK)
    plain = dry_run(module, batch_size=2, seq_len=16, extrapolate=False).steps[-1]["live_at_end"]["device"]
    assert predicted == expected  # the projections included, at their rank's size (not the SVD factor they slice)
    assert predicted < 0.5 * plain["optimizer_state"]


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
@pytest.mark.parametrize("kind", ["adamw8bit", "adamw4bit"])
def test_dry_run_counts_torchao_state_at_its_quantized_size(kind):
    """torchao keeps each moment as a wrapper tensor subclass whose own storage reads the fp32 size; the bytes are its
    codes, scales and quantization map. Reference: torchao's real optimizer stepped once on the real module."""
    import torchao.optim

    from lightning_lowmem import dry_run

    est = dry_run(module, batch_size=2, seq_len=16, callbacks=[LeanOptimizer(kind)], extrapolate=False)
    predicted = est.steps[-1]["live_at_end"]["device"]["optimizer_state"]
    model = module()
    params = list({id(p): p for p in model.parameters()}.values())
    real = (torchao.optim.AdamW8bit if kind == "adamw8bit" else torchao.optim.AdamW4bit)(params)
    for p in params:
        p.grad = torch.ones_like(p)
    torch.compiler.set_stance("force_eager")
    try:
        real.step()
    finally:
        torch.compiler.set_stance("default")
    expected = 0
    for state in real.state.values():
        for value in state.values():
            parts = [value.codes, value.scale, value.qmap] if hasattr(value, "codes") else [value]
            expected += sum(t.numel() * t.element_size() for t in parts)
    plain = dry_run(module, batch_size=2, seq_len=16, extrapolate=False).steps[-1]["live_at_end"]["device"]
    assert predicted == expected
    assert predicted < (0.6 if kind == "adamw8bit" else 0.3) * plain["optimizer_state"]

"""Small Hugging Face models and LightningModules shared by the tests (random weights, nothing downloaded)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_lowmem.demo.module import CausalLMModule, build_causal_lm

VOCAB = 258  # the demo's byte tokenizer

GPT2_TINY: dict[str, Any] = {"n_layer": 4, "n_embd": 64, "n_head": 4, "n_positions": 64}
LLAMA_TINY: dict[str, Any] = {
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def tiny_gpt2(dropout: float = 0.0, **overrides: Any) -> torch.nn.Module:
    cfg = {**GPT2_TINY, "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout, **overrides}
    return build_causal_lm("gpt2", cfg)


def tiny_llama(**overrides: Any) -> torch.nn.Module:
    return build_causal_lm("llama", {**LLAMA_TINY, **overrides})


def tiny_lm_module(model_type: str = "gpt2", **kwargs: Any) -> CausalLMModule:
    config = dict(GPT2_TINY if model_type == "gpt2" else LLAMA_TINY)
    config.update(kwargs.pop("config", {}))
    return CausalLMModule(model_type=model_type, config=config, **kwargs)


def random_batch(batch_size: int = 2, seq_len: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch_size, seq_len), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

"""``estimate_memory``: configs in, a traced prediction (or a stated fallback) out, bad input refused clearly."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_lowmem import estimate_memory
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.memory.categories import CATEGORIES
from lightning_lowmem.memory.estimate import MemoryEstimate, parse_bytes, resolve_config, shipped_shapes

pytestmark = pytest.mark.filterwarnings("ignore:.*self.log.*")

TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 258}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("12 GiB", 12 * 2**30), ("12GB", 12 * 10**9), ("12e9", 12 * 10**9), ("6144MiB", 6 * 2**30),
     ("1.5 tb", 1.5e12), (" 100 ", 100), (4096, 4096)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == int(expected)


@pytest.mark.parametrize(("text", "match"), [("12 G", "ambiguous"), ("twelve", "does not parse"), ("-1GB", "does not parse"),
                                             ("0", "positive"), ("12 parsecs", "does not parse")])
def test_parse_bytes_refuses(text, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(text)


def test_shipped_shapes_resolve_to_their_architectures():
    assert set(shipped_shapes()) == {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "opt-1.3b", "llama-7b"}
    xl = resolve_config("gpt2-xl")
    assert (xl.model_type, xl.n_layer, xl.n_embd, xl.n_head, xl.vocab_size) == ("gpt2", 48, 1600, 25, 50257)
    llama = resolve_config("llama-7b", {"num_hidden_layers": 2})
    assert (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers) == (4096, 11008, 2)
    assert resolve_config("opt-1.3b").ffn_dim == 8192


def test_config_from_json_path_class_name_and_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    assert resolve_config(str(path)).n_embd == 64
    assert resolve_config(str(tmp_path)).n_layer == 2  # a directory holding config.json
    assert resolve_config("GPT2Config", {"n_layer": 3}).n_layer == 3
    assert resolve_config("llama", {"hidden_size": 128}).hidden_size == 128


def test_config_errors_say_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="shipped shape"):
        resolve_config("gpt5-ultra")
    with pytest.raises(FileNotFoundError, match="no such config file"):
        resolve_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_config(str(bad))
    with pytest.raises(ValueError, match="model_type"):
        resolve_config({"n_layer": 2})


def test_estimate_is_traced_json_able_and_above_the_analytic_bound():
    est = estimate_memory(TINY, 2, 32, target="cpu")
    assert isinstance(est, MemoryEstimate) and est.method == "dry_run"
    data = json.loads(json.dumps(est.to_dict()))
    assert data["binding_phase"] in ("forward", "backward", "optimizer")
    assert set(data["phases"]["forward"]["device"]) == {*CATEGORIES, "total"}
    assert data["peak_device"] == max(p["device"]["total"] for p in data["phases"].values())
    # the closed form misses HF's GELU intermediates, fp32 masks and the loss copies: a lower bound here
    assert 0 < est.analytic_bound["peak"] < est.peak_device
    analytic = estimate_memory(TINY, 2, 32, target="cpu", method="analytic")
    assert analytic.method == "analytic" and analytic.peak_device == est.analytic_bound["peak"]


def test_technique_flags_change_the_prediction_the_expected_way():
    base = estimate_memory(TINY, 4, 32, target="cpu")
    micro = estimate_memory(TINY, 4, 32, target="cpu", micro_batch_size=2)
    assert micro.techniques["accumulate_grad_batches"] == 2
    assert micro.phases["backward"].device["activations"] < base.phases["backward"].device["activations"]
    sgd = estimate_memory(TINY, 4, 32, target="cpu", optimizer="sgd")
    assert sgd.phases["optimizer"].device["optimizer_state"] == pytest.approx(
        base.phases["optimizer"].device["optimizer_state"] / 2, rel=0.01
    )


def test_zero_partitions_model_states_in_closed_form():
    one = estimate_memory(TINY, 2, 32, target="cpu", zero_stage=2, precision="bf16-mixed")
    P = one.num_params
    assert one.phases["optimizer"].device["weights"] == 2 * P
    assert one.phases["optimizer"].device["optimizer_state"] == 12 * P  # fp32 masters + AdamW moments
    fp32 = estimate_memory(TINY, 2, 32, target="cpu", zero_stage=2)
    assert fp32.phases["optimizer"].device["weights"] == 4 * P
    assert fp32.phases["optimizer"].device["optimizer_state"] == 8 * P  # no separate masters in fp32
    four = estimate_memory(TINY, 2, 32, target="cpu", zero_stage=3, world_size=4, precision="bf16-mixed")
    assert four.phases["optimizer"].device["weights"] == 2 * P // 4
    assert four.phases["optimizer"].device["optimizer_state"] == 12 * P // 4
    off = estimate_memory(TINY, 2, 32, target="cpu", zero_stage=3, world_size=4, offload=True, precision="bf16-mixed")
    assert off.phases["optimizer"].device["optimizer_state"] == 0 and off.phases["forward"].device["gradients"] == 0
    assert off.peak_host == (12 + 4 + 2) * P // 4  # state + fp32 gradients + the 16-bit parameter shards
    assert 0 < off.phases["forward"].device["weights"] < 2 * P  # two gathered blocks, not the whole model
    assert any("ZeRO-3" in n for n in off.notes)


def test_lightning_module_is_traced_with_its_own_step():
    module = CausalLMModule(config={k: v for k, v in TINY.items() if k != "model_type"})
    est = estimate_memory(module, 2, 16, target="cpu")
    assert est.method == "dry_run" and est.analytic_bound is None


def test_unsupported_architecture_falls_back_to_the_analytic_bound_and_says_why():
    t5 = {"model_type": "t5", "num_layers": 2, "d_model": 64, "num_heads": 2, "d_ff": 128, "vocab_size": 100}
    est = estimate_memory(t5, 2, 16, target="cpu")
    assert est.method == "analytic" and est.peak_device > 0
    assert "t5" in est.fallback_reason and "causal-LM" in est.fallback_reason
    with pytest.raises(ValueError, match="Cannot estimate this model: architecture `resnet`"):
        estimate_memory({"model_type": "resnet"}, 2, 16, target="cpu")


def test_op_without_fake_implementation_falls_back_and_names_the_op(monkeypatch):
    def training_step(self, batch, batch_idx):
        return self.loss_sum_and_tokens(batch)[0] * batch["input_ids"].nonzero().shape[0]

    monkeypatch.setattr(CausalLMModule, "training_step", training_step)
    est = estimate_memory(TINY, 2, 16, target="cpu")
    assert est.method == "analytic"
    assert "aten.nonzero" in est.fallback_reason


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "bf16"}, "precision='bf16'"),
        ({"checkpointing": "sqrtt"}, "checkpointing='sqrtt'"),
        ({"optimizer": "adam8"}, "optimizer='adam8'"),
        ({"zero_stage": 1}, "zero_stage=1"),
        ({"micro_batch_size": 3}, "micro_batch_size=3"),
        ({"world_size": 0}, "world_size=0"),
        ({"zero_stage": 2, "optimizer_in_backward": True}, "DeepSpeed"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(TINY, 2, 16, **kwargs)


def test_bad_sizes():
    with pytest.raises(ValueError, match="batch_size=0"):
        estimate_memory(TINY, 0, 16)
    with pytest.raises(ValueError, match="seq_len=-1"):
        estimate_memory(TINY, 2, -1)
    with pytest.raises(TypeError, match="config"):
        estimate_memory(torch.zeros(1), 2, 16)

"""``estimate_memory``: model shapes, modules and YAML runs in, a traced prediction (or a stated fallback) out, bad
input refused clearly; ``units`` and ``configs``, the byte sizes and model shapes it reads."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from lightning_lowmem import ActivationCheckpointing, estimate_memory
from lightning_lowmem.core.accounting import CATEGORIES
from lightning_lowmem.core.units import fmt_gib, fmt_mib, parse_bytes
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.predict.configs import max_positions, resolve_config, shipped_shapes
from lightning_lowmem.predict.dry_run import dry_run
from lightning_lowmem.predict.result import MemoryEstimate
from tests.helpers.runif import RunIf

pytestmark = pytest.mark.filterwarnings("ignore:.*self.log.*")

TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 258}
TINY_MODULE_CONFIG = {k: v for k, v in TINY.items() if k != "model_type"}


# --- units --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [("12 GiB", 12 * 2**30), ("12GB", 12 * 10**9), ("12e9", 12 * 10**9), ("6144MiB", 6 * 2**30),
     ("1.5 tb", 1.5e12), (" 100 ", 100), (4096, 4096), (2.5e3, 2500), ("1 KiB", 1024)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == int(expected)


@pytest.mark.parametrize(("text", "match"), [("12 G", "ambiguous"), ("twelve", "does not parse"), ("-1GB", "does not parse"),
                                             ("0", "positive"), ("12 parsecs", "does not parse"), (-5, "positive"),
                                             (float("inf"), "positive")])
def test_parse_bytes_refuses(text, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(text)


@pytest.mark.parametrize("value", [True, None, [1], b"12GB"])
def test_parse_bytes_refuses_a_wrong_type_with_a_type_error(value):
    with pytest.raises(TypeError, match=re.escape(f"Passed `budget` {value!r} of type {type(value).__name__}; expected a number")):
        parse_bytes(value, "`budget`")


def test_parse_bytes_names_the_argument():
    with pytest.raises(ValueError, match=r"Passed `--budget` 'lots' that does not parse"):
        parse_bytes("lots", "`--budget`")
    with pytest.raises(ValueError, match=r"Passed a memory size 'lots' that does not parse"):
        parse_bytes("lots")


def test_formatters():
    assert fmt_gib(3 * 2**30) == "3.00 GiB" and fmt_mib(1536 * 2**20) == "1,536.00 MiB"
    assert fmt_gib(None) == fmt_mib(None) == "-"


# --- model shapes -------------------------------------------------------------------------------------------------
def test_shipped_shapes_resolve_to_their_architectures():
    assert set(shipped_shapes()) == {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "opt-1.3b", "llama-7b", "llama-13b",
                                     "llama-70b"}
    xl = resolve_config("gpt2-xl")
    assert (xl.model_type, xl.n_layer, xl.n_embd, xl.n_head, xl.vocab_size) == ("gpt2", 48, 1600, 25, 50257)
    llama = resolve_config("llama-7b", {"num_hidden_layers": 2})
    assert (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers) == (4096, 11008, 2)
    assert resolve_config("opt-1.3b").ffn_dim == 8192
    assert max_positions(xl) == 1024 and max_positions(llama) == 2048
    seventy = resolve_config("llama-70b")  # Llama-2-70B: grouped-query attention
    assert (seventy.hidden_size, seventy.num_hidden_layers, seventy.num_key_value_heads) == (8192, 80, 8)


def test_config_from_json_path_class_name_and_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    assert resolve_config(str(path)).n_embd == 64
    assert resolve_config(str(tmp_path)).n_layer == 2  # a directory holding config.json
    assert resolve_config("GPT2Config", {"n_layer": 3}).n_layer == 3
    assert resolve_config("llama", {"hidden_size": 128}).hidden_size == 128
    assert resolve_config(resolve_config("gpt2"), {"n_layer": 5}).n_layer == 5  # a config object, copied
    assert resolve_config("gpt2", {"num_hidden_layers": 7}).n_layer == 7  # an attribute_map alias


def test_overrides_recompute_derived_fields():
    assert resolve_config("llama", {"hidden_size": 256, "num_attention_heads": 4}).head_dim == 64
    assert resolve_config("llama-7b", {"hidden_size": 256, "num_attention_heads": 4}).head_dim == 64


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
    with pytest.raises(TypeError, match="of type int"):
        resolve_config(3)


def test_overrides_refuse_unknown_keys_and_wrong_types_all_at_once():
    with pytest.raises(ValueError) as err:
        resolve_config("gpt2", {"n_layers": 2, "n_head": "two", "n_embd": 64})
    message = str(err.value)
    assert "`n_layers` is not a field of GPT2Config (did you mean 'n_layer'" in message
    assert "`n_head='two'` has the wrong type: GPT2Config.n_head is int (now 12)" in message
    with pytest.raises(ValueError, match="wrong type"):
        resolve_config("gpt2", {"scale_attn_weights": 1})  # an int for a bool
    with pytest.raises(ValueError, match="not a field of LlamaConfig"):
        resolve_config("llama-7b", {"qwerty": 1})


# --- estimate_memory ----------------------------------------------------------------------------------------------
def test_estimate_is_traced_json_able_and_above_the_analytic_bound():
    est = estimate_memory(TINY, 2, 32, target="cpu")
    assert isinstance(est, MemoryEstimate) and est.method == "dry_run"
    assert est.run == {"strategy": "auto", "precision": "32-true", "callbacks": [], "accumulate_grad_batches": 1}
    assert len(est.steps) == 2  # the traced optimizer steps, recorded as MemoryReport records measured ones
    data = json.loads(json.dumps(est.to_dict()))
    assert data["binding_phase"] in ("forward", "backward", "optimizer")
    assert set(data["phases"]["forward"]["device"]) == {*CATEGORIES, "total"}
    assert data["peak_device"] == max(p["device"]["total"] for p in data["phases"].values())
    # the closed form misses HF's GELU intermediates, fp32 masks and the loss copies: a lower bound here
    assert 0 < est.analytic_bound["peak"] < est.peak_device
    analytic = estimate_memory(TINY, 2, 32, target="cpu", method="analytic")
    assert analytic.method == "analytic" and analytic.peak_device == est.analytic_bound["peak"]
    assert analytic.run == est.run and analytic.fallback_reason is None


def test_shorthands_describe_the_same_run_as_the_trainers_arguments():
    short = estimate_memory(TINY, 2, 32, target="cpu", precision="bf16-true", offload=True, checkpointing="all")
    full = estimate_memory(TINY, 2, 32, target="cpu", precision="bf16-true", strategy="lowmem_offload",
                           callbacks=[ActivationCheckpointing("all")])
    assert short.run["strategy"].startswith("OffloadStrategy(") and full.run["strategy"] == "lowmem_offload"
    for phase in full.phases:
        for role in ("device", "host"):
            assert short.phases[phase].total(role) == full.phases[phase].total(role), (phase, role)
    assert short.peak_host > 0


def test_technique_flags_change_the_prediction_the_expected_way():
    base = estimate_memory(TINY, 4, 32, target="cpu")
    micro = estimate_memory(TINY, 4, 32, target="cpu", micro_batch_size=2)
    assert micro.run["callbacks"] == ["AccumulationScheduler(effective_batch_size=4, micro_batch_size=2)"]
    assert micro.phases["backward"].device["activations"] < base.phases["backward"].device["activations"]
    ckpt = estimate_memory(TINY, 4, 32, target="cpu", checkpointing="all")
    assert ckpt.phases["backward"].device["activations"] < base.phases["backward"].device["activations"]
    assert ckpt.phases["optimizer"].device["optimizer_state"] == base.phases["optimizer"].device["optimizer_state"]


def test_offload_params_streams_the_block_weights():
    resident = estimate_memory(TINY, 2, 32, target="cpu", precision="bf16-true", offload=True)
    streamed = estimate_memory(TINY, 2, 32, target="cpu", precision="bf16-true", offload=True, offload_params=True)
    assert streamed.run["strategy"] == "OffloadStrategy(optimizer_in_backward=False, offload_params=True)"
    assert streamed.phases["forward"].device["weights"] < resident.phases["forward"].device["weights"]
    assert streamed.peak_host == resident.peak_host  # no host copy of a trained block weight: fetched from its master
    with pytest.raises(ValueError, match="`offload_params=True` without `offload=True`"):
        estimate_memory(TINY, 2, 32, offload_params=True)


def test_the_optimizer_is_the_modules_own():
    class SGDModule(CausalLMModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    module = SGDModule(config=TINY_MODULE_CONFIG)
    n_params = sum(p.numel() for p in module.parameters())
    sgd = estimate_memory(module, 2, 16, target="cpu")
    assert sgd.phases["optimizer"].device["optimizer_state"] == 4 * n_params  # one fp32 momentum buffer
    adamw = estimate_memory(CausalLMModule(config=TINY_MODULE_CONFIG), 2, 16, target="cpu")
    # two fp32 moments per parameter and one fp32 step counter per tensor
    assert adamw.phases["optimizer"].device["optimizer_state"] == 8 * n_params + 4 * len(list(module.parameters()))
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        estimate_memory(TINY, 2, 16, optimizer="sgd")


@pytest.mark.deepspeed
@RunIf(deepspeed=True)
def test_zero_partitions_model_states_in_closed_form():
    one = estimate_memory(TINY, 2, 32, target="cpu", zero_stage=2, precision="bf16-mixed")
    assert one.method == "dry_run+zero_closed_form" and one.steps == []
    assert one.run["strategy"] == "lowmem_zero2"
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


@pytest.mark.deepspeed
@RunIf(deepspeed=True)
def test_zero3_nvme_puts_the_optimizer_state_on_disk_and_names_the_host_buffers(tmp_path, monkeypatch):
    from lightning_lowmem.predict.analytic import zero_states
    from lightning_lowmem.predict.run_spec import RunSpec
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    monkeypatch.setenv("LOWMEM_NVME_PATH", str(tmp_path))
    shape = dict(TINY, n_embd=512, n_head=8)  # a 512 x 2048 MLP weight: past DeepSpeed's 1 MiB swap minimum
    cpu = estimate_memory(shape, 2, 32, target="cpu", strategy="lowmem_zero3_offload", precision="bf16-mixed")
    nvme = estimate_memory(shape, 2, 32, target="cpu", strategy="lowmem_zero3_nvme", precision="bf16-mixed")
    P = nvme.num_params
    aligned = -(-P // 256) * 256  # fp32 elements padded to DeepSpeed's 1 KiB I/O alignment
    assert cpu.peak_disk == 0 and cpu.peak_host == (12 + 4 + 2) * P  # lowmem_zero3_offload as before
    assert all(nvme.phases[p].device == cpu.phases[p].device for p in cpu.phases)
    for bd in nvme.phases.values():
        assert bd.disk["optimizer_state"] == (4 + 8) * aligned  # fp32 masters and AdamW's moments
        assert 0 < bd.disk["gradients"] <= 4 * P and 0 < bd.disk["weights"] <= 2 * P  # the tensors of 1 MiB or more
        assert bd.host["optimizer_state"] == 0 and bd.host["weights"] == bd.host["gradients"] == 2 * P
        # DeepSpeed's defaults: 4 fp32 optimizer swap buffers of the whole partition, 5 parameter buffers of 1e8
        # 16-bit elements (padded to 512)
        assert bd.host["other"] == 4 * 4 * aligned + 5 * 2 * (-(-10**8 // 512) * 512)
    assert nvme.peak_disk == sum(nvme.phases["optimizer"].disk.values())
    note = next(n for n in nvme.notes if n.startswith("NVMe offload"))
    assert "on disk fp32 master partitions" in note and "NVMe optimizer swap buffers" in note
    assert "NVMe parameter swap buffers 953.68 MiB" in note and "16-bit parameters kept in RAM (max_in_cpu)" in note

    # a ZeroStrategy's own config: its buffer sizes count
    own = ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True, offload_device="nvme",
                       config={"zero_optimization": {"offload_param": {"buffer_count": 2, "buffer_size": 2**24}}})
    plan = RunSpec(strategy=own).zero()
    est = MemoryEstimate(phases=copy.deepcopy(cpu.phases), method="dry_run", num_params=P)
    zero_states(est, plan, precision="bf16-mixed", gathered_params=None, numels=[P])
    assert plan.nvme and est.phases["optimizer"].host["other"] == 4 * 4 * aligned + 2 * 2 * 2**24


@pytest.mark.deepspeed
@RunIf(deepspeed=True)
def test_zero_with_activation_techniques_is_refused_as_the_real_run_refuses_it():
    with pytest.raises(ValueError, match="(?s)ActivationCheckpointing cannot run here.*policy='sqrt'.*ZeRO stage 3"):
        estimate_memory(TINY, 2, 16, target="cpu", precision="bf16-mixed", zero_stage=3, checkpointing="sqrt")
    with pytest.raises(ValueError, match="ActivationOffload cannot run under this strategy"):
        estimate_memory(TINY, 2, 16, target="cpu", precision="bf16-mixed", zero_stage=3, offload=True,
                        activation_offload=True)


def test_lightning_module_is_traced_with_its_own_step():
    module = CausalLMModule(config=TINY_MODULE_CONFIG)
    est = estimate_memory(module, 2, 16, target="cpu")
    assert est.method == "dry_run" and est.analytic_bound is None


def test_module_class_path_is_built_and_run_on_its_own_data():
    from tests.helpers.foreign import LitPlainTensor

    est = estimate_memory("tests.helpers.foreign.LitPlainTensor", target="cpu")
    assert est.method == "dry_run" and est.peak_device > 0
    assert est.peak_device == dry_run(LitPlainTensor).peak_device


def test_yaml_describes_the_run(tmp_path):
    from lightning_lowmem.demo.data import StdlibTextDataModule

    yaml = tmp_path / "run.yaml"
    yaml.write_text("""
trainer:
  accelerator: cpu
  strategy: lowmem_offload
  precision: bf16-true
  logger: false
  callbacks:
    - class_path: ActivationCheckpointing
      init_args: {policy: all}
    - class_path: MemoryReport
model:
  class_path: lightning_lowmem.demo.module.CausalLMModule
  init_args:
    config: {n_layer: 2, n_embd: 64, n_head: 2, n_positions: 64}
data:
  class_path: lightning_lowmem.demo.data.StdlibTextDataModule
  init_args: {seq_len: 32, batch_size: 2, max_bytes: 20000}
""")
    est = estimate_memory(str(yaml), target="cpu")
    assert est.run["precision"] == "bf16-true" and est.run["strategy"].startswith("OffloadStrategy(")
    assert [c.split("(")[0] for c in est.run["callbacks"]] == ["ActivationCheckpointing"]
    assert any("MemoryReport" in n for n in est.notes)  # named as left out of the prediction
    same = estimate_memory(CausalLMModule(config=TINY_MODULE_CONFIG), target="cpu", strategy="lowmem_offload",
                           precision="bf16-true", callbacks=[ActivationCheckpointing("all")],
                           data=StdlibTextDataModule(seq_len=32, batch_size=2, max_bytes=20000))
    assert (est.peak_device, est.peak_host) == (same.peak_device, same.peak_host)
    with pytest.raises(ValueError, match="the YAML describes the run"):
        estimate_memory(str(yaml), checkpointing="all")
    with pytest.raises(FileNotFoundError, match="no such file"):
        estimate_memory(str(tmp_path / "missing.yaml"))


def test_unsupported_architecture_falls_back_to_the_analytic_bound_and_says_why():
    t5 = {"model_type": "t5", "num_layers": 2, "d_model": 64, "num_heads": 2, "d_ff": 128, "vocab_size": 100}
    est = estimate_memory(t5, 2, 16, target="cpu")
    assert est.method == "analytic" and est.peak_device > 0
    assert "t5" in est.fallback_reason and "causal-LM" in est.fallback_reason
    with pytest.raises(ValueError, match="Cannot estimate this model: architecture `resnet`"):
        estimate_memory({"model_type": "resnet"}, 2, 16, target="cpu")


def test_op_without_fake_implementation_falls_back_and_names_the_op(monkeypatch):
    def training_step(self, batch, batch_idx):
        repeats = (self.model.lm_head.weight[0] > 0).long()  # a size no bound covers: the weights' values
        kept = torch.repeat_interleave(repeats)
        return self.loss_sum_and_tokens(batch)[0] + kept.sum()

    monkeypatch.setattr(CausalLMModule, "training_step", training_step)
    est = estimate_memory(TINY, 2, 16, target="cpu")
    assert est.method == "analytic"
    assert "aten.repeat_interleave" in est.fallback_reason
    # a module has no closed form to fall back on: the dry run's error is raised
    from lightning_lowmem.predict.fake import DryRunUnsupportedError

    with pytest.raises(DryRunUnsupportedError, match="aten.repeat_interleave"):
        estimate_memory(CausalLMModule(config=TINY_MODULE_CONFIG), 2, 16, target="cpu")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "bf16"}, "precision='bf16'"),
        ({"checkpointing": "sqrtt"}, "checkpointing='sqrtt'"),
        ({"optimizer": "adam8"}, "optimizer='adam8'"),
        ({"zero_stage": 1}, "zero_stage=1"),
        ({"micro_batch_size": 3}, "micro_batch_size=3"),
        ({"world_size": 0}, "world_size=0"),
        ({"target": "tpu"}, "target='tpu'"),
        ({"method": "guess"}, "method='guess'"),
        ({"zero_stage": 2, "optimizer_in_backward": True}, "DeepSpeed"),
        ({"offload": True, "strategy": "lowmem_offload"}, r"shorthand\(s\) \['offload'\] together with"),
        ({"checkpointing": "all", "callbacks": [ActivationCheckpointing("all")]}, "describe the run one way"),
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
    with pytest.raises(ValueError, match="without `batch_size` and `seq_len`"):
        estimate_memory(TINY)
    with pytest.raises(ValueError, match="seq_len=128`, beyond the 64 positions"):
        estimate_memory(TINY, 2, 128)
    with pytest.raises(TypeError, match="config"):
        estimate_memory(torch.zeros(1), 2, 16)

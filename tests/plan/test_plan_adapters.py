"""The planner's adapter dimension: adapter candidates only where the user lists them (never a silent switch from a
full fine-tune), the plan says which training it chose, a run's own ``Adapters`` is planned as the adapter run it is."""

from __future__ import annotations

import lightning as L
import pytest

import lightning_lowmem  # noqa: F401  (registers lowmem_auto)
from lightning_lowmem import Adapters
from lightning_lowmem.cli.plan import main
from lightning_lowmem.plan import plan
from lightning_lowmem.plan.auto import AutoStrategy
from lightning_lowmem.plan.cost import step_cost, trainable_params
from lightning_lowmem.plan.recipes import FULL_FINE_TUNE, Recipe, candidates
from tests.helpers.models import LLAMA_TINY, tiny_lm_module
from tests.helpers.runif import RunIf
from tests.memory.test_estimate_adapters import SHAPE

pytestmark = [RunIf(peft=True), pytest.mark.filterwarnings("ignore:.*self.log.*")]

#: fp32 only, whole batch: a few traces per plan
SMALL = {"bases": ["fp32"], "target": "cpu", "hardware": "rtx3060-12gb"}


#: a large vocabulary: the embedding and head weigh most, so the full fine-tune's gradients and AdamW state cannot
#: fit where the frozen base with adapters does
WIDE = {**SHAPE, "vocab_size": 4096}


def test_default_candidates_are_the_full_fine_tune_alone():
    assert all(r.adapters is None for r in candidates(4))
    listed = candidates(4, adapters=[FULL_FINE_TUNE, ("lora", None), ("lora", "nf4")], adapter_r=8)
    variants = {r.adapter_variant for r in listed}
    assert variants == {(None, 16, None), ("lora", 8, None), ("lora", 8, "nf4")}
    assert not any(r.quantize_base and r.base.startswith("zero") for r in listed)  # DeepSpeed cannot hold bnb weights
    only = candidates(4, adapters=[("dora", None)], adapter_r=8)
    assert only and all(r.adapters == "dora" for r in only)


@pytest.mark.slow
def test_listed_adapters_are_chosen_where_only_they_fit_and_the_plan_says_so():
    budget = 2 * 4 * 2 * 4096 * 64 - 2**18  # under the weights and gradients of the embedding and head alone
    p = plan(WIDE, 2, 32, device_memory=budget, adapters=["none", "lora"], adapter_r=4, **SMALL)
    assert p.chosen.recipe.adapters == "lora" and p.chosen.peak_device <= budget
    assert "LoRA r=4" in p.chosen.name and "LoRA r=4" in p.summary()
    assert p.notes[-1] == ("trainings, in the order allowed: full fine-tune, LoRA r=4; chosen: LoRA r=4 (no recipe "
                           "of full fine-tune fits)")
    adapters = [c for c in p.run.callbacks if isinstance(c, Adapters)]
    assert len(adapters) == 1 and adapters[0].r == 4 and adapters[0].kind == "lora"
    assert "Adapters(r=4)" in p.trainer_arguments()
    # the full fine-tune's floors were judged, and none fits
    judged = [r for r in p.rows if r.recipe.adapters is None and r.status != "not traced"]
    assert judged and all(r.status == "too big" for r in judged)
    # without the listing the same budget has no recipe: the plan does not switch the training by itself
    with pytest.raises(ValueError, match="No recipe fits"):
        plan(WIDE, 2, 32, device_memory=budget, **SMALL)
    # where the full fine-tune fits, it is chosen though the adapters' recipes are faster: a preference, not a speed-up
    roomy = plan(WIDE, 2, 32, device_memory="1GB", adapters=["none", "lora"], adapter_r=4, **SMALL)
    assert roomy.chosen.recipe.adapters is None and "chosen: full fine-tune" in roomy.notes[-1]
    assert all(r.status == "not traced" for r in roomy.rows if r.recipe.adapters)


def test_adapter_arguments_are_checked_together():
    with pytest.raises(ValueError) as err:
        plan(SHAPE, 2, 32, device_memory="1GB", adapters=["none", "lorax"], quantize_base="nf3", **SMALL)
    for message in ("Passed `adapters=['none', 'lorax']`; expected some of 'none', 'lora', 'dora'",
                    "Passed `quantize_base='nf3'`; expected some of 'none', 'nf4'"):
        assert message in str(err.value)
    with pytest.raises(ValueError, match=r"`quantize_base='nf4'` with `adapters='none'`: a quantized base is frozen"):
        plan(SHAPE, 2, 32, device_memory="1GB", adapters="none", quantize_base="nf4", **SMALL)
    with pytest.raises(TypeError, match=r"`adapter_r='4'`; expected an int >= 1"):
        plan(SHAPE, 2, 32, device_memory="1GB", adapters="lora", adapter_r="4", **SMALL)
    with pytest.raises(ValueError, match=r"the run has its own `Adapters\(kind='dora'.*its training stays"):
        plan(SHAPE, 2, 32, device_memory="1GB", adapters="lora", fixed_callbacks=[Adapters("dora", r=2)], **SMALL)


def test_cost_model_prices_the_frozen_base():
    from lightning_lowmem.plan.cost import ModelShape
    from lightning_lowmem.plan.hardware import PROFILES

    shape = ModelShape(6_700_000_000, 32, 4096, 2048, 32000)
    full, lora = Recipe("offload", 1), Recipe("offload", 1, adapters="lora", adapter_r=16)
    qlora = Recipe("offload", 1, adapters="lora", adapter_r=16, quantize_base="nf4")
    assert trainable_params(lora, shape) == 32 * 16 * 18 * 4096  # 37.7 M: LLaMA-7B's all-linear r=16 is 40 M
    costs = {r: step_cost(r, shape, 1, PROFILES["rtx4090-24gb"]) for r in (full, lora, qlora)}
    # no weight gradients for the frozen base: 2 N T fewer FLOPs, 2 N_adapters T more
    assert costs[full].flops - costs[lora].flops == 2 * (shape.num_params - trainable_params(lora, shape)) * 2048
    assert costs[lora].link_bytes < costs[full].link_bytes / 100 and costs[lora].host_optimizer_s < \
        costs[full].host_optimizer_s / 100
    assert costs[lora].total_s < costs[qlora].total_s < costs[full].total_s


def test_lowmem_auto_plans_the_users_adapter_run():
    """The user's own ``Adapters`` is a technique of the run: every candidate is traced with it (before, the plan
    traced the full fine-tune: the adapters' run predicted with the base's gradients and AdamW state)."""
    module = tiny_lm_module("llama", config={**LLAMA_TINY, "num_hidden_layers": 2, "vocab_size": 258})
    users = Adapters("lora", r=4)
    auto = AutoStrategy(device_budget="1GB")
    from tests.plan.test_plan import TokenData

    trainer = L.Trainer(strategy=auto, accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[users])
    trainer.fit(module, datamodule=TokenData())
    base = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    opt = auto.plan.chosen.estimate.phases["optimizer"].device
    assert opt["gradients"] <= 4 * trained < 4 * base / 5
    assert [c for c in trainer.callbacks if isinstance(c, Adapters)] == [users]
    assert "training: the run's own `Adapters(kind='lora', r=4" in auto.plan.notes[-1]


def test_cli_lists_the_trainings(capsys):
    argv = ["--model", "llama", *(a for k, v in SHAPE.items() if k != "model_type" for a in ("--set", f"{k}={v}")),
            "--batch-size", "2", "--seq-len", "32", "--device-memory", "1GB", "--target", "cpu"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--adapters", "none,lorax", "--adapter-r", "0", "--quantize-base", "nf4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Passed `--adapters none,lorax`; expected some of 'none', 'lora', 'dora'" in err
    assert "Passed `--adapter-r 0`; expected an int >= 1" in err


YAML = """
trainer:
  accelerator: cpu
  logger: false
  callbacks:
    - class_path: Adapters
      init_args: {r: 4, target_modules: ["c_attn"]}
model:
  class_path: lightning_lowmem.demo.module.CausalLMModule
  init_args:
    config: {n_layer: 2, n_embd: 64, n_head: 2, n_positions: 64}
data:
  class_path: lightning_lowmem.demo.data.StdlibTextDataModule
  init_args: {seq_len: 32, batch_size: 2, max_bytes: 20000}
"""


def test_a_yamls_adapters_are_planned_and_written_once(tmp_path):
    """A YAML's ``Adapters`` is its training: every candidate is traced with it (before, the plan predicted the full
    fine-tune and wrote the adapters beside it), and the written YAML has it once."""
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    p = plan(str(path), device_memory="1GB", target="cpu", bases=["fp32"])
    opt = p.chosen.estimate.phases["optimizer"].device
    assert 0 < opt["gradients"] < opt["weights"] / 20  # the adapters' (c_attn, r=4), not the base's
    assert p.notes[-1].startswith("training: the run's own `Adapters(kind='lora', r=4")
    written = yaml.safe_load(p.write_yaml(tmp_path / "plan.yaml").read_text())
    assert [c["class_path"] for c in written["trainer"]["callbacks"]].count("Adapters") == 1

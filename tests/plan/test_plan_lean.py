"""The planner's optimizer dimension: ``LeanOptimizer`` candidates only where the user lists them, in the order listed
(a lean optimizer changes the maths: a preference, never a silent switch), checked up front (a missing extra named),
and a run's own ``LeanOptimizer`` kept as the optimizer it is."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import lightning_lowmem  # noqa: F401
from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
from lightning_lowmem.cli.plan import main
from lightning_lowmem.plan import plan
from lightning_lowmem.plan.recipes import Recipe, candidates
from lightning_lowmem.plan.source import Source
from tests.helpers.models import LLAMA_TINY

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore:.*self.log.*")]

#: wide linears, a small vocabulary: APOLLO-Mini's projected state is most of what AdamW's would be
SHAPE = {"model_type": "llama", **LLAMA_TINY, "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 1024,
         "vocab_size": 258, "max_position_embeddings": 64}
SMALL = {"bases": ["fp32"], "target": "cpu", "hardware": "rtx3060-12gb"}
needs_apollo = pytest.mark.skipif(importlib.util.find_spec("apollo_torch") is None, reason="apollo-torch is missing")


def test_default_candidates_keep_the_modules_optimizer():
    assert all(r.optimizer is None for r in candidates(4))
    listed = candidates(4, optimizers=[None, "apollo_mini"])
    lean = [r for r in listed if r.optimizer == "apollo_mini"]
    assert lean and len(lean) < len(listed) - len(lean)  # no DeepSpeed base
    assert not any(r.base.startswith("zero") for r in lean)
    recipe = Recipe("offload", 2, "all", optimizer="apollo_mini")
    assert recipe.name() == "lowmem_offload + APOLLO-Mini + ckpt(all), micro 2"
    assert recipe.training_name == "full fine-tune with APOLLO-Mini"
    assert [(type(c).__name__, getattr(c, "kind", None)) for c in recipe.run(2).callbacks] == [
        ("ActivationCheckpointing", None), ("LeanOptimizer", "apollo_mini")]
    # compared only within one optimizer: a lean recipe saves no "more" than an AdamW one
    assert not recipe.saves_at_least(Recipe("offload", 2, "all"))


@needs_apollo
@pytest.mark.slow
def test_a_listed_lean_optimizer_is_chosen_only_where_adamw_does_not_fit():
    source = Source.of(SHAPE, 2, 16, None, [])

    def floor(**kw):
        return source.estimate(Recipe("fp32", 1, "all", True, True, **kw).run(2), "cpu").peak_device

    adamw = floor()
    lean = floor(optimizer="apollo_mini")
    assert lean < adamw
    budget = (lean + adamw) // 2
    p = plan(SHAPE, 2, 16, device_memory=budget, optimizers=["adamw", "apollo_mini"], **SMALL)
    assert p.chosen.recipe.optimizer == "apollo_mini" and p.chosen.peak_device <= budget
    assert p.notes[-1] == ("trainings, in the order allowed: full fine-tune, full fine-tune with APOLLO-Mini; chosen: "
                           "full fine-tune with APOLLO-Mini (no recipe of full fine-tune fits)")
    assert [c.kind for c in p.run.callbacks if isinstance(c, LeanOptimizer)] == ["apollo_mini"]
    judged = [r for r in p.rows if r.recipe.optimizer is None and r.status != "not traced"]
    assert judged and all(r.status in ("too big", "refused") for r in judged)
    with pytest.raises(ValueError, match="No recipe fits"):  # not listed: the plan does not switch the optimizer
        plan(SHAPE, 2, 16, device_memory=budget, **SMALL)
    roomy = plan(SHAPE, 2, 16, device_memory="1GB", optimizers=["adamw", "apollo_mini"], **SMALL)
    assert roomy.chosen.recipe.optimizer is None
    assert all(r.status == "not traced" for r in roomy.rows if r.recipe.optimizer)


def test_optimizer_arguments_are_checked_together(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "galore_torch", None)  # as if galore-torch were not installed
    with pytest.raises(ValueError) as err:
        plan(SHAPE, 2, 16, device_memory="1GB", optimizers=["adamw", "sophia"], adapters="lorax", **SMALL)
    assert "Passed `optimizers=['adamw', 'sophia']`; expected some of 'adamw', 'adamw8bit', 'galore'" in str(err.value)
    assert "Passed `adapters='lorax'`" in str(err.value)
    with pytest.raises(ValueError, match=r"`optimizers=\('adamw', 'galore'\)`.*pip install 'lightning-lowmem\[galore\]'"):
        plan(SHAPE, 2, 16, device_memory="1GB", optimizers=("adamw", "galore"), **SMALL)
    with pytest.raises(ValueError, match=r"the run has its own `LeanOptimizer\(kind='adam_mini'\)`: its optimizer stays"):
        plan(SHAPE, 2, 16, device_memory="1GB", optimizers=["apollo"], fixed_callbacks=[LeanOptimizer("adam_mini")],
             **SMALL)
    argv = ["--model", "llama", "--set", "num_hidden_layers=2", "--batch-size", "2", "--seq-len", "16",
            "--device-memory", "1GB", "--target", "cpu"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--optimizers", "adamw,galore"])
    assert exc.value.code == 2
    err_text = capsys.readouterr().err
    assert "`--optimizers adamw,galore` needs the `galore_torch` package" in err_text
    assert "pip install 'lightning-lowmem[galore]'" in err_text


YAML = """
trainer:
  accelerator: cpu
  logger: false
  callbacks:
    - class_path: LeanOptimizer
      init_args: {kind: apollo_mini}
model:
  class_path: lightning_lowmem.demo.module.CausalLMModule
  init_args:
    config: {n_layer: 2, n_embd: 64, n_head: 2, n_positions: 64}
data:
  class_path: lightning_lowmem.demo.data.StdlibTextDataModule
  init_args: {seq_len: 32, batch_size: 2, max_bytes: 20000}
"""


@needs_apollo
def test_a_yamls_lean_optimizer_is_planned_and_kept(tmp_path):
    """A YAML's ``LeanOptimizer`` is the run's optimizer: every candidate is traced with it (before, the plan dropped
    it with the YAML's techniques and predicted AdamW), none adds 8-bit AdamW, and the written YAML has it once."""
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    p = plan(str(path), device_memory="1GB", target="cpu", bases=["fp32"])
    assert not any(r.recipe.optimizer for r in p.rows)
    assert not any(isinstance(c, LeanOptimizer) for c in p.run.callbacks)  # the YAML's own: kept as it is
    written = yaml.safe_load(p.write_yaml(tmp_path / "plan.yaml").read_text())
    assert [c["class_path"] for c in written["trainer"]["callbacks"]].count("LeanOptimizer") == 1
    opt = p.chosen.estimate.phases["optimizer"].device
    assert opt["optimizer_state"] < opt["weights"]  # APOLLO-Mini's state, not AdamW's twice the weights

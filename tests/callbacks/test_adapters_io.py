"""``Adapters``: checkpoints resume identically in a new process; the merged export loads without peft."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_lowmem import Adapters
from tests.callbacks.test_adapters import LORA, LitLM, fit
from tests.helpers.models import random_batch
from tests.helpers.runif import RunIf

pytestmark = [RunIf(peft=True)]
CHILD = Path(__file__).with_name("_adapters_child.py")
ROOT = CHILD.parents[2]


def run_child(**spec) -> dict[str, torch.Tensor]:
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(spec)], check=False, capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(spec["out"], weights_only=True)


@pytest.mark.slow  # three child processes per case (about 40 s each on 2 busy cores)
@pytest.mark.parametrize(("strategy", "precision", "kind"),
                         [pytest.param("auto", "32-true", "lora", marks=RunIf(sweep=True)), ("offload", "bf16-mixed", "lora"),
                          pytest.param("auto", "32-true", "dora", marks=RunIf(sweep=True))])
def test_three_plus_three_steps_in_new_processes_equal_six_straight(tmp_path, strategy, precision, kind):
    common = {"strategy": strategy, "precision": precision, "kind": kind}
    straight = run_child(**common, steps=6, save=None, resume=None, out=str(tmp_path / "straight.pt"))
    ckpt = str(tmp_path / "three.ckpt")
    run_child(**common, steps=3, save=ckpt, resume=None, out=str(tmp_path / "first.pt"))
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    # the checkpoint holds the whole module: the adapters and the frozen base
    assert any("lora_A" in k for k in saved) and any(k.endswith("base_layer.weight") for k in saved)
    assert any("embed_tokens" in k for k in saved)
    resumed = run_child(**common, steps=6, save=None, resume=ckpt, out=str(tmp_path / "resumed.pt"))
    assert resumed.keys() == straight.keys()
    bad = [k for k in straight if not torch.equal(resumed[k], straight[k])]
    assert not bad, bad
    first = torch.load(tmp_path / "first.pt", weights_only=True)
    assert any(not torch.equal(first[k], straight[k]) for k in straight if "lora_" in k)  # steps 4-6 changed them


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merged_export_loads_with_transformers_and_gives_the_adapted_logits(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    module = LitLM(None)
    fit(module, [Adapters(kind, **LORA)], steps=3)
    ids = random_batch(2, 16, seed=99)["input_ids"]
    module.model.eval()
    with torch.no_grad():
        want = module.model(input_ids=ids).logits
    path = Adapters.export_merged(module, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        still = module.model(input_ids=ids).logits
    assert torch.equal(still, want)  # the training model keeps its adapters (the merge ran on a copy)
    # measured: W + s*B@A against W x + s*B(A x) in fp32 differs by ~1e-6 on logits of size ~1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain = LitLM(None).model(input_ids=ids).logits
    assert not torch.allclose(got, plain, atol=1e-3)  # the adapters matter


def test_export_merged_without_a_peft_model_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match=r"Expected one `peft.PeftModel`.*found 0"):
        Adapters.export_merged(LitLM(None), tmp_path / "x")
    assert not (tmp_path / "x").exists()

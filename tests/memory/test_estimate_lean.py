"""``estimate_memory(optimizer=<lean kind>)`` and ``lowmem estimate --optimizer``: the run with ``LeanOptimizer`` as
its callback (its own code in the dry run), every combination of the table stepping it, and a missing extra named
before anything is traced."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from lightning_lowmem import estimate_memory
from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
from lightning_lowmem.cli.estimate import main
from tests.helpers.models import LLAMA_TINY

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore:.*self.log.*")]

SHAPE = {"model_type": "llama", **LLAMA_TINY, "num_hidden_layers": 2, "vocab_size": 258}
TINY = ["--model", "llama", *(a for k, v in SHAPE.items() if k != "model_type" for a in ("--set", f"{k}={v}"))]
needs_apollo = pytest.mark.skipif(importlib.util.find_spec("apollo_torch") is None, reason="apollo-torch is missing")


@needs_apollo
def test_the_shorthand_is_the_callback():
    by_flag = estimate_memory(SHAPE, 2, 16, target="cpu", precision="bf16-true", optimizer="apollo_mini")
    by_callback = estimate_memory(SHAPE, 2, 16, target="cpu", precision="bf16-true",
                                  callbacks=[LeanOptimizer("apollo_mini")])
    adamw = estimate_memory(SHAPE, 2, 16, target="cpu", precision="bf16-true")
    assert by_flag.phases == by_callback.phases and by_flag.peak_device == by_callback.peak_device
    assert by_flag.run["callbacks"] == ["LeanOptimizer('apollo_mini')"]
    state = by_flag.phases["optimizer"].device["optimizer_state"]
    assert 0 < state < 0.5 * adamw.phases["optimizer"].device["optimizer_state"]
    assert by_flag.analytic_bound is None  # the closed form is AdamW's: not printed beside a lean optimizer
    with pytest.raises(ValueError, match=r"method='analytic'.*closed form does not model lean optimizers"):
        estimate_memory(SHAPE, 2, 16, optimizer="apollo_mini", method="analytic")


def test_torchao_8bit_is_named_apart_from_bitsandbytes():
    from lightning_lowmem.predict.run_spec import RunSpec

    assert [repr(c) for c in RunSpec.from_flags(optimizer="torchao_adamw8bit").callbacks] == [
        "LeanOptimizer(kind='adamw8bit')"]
    assert [type(c).__name__ for c in RunSpec.from_flags(optimizer="adamw8bit").callbacks] == ["LowBitOptimizer"]
    with pytest.raises(ValueError, match=r"`optimizer='lion'`; expected one of 'adamw', 'adamw8bit', 'galore'"):
        estimate_memory(SHAPE, 2, 16, optimizer="lion")


def test_a_missing_extra_is_named_before_tracing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "galore_torch", None)  # as if galore-torch were not installed
    with pytest.raises(ModuleNotFoundError, match=r"`optimizer='galore'`.*pip install 'lightning-lowmem\[galore\]'"):
        estimate_memory(SHAPE, 2, 16, optimizer="galore")
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--batch-size", "2", "--seq-len", "16", "--optimizer", "galore"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "`--optimizer galore` needs the `galore_torch` package" in err
    assert "pip install 'lightning-lowmem[galore]'" in err


def test_cli_optimizer_problems_are_reported_together(capsys):
    with pytest.raises(SystemExit):
        main([*TINY, "--batch-size", "2", "--seq-len", "16", "--optimizer", "sophia", "--adapter-r", "4"])
    err = capsys.readouterr().err
    assert "Passed `--optimizer sophia`; expected one of adamw, adamw8bit, galore" in err
    assert "Passed `--adapter-r 4` without `--adapters`" in err
    with pytest.raises(SystemExit):
        main(["--config", "run.yaml", "--optimizer", "galore"])
    assert "`--optimizer` is for --model" in capsys.readouterr().err


@needs_apollo
def test_cli_rows_step_the_lean_optimizer(capsys):
    main([*TINY, "--batch-size", "2", "--seq-len", "16", "--optimizer", "apollo_mini", "--only", "bf16-true",
          "--target", "cpu"])
    out = capsys.readouterr().out
    assert "optimizer apollo_mini" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith("bf16-true")]
    # the 8-bit AdamW combination chooses its own optimizer: left out; with the optimizer in backward: layer-wise
    assert [r.split("  ")[0] for r in rows] == ["bf16-true", "bf16-true + ckpt(all)", "bf16-true + ckpt(all) + opt-in-bwd"]
    assert all("dry_run" in r for r in rows)

"""`make demo` on any CPU (issue 48): its precision from a probe of the machine, its progress on screen, and what
the README says about setting it up."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import tomllib
import yaml

from lightning_lowmem.demo import probe
from lightning_lowmem.demo.loss_log import LossLog

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("bf16_seconds", "expected"), [(0.2, "bf16-true"), (1.9, "bf16-true"), (10.0, "32-true")])
def test_the_probe_trains_in_bf16_only_where_this_cpu_computes_it_natively(monkeypatch, bf16_seconds, expected):
    """A 2-core AVX2 EPYC computes a bf16 matmul 10x slower than fp32 (emulated): the demo took 105 minutes there."""
    monkeypatch.setattr(probe, "_seconds", lambda dtype: bf16_seconds if dtype == probe.torch.bfloat16 else 1.0)
    monkeypatch.setattr(probe.torch, "set_num_threads", lambda n: None)
    precision, why = probe.demo_precision()
    assert precision == expected
    assert f"a bf16 matmul takes {bf16_seconds:.2f}x the fp32 one here" in why
    if expected == "32-true":
        assert "emulates bf16" in why and "the memory report's GPU rows predict the bf16-true recipe on a GPU" in why


def test_the_probe_measures_this_machine(capsys):
    assert probe.main() == 0
    out, err = capsys.readouterr()
    precision, threads = out.split()
    assert precision in ("bf16-true", "32-true") and 1 <= int(threads) <= probe.torch.get_num_threads()
    assert err.startswith("demo: a bf16 matmul takes") and "thread" in err


@pytest.mark.parametrize(("one", "many", "expected"), [(1.0, 0.5, 2), (1.0, 0.9, 1), (1.0, 9.0, 1)])
def test_the_probe_uses_one_thread_where_more_wait_on_each_other(monkeypatch, one, many, expected):
    """On a busy 2-core machine the demo's matmuls took 9x longer on torch's 2 threads than on one."""
    monkeypatch.setattr(probe.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(probe.torch, "set_num_threads", lambda n: calls.append(n))
    calls: list[int] = []
    monkeypatch.setattr(probe, "_seconds", lambda dtype, pick: one if calls and calls[-1] == 1 and len(calls) == 1
                        else many)
    assert probe.demo_threads()[0] == expected


def test_make_demo_runs_the_config_at_the_probes_precision_and_shows_its_progress():
    make = (ROOT / "Makefile").read_text()
    assert "set -- $$($(PY) -m lightning_lowmem.demo.probe)" in make
    assert "OMP_NUM_THREADS=$$2 $(VENV)/bin/lowmem fit --config configs/demo.yaml --trainer.precision $$1" in make
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c.get("init_args", {}) for c in config["trainer"]["callbacks"]}
    assert callbacks["LossLog"] == {"every_n_steps": 1}
    assert callbacks["MemoryReport"]["gpu_precision"] == "bf16-true"  # what the recipe saves on a GPU, at any precision


def test_the_loss_log_says_the_step_the_loss_and_the_time_left(capsys):
    from lightning_lowmem.demo.data import StdlibTextDataModule
    from lightning_lowmem.demo.module import CausalLMModule

    trainer = L.Trainer(callbacks=[LossLog(every_n_steps=2)], max_steps=4, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(CausalLMModule(config={"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}),
                StdlibTextDataModule(seq_len=32, batch_size=2, max_bytes=8192))
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/4", "2/4", "4/4"]  # the first step at once, then every 2nd
    assert re.search(r"s/step, ~\d+ s left$", steps[0]) and steps[-1].endswith("s/step")
    with pytest.raises(ValueError, match=r"Passed `LossLog\(every_n_steps=0\)`"):
        LossLog(every_n_steps=0)


def test_the_readme_says_what_the_extras_and_the_make_targets_are():
    """Issue 48 item 9: the `all` extra was described as DeepSpeed + bitsandbytes while it installs peft, the lean
    optimizers and torchao too; `STAGE=1|2|3|4` where the Makefile has 1-5."""
    readme = (ROOT / "README.md").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (inner,) = re.findall(r"lightning-lowmem\[([^\]]+)\]", extras["all"][0])
    sentence = next(line for line in readme.split("\n\n") if "`all` (" in line)
    for extra in inner.split(","):
        assert f"`{extra}`" in sentence, extra
    stages = re.search(r'case "\$\(STAGE\)" in ([\d|]+)\)', (ROOT / "Makefile").read_text()).group(1)
    assert f"STAGE={stages}" in readme and "STAGE=1|2|3|4`" not in readme

"""Every shipped YAML in configs/ parses and runs for 2 steps (shrunk where it would take long)."""

from pathlib import Path

import pytest
import yaml

from lightning_lowmem.cli import LowMemCLI

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
# a couple of steps, little data, nothing logged: enough to prove the file is valid and the recipe runs
SHRINK = [
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=1",
    "--trainer.val_check_interval=1.0",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--data.init_args.max_bytes=60000",
    "--data.init_args.seq_len=64",  # NOTE: the recipes do not depend on the sequence length; the step time does
]


def test_configs_exist():
    assert any(p.name == "demo.yaml" for p in CONFIGS)


@pytest.mark.integration
@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_runs(path, tmp_path, monkeypatch):
    cfg = yaml.safe_load(path.read_text())
    strategy = cfg.get("trainer", {}).get("strategy")
    if isinstance(strategy, str) and strategy.startswith("lowmem_zero"):
        pytest.importorskip("deepspeed", reason="needs `pip install 'lightning-lowmem[deepspeed]'`")
    if "LeanOptimizer" in path.read_text():
        pytest.importorskip("galore_torch", reason="needs `pip install 'lightning-lowmem[galore]'`")
    monkeypatch.chdir(tmp_path)  # anything a config writes (reports, logs) lands in tmp_path
    cli = LowMemCLI(args=["fit", "--config", str(path), *SHRINK])
    assert cli.trainer.global_step == 2

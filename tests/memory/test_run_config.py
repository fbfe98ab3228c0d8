"""One description of a run: a YAML estimated by `lowmem estimate --config` is the run `lowmem fit --config` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lightning_lowmem.cli import main
from lightning_lowmem.predict.estimate import estimate_memory
from lightning_lowmem.predict.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[2]


def _small_demo(tmp_path: Path) -> Path:
    """configs/demo.yaml with a smaller model, 3 steps, no validation, the report in tmp_path."""
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config["trainer"].update(max_steps=3, val_check_interval=None, limit_val_batches=0, default_root_dir=str(tmp_path))
    config["model"]["init_args"]["config"] = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128}
    config["data"]["init_args"].update(seq_len=64, max_bytes=200_000)
    for cb in config["trainer"]["callbacks"]:
        if cb["class_path"] == "MemoryReport":
            cb["init_args"] = {"every_n_steps": 1, "save_dir": str(tmp_path / "report"), "plot": False}
        if cb["class_path"] == "LowBitOptimizer":
            pytest.importorskip("bitsandbytes", reason="needs `pip install 'lightning-lowmem[bnb]'`")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_yaml_is_read_as_lowmem_fit_reads_it(tmp_path):
    module, _, run = load_run_config(_small_demo(tmp_path))
    assert next(module.parameters()).is_meta  # described, not allocated
    assert run.strategy_name == "lowmem_offload" and run.precision == "bf16-true"
    assert [type(c).__name__ for c in run.callbacks] == ["ActivationCheckpointing", "AccumulationScheduler",
                                                          "LowBitOptimizer"]
    assert any("MemoryReport" in n for n in run.notes)  # said, not silently dropped


@pytest.mark.integration
@pytest.mark.slow
def test_estimate_of_a_yaml_equals_the_memory_report_of_its_fit(tmp_path, capsys):
    # NOTE: no target given: the YAML's `accelerator: cpu` decides (a CUDA target would add the CUDA context)
    path = _small_demo(tmp_path)
    est = estimate_memory(path)
    assert est.target == "cpu"
    assert main(["estimate", "--config", str(path), "--budget", "1GB", "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{path}: target cpu (from trainer.accelerator: cpu;") and "fits 1GB" in out
    assert json.loads((tmp_path / "e.json").read_text())[0]["peak_device"] == est.peak_device
    assert main(["fit", "--config", str(path)]) == 0
    report = json.loads((tmp_path / "report" / "memory_report.json").read_text())
    worst = max(report["steps"], key=lambda r: r["peak_bytes"])
    steady_host = max(r["peak_bytes_host"] for r in report["steps"] if r["window"] >= 1)
    assert est.peak_device == pytest.approx(worst["peak_bytes"], rel=0.01)
    assert est.peak_host == pytest.approx(steady_host, rel=0.01)
    assert report["predicted"]["peak_device"] == pytest.approx(est.peak_device, rel=0.01)


def test_missing_yaml_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        estimate_memory(str(tmp_path / "nope.yaml"))

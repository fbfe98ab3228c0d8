"""MemoryReport through a real ``Trainer.fit`` with the demo causal-LM module (tiny GPT-2)."""

from __future__ import annotations

import importlib.util
import json
import re

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader, Dataset

from lightning_lowmem.callbacks.memory_report import PHASES, MemoryReport
from lightning_lowmem.memory.categories import CATEGORIES, module_weight_bytes
from tests.helpers.models import random_batch, tiny_lm_module

pytestmark = pytest.mark.integration


class _Batches(Dataset):
    def __init__(self, n: int = 16, seq_len: int = 32) -> None:
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in random_batch(1, self.seq_len, seed=i).items()}


class CaptureLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        pass

    def log_metrics(self, metrics, step=None) -> None:  # type: ignore[no-untyped-def]
        self.logged.append((step, dict(metrics)))


def _trainer(callbacks, **kwargs):  # type: ignore[no-untyped-def]
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=3,
    )
    return L.Trainer(callbacks=callbacks, **{**defaults, **kwargs})


def _documented_keys() -> set[str]:
    """The CPU metric keys listed in MemoryReport's docstring, with <category> and <phase> expanded."""
    doc = MemoryReport.__doc__ or ""
    section = doc.split("Metric keys", 1)[1].split("Args:", 1)[0]
    keys = set()
    for raw in re.findall(r"``(memory/[^`]+)``", section):
        if "cuda" in raw:
            continue
        for phase in PHASES if "<phase>" in raw else [None]:
            for cat in CATEGORIES if "<category>" in raw else [None]:
                keys.add(raw.replace("<phase>", phase or "").replace("<category>", cat or ""))
    return keys


def _adamw_state_bytes(module: torch.nn.Module) -> int:
    return sum(2 * p.numel() * p.element_size() + 4 for p in module.parameters())


def test_fit_with_accumulation(tmp_path):
    logger = CaptureLogger()
    cb = MemoryReport(every_n_steps=2, save_dir=tmp_path / "mem")
    module = tiny_lm_module()
    trainer = _trainer([cb], logger=logger, accumulate_grad_batches=2)
    trainer.fit(module, DataLoader(_Batches(), batch_size=2))

    assert [s["step"] for s in cb.steps] == [0, 1, 2]
    assert all(s["micro_batches"] == 2 for s in cb.steps)
    # every documented key is logged at every sampled step, and nothing undocumented
    memory_logs = [(step, {k: v for k, v in m.items() if k.startswith("memory/")}) for step, m in logger.logged]
    memory_logs = [(step, m) for step, m in memory_logs if m]
    assert [step for step, _ in memory_logs] == [0, 1, 2]
    for _, metrics in memory_logs:
        assert set(metrics) == _documented_keys()

    weights = module_weight_bytes(module)
    for s in cb.steps:
        assert s["peak"]["device"]["weights"] == weights
        assert s["peak_bytes"] == max(p["device"]["total"] for p in s["phases"].values())
        assert s["peak"]["device"]["total"] == s["peak_bytes"]
        assert s["peak_bytes_host"] == 0  # nothing is marked host without an offloading technique
        assert s["activations_after_forward"] > 0
    # steady state: the optimizer state exists from step 1 on and is counted exactly
    step1 = cb.steps[1]
    assert step1["live_at_end"]["device"]["optimizer_state"] == _adamw_state_bytes(module)
    # Lightning zeroes gradients after the first micro-batch's forward: the second micro-batch's forward runs with
    # the first one's gradients alive, so the forward peak holds a full set of gradients
    assert step1["phases"]["forward"]["device"]["gradients"] == weights

    report = json.loads((tmp_path / "mem" / "memory_report.json").read_text())
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert report["plain_fp32_adamw"]["num_params"] == sum(p.numel() for p in module.parameters())
    png = (tmp_path / "mem" / "memory_step.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "measured backward" in cb.table and "Plain fp32 AdamW" in cb.table
    if importlib.util.find_spec("lightning_lowmem.memory.estimate") is not None:
        assert cb.predicted is not None and "error" not in cb.predicted, cb.predicted
        assert "predicted backward" in cb.table
        assert cb.predicted["arguments"]["micro_batch_size"] == 2 and cb.predicted["arguments"]["batch_size"] == 4


def test_unsampled_steps_log_nothing(tmp_path):
    logger = CaptureLogger()
    cb = MemoryReport(every_n_steps=10, phases=False, plot=False, save_dir=tmp_path, predict=False)
    trainer = _trainer([cb], logger=logger, max_steps=3)
    trainer.fit(tiny_lm_module(), DataLoader(_Batches(), batch_size=2))
    assert [s["step"] for s in cb.steps] == [0, 1]
    memory_steps = [step for step, m in logger.logged if any(k.startswith("memory/") for k in m)]
    assert memory_steps == [0, 1]
    keys = {k for _, m in logger.logged for k in m if k.startswith("memory/")}
    assert not any(k.startswith(("memory/forward", "memory/backward", "memory/optimizer")) for k in keys)
    assert not (tmp_path / "memory_step.png").exists()
    assert (tmp_path / "memory_report.json").is_file()
    assert "measured backward" not in cb.table and "measured step peak" in cb.table


def test_unwritable_save_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    cb = MemoryReport(save_dir=blocker / "memory")
    trainer = _trainer([cb])
    with pytest.raises(ValueError, match="cannot be written"):
        trainer.fit(tiny_lm_module(), DataLoader(_Batches(), batch_size=2))
    assert cb.steps == []


@pytest.mark.skipif(
    importlib.util.find_spec("lightning_lowmem.strategies.offload") is None, reason="lowmem_offload not landed yet"
)
def test_fit_with_offload_strategy(tmp_path):
    import lightning_lowmem  # noqa: F401  (registers the strategy names)

    cb = MemoryReport(every_n_steps=1, save_dir=tmp_path, plot=False, predict=False)
    module = tiny_lm_module()
    n_params = sum(p.numel() for p in module.parameters())
    trainer = _trainer([cb], strategy="lowmem_offload", precision="bf16-true", max_steps=2)
    trainer.fit(module, DataLoader(_Batches(), batch_size=2))
    steady = cb.steps[1]
    # device role: bf16 compute weights only (no gradients, no optimizer state); host: masters, grads, state
    assert steady["peak"]["device"]["weights"] == 2 * n_params
    assert steady["peak"]["device"]["gradients"] == 0
    assert steady["peak"]["device"]["optimizer_state"] == 0
    reported = steady["components"]["OffloadStrategy"]
    assert steady["live_at_end"]["host"] == reported["host"]  # measured == what the strategy says it holds
    assert steady["peak_bytes_host"] >= 16 * n_params - 4 * n_params  # masters 4 + grads 4 + Adam 8 per param
    assert "OffloadStrategy.memory_breakdown()" in cb.table

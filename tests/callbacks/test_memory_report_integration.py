"""MemoryReport through a real ``Trainer.fit``: what it measures, logs and writes, its prediction of the same run
and the plain fp32 baseline (both dry runs made at ``teardown``)."""

from __future__ import annotations

import json
import re

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader, Dataset

from lightning_lowmem import ActivationCheckpointing
from lightning_lowmem.core.accounting import CATEGORIES, module_weight_bytes
from lightning_lowmem.report.memory_report import PHASES, MemoryReport
from tests.helpers.models import random_batch, tiny_lm_module

pytestmark = pytest.mark.integration

PLAIN_FP32 = {"strategy": "auto", "precision": "32-true", "callbacks": [], "accumulate_grad_batches": 1}


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
    defaults = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "max_steps": 3,
    }
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


def _adamw_state_bytes(module: torch.nn.Module, element_size: int | None = None) -> int:
    """Two moments per parameter and one fp32 step counter per tensor (torch's AdamW, capturable=False)."""
    return sum(2 * p.numel() * (element_size or p.element_size()) + 4 for p in module.parameters())


def _worst(report: MemoryReport) -> dict:
    return max(report.steps, key=lambda r: r["peak_bytes"])


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

    # the prediction: the same run (accumulation included) on the run's first batch, equal to the measurement
    assert cb.predicted is not None and "error" not in cb.predicted, cb.predicted
    assert cb.predicted["method"] == "dry_run" and cb.predicted["target"] == "cpu"
    assert cb.predicted["run"] == {**PLAIN_FP32, "accumulate_grad_batches": 2}
    assert cb.predicted["batch"] == "the run's first batch"
    assert cb.predicted["peak_device"] == pytest.approx(_worst(cb)["peak_bytes"], rel=0.01)
    # the baseline: plain fp32, no accumulation, the two micro-batches in one batch (twice the activations)
    assert cb.baseline is not None and "error" not in cb.baseline, cb.baseline
    assert cb.baseline["run"] == PLAIN_FP32 and cb.baseline["batch"] == "2 micro-batch(es) in one batch"
    assert cb.baseline["num_params"] == sum(p.numel() for p in module.parameters())
    assert cb.baseline["phases"]["forward"]["device"]["activations"] > cb.predicted["phases"]["forward"]["device"][
        "activations"]
    # and plain fp32 at the run's own micro-batch: the saving of the techniques alone, labelled apart
    same = cb.baseline["same_micro_batch"]
    assert same["run"] == PLAIN_FP32 and same["batch"] == "one micro-batch, as the run"
    assert same["phases"]["forward"]["device"]["activations"] == cb.predicted["phases"]["forward"]["device"][
        "activations"]
    assert same["peak_device"] < cb.baseline["peak_device"]
    whole = cb.baseline["peak_device"] - _worst(cb)["peak_bytes"]
    alone = same["peak_device"] - _worst(cb)["peak_bytes"]
    assert f"saving the whole accumulation window as one batch: {whole / 2**20:,.2f} MiB" in cb.table
    assert f"saving of the techniques at the same micro-batch {alone / 2**20:,.2f} MiB" in cb.table

    report = json.loads((tmp_path / "mem" / "memory_report.json").read_text())
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert report["worst_step"] == _worst(cb)["step"]
    assert report["predicted"]["peak_device"] == cb.predicted["peak_device"]
    assert report["plain_fp32"]["peak_device"] == cb.baseline["peak_device"]
    png = (tmp_path / "mem" / "memory_step.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "measured backward" in cb.table and "predicted backward" in cb.table and "plain fp32 backward" in cb.table
    assert "Predicted / measured peak: device" in cb.table and "Plain fp32 training of this module" in cb.table


def test_technique_run_predicted_and_compared_with_plain_fp32(tmp_path):
    """bf16 weights and checkpointing: the prediction is this run; the baseline is the module as built, in fp32."""
    cb = MemoryReport(every_n_steps=1, plot=False, save_dir=tmp_path)
    module = tiny_lm_module()
    n_params = sum(p.numel() for p in module.parameters())
    # MemoryReport first: its teardown runs before the technique's, and predicts from the module as built all the same
    # (the techniques take their changes back at `on_fit_end`); the callbacks keep their order
    ckpt = ActivationCheckpointing("all")
    trainer = _trainer([cb, ckpt], precision="bf16-true", max_steps=2)
    trainer.fit(module, DataLoader(_Batches(), batch_size=2))
    assert trainer.callbacks.index(cb) < trainer.callbacks.index(ckpt)

    assert "error" not in cb.predicted, cb.predicted
    assert cb.predicted["run"]["precision"] == "bf16-true"
    assert [c.split("(")[0] for c in cb.predicted["run"]["callbacks"]] == ["ActivationCheckpointing"]
    assert cb.predicted["peak_device"] == pytest.approx(_worst(cb)["peak_bytes"], rel=0.01)
    assert cb.predicted["phases"]["optimizer"]["device"]["weights"] == 2 * n_params

    assert "error" not in cb.baseline, cb.baseline
    assert cb.baseline["run"] == PLAIN_FP32
    optimizer = cb.baseline["phases"]["optimizer"]["device"]
    assert optimizer["weights"] == 4 * n_params  # the fp32 module, not the bf16 one the plugin left behind
    assert optimizer["optimizer_state"] == _adamw_state_bytes(module, element_size=4)
    assert cb.baseline["peak_device"] > _worst(cb)["peak_bytes"]
    saving = cb.baseline["peak_device"] - _worst(cb)["peak_bytes"]
    assert f"saving {saving / 2**20:,.2f} MiB" in cb.table


def test_baseline_uses_the_modules_own_optimizer(tmp_path):
    """Lightning's image-classifier example steps SGD with momentum: 4 B/param of state, not AdamW's 8."""
    from tests.helpers.foreign import make

    cb = MemoryReport(every_n_steps=1, plot=False, save_dir=tmp_path)
    module = make("classifier")
    n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    _trainer([cb], max_steps=2, limit_val_batches=0).fit(module)
    assert cb.steps[1]["live_at_end"]["device"]["optimizer_state"] == 4 * n_params  # one momentum buffer
    assert cb.baseline["run"] == PLAIN_FP32
    assert cb.baseline["phases"]["optimizer"]["device"]["optimizer_state"] == 4 * n_params
    assert cb.predicted["phases"]["optimizer"]["device"]["optimizer_state"] == 4 * n_params


def test_a_failed_prediction_is_reported_not_raised(tmp_path, monkeypatch):
    import lightning_lowmem.report.memory_report as dry_run_module  # NOTE: where MemoryReport reads `dry_run` from

    def broken(*args, **kwargs):
        raise RuntimeError("no trace today")

    monkeypatch.setattr(dry_run_module, "dry_run", broken)
    cb = MemoryReport(every_n_steps=1, plot=False, save_dir=tmp_path)
    with pytest.warns(UserWarning, match="no prediction"):
        _trainer([cb], max_steps=2).fit(tiny_lm_module(), DataLoader(_Batches(), batch_size=2))
    assert cb.predicted["error"] == "RuntimeError: no trace today"
    assert cb.baseline["error"] == "RuntimeError: no trace today" and cb.baseline["run"] == PLAIN_FP32
    assert "Predicted: not available (RuntimeError: no trace today)" in cb.table
    assert "Plain fp32 baseline: not available" in cb.table
    report = json.loads((tmp_path / "memory_report.json").read_text())
    assert report["predicted"]["error"] == "RuntimeError: no trace today" and len(report["steps"]) == 2


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
    report = json.loads((tmp_path / "memory_report.json").read_text())
    assert report["predicted"] is None and report["plain_fp32"] is None
    assert cb.predicted is None and cb.baseline is None  # predict=False: no dry run
    assert "measured backward" not in cb.table and "measured step peak" in cb.table
    assert "predicted" not in cb.table and "plain fp32" not in cb.table


def test_second_window_of_a_two_optimizer_module_is_sampled(tmp_path):
    """The GAN example steps two optimizers per batch: global_step moves by 2, the second batch is still sampled."""
    from tests.helpers.foreign import make

    cb = MemoryReport(every_n_steps=10, plot=False, save_dir=tmp_path, predict=False)
    _trainer([cb], max_steps=6).fit(make("gan"))
    assert [(s["step"], s["window"]) for s in cb.steps] == [(0, 0), (2, 1)]


def test_unwritable_save_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    cb = MemoryReport(save_dir=blocker / "memory")
    trainer = _trainer([cb])
    with pytest.raises(ValueError, match="cannot be written"):
        trainer.fit(tiny_lm_module(), DataLoader(_Batches(), batch_size=2))
    assert cb.steps == []


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

"""The dry run on modules users bring: predicted = MemoryReport-measured on CPU, or a refusal naming the op and line.

Each cause of a difference was found by comparing the real run's per-op storage ledger with the fake run's for the
same module and batch; the kernel-level tests (``test_kernels.py``) pin each fake kernel to the real CPU kernel.
"""

from __future__ import annotations

import pytest

from lightning_lowmem.predict.run_spec import RunSpec
from tests.memory._modules import make
from tests.memory.test_dry_run import _assert_predicted_equals_measured, _measure

RUNS = {
    "plain": lambda: RunSpec(),
    "offload": lambda: RunSpec(strategy="lowmem_offload", precision="bf16-true"),
}


@pytest.mark.integration
@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("name", ["lstm", "gru", "rnn", "lstm_packed", "autoencoder_mse", "conv_bn", "torchmetrics"])
def test_prediction_equals_measurement(name, run, tmp_path):
    module, batch = make(name)
    report = _measure(RUNS[run](), module, batch, tmp_path)
    # every step (device and host) and every phase within 1 %
    _assert_predicted_equals_measured(report)
    assert "error" not in report.baseline, report.baseline  # the plain fp32 baseline too (a bf16 batch is upcast)


@pytest.mark.integration
def test_torchmetrics_bounds_are_recorded_with_the_modules_line(tmp_path):
    from lightning_lowmem import dry_run

    module, batch = make("torchmetrics")
    est = dry_run(module, batch=batch)
    by_op = {b["op"]: b for b in est.bounds}
    # Accuracy validates `len(torch.unique(preds)) <= num_classes` on the (fake) predictions: one distinct value
    assert "aten._unique2.default" in by_op
    assert "one distinct value" in by_op["aten._unique2.default"]["assumption"]
    # the F1 score's confusion counts: bincount(minlength=num_classes**2)
    assert "below minlength=100" in by_op["aten.bincount.default"]["assumption"]
    # each names the line of the user's module that called it, then the library's line
    for bound in est.bounds:
        assert "_modules.py:" in bound["where"] and "torchmetrics" in bound["where"], bound
    assert any("aten.bincount.default at" in n for n in est.notes)



@pytest.mark.integration
def test_lowmem_plan_and_lowmem_auto_accept_a_module_with_torchmetrics():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_lowmem.plan.auto import AutoStrategy
    from lightning_lowmem.plan.search import plan

    module, batch = make("torchmetrics")
    loader = DataLoader(TensorDataset(*batch), batch_size=16)
    chosen = plan(module, data=loader, device_memory="1GB", target="cpu", bases=["fp32", "offload"]).chosen
    assert chosen is not None and any("aten._unique2.default" == b["op"] for b in chosen.estimate.bounds)
    auto = AutoStrategy(device_budget=2 * chosen.peak_device)
    trainer = L.Trainer(strategy=auto, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == 2 and auto.plan.chosen.peak_device <= 2 * chosen.peak_device

"""MemoryReport: constructor validation and the helpers (sampling, downsampling, reporters, prediction arguments)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_lowmem.callbacks import memory_report as mr
from lightning_lowmem.callbacks.memory_report import MemoryReport
from lightning_lowmem.memory.categories import CATEGORIES, MemoryBreakdown


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "10"])
def test_every_n_steps_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=f"every_n_steps={bad!r}"):
        MemoryReport(every_n_steps=bad)


def test_flags_and_save_dir_validated(tmp_path):
    with pytest.raises(TypeError, match="phases='yes'"):
        MemoryReport(phases="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plot=1"):
        MemoryReport(plot=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="save_dir` of type int"):
        MemoryReport(save_dir=3)  # type: ignore[arg-type]
    a_file = tmp_path / "report.json"
    a_file.write_text("{}")
    with pytest.raises(ValueError, match="which is a file"):
        MemoryReport(save_dir=a_file)


def test_unwritable_save_dir_named(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be written"):
        MemoryReport._check_writable(blocker / "sub")  # a directory under a file: fails even as root


def test_sampling():
    cb = MemoryReport(every_n_steps=3)
    assert [s for s in range(10) if cb._sampled(s)] == [0, 1, 3, 6, 9]
    assert all(MemoryReport(every_n_steps=1)._sampled(s) for s in range(5))


def test_downsample_keeps_the_peak(monkeypatch):
    monkeypatch.setattr(mr, "_MAX_TIMELINE_POINTS", 10)
    n = 95
    tl = {"phases": ["<start>", "forward"], "phase": [1] * n, **{c: [0] * n for c in CATEGORIES}, "host_total": [0] * n}
    tl["activations"] = [i % 17 for i in range(n)]
    tl["activations"][42] = 1000
    out = mr._downsample(tl)
    assert len(out["phase"]) <= 10 and len(out["activations"]) == len(out["phase"])
    assert max(out["activations"]) == 1000
    assert out["phases"] == tl["phases"]


class _Reporter:
    def memory_breakdown(self) -> MemoryBreakdown:
        bd = MemoryBreakdown()
        bd.add("host", "activations", 123)
        return bd


def test_reporters_found_and_self_excluded():
    cb = MemoryReport()
    reporter = _Reporter()
    trainer = SimpleNamespace(strategy=object(), callbacks=[cb, reporter, reporter])
    found = mr._reporters(trainer, exclude=cb)  # type: ignore[arg-type]
    assert found == [("_Reporter", reporter)]


def test_prediction_arguments_from_the_trainer():
    class ActivationCheckpointing:
        policy, n = "every_n", 2

    class ActivationOffload:
        pass

    trainer = SimpleNamespace(
        accumulate_grad_batches=4,
        precision="bf16-true",
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        callbacks=[ActivationCheckpointing(), ActivationOffload()],
    )
    kwargs = mr._techniques(trainer, (2, 128))  # type: ignore[arg-type]
    assert kwargs == {
        "batch_size": 8,
        "seq_len": 128,
        "micro_batch_size": 2,
        "precision": "bf16-true",
        "target": "cpu",
        "checkpointing": "every_n",
        "checkpointing_every_n": 2,
        "activation_offload": True,
    }
    assert mr._techniques(trainer, (4,)) is None  # type: ignore[arg-type]


def test_batch_shape_prefers_token_ids():
    batch = {"x": torch.randn(3, 5, 7), "input_ids": torch.zeros(3, 5, dtype=torch.long)}
    assert mr._batch_shape(batch) == (3, 5)
    assert mr._batch_shape([torch.randn(4)]) == (4,)
    assert mr._batch_shape({"n": 3}) is None


def test_missing_estimator_is_tolerated(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning_lowmem.memory.estimate", None)  # import fails
    cb = MemoryReport()
    out = cb._predict(SimpleNamespace(), torch.nn.Linear(1, 1))  # type: ignore[arg-type]
    assert out is not None and "not available" in out["error"]

"""MemoryReport: constructor validation and the pieces it is built from (sampling, downsampling, reporters).

Behaviour through a real ``Trainer.fit`` (measurement, prediction, plain fp32 baseline) is in
``test_memory_report_integration.py``.
"""

from __future__ import annotations

import pytest

from lightning_lowmem.core.accounting import CATEGORIES
from lightning_lowmem.core.atomic import atomic_write_text
from lightning_lowmem.measure.recorder import StepMemoryRecorder, reporters
from lightning_lowmem.report import render
from lightning_lowmem.report.memory_report import MemoryReport


@pytest.mark.parametrize("bad", [1.5, True, "10", None])
def test_every_n_steps_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match=f"every_n_steps={bad!r}"):
        MemoryReport(every_n_steps=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -3])
def test_every_n_steps_below_one_is_a_value_error(bad):
    with pytest.raises(ValueError, match=f"every_n_steps={bad!r}"):
        MemoryReport(every_n_steps=bad)


def test_flags_and_save_dir_validated(tmp_path):
    with pytest.raises(TypeError, match="phases='yes'"):
        MemoryReport(phases="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plot=1"):
        MemoryReport(plot=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="predict=None"):
        MemoryReport(predict=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="save_dir` of type int"):
        MemoryReport(save_dir=3)  # type: ignore[arg-type]
    a_file = tmp_path / "report.json"
    a_file.write_text("{}")
    with pytest.raises(ValueError, match="which is a file"):
        MemoryReport(save_dir=a_file)


def test_every_problem_is_reported_at_once(tmp_path):
    a_file = tmp_path / "report.json"
    a_file.write_text("{}")
    # a wrong type and a wrong value together: TypeError (the type is the first thing to fix), naming both
    with pytest.raises(TypeError, match=r"(?s)plot='no'.*which is a file"):
        MemoryReport(plot="no", save_dir=a_file)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"(?s)every_n_steps=0.*which is a file"):
        MemoryReport(every_n_steps=0, save_dir=a_file)


def test_unwritable_save_dir_named(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be written"):
        MemoryReport._check_writable(blocker / "sub")  # a directory under a file: fails even as root


def test_memory_report_is_the_shared_step_recorder():
    cb = MemoryReport(every_n_steps=4)
    assert isinstance(cb, StepMemoryRecorder)
    assert cb.every_n_steps == 4 and cb.predicted is None and cb.baseline is None


def test_sampling():
    cb = MemoryReport(every_n_steps=3)
    sampled = []
    for step in range(10):
        cb._windows = step  # one optimizer: one window per global step
        if cb.sampled(step):
            sampled.append(step)
    assert sampled == [0, 1, 3, 6, 9]
    every = MemoryReport(every_n_steps=1)
    assert all(every.sampled(s) for s in range(5))


def test_second_window_is_sampled_with_two_optimizers():
    # a GAN's batch steps two optimizers: global_step goes 0, 2, 4, ...; the second window is step 2
    cb = MemoryReport(every_n_steps=5)
    sampled = []
    for window, step in enumerate(range(0, 20, 2)):
        cb._windows = window
        if cb.sampled(step):
            sampled.append(step)
    assert sampled == [0, 2, 10]


def test_downsample_keeps_the_peak(monkeypatch):
    monkeypatch.setattr(render, "_MAX_TIMELINE_POINTS", 10)
    n = 95
    tl = {"phases": ["<start>", "forward"], "phase": [1] * n, **{c: [0] * n for c in CATEGORIES}, "host_total": [0] * n}
    tl["activations"] = [i % 17 for i in range(n)]
    tl["activations"][42] = 1000
    out = render.downsample(tl)
    assert len(out["phase"]) <= 10 and len(out["activations"]) == len(out["phase"])
    assert max(out["activations"]) == 1000
    assert out["phases"] == tl["phases"]


def test_downsample_leaves_a_short_timeline_alone():
    tl = {"phases": ["forward"], "phase": [0, 0], **{c: [1, 2] for c in CATEGORIES}, "host_total": [0, 0]}
    assert render.downsample(tl) is tl


def test_atomic_write_is_readable_by_others(tmp_path):
    path = tmp_path / "sub" / "memory_report.json"
    atomic_write_text(path, "{}\n")
    assert path.read_text() == "{}\n" and path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["memory_report.json"]  # no temporary left behind


def test_reporters_are_the_techniques_that_report_their_memory():
    """Of a real Trainer's strategy, precision plugin and callbacks: those implementing ``memory_breakdown()``,
    each once, the report itself excluded."""
    import lightning as L

    import lightning_lowmem  # noqa: F401  (registers lowmem_offload)
    from lightning_lowmem import ActivationCheckpointing, ActivationOffload, LowBitOptimizer

    cb, offload = MemoryReport(), ActivationOffload()
    trainer = L.Trainer(accelerator="cpu", strategy="lowmem_offload", logger=False, enable_checkpointing=False,
                        callbacks=[cb, ActivationCheckpointing("all"), offload, LowBitOptimizer()])
    trainer.callbacks.append(offload)  # listed twice: reported once
    found = reporters(trainer, exclude=cb)
    assert found == [("OffloadStrategy", trainer.strategy), ("ActivationOffload", offload)]
    assert reporters(L.Trainer(accelerator="cpu", logger=False, callbacks=[cb]), exclude=cb) == []

"""What remains of ``core.side_step`` and ``core.kept_state`` (used by the dry run and ``lowmem_auto`` only): the RNG
forked, logging silenced, warnings quieted, a module's buffers, metric states and rebound attributes put back.

Nothing in the package runs a training step outside Lightning's loop any more (the probe and the micro-batch search
measure fake copies: ``test_no_trace.py``); both modules go once their last users stop using them.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torchmetrics import CatMetric, SumMetric

from lightning_lowmem.core.kept_state import kept_state
from lightning_lowmem.core.side_step import forked_rng, quiet_warnings, silenced_log


class _Logs(L.LightningModule):
    """Records what reaches ``self.log``/``self.log_dict`` (the class methods, as Lightning's own would be called)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def log(self, name: str, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.calls.append(name)

    def log_dict(self, dictionary: dict[str, Any], *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.calls.extend(dictionary)


def test_rng_is_put_back_after_the_fork_and_after_an_error():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with forked_rng():
        inside = torch.rand(4)
    assert torch.equal(inside, expected)  # the fork draws what the run would have drawn...
    with pytest.raises(RuntimeError, match="boom"), forked_rng():
        torch.rand(100)
        raise RuntimeError("boom")
    assert torch.equal(torch.rand(4), expected)  # ...and the run draws it again afterwards


def test_python_and_numpy_generators_are_put_back():
    np = pytest.importorskip("numpy")
    random.seed(1)
    np.random.seed(1)
    expected = (random.random(), float(np.random.rand()))
    random.seed(1)
    np.random.seed(1)
    with forked_rng():
        assert (random.random(), float(np.random.rand())) == expected  # the run's draws...
        random.random()
    assert (random.random(), float(np.random.rand())) == expected  # ...drawn again by the run


def test_logging_is_silenced_inside_and_restored_after_an_error():
    module = _Logs()
    with pytest.raises(ValueError, match="inside"), silenced_log(module):
        module.log("a", 1.0)
        module.log_dict({"b": 2.0})
        raise ValueError("inside")
    assert module.calls == []
    assert "log" not in vars(module) and "log_dict" not in vars(module)
    module.log("c", 3.0)
    module.log_dict({"d": 4.0})
    assert module.calls == ["c", "d"]


def test_a_class_can_be_silenced_and_restored():
    original = L.LightningModule.log
    with silenced_log(L.LightningModule):
        assert L.LightningModule.log is not original
        L.LightningModule().log("x", 1.0)  # no trainer: would warn; silenced, it does nothing
    assert L.LightningModule.log is original


def test_quiet_warnings_ignores_inside_only():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_warnings():
            warnings.warn("simulated", UserWarning, stacklevel=1)
        warnings.warn("real", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["real"]


class _Counting(_Logs):
    """A module whose step changes what ``kept_state`` must put back, and what it leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(3)
        self.total = SumMetric()
        self.outputs = CatMetric()
        self.steps = 0
        self.last: torch.Tensor | None = None
        self.history: list[int] = []

    def training_step(self, x: torch.Tensor) -> None:
        out = self.norm(x)
        self.total.update(x.shape[0])
        self.outputs(out.sum(1).detach())  # `forward`: updates the state, caches the batch value
        self.steps += 1
        self.last = out.detach()
        self.history.append(self.steps)  # a list changed in place: not put back (documented)
        self.started = True  # set for the first time: left (documented)
        self.register_buffer("scale", torch.ones(()))  # registered: left registered


def test_kept_state_puts_back_buffers_metric_states_and_rebound_attributes():
    module = _Counting()
    module.training_step(torch.randn(4, 3))  # a real step: what must be kept
    norm = {k: v.clone() for k, v in module.norm.state_dict().items()}
    mean, total, outputs = module.norm.running_mean, module.total.compute(), module.outputs.compute()
    last, history = module.last, module.history
    with kept_state(module):
        module.training_step(torch.randn(8, 3) * 5)
        module.eval()
        assert module.total.update_count == 2 and module.steps == 2
    assert all(torch.equal(v, norm[k]) for k, v in module.norm.state_dict().items())
    assert module.norm.running_mean is mean  # the same tensor object (references elsewhere stay valid)
    assert torch.equal(module.total.compute(), total) and module.total.update_count == 1
    assert torch.equal(module.outputs.compute(), outputs) and len(module.outputs.value) == 1
    assert module.steps == 1 and module.last is last and module.training
    assert module.history is history and history == [1, 2] and module.started and "scale" in dict(module.named_buffers())
    module.training_step(torch.randn(4, 3))  # the metrics go on from where the real step left them
    assert module.total.update_count == 2 and float(module.total.compute()) == 8.0


def test_kept_state_puts_back_after_an_error_and_takes_a_module_without_hash():
    class Unhashable(_Counting):
        def __eq__(self, other: object) -> bool:  # defining __eq__ removes __hash__
            return isinstance(other, Unhashable)

    module = Unhashable()
    with pytest.raises(RuntimeError, match="trial"), kept_state(module):
        module.training_step(torch.randn(4, 3))
        raise RuntimeError("trial")
    assert module.steps == 0 and module.total.update_count == 0 and int(module.norm.num_batches_tracked) == 0

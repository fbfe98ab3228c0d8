"""``side_step``: a training step run outside Lightning's loop leaves the run as it was.

Unit tests of the context manager (RNG, logging, the mark, nesting, errors). Nothing in the package runs a side
step any more (the probe and the micro-batch search measure fake copies: ``test_no_trace.py``); the module goes
once its last helpers (``forked_rng``, ``quiet_warnings``, ``silenced_log``) have no user.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torchmetrics import CatMetric, SumMetric

from lightning_lowmem.core.side_step import forked_rng, marked, quiet_warnings, side_step, silenced_log, stands_aside


class _Logs(L.LightningModule):
    """Records what reaches ``self.log``/``self.log_dict`` (the class methods, as Lightning's own would be called)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def log(self, name: str, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.calls.append(name)

    def log_dict(self, dictionary: dict[str, Any], *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.calls.extend(dictionary)


def _attached() -> _Logs:
    module = _Logs()
    module.trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                               enable_model_summary=False)
    return module


def test_rng_is_put_back_after_the_side_step_and_after_an_error():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    module = _attached()
    with side_step(module):
        inside = torch.rand(4)
    assert torch.equal(inside, expected)  # the side step draws what the run would have drawn...
    with pytest.raises(RuntimeError, match="boom"), side_step(module):
        torch.rand(100)
        raise RuntimeError("boom")
    assert torch.equal(torch.rand(4), expected)  # ...and the run draws it again afterwards


def test_logging_is_silenced_inside_and_restored_after_an_error():
    module = _attached()
    with pytest.raises(ValueError, match="inside"), side_step(module):
        module.log("a", 1.0)
        module.log_dict({"b": 2.0})
        raise ValueError("inside")
    assert module.calls == []
    assert "log" not in vars(module) and "log_dict" not in vars(module)
    module.log("c", 3.0)
    module.log_dict({"d": 4.0})
    assert module.calls == ["c", "d"]


def test_an_instance_log_of_someone_else_is_given_back():
    module = _attached()
    recorded: list[str] = []
    module.log = lambda name, *a, **k: recorded.append(name)  # type: ignore[method-assign]  # e.g. the OOM splitter's
    with side_step(module):
        module.log("probe", 1.0)
    module.log("real", 1.0)
    assert recorded == ["real"] and module.calls == []


def test_a_class_can_be_silenced_and_restored():
    original = L.LightningModule.log
    with silenced_log(L.LightningModule):
        assert L.LightningModule.log is not original
        L.LightningModule().log("x", 1.0)  # no trainer: would warn; silenced, it does nothing
    assert L.LightningModule.log is original


def test_the_mark_tells_a_wrapper_to_stand_aside_and_nesting_keeps_the_outer_one():
    module = _attached()
    other = _attached()
    assert not stands_aside(module)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with side_step(module):
        with side_step(module):
            assert stands_aside(module)
            module.log("inner", 1.0)
            torch.rand(10)
        # the inner exit gives back what the outer set: still marked, still silent, its RNG state
        assert stands_aside(module) and not stands_aside(other)
        module.log("outer", 1.0)
        assert torch.equal(torch.rand(3), expected)
    assert not stands_aside(module) and module.calls == []
    assert torch.equal(torch.rand(3), expected)


def test_a_detached_module_stands_aside_and_marked_alone_touches_nothing_else():
    assert stands_aside(_Logs())  # no Trainer: no loop whose step a wrapper could change
    module = _attached()
    with marked(module), forked_rng():
        assert stands_aside(module)
        module.log("kept", 1.0)  # `marked` alone (the OOM splitter's view) leaves logging on
    assert module.calls == ["kept"]


def test_a_module_without_hash_can_be_marked():
    class Unhashable(_Logs):
        def __eq__(self, other: object) -> bool:  # defining __eq__ removes __hash__
            return isinstance(other, Unhashable)

    module = Unhashable()
    module.trainer = _attached().trainer
    with side_step(module):
        assert stands_aside(module)
    assert not stands_aside(module)


def test_quiet_warnings_ignores_inside_only():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_warnings():
            warnings.warn("simulated", UserWarning, stacklevel=1)
        warnings.warn("real", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["real"]


def test_python_and_numpy_generators_are_put_back():
    np = pytest.importorskip("numpy")
    random.seed(1)
    np.random.seed(1)
    expected = (random.random(), float(np.random.rand()))
    random.seed(1)
    np.random.seed(1)
    with side_step(_attached()):
        assert (random.random(), float(np.random.rand())) == expected  # the run's draws...
        random.random()
    assert (random.random(), float(np.random.rand())) == expected  # ...drawn again by the run


class _Counting(_Logs):
    """A module whose step changes what a side step must put back, and what it leaves."""

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


def test_side_step_puts_back_buffers_metric_states_and_rebound_attributes():
    module = _Counting()
    module.training_step(torch.randn(4, 3))  # a real step: what the side step must keep
    norm = {k: v.clone() for k, v in module.norm.state_dict().items()}
    mean, total, outputs = module.norm.running_mean, module.total.compute(), module.outputs.compute()
    last, history = module.last, module.history
    with side_step(module):
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


def test_side_step_puts_back_after_an_error():
    module = _Counting()
    with pytest.raises(RuntimeError, match="trial"), side_step(module):
        module.training_step(torch.randn(4, 3))
        raise RuntimeError("trial")
    assert module.steps == 0 and module.total.update_count == 0 and int(module.norm.num_batches_tracked) == 0


def test_param_writes_undone_puts_back_writes_through_data_views_and_out_and_leaves_reads():
    from lightning_lowmem.core.kept_state import param_writes_undone

    net = torch.nn.Linear(4, 4)
    before = {k: v.detach().clone() for k, v in net.state_dict().items()}
    with param_writes_undone(net), torch.no_grad():
        net.weight.data.mul_(2.0)  # NOTE: through `.data`: no version bump, still seen (by storage)
        net.weight[0].zero_()  # a view
        torch.add(net.bias, 1.0, out=net.bias)
        seen = net.weight.detach().clone()
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert not seen[0].any() and torch.equal(seen[1:], 2 * before["weight"][1:])  # NOTE: inside, the writes were seen

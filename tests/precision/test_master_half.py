"""Unit tests of MasterHalfPrecision and its fp16 loss scaler (no Trainer; see tests/strategies for Trainer.fit)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_lowmem.precision.loss_scaler import DynamicLossScaler
from lightning_lowmem.precision.master_half import MasterHalfPrecision


def test_rejects_unknown_precision():
    with pytest.raises(ValueError, match=r"precision='bf16'.*expected one of 'bf16-true'"):
        MasterHalfPrecision("bf16")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("precision", "dtype", "scaler"),
    [("bf16-true", torch.bfloat16, False), ("16-true", torch.float16, True), ("bf16-mixed", torch.bfloat16, False),
     ("16-mixed", torch.float16, True), ("32-true", torch.float32, False)],
)
def test_compute_dtype_and_scaler(precision, dtype, scaler):
    plugin = MasterHalfPrecision(precision)
    assert plugin.compute_dtype == dtype
    assert (plugin.scaler is not None) == scaler
    module = plugin.convert_module(torch.nn.Linear(3, 3))
    assert module.weight.dtype == dtype
    # modules are built in fp32 whatever the compute dtype: the masters are copied from them
    with plugin.module_init_context():
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32


def test_true_precision_casts_inputs_and_sets_default_dtype():
    plugin = MasterHalfPrecision("bf16-true")
    batch = {"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)}
    out = plugin.convert_input(batch)
    assert out["x"].dtype == torch.bfloat16 and out["ids"].dtype == torch.long
    with plugin.forward_context():
        assert torch.get_default_dtype() == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


def test_mixed_precision_autocasts_and_keeps_inputs():
    plugin = MasterHalfPrecision("bf16-mixed")
    plugin.device_type = "cpu"
    x = torch.ones(2, 3)
    assert plugin.convert_input(x).dtype == torch.float32
    linear = torch.nn.Linear(3, 3)
    with plugin.forward_context():
        assert linear(x).dtype == torch.bfloat16  # matmul in bf16
        # autocast's CPU policy keeps losses in fp32 (softmax and norms are fp32 only in its CUDA policy)
        assert torch.nn.functional.cross_entropy(linear(x), torch.tensor([0, 1])).dtype == torch.float32


def test_scaler_overflow_halves_and_growth_doubles():
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    grads = [torch.full((4,), 2.0**10), torch.tensor([1.0, float("nan")])]
    assert scaler.unscale_(grads) is True
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**9 and scaler.overflows == 1
    clean = [torch.full((4,), 2.0**9)]
    assert scaler.unscale_(clean) is False
    assert torch.equal(clean[0], torch.ones(4))  # power-of-two scales unscale exactly
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 2.0**10 and scaler.growth_tracker == 0


def test_scaler_state_round_trip_and_validation():
    a = DynamicLossScaler(init_scale=64.0, growth_interval=5)
    a.update(True)
    a.update(False)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    with pytest.raises(ValueError, match="lacks"):
        b.load_state_dict({"scale": 1.0})
    with pytest.raises(ValueError, match=r"backoff_factor=1.5"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match=r"growth_interval=0"):
        DynamicLossScaler(growth_interval=0)


def test_fp16_state_dict_holds_the_scaler_bf16_has_none():
    assert MasterHalfPrecision("bf16-true").state_dict() == {}
    plugin = MasterHalfPrecision("16-true", init_scale=128.0)
    plugin.scaler.update(True)
    restored = MasterHalfPrecision("16-true")
    restored.load_state_dict(plugin.state_dict())
    assert restored.scaler.scale == 64.0 and restored.scaler.overflows == 1


class _Module(SimpleNamespace):
    """Just enough of a LightningModule for Precision.optimizer_step (no Trainer attached)."""

    automatic_optimization = True
    _trainer = None

    @property
    def trainer(self):
        return SimpleNamespace(gradient_clip_val=None, gradient_clip_algorithm=None, callbacks=[], lightning_module=self)


def test_overflow_skips_step_and_never_touches_the_masters(monkeypatch):
    plugin = MasterHalfPrecision("16-true", init_scale=8.0)
    monkeypatch.setattr(plugin, "_after_closure", lambda model, opt: None)  # the hooks need a Trainer
    master = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([master], lr=0.1, momentum=0.9)
    calls = []

    def closure():
        master.grad = torch.tensor([8.0, float("inf"), 8.0])  # a planted inf in the (scaled) gradient
        return torch.tensor(1.0)

    plugin.optimizer_step(opt, _Module(), closure, step_fn=lambda o: calls.append(o))
    assert calls == [] and plugin.last_step_skipped
    assert torch.equal(master.detach(), torch.ones(3)) and master.grad is None
    assert plugin.scaler.scale == 4.0

    def clean():
        master.grad = torch.full((3,), 4.0)  # scaled by 4: unscales to 1
        return torch.tensor(1.0)

    plugin.optimizer_step(opt, _Module(), clean)
    assert not plugin.last_step_skipped
    assert torch.equal(master.detach(), torch.full((3,), 0.9))

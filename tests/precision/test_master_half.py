"""Unit tests of MasterHalfPrecision and its fp16 loss scaler (no Trainer; see tests/strategies for Trainer.fit)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from lightning_lowmem.strategies.offload.loss_scaler import DynamicLossScaler
from lightning_lowmem.strategies.offload.precision import MasterHalfPrecision


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
    # NOTE: "*-mixed" keeps the compute weights fp32, as Lightning's MixedPrecision (autocast casts per op)
    assert module.weight.dtype == plugin.weight_dtype == (torch.float32 if precision.endswith("-mixed") else dtype)
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


def test_forward_context_restores_the_default_dtype_on_error_and_32_true_leaves_it():
    plugin = MasterHalfPrecision("16-true")
    with pytest.raises(RuntimeError, match="boom"), plugin.forward_context():
        assert torch.get_default_dtype() == torch.float16
        raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32
    torch.set_default_dtype(torch.float64)
    try:
        with MasterHalfPrecision("32-true").forward_context():
            assert torch.get_default_dtype() == torch.float64
        with plugin.forward_context():
            assert torch.get_default_dtype() == torch.float16
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


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


@pytest.mark.parametrize("init_scale", [2.0**6, 1000.0])  # a power of two, and one whose inverse rounds in fp32
def test_scaler_matches_torch_grad_scaler_above_min_scale_and_keeps_its_floor(init_scale):
    """The loss-scale schedule and the unscaled host gradients are torch.amp.GradScaler's, bit for bit, over a
    sequence of clean and overflowing steps; below ``min_scale`` GradScaler keeps halving, this scaler stops."""
    params = [torch.nn.Parameter(torch.zeros(7)) for _ in range(3)]
    opt = torch.optim.SGD(params, lr=0.1)
    ours = DynamicLossScaler(init_scale=init_scale, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    g = torch.Generator().manual_seed(0)
    for overflow in [False, False, True, False, False, False, True, True, False, False]:
        loss = torch.rand((), generator=g)
        assert torch.equal(ours.scale_loss(loss), theirs.scale(loss))
        grads = [torch.randn(7, generator=g) * 1000 for _ in params]
        if overflow:
            grads[1][3] = float("inf")
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        theirs.unscale_(opt)
        assert ours.unscale_(grads) is overflow
        assert all(torch.equal(p.grad, grad) for p, grad in zip(params, grads))
        theirs.update()
        ours.update(found_inf=overflow)
        assert ours.scale == theirs.get_scale()

    floor, torch_scaler = DynamicLossScaler(init_scale=1.0), torch.amp.GradScaler("cpu", init_scale=1.0)
    torch_scaler.scale(torch.ones(()))
    params[0].grad = torch.tensor([float("nan")] * 7)
    torch_scaler.unscale_(opt)
    torch_scaler.update()
    floor.update(found_inf=True)
    assert (floor.scale, torch_scaler.get_scale()) == (1.0, 0.5)


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

    def closure():
        master.grad = torch.tensor([8.0, float("inf"), 8.0])  # a planted inf in the (scaled) gradient
        return torch.tensor(1.0)

    plugin.optimizer_step(opt, _Module(), closure)
    assert torch.equal(master.detach(), torch.ones(3)) and master.grad is None and not opt.state
    assert plugin.scaler.scale == 4.0

    def clean():
        master.grad = torch.full((3,), 4.0)  # scaled by 4: unscales to 1
        return torch.tensor(1.0)

    plugin.optimizer_step(opt, _Module(), clean)
    assert torch.equal(master.detach(), torch.full((3,), 0.9))


class _Block(torch.nn.Module):
    """Every kind of parameter owner `-mixed` must tell apart, plus an fp32 buffer."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.embed = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: an embedding too, so it must stay fp32
        self.proj = torch.nn.Linear(8, 8)
        self.conv = torch.nn.Conv1d(8, 8, 3)
        self.hf_conv = Conv1D(8, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
        self.norm = torch.nn.LayerNorm(8)
        self.scale = torch.nn.Parameter(torch.ones(8))
        self.custom = _ScaledLinear(8, 8)
        self.register_buffer("table", torch.randn(4, 8))


class _ScaledLinear(torch.nn.Linear):
    def forward(self, x):  # reads its weight outside F.linear too
        return super().forward(x) * self.weight.norm()


def test_mixed_casts_nothing():
    module = _Block()
    MasterHalfPrecision("bf16-mixed").convert_module(module)
    assert {p.dtype for p in module.parameters()} | {b.dtype for b in module.buffers()} == {torch.float32}


def test_true_casts_everything_buffers_included():
    module = _Block()
    MasterHalfPrecision("bf16-true").convert_module(module)
    assert {p.dtype for p in module.parameters()} | {b.dtype for b in module.buffers()} == {torch.bfloat16}


def test_mixed_forward_equals_plain_autocast_bit_for_bit():
    """Autocast casts per op: the same outputs and the same gradients as plain mixed precision."""
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                      norm=torch.nn.LayerNorm(16), enable_nested_tensor=False)
    ours = copy.deepcopy(ref)
    plugin = MasterHalfPrecision("bf16-mixed")
    plugin.device_type = "cpu"
    plugin.convert_module(ours)
    x = torch.randn(3, 5, 16)  # fp32 input straight into an fp32 LayerNorm after bf16 attention: mixed dtypes
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        want = ref(x)
    with plugin.forward_context():
        got = ours(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    want.float().square().sum().backward()
    got.float().square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p.grad, q.grad), name

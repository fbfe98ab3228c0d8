"""Fake kernels allocate what the real CPU kernels allocate (``lightning_lowmem.predict.kernels``).

Each op of ``PROBED`` runs once for real and once inside a fake execution on tensors of the same sizes; the
storages of their outputs (bytes, and which outputs share one) must be the same.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.predict import kernels as _kernels
from lightning_lowmem.predict.fake import DryRunUnsupportedError, fake_execution

_aten = torch.ops.aten


def _storages(outs):
    """(bytes, index of the first output on the same storage) per tensor output that has bytes (no grad: the real
    LSTM kernel returns no workspace, the fake one an empty tensor)."""
    outs = [outs] if isinstance(outs, torch.Tensor) else outs
    seen, out = {}, []
    for i, t in enumerate(outs):
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            out.append((t.untyped_storage().nbytes(), seen.setdefault(t.untyped_storage()._cdata, i)))
    return out


def _lstm_args(t, n=8, features=16, hidden=32, dtype=torch.float32, batch_first=False):
    x = torch.randn(t, n, features)  # (seq, batch, features) whatever `batch_first` says (aten's lstm transposes)
    weights = [torch.randn(4 * hidden, features), torch.randn(4 * hidden, hidden), torch.randn(4 * hidden),
               torch.randn(4 * hidden)]
    state = [torch.zeros(n, hidden), torch.zeros(n, hidden)]
    tensors = [a.to(dtype) for a in (x, *weights, *state)]
    # reverse, batch_sizes, mode (LSTM), hidden_size, num_layers, has_biases, bidirectional, batch_first, train
    return tensors, (False, [], 2, hidden, 1, True, False, batch_first, True)


def _real_and_fake(op, tensors, rest):
    real = op(*tensors, *rest)
    with fake_execution() as fx:
        fakes = [fx.fake(t) for t in tensors]
        fake = op(*fakes, *rest)
        kept = _storages(fake)
    return _storages(real), kept, real


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [True, False])
def test_lstm_forward_workspace_is_the_real_kernels(dtype, grad):
    tensors, rest = _lstm_args(10, dtype=dtype)
    with torch.set_grad_enabled(grad):
        real, fake, out = _real_and_fake(_aten.mkldnn_rnn_layer.default, tensors, rest)
    assert fake == real
    if grad:  # the workspace: oneDNN's own size (fake kernels without the correction return an empty one)
        assert out[3].numel() > out[0].untyped_storage().nbytes()


def test_lstm_backward_returns_two_bias_gradients():
    tensors, rest = _lstm_args(10)
    with torch.enable_grad():
        out = _aten.mkldnn_rnn_layer.default(*tensors, *rest)
    # input, 4 weights, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy, then the flags and the workspace
    args = [*tensors, out[0], out[1], out[2], torch.ones_like(out[0]), None, None]
    flags = (False, 2, 32, 1, True, True, False, [], False)
    real = _storages(_aten.mkldnn_rnn_layer_backward.default(*args, *flags, out[3]))
    with fake_execution() as fx:
        fakes = [fx.fake(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = _storages(_aten.mkldnn_rnn_layer_backward.default(*fakes, *flags, fx.fake(out[3])))
    assert fake == real
    assert real[3][1] != real[4][1]  # separate storages for the two bias gradients


@pytest.mark.parametrize("op, target", [
    (_aten.mse_loss.default, "float"), (_aten.smooth_l1_loss.default, "float"),
    (_aten.soft_margin_loss.default, "sign"), (_aten.binary_cross_entropy.default, "prob"),
])
@pytest.mark.parametrize("reduction", [0, 1, 2])  # none, mean, sum
def test_losses_keep_their_unreduced_buffer(op, target, reduction):
    x = torch.rand(16, 7) if target == "prob" else torch.randn(16, 7)
    y = {"float": torch.randn(16, 7), "sign": torch.randn(16, 7).sign(), "prob": torch.rand(16, 7)}[target]
    real, fake, _ = _real_and_fake(op, [x, y], (reduction,) if op is not _aten.binary_cross_entropy.default
                                   else (None, reduction))
    assert fake == real
    assert real[0][0] == 16 * 7 * 4  # reduced or not, the buffer of every element


def test_probe_extrapolates_along_the_sequence_when_the_full_size_is_over_budget(monkeypatch):
    """Over the probe budget the workspace comes from three shorter sequences: exact for batch and hidden sizes that
    are multiples of 8, an upper bound (said in the note) for odd ones."""
    for n, features, hidden, budget in ((8, 16, 32, 2 * 2**20), (3, 5, 13, 2**19)):
        monkeypatch.setattr(_kernels, "PROBE_BYTES", budget)  # below the full size's, above the third length's
        tensors, rest = _lstm_args(1000, n=n, features=features, hidden=hidden, batch_first=True)
        with torch.enable_grad():
            real = _storages(_aten.mkldnn_rnn_layer.default(*tensors, *rest))
            with fake_execution() as fx:
                fake = _storages(_aten.mkldnn_rnn_layer.default(*[fx.fake(t) for t in tensors], *rest))
                notes = fx.notes()
        assert "extrapolated from lengths (40, 104, 168) of dimension " in notes[0] and " to 1000" in notes[0]
        if n == 8:
            assert fake == real
        else:
            assert fake[:3] == real[:3] and real[3][0] <= fake[3][0] <= 1.05 * real[3][0]
            assert "an upper bound" in notes[0]


def test_loss_probe_over_budget_shortens_the_largest_dimension(monkeypatch):
    x, y = torch.randn(4, 1000), torch.randn(4, 1000)
    real = _storages(_aten.mse_loss.default(x, y, 1))
    monkeypatch.setattr(_kernels, "PROBE_BYTES", 8 * 2**10)
    with fake_execution() as fx:
        fake = _storages(_aten.mse_loss.default(fx.fake(x), fx.fake(y), 1))
        notes = fx.notes()
    assert fake == real == [(16000, 0)]
    assert "extrapolated from lengths (40, 104, 168) of dimension " in notes[0] and " to 1000" in notes[0]


def test_probe_over_budget_without_a_length_is_refused_naming_the_line(monkeypatch):
    tensors, (reverse, _, *flags) = _lstm_args(10)
    packed = [tensors[0].reshape(80, 16), *tensors[1:]]
    monkeypatch.setattr(_kernels, "PROBE_BYTES", 1024)
    with torch.enable_grad(), fake_execution() as fx, pytest.raises(DryRunUnsupportedError) as err:
        _aten.mkldnn_rnn_layer.default(*[fx.fake(t) for t in packed], reverse, [10] * 8, *flags)  # the line
    assert "aten.mkldnn_rnn_layer.default" in str(err.value)
    assert "test_kernels.py:" in str(err.value) and "(_aten.mkldnn_rnn_layer.default(" in str(err.value)
    assert "probe budget" in str(err.value)


def test_corrections_are_listed_in_the_notes():
    tensors, rest = _lstm_args(10)
    with torch.enable_grad(), fake_execution() as fx:
        _aten.mkldnn_rnn_layer.default(*[fx.fake(t) for t in tensors], *rest)
        notes = fx.notes()
    assert len(notes) == 1 and notes[0].startswith("aten.mkldnn_rnn_layer.default: fake kernel corrected")


def test_a_cuda_target_says_the_lstm_workspace_is_the_cpu_kernels():
    from lightning_lowmem import dry_run
    from tests.memory._modules import make

    module, batch = make("lstm")
    est = dry_run(module, batch=batch, target="cuda")
    assert "rnn_workspace" in {c.name for c in est.corrections}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("a", "b"),  # the three forms Hugging Face's experts call (forward, grad of the input, grad of the weights)
    [((96, 32), (4, 32, 128)), ((96, 128), (4, 128, 32)), ((32, 96), (96, 64))],
)
def test_grouped_mm_fake_output_is_the_cpu_kernels(a, b, dtype):
    """fp32 raised in torch's meta function (bf16 only, the CUDA kernel's check); the output is the CPU kernel's."""
    offs = torch.tensor([20, 50, 70, 96], dtype=torch.int32)
    mat_a = torch.randn(a, dtype=dtype) if a[0] == 96 else torch.randn(a[::-1], dtype=dtype).t()
    mat_b = torch.randn(b[0], b[2], b[1], dtype=dtype).transpose(1, 2) if len(b) == 3 else torch.randn(b, dtype=dtype)
    real = _aten._grouped_mm.default(mat_a, mat_b, offs)
    with fake_execution() as fx:
        fake = _aten._grouped_mm.default(fx.fake(mat_a), fx.fake(mat_b), offs)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
        assert _storages(fake) == _storages(real)
        notes = fx.notes()
    assert any(n.startswith("aten._grouped_mm.default") for n in notes), notes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("op", [_aten._embedding_bag.default, _aten._embedding_bag_forward_only.default])
def test_embedding_bag_fake_outputs_are_the_cpu_kernels(dtype, mode, weighted, op):
    """bf16 sum bags: the meta function allocated an index-sized offset2bag the CPU kernel's fast path leaves empty."""
    if weighted and mode != 0:
        pytest.skip("per-sample weights need mode='sum'")
    weight, indices, offsets = torch.randn(50, 8, dtype=dtype), torch.randint(0, 50, (24,)), torch.arange(0, 24, 3)
    psw = torch.rand(24, dtype=dtype) if weighted else None
    real = op(weight, indices, offsets, False, mode, False, psw, False, -1)
    with fake_execution() as fx:
        fake = op(fx.fake(weight), indices, offsets, False, mode, False, None if psw is None else fx.fake(psw), False, -1)
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]

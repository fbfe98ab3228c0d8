"""ActivationOffload through recurrent networks: ``nn.RNN``/``nn.LSTM``/``nn.GRU`` train exactly as plain Lightning.

The recurrent cells compute their gates in one storage, split it with ``unsafe_chunk`` (views with version counters
of their own) and write the gates in place one after the other, saving some on the way: a gate saved at version 2
and the next gate written afterwards leave the storage's bytes changed with no version the engine could see change.
Every case fits 3 steps with ``ActivationOffload(min_bytes=0)`` and compares every weight and buffer with a plain
``Trainer.fit`` by ``torch.equal``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.callbacks.activation_offload.engine import SavedTensorOffloader, SyncCopier
from tests.helpers.activation_modules import LitRecurrent, assert_same_state, fit_state
from tests.helpers.streams import assert_copies_were_deferred

pytestmark = pytest.mark.integration

CASES = {
    # kind, batch_first, bidirectional, num_layers, packed, dropout
    "gru": ("GRU", True, False, 1, False, 0.0),
    "gru-time-first": ("GRU", False, False, 1, False, 0.0),
    "gru-bi-2layer-dropout": ("GRU", True, True, 2, False, 0.1),
    "gru-packed-bi": ("GRU", True, True, 1, True, 0.0),
    "gru-packed-time-first-2layer": ("GRU", False, False, 2, True, 0.0),
    "lstm": ("LSTM", True, False, 1, False, 0.0),
    "lstm-time-first-bi": ("LSTM", False, True, 1, False, 0.0),
    "lstm-2layer-dropout": ("LSTM", True, False, 2, False, 0.1),
    "lstm-packed-bi-2layer": ("LSTM", False, True, 2, True, 0.0),
    "rnn": ("RNN", True, False, 1, False, 0.0),
    "rnn-time-first-bi-2layer": ("RNN", False, True, 2, False, 0.1),
    "rnn-packed": ("RNN", True, False, 1, True, 0.0),
}


def _factory(case: str):
    kind, batch_first, bidirectional, num_layers, packed, dropout = CASES[case]
    return functools.partial(LitRecurrent, kind, batch_first, bidirectional, num_layers, packed, dropout)


@functools.cache
def _plain(case: str):
    return fit_state(_factory(case))[0]


@pytest.mark.parametrize("case", list(CASES))
def test_recurrent_modules_train_as_plain_lightning(case):
    offload = ActivationOffload(min_bytes=0)
    got, _ = fit_state(_factory(case), [offload])
    assert offload.last_step.bytes_offloaded > 0
    assert_same_state(got, _plain(case))


@pytest.mark.parametrize("case", ["gru-bi-2layer-dropout", "lstm-packed-bi-2layer"])
def test_recurrent_modules_on_the_stream_copier(case, transfer_mode):
    """The CUDA copy logic (side stream, events; deferred copies on the CPU stand-in) recopies the same way."""
    offload = ActivationOffload(min_bytes=0, prefetch=1)
    got, _ = fit_state(_factory(case), [offload])
    assert_same_state(got, _plain(case))
    assert_copies_were_deferred(transfer_mode)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_recurrent_cells_without_onednn(kind):
    """With oneDNN off, the LSTM too runs the decomposed cell (as on CPUs and dtypes oneDNN does not serve)."""
    factory = _factory(kind.lower())
    with torch.backends.mkldnn.flags(enabled=False):
        want, _ = fit_state(factory)
        got, _ = fit_state(factory, [ActivationOffload(min_bytes=0)])
    assert_same_state(got, want)


def test_gate_written_through_an_untracked_view_after_another_gate_was_saved():
    """The engine's own account of the pattern: ``unsafe_chunk`` views, written in place one after the other."""
    torch.manual_seed(0)
    w = torch.randn(8, 24, requires_grad=True)
    x = torch.randn(4, 8)

    def forward() -> torch.Tensor:
        a, b, c = (x @ w).unsafe_chunk(3, 1)  # three views of one storage, version counters of their own
        a = a.sigmoid_()  # saves its output: `a` at version 1
        b = b.tanh_()  # writes the storage `a` was copied from; `b` is saved at version 1 too
        c = c.mul_(a)  # saves `a` again (unchanged) and a clone of `c`
        return (a * b + c).square().sum()

    forward().backward()
    want, w.grad = w.grad, None
    engine = SavedTensorOffloader(torch.device("cpu"), SyncCopier(), min_bytes=0)
    engine.begin_step([w, x])
    with engine.hooks():
        loss = forward()
    assert engine.stats.bytes_recopied > 0
    loss.backward()
    assert torch.equal(w.grad, want)


def test_dense_saves_cover_later_saves_strided_ones_do_not():
    """Bytes inside earlier dense saves come from the first copy; bytes only a strided save spans are copied again."""
    base, other = torch.randn(6, 8), torch.randn(6, 8)
    engine = SavedTensorOffloader(torch.device("cpu"), SyncCopier(), min_bytes=0)
    engine.begin_step([])
    saved = [base, base, base.t(), base[2:4, ::3]]  # dense, the same again, a dense view, a view inside them
    packed = [engine.pack(t) for t in saved]
    assert engine.stats.storages_offloaded == 1 and engine.stats.bytes_recopied == 0
    columns = [other[:, :2], other[:, 2:4], other[:, :2]]  # strided: each spans bytes no dense save covers
    packed += [engine.pack(t) for t in columns]
    assert engine.stats.storages_offloaded == 2
    assert engine.stats.bytes_recopied == 2 * (5 * 8 + 2) * 4
    assert all(torch.equal(engine.unpack(p), t) for p, t in zip(packed, saved + columns))

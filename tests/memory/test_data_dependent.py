"""Ops whose output size depends on values run in a dry run: exact from real values, else a recorded bound."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lowmem import dry_run
from lightning_lowmem.predict.fake import fake_execution
from lightning_lowmem.predict.unsupported import DryRunUnsupportedError, _where


def _fake_step():
    """A fake execution inside a training step, and a fake (4, 3) tensor."""
    ctx = fake_execution()
    fx = ctx.__enter__()
    fx.in_step = True
    return ctx, fx, fx.fake(torch.empty(4, 3))


def test_real_masks_give_exact_sizes():
    mask = torch.tensor([True, False, True, True])
    ctx, fx, x = _fake_step()
    try:
        assert x[mask].shape == (3, 3)
        assert torch.masked_select(x, mask[:, None]).shape == (9,)
        x[mask] = 0.0  # index_put_ with a mask
        assert torch.nonzero(mask).shape == (3, 1)  # all-real in a step: run for real (the fake mode refused it)
        assert torch.unique(torch.tensor([3, 1, 3])).tolist() == [1, 3]
        assert not fx.data_dependent.bounds
    finally:
        ctx.__exit__(None, None, None)


def test_fake_values_get_the_stated_bounds():
    ctx, fx, x = _fake_step()
    try:
        assert torch.nonzero(x > 0).shape == (12, 2)  # every element selected
        assert x[x > 0].shape == (12,)
        values, counts = torch.unique(x.argmax(-1), return_counts=True)
        assert values.shape == counts.shape == (1,)  # one distinct value...
        assert values.untyped_storage().nbytes() == 4 * 8  # ...its storage counted with all 4 distinct
        assert torch.bincount(x.argmax(-1), minlength=5).shape == (5,)
        bounds = {op: a for op, _, a in fx.data_dependent.bounds}
    finally:
        ctx.__exit__(None, None, None)
    assert set(bounds) == {"aten.nonzero.default", "aten.index.Tensor", "aten._unique2.default",
                           "aten.bincount.default"}
    assert "upper bound" in bounds["aten.nonzero.default"]
    assert "below minlength=5" in bounds["aten.bincount.default"]


def test_packed_sequences_keep_real_batch_sizes():
    lengths = torch.tensor([3, 5, 1])
    ctx, fx, _ = _fake_step()
    try:
        x = fx.fake(torch.empty(5, 3, 2))
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        assert packed.data.shape == (9, 2) and packed.batch_sizes.tolist() == [3, 2, 2, 1, 1]
        padded, out_lengths = torch.nn.utils.rnn.pad_packed_sequence(packed)
        assert padded.shape == (5, 3, 2) and out_lengths.tolist() == [3, 5, 1]
    finally:
        ctx.__exit__(None, None, None)


class _CountsWeights(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        counts = torch.bincount(self.layer(batch).argmax(-1))  # no minlength: its length is the largest value + 1
        return self.layer(batch).sum() + counts.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_unbounded_size_is_refused_naming_the_op_and_the_modules_line():
    with pytest.raises(DryRunUnsupportedError,
                       match=r"aten\.bincount\.default.*test_data_dependent\.py:\d+ \(counts = torch\.bincount"):
        dry_run(_CountsWeights(), batch=torch.ones(2, 4))


def test_the_modules_line_comes_first_when_a_library_called_the_op():
    import traceback

    frames = [traceback.FrameSummary("/home/u/train.py", 12, "step", line="self.acc(logits, y)"),
              traceback.FrameSummary("/venv/lib/python3.11/site-packages/torchmetrics/data.py", 206, "_bincount",
                                     line="return torch.bincount(x)"),
              traceback.FrameSummary(torch.__file__, 1, "f", line="")]
    assert _where(frames) == ("/home/u/train.py:12 (self.acc(logits, y)), in "
                              "/venv/lib/python3.11/site-packages/torchmetrics/data.py:206 (return torch.bincount(x))")


class _LBFGS(_CountsWeights):
    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_an_optimizer_whose_memory_follows_the_loss_values_is_refused():
    with pytest.raises(DryRunUnsupportedError, match=r"torch\.optim\.LBFGS.*test_data_dependent\.py:\d+ "
                                                     r"\(configure_optimizers\).*history"):
        dry_run(_LBFGS(), batch=torch.ones(2, 4))

"""``ActivationCheckpointing(policy="selective")`` and in-place changes of the matmul outputs it keeps.

Recurrent layers (``nn.RNN``/``LSTM``/``GRU`` and their cells) modify their matmul outputs in place inside the CPU
kernel: a block holding one is recomputed whole and trains as plain Lightning (the GRU trained silently on other
gradients before). A user's in-place change of a kept output (``nn.ReLU(inplace=True)`` right after an
``nn.Linear``) is refused in the first forward, before any optimizer step, naming the op and the fix.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_lowmem import ActivationCheckpointing
from tests.conformance.known._common import Classifier, differing, tokens, train

pytestmark = pytest.mark.integration


class _RecurrentBlock(nn.Module):
    """A linear (its output kept by the policy), then a recurrent layer, optionally over a packed batch."""

    def __init__(self, kind: str, bidirectional: bool, packed: bool) -> None:
        super().__init__()
        self.kind, self.packed = kind, packed
        self.proj = nn.Linear(8, 8)
        if kind == "GRUCell":
            self.rnn: nn.Module = nn.GRUCell(8, 8)
        else:
            hidden = 4 if bidirectional else 8
            self.rnn = getattr(nn, kind)(8, hidden, batch_first=True, bidirectional=bidirectional)

    def forward(self, x, lengths):
        h = torch.tanh(self.proj(x))
        if self.kind == "GRUCell":
            state, outs = torch.zeros_like(h[:, 0]), []
            for t in range(h.shape[1]):
                state = self.rnn(h[:, t], state)
                outs.append(state)
            return x + torch.stack(outs, 1)
        if not self.packed:
            return x + self.rnn(h)[0]
        packed = pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=h.shape[1])
        return x + out


class _Stack(nn.Module):
    def __init__(self, kind: str, bidirectional: bool = False, packed: bool = False) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(_RecurrentBlock(kind, bidirectional, packed) for _ in range(2))

    def forward(self, ids):
        lengths = (ids != 0).sum(1).clamp(min=1).cpu()
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, lengths)
        return self.head(x.sum(1))


@pytest.mark.parametrize(
    ("kind", "bidirectional", "packed"),
    [("RNN", False, False), ("LSTM", True, True), ("GRU", False, False), ("GRU", True, True), ("GRUCell", False, False)],
)
def test_selective_recomputes_blocks_with_a_recurrent_layer_whole(kind, bidirectional, packed):
    def build():
        return Classifier(_Stack(kind, bidirectional, packed), tokens())

    checkpointing = ActivationCheckpointing(policy="selective")
    got = train(build, callbacks=[checkpointing])
    assert checkpointing.wrapped == ["net.blocks.0", "net.blocks.1"]
    assert not differing(got, train(build))


class _Mixed(nn.Module):
    """A block without a recurrent layer and one with a GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 3)
        self.dense, self.rnn = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.GRU(8, 8, batch_first=True)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.dense(x)
        return self.head(self.rnn(x)[0][:, -1])


def test_selective_keeps_matmul_outputs_only_in_blocks_without_a_recurrent_layer():
    def build():
        return Classifier(_Mixed(), tokens())

    checkpointing = ActivationCheckpointing(policy="selective", blocks=["net.dense", "net.rnn"])
    got = train(build, callbacks=[checkpointing])
    assert not differing(got, train(build))
    assert checkpointing.wrapped == ["net.dense", "net.rnn"]


class _InPlaceAfterLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(8, 8), nn.ReLU(inplace=True)

    def forward(self, x):
        return x + self.act(self.lin(x))


def test_selective_refuses_an_in_place_change_of_a_kept_output_before_the_first_step():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(20, 8), *(_InPlaceAfterLinear() for _ in range(2)), nn.Flatten(), nn.Linear(48, 3))
    module = Classifier(net, tokens())
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ActivationCheckpointing(policy="selective", blocks=["net.1", "net.2"])])
    with pytest.raises(ValueError, match=r"aten\.relu_\.default.*aten\.addmm\.default.*inplace=False.*policy='all'"):
        trainer.fit(module)
    assert trainer.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())

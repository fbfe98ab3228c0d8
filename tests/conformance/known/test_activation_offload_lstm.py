"""``ActivationOffload`` through a packed, bidirectional 2-layer ``nn.LSTM`` (the sweep's ``lstm_packed``) trains as
plain Lightning does, as through ``nn.RNN``.

Found by the conformance sweep (other gradients than plain Lightning); the cause was the ``nn.GRU`` one: the recurrent
kernels' gates are ``unsafe_chunk`` views with their own version counters, so the offload's (storage, version) copy
served stale gates. Fixed in ``ActivationOffload`` (a save's bytes that no earlier dense save covers are recopied);
kept as a regression test.
"""

from __future__ import annotations

import pytest
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_lowmem import ActivationOffload
from tests.conformance.known._common import Classifier, differing, tokens, train

pytestmark = pytest.mark.integration


class Recurrent(nn.Module):
    """A bidirectional 2-layer recurrent net over a packed batch of variable lengths (the sweep's ``lstm_packed``)."""

    def __init__(self, rnn: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(16, 3)
        self.rnn = rnn(8, 8, num_layers=2, batch_first=True, bidirectional=True)

    def forward(self, ids):
        lengths = (ids != 0).sum(1).clamp(min=1)
        packed = pack_padded_sequence(self.embed(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        return self.head(out.sum(1))


@pytest.mark.parametrize("rnn", [nn.RNN, nn.LSTM])
def test_activation_offload_through_a_recurrent_layer_matches_plain(rnn):
    def build():
        return Classifier(Recurrent(rnn), tokens())

    assert not differing(train(build, callbacks=[ActivationOffload(min_bytes=0)]), train(build))

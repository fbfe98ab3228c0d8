"""A submodule that pins its own dtype (Hugging Face's Switch/MoE routers: ``self.dtype = router_dtype``, and in
forward ``self.classifier = self.classifier.to(self.dtype)``) trains under ``lowmem_offload`` *-mixed exactly as
under plain mixed precision: its weights keep fp32 (a compute-dtype copy would be cast up from its rounding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem import OffloadStrategy
from tests.conformance.known._common import Classifier, differing, tokens, train


class Router(nn.Module):
    """As transformers' SwitchTransformersTop1Router: casts its classifier (and its input) to its own dtype."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.dtype = torch.float32
        self.classifier = nn.Linear(hidden, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(self.dtype)
        return torch.softmax(self.classifier(x.to(self.dtype)), dim=-1).to(x.dtype)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.router = Router(16, 4)
        self.up = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.up(h) * self.router(h)[..., :1]
        return self.head(h.mean(1))


@pytest.mark.parametrize("precision", ["bf16-mixed"])  # NOTE: 16-mixed is bf16-mixed on the CPU
def test_a_submodule_that_pins_its_dtype_trains_as_under_plain_mixed_precision(precision):
    data = tokens()
    build = lambda: Classifier(Net(), data, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    want = train(build, precision=precision)
    # NOTE: host_optimizer="as_is": torch's for-loop AdamW on the host, as plain runs it (the fused kernel rounds otherwise)
    got = train(build, precision=precision, strategy=OffloadStrategy(host_optimizer="as_is"))
    assert differing(got, want) == []

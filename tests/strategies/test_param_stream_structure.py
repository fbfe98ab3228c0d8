"""``lowmem_offload_params`` on block structures beyond a flat list of called blocks: nested block lists (Funnel,
PoolFormer), a block called twice or out of order, a block's sub-layer called directly, a block's weight used
outside it. Each trains bit-identically to ``lowmem_offload`` or is refused before the first step, naming the weight.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem.strategies.offload import OffloadStrategy
from lightning_lowmem.strategies.offload.param_stream import block_params


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(h)))


class Net(L.LightningModule):
    """``nested``: a list of lists the model walks itself; ``twice``: blocks called out of order, one twice;
    ``sublayer``: the model calls a block's sub-layers, not the block; ``outside``: a block's weight used after it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Linear(4, 8)
        if how == "nested":
            self.layers = nn.ModuleList([nn.ModuleList([Layer(), Layer()]) for _ in range(2)])
        else:
            self.layers = nn.ModuleList([Layer() for _ in range(3)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.how == "nested":
            for group in self.layers:
                for layer in group:
                    h = layer(h)
        elif self.how == "twice":
            for i in (2, 0, 1, 0):
                h = self.layers[i](h)
        elif self.how == "sublayer":
            for layer in self.layers:
                h = h + layer.fc2(torch.tanh(layer.fc1(h)))
        else:
            for layer in self.layers:
                h = layer(h)
            h = F.linear(h, self.layers[0].fc1.weight)
        return self.head(h)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(module: L.LightningModule, offload_params: bool) -> None:
    trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(offload_params=offload_params), max_steps=3,
                        precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    generator = torch.Generator().manual_seed(0)
    trainer.fit(module, DataLoader([torch.randn(2, 4, generator=generator) for _ in range(3)], batch_size=None))


@pytest.mark.parametrize("how", ["nested", "twice"])
def test_called_blocks_stream_bit_identically(how):
    torch.manual_seed(0)
    reference = Net(how)
    streamed = copy.deepcopy(reference)
    blocks, per_block, _ = block_params(streamed)
    assert all(isinstance(block, Layer) for _, block in blocks) and all(per_block)  # the called modules stream
    _fit(reference, offload_params=False)
    _fit(streamed, offload_params=True)
    for (name, a), b in zip(reference.named_parameters(), streamed.parameters()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(Net(how).parameters(), reference.parameters()))


@pytest.mark.parametrize(("how", "weight"), [("sublayer", r"layers.0.fc1.(weight|bias)"), ("outside", "layers.0.fc1.weight")])
def test_a_released_weight_read_is_refused_before_the_first_step(how, weight):
    torch.manual_seed(0)
    module = Net(how)
    with pytest.raises(ValueError, match=rf"lowmem_offload_params cannot stream this model: .*`{weight}`.*"
                                         r"offload_params=False"):
        _fit(module, offload_params=True)

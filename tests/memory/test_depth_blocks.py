"""The dry run's depth cut takes only interchangeable blocks, and it predicts a step that skips no layer (LayerDrop)."""

from __future__ import annotations

import types

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem import dry_run
from lightning_lowmem.predict.depth import find_blocks


class _Stage(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


def _lists(*widths, strides=None):
    strides = strides or [1] * (len(widths) - 1)
    return nn.ModuleList(_Stage(a, b, s) for a, b, s in zip(widths, widths[1:], strides))


def test_same_class_blocks_of_other_shapes_are_not_cut():
    """MobileNetV2's inverted-residual layers: one class, channels changing by stage (a cut fed 8 where 80 expected)."""
    root = nn.Module()
    root.stages = _lists(3, 8, 8, 16, 16, 16, 32, 32, 80)
    assert find_blocks(root) is None


def test_a_stride_alone_makes_blocks_not_interchangeable():
    root = nn.Module()
    root.stages = _lists(*[8] * 9, strides=[1, 1, 1, 1, 2, 1, 1, 1])
    assert find_blocks(root) is None


def test_blocks_before_the_third_may_differ():
    """Always kept by the cut (T5's first block alone holds the relative position bias); a shorter uniform list loses."""
    root = nn.Module()
    root.stages = _lists(3, 16, *[16] * 8)
    root.other = _lists(*[4] * 3)
    parent, name, blocks = find_blocks(root)
    assert (parent, name, len(blocks)) == (root, "stages", 9)


class _LayerDropNet(L.LightningModule):
    """Two layers each skipped when ``torch.rand([]) < config.layerdrop`` (as Hugging Face's wav2vec2 does)."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(layerdrop=layerdrop)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        for layer in self.layers:
            if self.training and bool(torch.rand([]) < self.config.layerdrop):
                continue
            x = torch.tanh(layer(x))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 64)), batch_size=32)


def test_dry_run_predicts_the_step_that_skips_no_layer():
    # NOTE: layerdrop=0.99 skips (nearly) every layer on real draws: the old dry run predicted such a step
    predicted = dry_run(_LayerDropNet(0.99), precision="32-true")
    none_skipped = dry_run(_LayerDropNet(0.0), precision="32-true")
    assert predicted.peak_device == none_skipped.peak_device
    assert any(n.startswith("LayerDrop turned off (layerdrop=0.99)") for n in predicted.notes), predicted.notes
    # an upper bound, stated as the data-dependent ops' are: real steps that skip a layer hold less
    assert predicted.bounds == [{"op": "LayerDrop", "where": "layerdrop=0.99", "calls": 1,
                                 "assumption": "no layer skipped (the largest step)"}]
    assert none_skipped.bounds == []


def test_keep_every_layer_changes_only_the_copy_it_is_given():
    from lightning_lowmem.predict.depth import keep_every_layer

    module = _LayerDropNet(0.5)
    dry_run(module, precision="32-true")
    assert module.config.layerdrop == 0.5
    assert keep_every_layer(module) == ["layerdrop=0.5"] and module.config.layerdrop == 0.0


def test_streaming_chosen_from_a_budget_is_not_extrapolated():
    """``offload_params="auto"`` keeps resident the blocks a device budget holds: every block fits a shallow trace, so a
    line through 3, 4 and 5 blocks would keep all of a deep model's blocks resident."""
    from lightning_lowmem.predict.depth import depth_unit
    from lightning_lowmem.predict.run_spec import RunSpec
    from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

    assert depth_unit(RunSpec(strategy=OffloadStrategy(offload_params="auto", device_budget="8GB"))) is None
    assert depth_unit(RunSpec(strategy=OffloadStrategy(offload_params=True))) == 1
    assert depth_unit(RunSpec(strategy="lowmem_offload_params")) == 1

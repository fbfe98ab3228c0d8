"""Code that writes the weights outside the hooks that show the masters, under ``lowmem_offload``.

Plain Lightning's parameters are the weights the optimizer steps: a callback's ``on_train_batch_end`` clamping them, an
``on_train_epoch_start`` re-initialising a layer, a ``training_step`` shrinking a weight before its forward all change
what is trained. Under ``lowmem_offload`` such code writes the compute weights; the strategy copies each written one into
its fp32 master before the next read of the masters (the step, a view, a checkpoint, the module given back), so the
write is not overwritten by the next step. Compared through ``Trainer.fit`` with plain Lightning (``torch.equal`` on
every weight and buffer) at ``32-true``; at ``bf16-true`` the write reaches the masters rounded, with a warning.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem.strategies.offload import OffloadStrategy

pytestmark = pytest.mark.integration
CLAMP = 0.05


class Net(L.LightningModule):
    def __init__(self, shrink: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 2)
        self.shrink = shrink

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        if self.shrink:
            with torch.no_grad():
                self.body[0].weight.mul_(0.9)  # a write before the forward, inside training_step
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(24, 6, generator=g), torch.randint(0, 2, (24,), generator=g)),
                          batch_size=6)


class Writes(Callback):
    """Clamps the head after each batch, re-initialises it at epoch 1, replaces a bias's tensor after batch 2."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            pl_module.head.weight.clamp_(-CLAMP, CLAMP)
        if batch_idx == 2:
            bias = pl_module.body[0].bias
            bias.data = torch.full(bias.shape, 0.25, dtype=bias.dtype, device=bias.device)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            nn.init.constant_(pl_module.head.weight, 0.01)
            nn.init.zeros_(pl_module.head.bias)


class ClampAtEnd(Callback):
    def on_train_end(self, trainer, pl_module):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.clamp_(-CLAMP, CLAMP)


def _fit(strategy, precision="32-true", callbacks=None, **kwargs):
    L.seed_everything(0, verbose=False)
    module = Net(**kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_epochs=2,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[Writes()] if callbacks is None else list(callbacks))
    trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "optimizer_in_backward"])
def test_writes_outside_the_hooks_train_as_in_plain_lightning(transfer_mode, in_backward):
    want = _fit("auto")
    got = _fit(OffloadStrategy(host_optimizer="as_is", optimizer_in_backward=in_backward))
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert torch.equal(got["head.bias"], want["head.bias"]) and got["head.weight"].abs().max() <= CLAMP


def test_a_checkpoint_holds_a_write_made_after_the_last_step(tmp_path):
    """``ModelCheckpoint`` saves after the batch's ``on_train_batch_end`` wrote the weights: the checkpoint has them."""
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=OffloadStrategy(host_optimizer="as_is"), max_steps=2,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[Writes()])
    trainer.fit(Net(shrink=False))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]["head.weight"]
    assert saved.abs().max() <= CLAMP


def test_bf16_true_writes_reach_the_masters_rounded_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _fit(OffloadStrategy(host_optimizer="as_is"), "bf16-true", callbacks=[ClampAtEnd()], shrink=False)
    bound = torch.tensor(CLAMP, dtype=torch.bfloat16).float()  # the clamp ran on bf16 compute weights
    weights = [k for k in got if "running_" not in k and "num_batches" not in k]
    assert all(got[k].abs().max() <= bound for k in weights)
    assert sum("outside the hooks that show the fp32 masters" in str(w.message) for w in caught) == 1
    unwritten = _fit(OffloadStrategy(host_optimizer="as_is"), "bf16-true", callbacks=[], shrink=False)
    assert any(v.abs().max() > CLAMP for k, v in unwritten.items() if k.endswith("weight"))  # the clamp did act

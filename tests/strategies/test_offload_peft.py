"""PEFT adapters under ``lowmem_offload`` with ``bf16-mixed``: plain Lightning ``bf16-mixed``, bit for bit.

Under ``*-mixed`` the strategy stores in bf16 the weights autocast casts at every use. PEFT's LoRA layer reads
``lora_A.weight.dtype`` to cast its input before the adapter's dropout, and DoRA reads the base layer's weight: the
adapter layers' weights keep fp32 (as under plain mixed precision), the base layer of a plain LoRA layer, which the
layer only calls, keeps its bf16 copy. Before, with ``lora_dropout=0.05`` the LoRA weights drifted from plain
``bf16-mixed`` (``torch.equal`` failed after 4 steps; DoRA too).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.helpers.models import random_batch, tiny_gpt2
from tests.helpers.runif import RunIf

pytestmark = [pytest.mark.integration, RunIf(peft=True)]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _lora(model: nn.Module, targets: list[str], dora: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=targets, use_dora=dora)
    return get_peft_model(model, config)


class LitLoRA(L.LightningModule):
    """A LoRA fine-tune as PEFT's examples write it: adapters trained, base frozen, dropout on the adapters."""

    def __init__(self, arch: str, dora: bool) -> None:
        super().__init__()
        self.arch = arch
        if arch == "mlp":
            self.model = _lora(MLP(), ["inp", "blocks.0", "blocks.1"], dora)
        else:
            self.model = _lora(tiny_gpt2(n_layer=2), ["c_attn", "c_fc"], dora)

    def training_step(self, batch, batch_idx):
        if self.arch == "mlp":
            x, y = batch
            return nn.functional.mse_loss(self.model(x).float(), y)
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self):
        if self.arch == "mlp":
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x, torch.sin(x[:, :1]) * 3), batch_size=8)
        return DataLoader([{k: v[0] for k, v in random_batch(1, 16, seed=i).items()} for i in range(8)], batch_size=2)


def _fit(strategy, arch: str, dora: bool) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    module = LitLoRA(arch, dora)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=4, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    L.seed_everything(1, verbose=False)  # the dropout masks
    trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(("arch", "dora"), [("mlp", False), ("mlp", True), ("gpt2", False)])
def test_lora_with_dropout_equals_plain_bf16_mixed(arch, dora):
    want = _fit("auto", arch, dora)
    got = _fit(OffloadStrategy(host_optimizer="as_is"), arch, dora)
    assert got.keys() == want.keys()
    trained = [k for k in want if "lora_" in k]
    assert trained
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} differs by {(got[key] - value).abs().max()}"

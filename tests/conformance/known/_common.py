"""What the reproductions share: train a fresh, seeded module for a few steps and give back every parameter and buffer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_lowmem  # noqa: F401  (registers the strategy names)


def images(n: int = 16, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, classes, (n,), generator=g))


def tokens(n: int = 16, vocab: int = 20, seq: int = 6, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, 3, (n,), generator=g))


class Classifier(L.LightningModule):
    """``net`` on the batch's first tensor, cross-entropy against its second, the optimizer ``optimizer(params)``."""

    def __init__(self, net: torch.nn.Module, data: TensorDataset, optimizer: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.net, self.data = net, data
        self.batch_size, self.lr = 4, 1e-2
        self._optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=self.lr, momentum=0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return self._optimizer([p for p in self.parameters() if p.requires_grad])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


def train(build: Callable[[], L.LightningModule], steps: int = 3, **trainer_kwargs: Any) -> dict[str, torch.Tensor]:
    """``build()`` after ``torch.manual_seed(0)``, fit for ``steps`` batches (one epoch unless ``trainer_kwargs`` say
    otherwise); every parameter and buffer, as fp32 copies."""
    torch.manual_seed(0)
    module = build()
    settings = {"max_epochs": 1, "limit_train_batches": steps, "accelerator": "cpu", "devices": 1, "logger": False,
                "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                "num_sanity_val_steps": 0, **trainer_kwargs}
    L.seed_everything(1, verbose=False)
    L.Trainer(**settings).fit(module)
    state = {f"param:{n}": p.detach().float().clone() for n, p in module.named_parameters()}
    state.update({f"buffer:{n}": b.detach().clone() for n, b in module.named_buffers()})
    return state


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The names of the tensors that are not ``torch.equal``."""
    assert got.keys() == want.keys()
    return [k for k in want if not torch.equal(got[k], want[k])]

"""Small LightningModules of the kinds users bring, for the dry run's fidelity tests and ``bench_estimate_foreign``.

Each is written the plain way (no knowledge of lightning_lowmem): recurrent nets (``nn.LSTM``, whose CPU kernel
keeps a oneDNN workspace; ``nn.GRU``/``nn.RNN``; a packed-sequence LSTM), Lightning's MLP autoencoder with ``mse_loss``
(whose CPU kernel keeps the unreduced loss), a conv + batch-norm net, and an MLP classifier updating torchmetrics
metrics in ``training_step`` (``unique``, ``bincount`` and boolean indexing of predictions). ``make(name, scale)``
returns ``(module, batch)``; ``scale`` multiplies the sizes (1: a test, 4: a benchmark).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


class Recurrent(L.LightningModule):
    """A 2-layer ``nn.LSTM``/``GRU``/``RNN`` over ``(batch, seq, features)`` and a linear head on the last step."""

    def __init__(self, kind: str = "LSTM", features: int = 16, hidden: int = 32, classes: int = 4,
                 packed: bool = False) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)
        self.packed = packed

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, lengths = batch
        if self.packed:
            seq = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(seq)[0], batch_first=True)
        else:
            out, _ = self.rnn(x)
        return F.cross_entropy(self.head(out[:, -1]), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class AutoEncoder(L.LightningModule):
    """Lightning's autoencoder example (an MLP encoder/decoder on 28x28 images), ``F.mse_loss``, SGD."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 28 * 28))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        x = x.view(x.size(0), -1)
        return F.mse_loss(self.decoder(self.encoder(x)), x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Images(L.LightningDataModule):
    """28x28 random images with labels, for ``AutoEncoder`` (a module without ``train_dataloader``)."""

    def __init__(self, batch_size: int = 8, num_images: int = 64) -> None:
        super().__init__()
        self.batch_size, self.num_images = batch_size, num_images

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        images = torch.rand(self.num_images, 1, 28, 28, generator=_gen())
        dataset = torch.utils.data.TensorDataset(images, torch.zeros(self.num_images, dtype=torch.long))
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size)


class ConvBN(L.LightningModule):
    """Two conv + ``BatchNorm2d`` + ReLU + max-pool blocks, global average pooling, a linear head, SGD momentum."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class WithMetrics(L.LightningModule):
    """An MLP classifier whose ``training_step`` updates and logs torchmetrics metrics, as Lightning's docs show."""

    def __init__(self, features: int = 64, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        import torchmetrics

        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=classes)  # unique() of the predictions
        self.f1 = torchmetrics.classification.MulticlassF1Score(num_classes=classes, ignore_index=0)  # x[mask], bincount

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        self.accuracy(logits.argmax(-1), y)
        self.f1(logits, y)
        self.log("train_acc", self.accuracy, on_step=True)
        self.log("train_f1", self.f1, on_step=True)
        return F.cross_entropy(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _sequences(scale: int, features: int = 16) -> tuple[torch.Tensor, ...]:
    g = _gen()
    n, t = 8 * scale, 12 * scale
    return (torch.randn(n, t, features, generator=g), torch.randint(0, 4, (n,), generator=g),
            torch.randint(1, t + 1, (n,), generator=g))


def _recurrent(kind: str, packed: bool = False) -> Callable[[int], tuple[L.LightningModule, Any]]:
    return lambda scale: (Recurrent(kind, hidden=32 * scale, packed=packed), _sequences(scale))


def _autoencoder(scale: int) -> tuple[L.LightningModule, Any]:
    g = _gen()
    return AutoEncoder(hidden=64 * scale), (torch.rand(64 * scale, 1, 28, 28, generator=g),
                                            torch.randint(0, 10, (64 * scale,), generator=g))


def _conv_bn(scale: int) -> tuple[L.LightningModule, Any]:
    g = _gen()
    return ConvBN(width=16 * scale), (torch.randn(8 * scale, 3, 16, 16, generator=g),
                                      torch.randint(0, 4, (8 * scale,), generator=g))


def _metrics(scale: int) -> tuple[L.LightningModule, Any]:
    g = _gen()
    return WithMetrics(hidden=256 * scale), (torch.randn(32 * scale, 64, generator=g),
                                             torch.randint(0, 10, (32 * scale,), generator=g))


MODULES: dict[str, Callable[[int], tuple[L.LightningModule, Any]]] = {
    "lstm": _recurrent("LSTM"),
    "gru": _recurrent("GRU"),
    "rnn": _recurrent("RNN"),
    "lstm_packed": _recurrent("LSTM", packed=True),
    "autoencoder_mse": _autoencoder,
    "conv_bn": _conv_bn,
    "torchmetrics": _metrics,
}


def make(name: str, scale: int = 1) -> tuple[L.LightningModule, Any]:
    """``(module, batch)`` of ``name`` (a key of :data:`MODULES`), weights seeded."""
    torch.manual_seed(0)
    return MODULES[name](scale)

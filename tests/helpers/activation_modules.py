"""LightningModules of the kinds users bring to the activation techniques, and the fit-and-compare harness.

Written as a user would write them, with nothing adapted to lightning_lowmem: recurrent networks behind a 1x1
convolution (``nn.RNN``/``nn.LSTM``/``nn.GRU``, packed sequences), convolution + batch norm nets (running statistics
are buffers updated in forward), and a module with a buffer of its own that its forward updates. Each owns a fixed
dataset drawn from its own ``torch.Generator``; weights come from the global RNG, seeded by :func:`fit_state`.

:func:`fit_state` runs a real ``Trainer.fit`` on the CPU and returns the whole ``state_dict`` (weights *and*
buffers); :func:`assert_same_state` compares two of them with ``torch.equal``, key by key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _Fixed(L.LightningModule):
    """A fixed generated dataset, batches of 8 in order, Adam."""

    def _tensors(self) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*self._tensors()), batch_size=8, shuffle=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class LitRecurrent(_Fixed):
    """A 1x1 ``Conv1d`` feeding ``nn.RNN``/``nn.LSTM``/``nn.GRU``, then a linear head on the time-mean.

    ``packed``: sequences of different lengths through ``pack_padded_sequence`` (unsorted, ``enforce_sorted=False``)
    and back through ``pad_packed_sequence``. The convolution's gradients come through the recurrent backward.
    """

    def __init__(
        self, kind: str = "GRU", batch_first: bool = True, bidirectional: bool = False, num_layers: int = 1,
        packed: bool = False, dropout: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.conv = nn.Conv1d(4, 8, kernel_size=1)
        rnn_class = {"RNN": nn.RNN, "LSTM": nn.LSTM, "GRU": nn.GRU}[kind]
        self.rnn = rnn_class(8, 12, num_layers=num_layers, batch_first=batch_first, bidirectional=bidirectional,
                             dropout=dropout)  # fmt: skip
        self.head = nn.Linear(12 * (2 if bidirectional else 1), 3)

    def _tensors(self) -> tuple[Tensor, ...]:
        g = _gen(11)
        x = torch.randn(32, 4, 10, generator=g)
        lengths = torch.randint(3, 11, (32,), generator=g)
        return x, lengths, torch.randint(0, 3, (32,), generator=g)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, lengths, y = batch
        hp = self.hparams
        h = self.conv(x)  # (N, C, T)
        h = h.permute(0, 2, 1) if hp.batch_first else h.permute(2, 0, 1)  # (N, T, C) or (T, N, C)
        if hp.packed:
            packed = pack_padded_sequence(h, lengths, batch_first=hp.batch_first, enforce_sorted=False)
            out, _ = self.rnn(packed)
            out, _ = pad_packed_sequence(out, batch_first=hp.batch_first, total_length=x.size(-1))
        else:
            out, _ = self.rnn(h)
        pooled = out.mean(dim=1 if hp.batch_first else 0)
        return F.cross_entropy(self.head(pooled), y)


class _ConvBNBlock(nn.Module):
    def __init__(self, channels: int, dims: int) -> None:
        super().__init__()
        conv, bn = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
        self.conv = conv(channels, channels, 3, padding=1, bias=False)
        self.bn = bn(channels)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x))) + x


class LitConvBN(_Fixed):
    """A stem ``Conv``+``BatchNorm`` then ``blocks`` residual ``Conv``+``BatchNorm`` blocks in an ``nn.ModuleList``.

    ``dims``: 1 (``Conv1d``/``BatchNorm1d`` on sequences) or 2 (``Conv2d``/``BatchNorm2d`` on images). ``blocks=0``:
    no repeated blocks (``nn.Sequential`` of distinct layers), so the checkpointing policy measures what to wrap.
    ``momentum=None``: the cumulative running average, which reads ``num_batches_tracked``.
    """

    def __init__(self, dims: int = 2, blocks: int = 3, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        conv, bn = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
        self.stem = nn.Sequential(conv(3, 8, 3, padding=1), bn(8, momentum=momentum), nn.ReLU())
        self.blocks = nn.ModuleList(_ConvBNBlock(8, dims) for _ in range(blocks))
        for block in self.blocks:
            block.bn.momentum = momentum
        self.head = nn.Sequential(conv(8, 8, 3, padding=1), bn(8, momentum=momentum), nn.ReLU(), nn.Flatten(),
                                  nn.Linear(8 * (12 if dims == 1 else 36), 4))  # fmt: skip

    def _tensors(self) -> tuple[Tensor, ...]:
        g = _gen(12)
        shape = (32, 3, 12) if self.hparams.dims == 1 else (32, 3, 6, 6)
        return torch.randn(*shape, generator=g) * 2 + 1, torch.randint(0, 4, (32,), generator=g)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h), y)


class _Calibrated(nn.Module):
    """A layer with buffers of its own that its forward updates and reads: a running input scale and a call count."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.8).add_(0.2 * x.detach().abs().mean(0))
                self.calls += 1
        return torch.tanh(self.linear(x / self.scale)) * (1 + self.calls.float() / 10)


class LitCalibrated(_Fixed):
    """An MLP of ``_Calibrated`` layers (in an ``nn.ModuleList``, or, ``repeated=False``, a ``Sequential`` of distinct
    modules), whose forward reads the buffers it updated: a recompute that saw the updated values would differ."""

    def __init__(self, repeated: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        if repeated:
            self.layers = nn.ModuleList(_Calibrated(16) for _ in range(3))
        else:
            self.layers = nn.Sequential(_Calibrated(16), nn.Linear(16, 16), nn.Sequential(_Calibrated(16), nn.ReLU()))
        self.out = nn.Linear(16, 1)

    def _tensors(self) -> tuple[Tensor, ...]:
        g = _gen(13)
        x = torch.randn(32, 16, generator=g) * 3
        return x, x.sin().sum(-1, keepdim=True)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.out(x), y)


def fit_state(
    factory: Callable[[], L.LightningModule],
    callbacks: Sequence[L.Callback] = (),
    *,
    steps: int = 3,
    seed: int = 0,
    **trainer_kwargs: Any,
) -> tuple[dict[str, Tensor], L.Trainer]:
    """Build (global RNG seeded with ``seed``) and ``fit`` for ``steps`` on the CPU; the ``state_dict`` and trainer."""
    L.seed_everything(seed, verbose=False)
    module = factory()
    trainer_kwargs.setdefault("accelerator", "cpu")
    trainer_kwargs.setdefault("devices", 1)
    trainer = L.Trainer(
        max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), **trainer_kwargs,
    )  # fmt: skip
    L.seed_everything(1, verbose=False)  # dropout masks
    trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, trainer


def assert_same_state(got: dict[str, Tensor], want: dict[str, Tensor], **tolerance: Any) -> None:
    """Every weight and buffer ``torch.equal`` (or within ``tolerance``: ``assert_close`` arguments), key by key."""
    assert got.keys() == want.keys()
    differ = []
    for key, value in want.items():
        if tolerance:
            if not torch.allclose(got[key].double(), value.double(), **tolerance):
                differ.append(f"{key} (max abs diff {(got[key].double() - value.double()).abs().max().item():.3g})")
        elif not torch.equal(got[key], value):
            diff = (got[key].double() - value.double()).abs().max().item() if value.numel() else 0.0
            differ.append(f"{key} (max abs diff {diff:.3g})")
    assert not differ, "differ from plain Lightning: " + ", ".join(differ)

"""The hand-written half of the conformance corpus: modules unlike the transformers the suite was built on.

Convolutions with BatchNorm and GroupNorm, recurrent nets (RNN, packed bidirectional LSTM, GRU), a plain MLP, a frozen
backbone under a trained head, a module built in ``configure_model``, a ``torch.compile``-d submodule, and forwards
that return a dict, a tuple or a dataclass (with a dataclass batch). Each owns its generated data (a generator seeded
by the module's name, never the global RNG) and exposes ``batch_size``, ``lr`` and a validation loop, as
:class:`~tests.conformance.corpus_hf.HFModule` does.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader

SAMPLES, BATCH, CLASSES = 32, 4, 3


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


class Base(L.LightningModule):
    """Loaders over ``self._data`` (a list of samples), ``batch_size``/``lr`` attributes, ``val_loss``, the optimizer
    named by ``OPTIMIZER``. Subclasses define ``_make_data`` and ``_loss``."""

    OPTIMIZER = "adamw"
    LR = {"adamw": 2e-3, "adam": 2e-3, "sgd": 0.05, "rmsprop": 1e-3}  # noqa: RUF012  (read only)

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = BATCH
        self.lr: float | None = None
        self._data = self._make_data(_gen(type(self).__name__))

    def _make_data(self, g: torch.Generator) -> list[Any]:
        x = torch.randn(SAMPLES, 3, 16, 16, generator=g)
        y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
        return list(zip(x, y))

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def configure_optimizers(self) -> Any:
        lr = self.lr if self.lr is not None else self.LR[self.OPTIMIZER]
        params = self._trainable()
        if self.OPTIMIZER == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
        if self.OPTIMIZER == "rmsprop":
            return torch.optim.RMSprop(params, lr=lr)
        return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[self.OPTIMIZER](params, lr=lr)

    def _collate(self) -> Any:
        return None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._data, batch_size=self.batch_size, shuffle=False, collate_fn=self._collate())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._data[:8], batch_size=BATCH, shuffle=False, collate_fn=self._collate())


def _conv_block(c_in: int, c_out: int, norm: str) -> nn.Sequential:
    layer = nn.BatchNorm2d(c_out) if norm == "bn" else nn.GroupNorm(2, c_out)
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=norm != "bn"), layer, nn.ReLU())


class ConvBatchNorm(Base):
    """Conv + BatchNorm (running statistics: buffers that training changes), SGD with momentum and weight decay."""

    OPTIMIZER = "sgd"

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(_conv_block(3, 8, "bn"), nn.MaxPool2d(2), _conv_block(8, 16, "bn"),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


class ConvGroupNorm(Base):
    """Conv + GroupNorm + channel dropout, Adam."""

    OPTIMIZER = "adam"

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(_conv_block(3, 8, "gn"), nn.Dropout2d(0.1), _conv_block(8, 8, "gn"),
                                      nn.AvgPool2d(4))
        self.classifier = nn.Linear(8 * 4 * 4, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


class MLP(Base):
    """A plain MLP (Linear, LayerNorm, GELU, dropout), MSE regression, AdamW."""

    def _make_data(self, g: torch.Generator) -> list[Any]:
        x = torch.randn(SAMPLES, 24, generator=g)
        return list(zip(x, x[:, :4].sum(-1, keepdim=True).tanh()))

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(24, 48), nn.LayerNorm(48), nn.GELU(), nn.Dropout(0.1), nn.Linear(48, 48),
                                 nn.GELU(), nn.Linear(48, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


class _Tokens(Base):
    VOCAB, SEQ = 40, 10

    def _make_data(self, g: torch.Generator) -> list[Any]:
        ids = torch.randint(1, self.VOCAB, (SAMPLES, self.SEQ), generator=g)
        lengths = torch.randint(self.SEQ // 2, self.SEQ + 1, (SAMPLES,), generator=g)
        lengths[0] = self.SEQ
        for i, n in enumerate(lengths.tolist()):
            ids[i, n:] = 0
        return list(zip(ids, lengths, torch.randint(0, CLASSES, (SAMPLES,), generator=g)))

    def _loss(self, batch: Any) -> Tensor:
        ids, lengths, y = batch
        return F.cross_entropy(self(ids, lengths), y)


class ElmanRNN(_Tokens):
    """``nn.RNN`` (tanh, 2 layers) over embeddings, classification from the last step, Adam."""

    OPTIMIZER = "adam"

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 16)
        self.rnn = nn.RNN(16, 24, num_layers=2, batch_first=True, dropout=0.1)
        self.out = nn.Linear(24, CLASSES)

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        h, _ = self.rnn(self.embed(ids))
        return self.out(h[torch.arange(ids.shape[0]), lengths - 1])


class PackedLSTM(_Tokens):
    """Bidirectional 2-layer ``nn.LSTM`` over a ``PackedSequence`` (variable lengths), AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 16, padding_idx=0)
        self.lstm = nn.LSTM(16, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.out = nn.Linear(32, CLASSES)

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(self.embed(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True)
        return self.out(h.sum(1) / lengths[:, None].to(h.dtype))


class GRULanguageModel(_Tokens):
    """A GRU language model (next-token loss over every position, padding ignored), SGD with momentum."""

    OPTIMIZER = "sgd"

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 16)
        self.gru = nn.GRU(16, 32, batch_first=True)
        self.head = nn.Linear(32, self.VOCAB)

    def forward(self, ids: Tensor, lengths: Tensor | None = None) -> Tensor:
        return self.head(self.gru(self.embed(ids))[0])

    def _loss(self, batch: Any) -> Tensor:
        ids, _, _ = batch
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.VOCAB), ids[:, 1:].reshape(-1), ignore_index=0)


class FrozenBackbone(ConvBatchNorm):
    """A frozen backbone (``requires_grad=False``, its BatchNorm in eval mode as transfer-learning code does) under a
    trained head; the optimizer holds the head only. Also the host of ``BackboneFinetuning``."""

    OPTIMIZER = "adamw"

    def __init__(self) -> None:
        super().__init__()
        self.backbone.requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if not any(p.requires_grad for p in self.backbone.parameters()):
            self.backbone.eval()


class BuiltInConfigureModel(Base):
    """Layers created in ``configure_model`` (Lightning's hook for deferred, sharded or meta-device init)."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is not None:  # NOTE: Lightning calls it at every fit/validate/test; build once
            return
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(8 * 7 * 7, CLASSES))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class CompiledSubmodule(Base):
    """A ``torch.compile``-d submodule (the trunk) beside eager ones."""

    BACKEND = "inductor"

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2)
        trunk = nn.Sequential(nn.Flatten(), nn.Linear(8 * 7 * 7, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.trunk = torch.compile(trunk, backend=self.BACKEND)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.trunk(self.stem(x)))


class DictOutputs(MLP):
    """``forward`` returns a dict; ``training_step`` returns a dict with extra (detached) entries."""

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        h = self.net[:4](x)
        return {"prediction": self.net[4:](h), "hidden": h}

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out["prediction"], y)
        return {"loss": loss, "hidden_norm": out["hidden"].detach().norm(), "prediction": out["prediction"].detach()}

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x)["prediction"], y)


class TupleOutputs(ConvGroupNorm):
    """``forward`` returns a tuple (logits, features); the loss adds a penalty on the features."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        features = self.features(x).flatten(1)
        return self.classifier(features), features

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        logits, features = self(x)
        return F.cross_entropy(logits, y) + 1e-3 * features.pow(2).mean()


@dataclasses.dataclass
class Batch:
    """A dataclass batch (Lightning moves its tensor fields to the device)."""

    x: Tensor
    y: Tensor


@dataclasses.dataclass
class Output:
    logits: Tensor
    aux_loss: Tensor


def _dataclass_collate(samples: list[Any]) -> Batch:
    return Batch(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))


class DataclassOutputs(ConvBatchNorm):
    """A dataclass batch in, a dataclass ``Output`` out (with an auxiliary loss term)."""

    OPTIMIZER = "adam"

    def _collate(self) -> Any:
        return _dataclass_collate

    def forward(self, x: Tensor) -> Output:  # type: ignore[override]
        features = self.backbone(x)
        return Output(self.head(features), features.abs().mean())

    def _loss(self, batch: Any) -> Tensor:
        out = self(batch.x)
        return F.cross_entropy(out.logits, batch.y) + 0.01 * out.aux_loss

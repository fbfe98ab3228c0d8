"""Six LightningModules written the way Lightning's own examples write them, by people who never heard of
lightning_lowmem: the "foreign" modules every technique must accept unmodified.

Each one owns a small generated dataset (fixed by its own ``torch.Generator``, so the data never depends on
the global RNG) and its loaders; weights come from the global RNG, so build them with :func:`make` (which
seeds first) when two copies must start equal. A few optimizer steps take about a second on one CPU core.

What is unusual about each, i.e. what it tests in our code:

- ``autoencoder``: tuple batch ``(x, y)`` whose ``y`` is unused, no repeated blocks (plain MLP), Adam.
- ``classifier``: conv net, ``self.log`` of an accuracy, validation/test/predict steps, SGD with momentum.
- ``gan``: manual optimization, two optimizers, ``toggle_optimizer``, plain image-tensor batch, noise drawn
  from the global RNG inside ``training_step``.
- ``transformer_lm``: ``nn.Transformer`` with an *fp32 buffer* (sinusoidal positions, built on first use as
  Lightning's demo builds them, so no ``module.to(dtype)`` casts it) added to the embeddings before the
  ``LayerNorm``s of ``nn.Transformer``, a float causal mask built in ``forward`` with the
  default dtype, dropout, and ``loss.item()`` inside ``training_step``; plain LongTensor batch.
- ``hf_bert``: Hugging Face ``BertForSequenceClassification`` from a tiny config, dict batch with padding,
  decay/no-decay param groups, a linear-warmup scheduler sized by ``trainer.estimated_stepping_batches``
  returned as ``{"optimizer", "lr_scheduler": {"scheduler", "interval": "step"}}``, validation outputs
  gathered in ``on_validation_epoch_end``.
- ``plain_tensor``: plain tensor batch and ``training_step(self, batch)`` *without* ``batch_idx``
  (Lightning only passes what the signature asks for).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _Loaders:
    """Train and predict loaders over one fixed dataset each (Lightning's examples write them out; same effect)."""

    batch_size = 8

    def _dataset(self, split: str) -> Dataset:
        raise NotImplementedError

    def _loader(self, split: str) -> DataLoader:
        return DataLoader(self._dataset(split), batch_size=self.batch_size, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")


class _EvalLoaders(_Loaders):
    """Adds the validation and test loaders, for the modules that have those steps."""

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


_SPLIT_SEED = {"train": 1, "val": 2, "test": 3, "predict": 4}


def _images(split: str, n: int = 32) -> tuple[Tensor, Tensor]:
    g = _gen(_SPLIT_SEED[split])
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


class LitAutoEncoder(_EvalLoaders, L.LightningModule):
    """Lightning's autoencoder example: MLP encoder/decoder on 28x28 images, MSE; ``y`` of the batch unused.

    Unusual: nothing repeated to checkpoint (two ``nn.Sequential`` of distinct layers).
    """

    def __init__(self, hidden_dim: int = 64, latent_dim: int = 3, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, latent_dim))
        self.decoder = nn.Sequential(nn.Linear(latent_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28))

    def _dataset(self, split: str) -> Dataset:
        return TensorDataset(*_images(split))

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(x.view(x.size(0), -1))

    def _shared_step(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, _ = batch
        x = x.view(x.size(0), -1)
        x_hat = self.decoder(self.encoder(x))
        return F.mse_loss(x_hat, x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._shared_step(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._shared_step(batch))

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._shared_step(batch))

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        x, _ = batch
        return self(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class LitClassifier(_EvalLoaders, L.LightningModule):
    """A small conv classifier as in Lightning's image-classifier example: tuple batch, cross-entropy, accuracy
    logged in every stage, SGD with momentum.

    Unusual: an optimizer that is not Adam (momentum buffers only), metrics computed from the logits.
    """

    def __init__(self, channels: int = 4, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(channels * 7 * 7, num_classes)

    def _dataset(self, split: str) -> Dataset:
        return TensorDataset(*_images(split))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))

    def _loss_acc(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), (logits.argmax(dim=-1) == y).float().mean()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, acc = self._loss_acc(batch)
        self.log_dict({"train_loss": loss, "train_acc": acc}, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, acc = self._loss_acc(batch)
        self.log_dict({"val_loss": loss, "val_acc": acc})

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, acc = self._loss_acc(batch)
        self.log_dict({"test_loss": loss, "test_acc": acc})

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class LitGAN(_Loaders, L.LightningModule):
    """Lightning's basic GAN example: generator and discriminator MLPs, two Adam optimizers stepped by hand.

    Unusual: ``automatic_optimization = False``, ``toggle_optimizer``/``manual_backward``, a plain tensor batch
    of images, noise from the global RNG in ``training_step``; no validation.
    """

    def __init__(self, latent_dim: int = 16, hidden: int = 64, lr: float = 2e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        img = 28 * 28
        self.generator = nn.Sequential(
            nn.Linear(latent_dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, img), nn.Tanh()
        )
        self.discriminator = nn.Sequential(nn.Linear(img, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1))

    def _dataset(self, split: str) -> Dataset:
        return _images(split)[0] * 2 - 1  # a tensor is a Dataset of its rows: the batch is a plain tensor

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z).view(z.size(0), 1, 28, 28)

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        imgs = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).flatten(1)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(imgs.flatten(1)), valid)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach().flatten(1)), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def predict_step(self, batch: Tensor, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        g = _gen(batch_idx)
        z = torch.randn(batch.shape[0], self.hparams.latent_dim, generator=g).to(batch)
        return self(z)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
        return [opt_g, opt_d]


class PositionalEncoding(nn.Module):
    """Sinusoidal positions in a buffer built on first use, the way Lightning's transformer demo builds them.

    The table is made in the default dtype (fp32 unless a ``*-true`` precision changed it) *after* any
    ``module.to(dtype)``, so under mixed precision an fp32 buffer meets whatever dtype the embeddings have.
    """

    def __init__(self, dim: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.dim = dim
        self.dropout = nn.Dropout(p=dropout)
        self.register_buffer("pe", torch.zeros(1, 0, dim), persistent=False)

    def _table(self, length: int, device: torch.device) -> Tensor:
        position = torch.arange(length, dtype=torch.float, device=device).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, self.dim, 2, dtype=torch.float, device=device) * (-math.log(10000.0) / self.dim))
        pe = torch.zeros(1, length, self.dim, device=device)  # the default dtype, as in Lightning's demo
        pe[0, :, 0::2] = torch.sin(position * div_term)
        pe[0, :, 1::2] = torch.cos(position * div_term)
        return pe

    def forward(self, x: Tensor) -> Tensor:
        if self.pe.size(1) < x.size(1):
            self.pe = self._table(x.size(1), x.device)
        return self.dropout(x + self.pe[:, : x.size(1)])


class LitTransformerLM(_EvalLoaders, L.LightningModule):
    """Lightning's ``nn.Transformer`` language-model demo, positions kept in an fp32 buffer.

    Unusual: the fp32 position buffer is added to the (possibly half) embeddings before ``nn.Transformer``'s
    ``LayerNorm``s; the causal mask is made in ``forward`` in the default dtype; dropout; ``loss.item()``
    for a perplexity inside ``training_step``. The batch is a plain ``LongTensor`` of shape (batch, seq + 1).
    """

    def __init__(self, vocab_size: int = 50, d_model: int = 32, nhead: int = 2, num_layers: int = 1,
                 dim_feedforward: int = 64, dropout: float = 0.1, seq_len: int = 16, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.pos_encoder = PositionalEncoding(d_model, dropout)
        self.transformer = nn.Transformer(
            d_model=d_model, nhead=nhead, num_encoder_layers=num_layers, num_decoder_layers=num_layers,
            dim_feedforward=dim_feedforward, dropout=dropout, batch_first=True,
        )
        self.decoder = nn.Linear(d_model, vocab_size)

    def _dataset(self, split: str) -> Dataset:
        g = _gen(_SPLIT_SEED[split])
        return torch.randint(0, self.hparams.vocab_size, (32, self.hparams.seq_len + 1), generator=g)

    def forward(self, inputs: Tensor) -> Tensor:
        t = inputs.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=inputs.device)
        src = self.pos_encoder(self.embedding(inputs) * math.sqrt(self.hparams.d_model))
        out = self.transformer(src, src, src_mask=mask, tgt_mask=mask, memory_mask=mask)
        return self.decoder(out)

    def _loss(self, batch: Tensor) -> Tensor:
        inputs, target = batch[:, :-1], batch[:, 1:]
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        self.log("train_ppl", math.exp(loss.item()))
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Tensor, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self(batch[:, :-1]).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class _GlueLike(Dataset):
    """Padded sentence pairs with binary labels, as a GLUE DataModule's tokenised split yields them."""

    def __init__(self, split: str, n: int = 32, seq_len: int = 16, vocab: int = 100) -> None:
        g = _gen(_SPLIT_SEED[split])
        self.input_ids = torch.randint(5, vocab, (n, seq_len), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)
        pos = torch.arange(seq_len)
        self.attention_mask = (pos < lengths[:, None]).long()
        self.input_ids = self.input_ids * self.attention_mask  # pad id 0
        self.token_type_ids = (pos >= (lengths[:, None] // 2)).long() * self.attention_mask
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return self.labels.numel()

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i],
                "token_type_ids": self.token_type_ids[i], "labels": self.labels[i]}


class LitHFSequenceClassifier(_EvalLoaders, L.LightningModule):
    """Lightning's GLUE fine-tuning example (``GLUETransformer``) on a tiny random-weight BERT.

    Unusual: a Hugging Face model returning a ``ModelOutput``; dict batch; weight-decay param groups by name;
    ``configure_optimizers`` reads ``self.trainer.estimated_stepping_batches`` for a per-step linear warm-up.
    """

    def __init__(self, num_labels: int = 2, learning_rate: float = 2e-5, adam_epsilon: float = 1e-8,
                 warmup_steps: int = 2, weight_decay: float = 0.01) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        self.save_hyperparameters()
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=32, num_labels=num_labels)
        self.model = BertForSequenceClassification(config)
        self.outputs: list[dict[str, Tensor]] = []

    def _dataset(self, split: str) -> Dataset:
        return _GlueLike(split)

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        outputs = self(**batch)
        return outputs[0]

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        val_loss, logits = self(**batch)[:2]
        self.outputs.append({"loss": val_loss, "preds": logits.argmax(dim=1), "labels": batch["labels"]})

    def on_validation_epoch_end(self) -> None:
        loss = torch.stack([o["loss"] for o in self.outputs]).float().mean()
        preds = torch.cat([o["preds"] for o in self.outputs])
        labels = torch.cat([o["labels"] for o in self.outputs])
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_accuracy", (preds == labels).float().mean())
        self.outputs.clear()

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self(**batch).loss)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        batch = {k: v for k, v in batch.items() if k != "labels"}
        return self(**batch).logits.argmax(dim=-1)

    def configure_optimizers(self) -> dict[str, Any]:
        from transformers import get_linear_schedule_with_warmup

        no_decay = ["bias", "LayerNorm.weight"]
        groups = [
            {"params": [p for n, p in self.model.named_parameters() if not any(nd in n for nd in no_decay)],
             "weight_decay": self.hparams.weight_decay},
            {"params": [p for n, p in self.model.named_parameters() if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.learning_rate, eps=self.hparams.adam_epsilon)
        scheduler = get_linear_schedule_with_warmup(
            optimizer, num_warmup_steps=self.hparams.warmup_steps,
            num_training_steps=self.trainer.estimated_stepping_batches,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


class LitPlainTensor(_EvalLoaders, L.LightningModule):
    """BoringModel-style regression: the batch is a plain float tensor and the target a fixed function of it.

    Unusual: ``training_step(self, batch)`` and ``validation_step(self, batch)`` take no ``batch_idx``.
    """

    def __init__(self, dim: int = 32, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1))

    def _dataset(self, split: str) -> Dataset:
        return torch.randn(32, self.hparams.dim, generator=_gen(_SPLIT_SEED[split]))

    @staticmethod
    def target(x: Tensor) -> Tensor:
        return torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)

    def training_step(self, batch: Tensor) -> Tensor:
        loss = F.mse_loss(self(batch), self.target(batch))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Tensor) -> None:
        self.log("val_loss", F.mse_loss(self(batch), self.target(batch)))

    def test_step(self, batch: Tensor) -> None:
        self.log("test_loss", F.mse_loss(self(batch), self.target(batch)))

    def predict_step(self, batch: Tensor) -> Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


FOREIGN_MODULES: dict[str, Callable[[], L.LightningModule]] = {
    "autoencoder": LitAutoEncoder,
    "classifier": LitClassifier,
    "gan": LitGAN,
    "transformer_lm": LitTransformerLM,
    "hf_bert": LitHFSequenceClassifier,
    "plain_tensor": LitPlainTensor,
}


#: The ``Trainer`` entry points each module supports (the GAN example has no validation or test step).
STAGES: dict[str, tuple[str, ...]] = {
    name: ("fit", "predict") if name == "gan" else ("fit", "validate", "test", "predict") for name in FOREIGN_MODULES
}


def make(name: str, seed: int = 0, **kwargs: Any) -> L.LightningModule:
    """Build ``FOREIGN_MODULES[name]`` with the global RNG seeded first, so two calls give equal weights."""
    if name not in FOREIGN_MODULES:
        raise ValueError(f"Passed `name={name!r}`; expected one of {sorted(FOREIGN_MODULES)}.")
    L.seed_everything(seed, verbose=False)
    return FOREIGN_MODULES[name](**kwargs)

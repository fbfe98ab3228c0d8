"""Modules of the corpus that use Lightning's (and its ecosystem's) features rather than unusual layers: manual
optimization with several optimizers, torchmetrics inside ``training_step``, ``self.log(..., sync_dist=True)``, and
PEFT LoRA / DoRA adapters on a frozen Hugging Face base."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from tests.conformance import corpus_hf
from tests.conformance.corpus_nets import CLASSES, MLP, Base, ConvGroupNorm


class ManualOptimization(Base):
    """``automatic_optimization = False`` with three optimizers (SGD, Adam, AdamW on three parts), a StepLR stepped by
    hand, ``manual_backward`` and ``self.clip_gradients`` on one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten())
        self.mixer = nn.Sequential(nn.Linear(8 * 7 * 7, 32), nn.GELU())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.mixer(self.encoder(x)))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.optimizers()
        scheduler = self.lr_schedulers()
        loss = self._loss(batch)
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizers[0], gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        for opt in optimizers:
            opt.step()
        scheduler.step()
        self.log("train_loss", loss)

    def configure_optimizers(self) -> Any:
        sgd = torch.optim.SGD(self.encoder.parameters(), lr=0.05, momentum=0.9)
        adam = torch.optim.Adam(self.mixer.parameters(), lr=2e-3)
        adamw = torch.optim.AdamW(self.head.parameters(), lr=2e-3)
        return [sgd, adam, adamw], [torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)]


class WithTorchmetrics(ConvGroupNorm):
    """torchmetrics ``MulticlassAccuracy`` and ``MulticlassF1Score`` updated in ``training_step`` and logged as metric
    objects (Lightning computes and resets them)."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

        self.train_acc = MulticlassAccuracy(num_classes=CLASSES)
        self.train_f1 = MulticlassF1Score(num_classes=CLASSES, average="macro")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.train_f1.update(logits.detach(), y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_f1", self.train_f1, on_step=False, on_epoch=True)
        self.log("train_loss", loss)
        return loss


class SyncDistLogging(MLP):
    """``self.log(..., sync_dist=True)`` and ``self.log_dict(..., sync_dist=True)`` in training and validation."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        prediction = self(x)
        loss = F.mse_loss(prediction, y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.log_dict({"pred_mean": prediction.mean(), "pred_std": prediction.std()}, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)


class _Peft(Base):
    """A Hugging Face model of the corpus wrapped by ``peft.get_peft_model``: base frozen, adapters trained."""

    FAMILY = ""

    def __init__(self) -> None:
        self.family = next(f for f in corpus_hf.FAMILIES if f.model_type == self.FAMILY)
        super().__init__()
        from peft import get_peft_model

        self.model = get_peft_model(corpus_hf.build_model(self.family), self._peft_config())

    def _peft_config(self) -> Any:
        raise NotImplementedError

    def _make_data(self, g: torch.Generator) -> list[Any]:
        return corpus_hf.samples(self.family, corpus_hf.tiny_config(self.family))

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)

    def _loss(self, batch: Any) -> Tensor:
        return self.model(**batch).loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._data, batch_size=self.batch_size, shuffle=False)


class PeftLoRA(_Peft):
    """LoRA (r=4, dropout 0.1) on a LLaMA's attention projections."""

    FAMILY = "llama"

    def _peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


class PeftDoRA(_Peft):
    """DoRA (weight-decomposed LoRA: a trained magnitude vector per layer) on a BERT classifier's attention, the
    classifier head trained in full (``modules_to_save``)."""

    FAMILY = "bert"

    def _peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["query", "value"],
                          modules_to_save=["classifier"], task_type="SEQ_CLS")


class ClippingOverride(MLP):
    """A user's own ``configure_gradient_clipping`` (clip by norm at 0.5, then by value at 0.1), no Trainer flag."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="value")

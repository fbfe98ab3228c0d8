"""Hand-written modules of kinds the other corpus files do not have: a 1-D convolution over waveforms, an
``nn.EmbeddingBag`` recommender, a transformer whose output layer is tied to its embedding, ``InstanceNorm2d`` with
running statistics, an MLP-Mixer without norm layers, a graph network that aggregates messages with
``index_add_``/``scatter_add``, one block applied several times under reentrant checkpointing (ALBERT's sharing), and
blocks whose weights are parametrized (spectral norm's power iteration updates buffers in every training forward,
weight norm splits a weight into two parameters), a float64 calibration head beside float32 layers, and a
self-distillation student whose frozen EMA teacher is updated in place in ``training_step``. Each is tiny (a few thousand parameters) and trains on generated data.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tests.conformance.corpus_nets import CLASSES, SAMPLES, Base


class Conv1dAudio(Base):
    """``nn.Conv1d`` + ``BatchNorm1d`` over raw 1-D signals (an audio classifier's front end), AdamW."""

    def _make_data(self, g: torch.Generator) -> list[Any]:
        return list(zip(torch.randn(SAMPLES, 1, 128, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)))

    def __init__(self) -> None:
        super().__init__()
        self.frontend = nn.Sequential(nn.Conv1d(1, 8, 9, stride=4), nn.BatchNorm1d(8), nn.GELU(),
                                      nn.Conv1d(8, 16, 5, stride=2, dilation=2), nn.GELU(), nn.AdaptiveAvgPool1d(1))
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.frontend(x).flatten(1))


class EmbeddingBagRecommender(Base):
    """``nn.EmbeddingBag`` (sum of a user's item history, per-sample weights) and a user embedding, a dot-product
    click score with binary cross-entropy, Adam."""

    OPTIMIZER = "adam"
    ITEMS, USERS, HISTORY = 50, 12, 6

    def _make_data(self, g: torch.Generator) -> list[Any]:
        users = torch.randint(0, self.USERS, (SAMPLES,), generator=g)
        history = torch.randint(0, self.ITEMS, (SAMPLES, self.HISTORY), generator=g)
        weights = torch.rand(SAMPLES, self.HISTORY, generator=g)
        clicks = torch.randint(0, 2, (SAMPLES,), generator=g).float()
        return list(zip(users, history, weights, clicks))

    def __init__(self) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(self.ITEMS, 16, mode="sum")
        self.users = nn.Embedding(self.USERS, 16)
        self.mix = nn.Linear(16, 16)

    def forward(self, users: Tensor, history: Tensor, weights: Tensor) -> Tensor:
        taste = self.mix(self.items(history, per_sample_weights=weights))
        return (taste * self.users(users)).sum(-1)

    def _loss(self, batch: Any) -> Tensor:
        users, history, weights, clicks = batch
        return F.binary_cross_entropy_with_logits(self(users, history, weights), clicks)


class TiedTransformerLM(Base):
    """A 2-layer ``nn.TransformerEncoder`` language model (causal mask) whose output layer is its embedding (one
    parameter under two names), AdamW."""

    VOCAB, SEQ = 32, 8

    def _make_data(self, g: torch.Generator) -> list[Any]:
        return list(torch.randint(0, self.VOCAB, (SAMPLES, self.SEQ + 1), generator=g))

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.lm_head = nn.Linear(16, self.VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight  # NOTE: tied: one parameter, two module paths

    def forward(self, ids: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.lm_head(self.encoder(self.embed(ids), mask=mask, is_causal=True))

    def _loss(self, batch: Any) -> Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.VOCAB), batch[:, 1:].reshape(-1))


class InstanceNormStats(Base):
    """``InstanceNorm2d(affine=True, track_running_stats=True)``: running statistics (buffers) that are not
    BatchNorm's, SGD with momentum."""

    OPTIMIZER = "sgd"

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True,
                                      track_running_stats=True), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, channels: int) -> None:
        super().__init__()
        self.token_mix = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channel_mix = nn.Sequential(nn.Linear(channels, 2 * channels), nn.GELU(), nn.Linear(2 * channels, channels))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.token_mix(x.transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(x)


class MLPMixer(Base):
    """An MLP-Mixer without norm layers: patches by a strided conv, token- and channel-mixing MLPs (repeated blocks
    in an ``nn.ModuleList``), AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 12, 4, stride=4)  # 16x16 images: 16 tokens of 12 channels
        self.blocks = nn.ModuleList(_MixerBlock(16, 12) for _ in range(2))
        self.head = nn.Linear(12, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


class ScatterGNN(Base):
    """A graph network on a fixed ring-with-chords graph: messages gathered by edge, summed per node with
    ``index_add_`` and normalised by degree counts from ``scatter_add``, graph-level mean readout, Adam."""

    OPTIMIZER = "adam"
    NODES = 10

    def _make_data(self, g: torch.Generator) -> list[Any]:
        return list(zip(torch.randn(SAMPLES, self.NODES, 6, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)))

    def __init__(self) -> None:
        super().__init__()
        n = self.NODES
        src = torch.cat([torch.arange(n), torch.arange(n), torch.arange(0, n, 2)])
        dst = torch.cat([(torch.arange(n) + 1) % n, (torch.arange(n) - 1) % n, (torch.arange(0, n, 2) + n // 2) % n])
        self.register_buffer("src", src, persistent=False)
        self.register_buffer("dst", dst, persistent=False)
        self.embed = nn.Linear(6, 16)
        self.message = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.embed(x))  # (batch, nodes, 16)
        degree = torch.zeros(self.NODES, dtype=h.dtype).scatter_add(0, self.dst, torch.ones_like(self.dst, dtype=h.dtype))
        for layer in self.message:
            messages = layer(h)[:, self.src]  # (batch, edges, 16)
            summed = torch.zeros_like(h).index_add_(1, self.dst, messages)
            h = h + F.gelu(summed / degree[:, None])
        return self.head(h.mean(1))


class SharedReentrantBlock(Base):
    """One block applied three times (ALBERT-style sharing), each application under reentrant
    ``torch.utils.checkpoint`` (the default of older Hugging Face checkpointing): the block's gradient hooks fire once
    per segment, in each segment's inner backward, AdamW."""

    def _make_data(self, g: torch.Generator) -> list[Any]:
        return list(zip(torch.randn(SAMPLES, 12, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)))

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU())
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for _ in range(3):
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True) if torch.is_grad_enabled() else self.block(h)
        return self.head(h)


class _NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.spectral = nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16))
        self.weighted = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weighted(F.leaky_relu(self.spectral(x), 0.2))


class ParametrizedBlocks(Base):
    """Repeated blocks of parametrized layers (a GAN discriminator's ``spectral_norm``, whose power iteration updates
    its ``_u``/``_v`` buffers in every training forward, and ``weight_norm``'s ``original0``/``original1``), Adam."""

    OPTIMIZER = "adam"

    def _make_data(self, g: torch.Generator) -> list[Any]:
        return list(zip(torch.randn(SAMPLES, 12, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)))

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.blocks = nn.ModuleList(_NormedBlock() for _ in range(2))
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Float64Head(Base):
    """float32 layers under a float64 calibration head (a per-class scale and bias in double precision, with a float64
    running mean of the logits as a buffer), as scientific code keeps a few sensitive parameters, AdamW."""

    def _make_data(self, g: torch.Generator) -> list[Any]:
        return list(zip(torch.randn(SAMPLES, 12, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)))

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, CLASSES))
        self.scale = nn.Parameter(torch.ones(CLASSES, dtype=torch.float64))
        self.shift = nn.Parameter(torch.zeros(CLASSES, dtype=torch.float64))
        self.register_buffer("mean_logits", torch.zeros(CLASSES, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        logits = self.body(x).double() * self.scale + self.shift
        if self.training:
            with torch.no_grad():
                self.mean_logits.mul_(0.9).add_(logits.mean(0), alpha=0.1)
        return logits


class EMATeacher(Base):
    """Self-distillation (BYOL/DINO-style): a student and a frozen teacher of the same shape; ``training_step`` first
    moves the teacher toward the student in place (``torch.no_grad``, momentum 0.9), then trains the student to match
    the teacher's softened outputs plus the labels, AdamW."""

    def _make_data(self, g: torch.Generator) -> list[Any]:
        return list(zip(torch.randn(SAMPLES, 12, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)))

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, CLASSES))
        self.teacher = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, CLASSES))
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.student(x)

    def _trainable(self) -> list[nn.Parameter]:
        return list(self.student.parameters())

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        if self.training:
            with torch.no_grad():
                for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                    t.mul_(0.9).add_(s, alpha=0.1)
        with torch.no_grad():
            target = F.softmax(self.teacher(x) / 2.0, dim=-1)
        logits = self(x)
        return F.cross_entropy(logits, y) + F.kl_div(F.log_softmax(logits / 2.0, dim=-1), target, reduction="batchmean")

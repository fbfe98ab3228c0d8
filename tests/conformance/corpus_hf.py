"""The Hugging Face half of the conformance corpus: model families of the installed ``transformers``, each built
from its own config class at a tiny size (random weights, nothing downloaded) and trained on generated data.

Every family is one entry of :data:`FAMILIES`: its model type, its kind (which ``AutoModelFor...`` class and which
generated batch), and the config fields that make it tiny. The generic fields (:data:`_TINY`) are set only where the
config has them; the entries add what a family names differently. A family that does not build or train plainly is
listed in the results with the reason (:func:`screen`), never dropped silently.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

VOCAB, SEQ, BATCH, SAMPLES, NUM_LABELS = 96, 12, 4, 32, 3

# generic tiny sizes, applied to the fields a config has
_TINY: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "d_model": 32, "n_embd": 32, "num_hidden_layers": 2, "n_layer": 2,
    "num_layers": 2, "num_attention_heads": 2, "n_head": 2, "num_heads": 2, "num_key_value_heads": 1,
    "intermediate_size": 64, "n_inner": 64, "d_ff": 64, "max_position_embeddings": 64, "n_positions": 64,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_decoder_layers": 2, "head_dim": 16, "d_kv": 16,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0,
    "num_labels": NUM_LABELS, "use_cache": False, "type_vocab_size": 2,
}

_VISION: dict[str, Any] = {"image_size": 32, "num_channels": 3}


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family of the corpus."""

    model_type: str
    kind: str  # causal_lm | seq2seq | encoder_cls | vision_cls | audio_cls
    config: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "adamw"
    note: str = ""

    @property
    def name(self) -> str:
        return f"hf_{self.model_type.replace('-', '_')}"


def _f(model_type: str, kind: str, optimizer: str = "adamw", note: str = "", **config: Any) -> Family:
    """``config``: the family's own tiny sizes; ``_class`` names the model class where the auto class cannot pick
    one, ``_skip`` lists generic fields the config refuses."""
    return Family(model_type, kind, config, optimizer, note)


_CONVNET = {"hidden_sizes": [8, 16], "depths": [1, 1]}
FAMILIES: list[Family] = [
    # --- causal LMs
    _f("gpt2", "causal_lm"),
    _f("gpt_neo", "causal_lm", attention_types=[[["global", "local"], 1]], window_size=8, max_position_embeddings=64),
    _f("gpt_neox", "causal_lm", optimizer="adam"),
    _f("gptj", "causal_lm", rotary_dim=8),
    _f("llama", "causal_lm"),
    _f("mistral", "causal_lm", sliding_window=8),
    _f("mixtral", "causal_lm", num_local_experts=4, num_experts_per_tok=2, note="mixture of experts, top-2 routing"),
    _f("qwen2", "causal_lm"),
    _f("qwen3_moe", "causal_lm", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
       note="mixture of experts"),
    _f("phi", "causal_lm", optimizer="sgd"),
    _f("phi3", "causal_lm"),
    _f("gemma2", "causal_lm", note="logit soft-capping, sliding window"),
    _f("falcon", "causal_lm", new_decoder_architecture=False, multi_query=True, parallel_attn=True),
    _f("bloom", "causal_lm", note="ALiBi"),
    _f("opt", "causal_lm", ffn_dim=64, word_embed_proj_dim=32),
    _f("olmo2", "causal_lm"),
    _f("starcoder2", "causal_lm"),
    _f("mamba", "causal_lm", state_size=4, expand=2, conv_kernel=4, note="state-space model, no attention"),
    # --- encoder-decoder (seq2seq) LMs
    _f("t5", "seq2seq", decoder_start_token_id=0, note="relative position buckets, RMS norm"),
    _f("bart", "seq2seq"),
    _f("pegasus", "seq2seq"),
    _f("marian", "seq2seq", decoder_vocab_size=VOCAB),
    _f("switch_transformers", "seq2seq", num_experts=2, expert_capacity=64, num_sparse_encoder_layers=1,
       num_sparse_decoder_layers=1, decoder_start_token_id=0, note="sparse mixture of experts"),
    # --- encoder classifiers
    _f("bert", "encoder_cls"),
    _f("roberta", "encoder_cls", max_position_embeddings=64),
    _f("distilbert", "encoder_cls", dim=32, n_layers=2, n_heads=2, hidden_dim=64, optimizer="sgd"),
    _f("albert", "encoder_cls", embedding_size=16, note="one layer's weights shared by every layer"),
    _f("electra", "encoder_cls", embedding_size=16),
    _f("deberta-v2", "encoder_cls", note="disentangled relative attention"),
    _f("funnel", "encoder_cls", block_sizes=[1, 1], num_decoder_layers=1, n_head=2, d_head=8, d_inner=64,
       _skip=["num_hidden_layers"], note="pooling between blocks"),
    _f("mobilebert", "encoder_cls", embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
       num_feedforward_networks=1, note="bottlenecks, NoNorm"),
    _f("modernbert", "encoder_cls", global_attn_every_n_layers=2, local_attention=8),
    _f("fnet", "encoder_cls", note="Fourier transform instead of attention"),
    # --- vision classifiers
    _f("vit", "vision_cls", patch_size=8, **_VISION),
    _f("swin", "vision_cls", patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4, **_VISION),
    _f("convnext", "vision_cls", patch_size=4, num_stages=2, **_CONVNET, **_VISION),
    _f("resnet", "vision_cls", embedding_size=8, **_CONVNET, optimizer="sgd", note="BatchNorm", **_VISION),
    _f("mobilenet_v2", "vision_cls", depth_multiplier=0.25, note="BatchNorm, depthwise convolutions", **_VISION),
    _f("levit", "vision_cls", hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
       key_dim=[8, 8, 8], _class="LevitForImageClassification", note="BatchNorm in attention", **_VISION),
    _f("poolformer", "vision_cls", hidden_sizes=[8, 16], depths=[1, 1], num_encoder_blocks=2, patch_sizes=[7, 3],
       strides=[4, 2], padding=[2, 1], note="GroupNorm", **_VISION),
    _f("segformer", "vision_cls", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
       num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], **_VISION),
    _f("dinov2", "vision_cls", patch_size=8, **_VISION),
    # --- audio classifiers
    _f("wav2vec2", "audio_cls", conv_dim=[8, 8], conv_stride=[5, 4], conv_kernel=[10, 8], num_conv_pos_embeddings=4,
       num_conv_pos_embedding_groups=2, mask_time_prob=0.0, note="GroupNorm feature encoder"),
    _f("hubert", "audio_cls", conv_dim=[8, 8], conv_stride=[5, 4], conv_kernel=[10, 8], num_conv_pos_embeddings=4,
       num_conv_pos_embedding_groups=2, mask_time_prob=0.0),
    _f("wavlm", "audio_cls", conv_dim=[8, 8], conv_stride=[5, 4], conv_kernel=[10, 8], num_conv_pos_embeddings=4,
       num_conv_pos_embedding_groups=2, mask_time_prob=0.0, num_buckets=16, max_bucket_distance=32),
    _f("whisper", "audio_cls", num_mel_bins=8, max_source_positions=8, max_target_positions=16),
    _f("audio-spectrogram-transformer", "audio_cls", patch_size=4, frequency_stride=4, time_stride=4, max_length=16,
       num_mel_bins=8),
]


def tiny_config(family: Family) -> Any:
    from transformers import AutoConfig

    base = AutoConfig.for_model(family.model_type)
    # NOTE: some configs derive a size (Falcon's head_dim, Funnel's num_hidden_layers) in a read-only property
    aliases = getattr(base, "attribute_map", {})  # NOTE: Swin's num_attention_heads would overwrite its num_heads
    skip = set(family.config.get("_skip", ()))  # NOTE: Funnel's num_hidden_layers setter refuses any value
    values = {k: v for k, v in _TINY.items() if hasattr(base, k) and k not in aliases and k not in skip
              and getattr(getattr(type(base), k, None), "fset", True) is not None}
    values.update({k: v for k, v in family.config.items() if not k.startswith("_")})
    return AutoConfig.for_model(family.model_type, **values)


_AUTO = {
    "causal_lm": "AutoModelForCausalLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "encoder_cls": "AutoModelForSequenceClassification",
    "vision_cls": "AutoModelForImageClassification",
    "audio_cls": "AutoModelForAudioClassification",
}


def build_model(family: Family) -> torch.nn.Module:
    import transformers

    config = tiny_config(family)
    if "_class" in family.config:  # NOTE: LeViT's mapping names two classes and picks by `architectures`
        return getattr(transformers, family.config["_class"])(config)
    return getattr(transformers, _AUTO[family.kind]).from_config(config)


def samples(family: Family, config: Any, n: int = SAMPLES) -> list[dict[str, torch.Tensor]]:
    """``n`` generated samples of the family's kind, from a generator seeded by the family's name only."""
    g = torch.Generator().manual_seed(zlib.crc32(family.model_type.encode()))
    out: list[dict[str, torch.Tensor]] = []
    for i in range(n):
        if family.kind in ("causal_lm", "seq2seq", "encoder_cls"):
            ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
            mask = torch.ones(SEQ, dtype=torch.long)
            if i % 4 == 1 and family.kind != "seq2seq":  # right padding on some rows: masks and ignored labels
                ids[-3:], mask[-3:] = 0, 0
            sample = {"input_ids": ids, "attention_mask": mask}
            if family.kind == "causal_lm":
                sample["labels"] = ids.masked_fill(mask == 0, -100)
            elif family.kind == "seq2seq":
                sample["labels"] = torch.randint(3, VOCAB, (SEQ // 2,), generator=g)
            else:
                sample["labels"] = torch.randint(0, NUM_LABELS, (), generator=g)
            if family.model_type == "mamba":
                sample.pop("attention_mask")
        elif family.kind == "vision_cls":
            sample = {"pixel_values": torch.randn(3, 32, 32, generator=g),
                      "labels": torch.randint(0, NUM_LABELS, (), generator=g)}
        elif family.model_type == "whisper":
            sample = {"input_features": torch.randn(config.num_mel_bins, 2 * config.max_source_positions, generator=g),
                      "labels": torch.randint(0, NUM_LABELS, (), generator=g)}
        elif family.model_type == "audio-spectrogram-transformer":
            sample = {"input_values": torch.randn(config.max_length, config.num_mel_bins, generator=g),
                      "labels": torch.randint(0, NUM_LABELS, (), generator=g)}
        else:
            sample = {"input_values": torch.randn(800, generator=g), "labels": torch.randint(0, NUM_LABELS, (), generator=g)}
        out.append(sample)
    return out


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=2e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}


class HFModule(L.LightningModule):
    """A Hugging Face model trained the way its users write it: ``self.model(**batch).loss``, their own optimizer,
    a validation loop logging ``val_loss``, ``batch_size`` and ``lr`` attributes (for the batch-size and LR finders)."""

    def __init__(self, family: Family) -> None:
        super().__init__()
        self.family = family
        self.model = build_model(family)
        self.batch_size = BATCH
        self.lr = None  # the optimizer's own default unless a LearningRateFinder sets it
        self._data = samples(family, self.model.config)

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = OPTIMIZERS[self.family.optimizer](self.parameters())
        if self.lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = self.lr
        return optimizer

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._data, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._data[:8], batch_size=BATCH, shuffle=False)

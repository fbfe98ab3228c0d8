"""A causal-LM fine-tuning LightningModule over any Hugging Face causal LM."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.callbacks.chunked_lm_loss.callback import is_chunked
from lightning_lowmem.demo.tokenizer import ByteTokenizer

IGNORE_INDEX = -100


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build_causal_lm(
    model_type: str = "gpt2",
    config: dict[str, Any] | None = None,
    pretrained_path: str | None = None,
    vocab_size: int | None = ByteTokenizer.vocab_size,
) -> torch.nn.Module:
    """Build a Hugging Face causal LM: random weights from a config, or ``from_pretrained`` on a local directory.

    Args:
        model_type: a ``transformers`` model type with a causal-LM head (``gpt2``, ``llama``, ``opt``, ...).
        config: overrides of that type's default config (``n_layer``, ``hidden_size``, ...).
        pretrained_path: a local directory written by ``save_pretrained``; takes precedence over the above.
        vocab_size: vocabulary size for a model built from a config (the demo's byte tokenizer by default).

    Raises:
        FileNotFoundError: ``pretrained_path`` is not a directory with a ``config.json``.
        ValueError: ``model_type`` is unknown or has no causal-LM head.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if pretrained_path is not None:
        path = Path(pretrained_path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"Passed `pretrained_path={pretrained_path!r}`, which is not a directory holding a `config.json`. "
                "Give the directory that `model.save_pretrained(...)` wrote, or leave `pretrained_path` unset "
                "to build a model with random weights from `model_type` and `config`."
            )
        # NOTE: `from_pretrained` returns the model in eval mode (dropout off), and Lightning keeps each module's mode
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).train()

    overrides = dict(config or {})
    if vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
        if vocab_size == ByteTokenizer.vocab_size:
            tok = ByteTokenizer()
            for key in ("bos_token_id", "eos_token_id"):
                overrides.setdefault(key, tok.eos_token_id)
            overrides.setdefault("pad_token_id", tok.pad_token_id)
    types = causal_lm_types()
    if model_type not in types:
        raise ValueError(
            f"Passed `model_type={model_type!r}`, which is not a Hugging Face causal LM type. "
            f"Expected one of: {', '.join(t for t in types if t in _COMMON) or ', '.join(types[:10])} "
            f"(or any of the {len(types)} types in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)."
        )
    negative = {k: v for k, v in (config or {}).items()
                if isinstance(v, int) and not isinstance(v, bool) and v < 0 and _SIZE_KEY.search(k)}
    if negative:
        raise ValueError(
            f"Passed `config` with {', '.join(f'`{k}: {v}`' for k, v in negative.items())}: layer counts and sizes must "
            f"be positive. Give e.g. `{next(iter(negative))}: {_EXAMPLE.get(next(iter(negative)), 4)}`."
        )
    try:
        hf_config = AutoConfig.for_model(model_type, **overrides)
    except (TypeError, ValueError) as err:
        raise ValueError(f"Could not build a `{model_type}` config from `config={overrides!r}`: {err}") from err
    try:
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError, IndexError, ZeroDivisionError) as err:
        # NOTE: e.g. `n_head` not dividing `n_embd`: the model's own message, with the config that produced it
        raise ValueError(
            f"Could not build the `{model_type}` model from `config={dict(config or {})!r}`: {str(err).rstrip('.')}. "
            "Check the sizes (layers, hidden size, heads dividing it, positions)."
        ) from err


# NOTE: config keys that are counts or sizes (a negative one fails deep in torch, e.g. "__len__() should return >= 0")
_SIZE_KEY = re.compile(r"^(n_|num_)|_(size|layers|heads|positions|embd|dim)$|^(hidden|intermediate)_size$")
_EXAMPLE = {"n_layer": 4, "num_hidden_layers": 4, "n_embd": 256, "hidden_size": 256, "n_head": 4}
_COMMON = {"gpt2", "gpt_neox", "llama", "mistral", "opt", "qwen2", "phi", "gemma", "falcon", "bloom"}


class CausalLMModule(L.LightningModule):
    """Causal-LM fine-tuning of a Hugging Face model, ready for every technique of the suite.

    The loss is the mean cross-entropy over the non-padding tokens of the batch. With
    ``loss_reduction="sum"`` ``training_step`` returns ``{"loss": sum_of_token_losses, "num_tokens": n}``
    instead, the contract ``AccumulationScheduler(loss_normalization="tokens")`` uses to give the exact
    mean over every token of the effective batch.

    Args:
        model_type, config, pretrained_path: see :func:`build_causal_lm`.
        learning_rate, weight_decay, betas: AdamW settings (no weight decay on biases and norms).
        warmup_steps: linear warm-up of the learning rate, then constant; 0 for none.
        loss_reduction: ``"mean"`` or ``"sum"`` (see above).

    Example:
        >>> module = CausalLMModule(config={"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128})
        >>> sum(p.numel() for p in module.parameters()) > 0
        True
    """

    def __init__(
        self,
        model_type: str = "gpt2",
        config: dict[str, Any] | None = None,
        pretrained_path: str | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        loss_reduction: Literal["mean", "sum"] = "mean",
    ) -> None:
        super().__init__()
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"Passed `loss_reduction={loss_reduction!r}`; expected 'mean' or 'sum'.")
        if learning_rate <= 0:
            raise ValueError(f"Passed `learning_rate={learning_rate}`; it must be positive.")
        if warmup_steps < 0:
            raise ValueError(f"Passed `warmup_steps={warmup_steps}`; it must be 0 or more.")
        self.save_hyperparameters()
        self.model = build_causal_lm(model_type, config, pretrained_path)

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model can embed with learned absolute positions (None for rotary/relative ones)."""
        cached = self.__dict__.get("_max_positions")
        if cached is not None and cached[0] is self.model:
            return cached[1]
        config = getattr(self.model, "config", None)
        limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        learned = any(
            isinstance(m, torch.nn.Embedding) and (name.endswith("wpe") or "position" in name)
            for name, m in self.model.named_modules()
        )
        value = int(limit) if learned and limit else None
        self.__dict__["_max_positions"] = (self.model, value)
        return value

    def _check_seq_len(self, seq_len: int, where: str) -> None:
        limit = self.max_positions
        if limit is not None and seq_len > limit:
            raise ValueError(
                f"{where} has sequences of {seq_len} tokens, but the `{self.hparams.model_type}` model embeds at most "
                f"{limit} positions (`n_positions`/`max_position_embeddings` in `config`). Lower `seq_len` to {limit} "
                f"or less, or raise the model's positions (e.g. `config: {{n_positions: {seq_len}}}`)."
            )

    @override
    def setup(self, stage: str) -> None:
        # NOTE: caught here, before the first step, instead of an IndexError deep inside the embedding lookup.
        trainer = lightning_internals.attached_trainer(self)
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        seq_len = getattr(datamodule, "seq_len", None)
        if isinstance(seq_len, int):
            self._check_seq_len(seq_len, f"The datamodule (`{type(datamodule).__name__}(seq_len={seq_len})`)")
        tokenizer = getattr(datamodule, "tokenizer", None)
        ids = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
        if self.model is None:  # NOTE: built in `configure_model`, after `setup`: nothing to check against yet
            return
        rows = self.model.get_input_embeddings().num_embeddings
        if isinstance(ids, int) and ids > rows:
            # NOTE: else an IndexError deep in the embedding lookup, at the first batch holding a high id
            raise ValueError(
                f"The datamodule's tokenizer (`{type(tokenizer).__name__}`) gives {ids} token ids, but the model "
                f"embeds {rows} (its `vocab_size`): ids {rows} and up would index past the embedding. Train on data "
                f"tokenized as the model was (its own tokenizer), or give the model {ids} rows before saving it "
                f"(`model.resize_token_embeddings({ids})`, then `save_pretrained`)."
            )

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self._check_seq_len(input_ids.size(-1), "The batch")
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def loss_sum_and_tokens(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of next-token cross-entropies over the labelled tokens, and their number."""
        labels = batch.get("labels", batch["input_ids"])
        if self.training and is_chunked(self.model):
            # NOTE: `ChunkedLMLoss` wraps the model: its labels= loss never builds the logits (they come back None)
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=labels)
            return out.loss_sum, out.num_tokens
        logits = self(batch["input_ids"], batch.get("attention_mask"))
        # NOTE: logits upcast for the loss (as Hugging Face does: a half softmax loses small probabilities); the fp32
        # copy is the LM head's memory spike in backward. A float64 model (precision="64-true") keeps float64.
        dtype = torch.promote_types(logits.dtype, torch.float32)
        shift_logits = logits[:, :-1, :].to(dtype).reshape(-1, logits.size(-1))
        shift_labels = labels[:, 1:].reshape(-1)
        loss_sum = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum, (shift_labels != IGNORE_INDEX).sum()

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        loss_sum, n_tokens = self.loss_sum_and_tokens(batch)
        loss = loss_sum / n_tokens.clamp(min=1)
        self.log("train_loss", loss.detach(), prog_bar=True, batch_size=batch["input_ids"].size(0))
        if self.hparams.loss_reduction == "sum":
            return {"loss": loss_sum, "num_tokens": n_tokens}
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss_sum, n_tokens = self.loss_sum_and_tokens(batch)
        self.log("val_loss", loss_sum / n_tokens.clamp(min=1), prog_bar=True, batch_size=batch["input_ids"].size(0))

    @override
    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or "norm" in name.lower() or "ln_" in name else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.learning_rate, betas=tuple(self.hparams.betas))
        if not self.hparams.warmup_steps:
            return optimizer
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

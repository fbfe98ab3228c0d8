"""Add AccumulationScheduler to an existing Lightning script: one import, one callback.

The script below is the kind people already have: a LightningModule around a Hugging Face causal LM over
padded sequences of different lengths, a DataModule with a ``batch_size`` attribute, a Trainer. The additions:

1. ``AccumulationScheduler(effective_batch_size=64, micro_batch_size="auto", measure=dry_run_peak, ...)`` in
   ``callbacks``: it picks the largest micro-batch whose step fits ``--budget`` (measured by dry runs on a fake copy
   of the model, before the first step), sets ``datamodule.batch_size`` and the accumulation itself, and says what it
   chose;
2. ``training_step`` returns the *sum* of its token losses and their count, so the step gets the exact mean over
   every token of the 64 sequences (a per-micro-batch mean would weight short and long micro-batches alike).

    python examples/accumulation.py --budget 300MiB
    python examples/accumulation.py --micro-batch 8 --warmup   # fixed micro-batch, effective batch 16 -> 64
    python examples/accumulation.py --smoke                    # tiny model, 2 steps
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_lowmem import AccumulationScheduler, dry_run_peak


class LitLM(L.LightningModule):
    def __init__(self, n_layer: int, n_embd: int, seq_len: int) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=257, n_layer=n_layer, n_embd=n_embd, n_head=4, n_positions=seq_len)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        loss_sum = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100, reduction="sum")
        n_tokens = (labels != -100).sum()
        self.log("train_loss", loss_sum / n_tokens, prog_bar=True)
        return {"loss": loss_sum, "num_tokens": n_tokens}  # the change: a sum and its count, not a mean

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class PaddedText(L.LightningDataModule):
    """Stand-in for your tokenized dataset: sequences of random lengths, padded, labels -100 on padding."""

    def __init__(self, n: int, seq_len: int, batch_size: int = 1) -> None:
        super().__init__()
        self.batch_size = batch_size  # AccumulationScheduler sets this
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(seq_len // 8, seq_len + 1, (n,), generator=g)
        self.ids = torch.randint(0, 256, (n, seq_len), generator=g)
        self.mask = (torch.arange(seq_len) < lengths[:, None]).long()

    def train_dataloader(self) -> DataLoader:
        items = [
            {"input_ids": i, "attention_mask": m, "labels": i.masked_fill(m == 0, -100)} for i, m in zip(self.ids, self.mask)
        ]
        return DataLoader(items, batch_size=self.batch_size, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="300MiB", help="peak memory a training step may use (auto micro-batch)")
    parser.add_argument("--micro-batch", type=int, default=None, help="a fixed micro-batch instead of 'auto'")
    parser.add_argument("--warmup", action="store_true", help="effective batch 16, then 32 from step 10, 64 from 20")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps")
    args = parser.parse_args()

    L.seed_everything(0)
    n_layer, n_embd, seq_len, steps, budget = (2, 32, 32, 2, "64MiB") if args.smoke else (6, 256, 256, 30, args.budget)
    callback = AccumulationScheduler(  # the one addition
        effective_batch_size=16 if args.warmup else 64,
        micro_batch_size=args.micro_batch or "auto",
        schedule={10: 32, 20: 64} if args.warmup else None,
        loss_normalization="tokens",
        memory_budget=None if args.micro_batch else budget,
        measure=None if args.micro_batch else dry_run_peak,
    )
    trainer = L.Trainer(
        accelerator="auto", devices=1, max_steps=steps, logger=False, enable_checkpointing=False, callbacks=[callback]
    )
    trainer.fit(LitLM(n_layer, n_embd, seq_len), PaddedText(256, seq_len))
    c = callback.choice
    print(f"micro-batch {c.micro_batch_size} x accumulation {c.accumulation} = effective batch {c.effective_batch_size}")


if __name__ == "__main__":
    main()

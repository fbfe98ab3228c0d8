"""Add activation checkpointing to an existing Lightning script: one import, one callback.

The script below is the kind people already have: a LightningModule around a Hugging Face causal LM,
a DataLoader, a Trainer. The only addition is ``ActivationCheckpointing(policy=...)`` in ``callbacks``;
the transformer blocks are found automatically and recomputed in backward, gradients unchanged.

    python examples/activation_checkpointing.py --policy selective
    python examples/activation_checkpointing.py --policy budget --budget 200MiB
    python examples/activation_checkpointing.py --smoke          # tiny model, 2 steps
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_lowmem import ActivationCheckpointing


class LitLM(L.LightningModule):
    def __init__(self, n_layer: int, n_embd: int, seq_len: int) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=256, n_layer=n_layer, n_embd=n_embd, n_head=4, n_positions=seq_len)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="sqrt", choices=["all", "every_n", "sqrt", "selective", "budget"])
    parser.add_argument("--n", type=int, default=None, help="for --policy every_n (default 2)")
    parser.add_argument("--budget", default=None, help="for --policy budget, e.g. 200MiB")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps")
    args = parser.parse_args()

    n = args.n if args.n is not None or args.policy != "every_n" else 2
    L.seed_everything(0)
    n_layer, n_embd, seq_len, steps = (2, 32, 32, 2) if args.smoke else (12, 256, 512, 50)
    data = torch.randint(0, 256, (64, seq_len))  # stand-in for your tokenized dataset
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        callbacks=[ActivationCheckpointing(policy=args.policy, n=n, budget=args.budget)],  # the one addition
    )
    trainer.fit(LitLM(n_layer, n_embd, seq_len), DataLoader(data, batch_size=2))


if __name__ == "__main__":
    main()

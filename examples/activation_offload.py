"""Add activation offload to an existing Lightning script: one import, one or two callbacks.

The script below is the kind people already have: a LightningModule around a Hugging Face causal LM,
a DataLoader, a Trainer. The addition is ``ActivationOffload(...)`` in ``callbacks``: the tensors autograd
saves in the training forward go to host memory and come back in backward (on CUDA through a side stream
and pinned buffers, prefetched). With ``--boundaries-only`` it is paired with ``ActivationCheckpointing``:
only the inputs of the checkpointed blocks go to the host and everything inside is recomputed, the smallest
activation footprint. Gradients are bit-identical to training without it. The bytes moved per optimizer step
are logged as ``activation_offload/bytes_per_step`` (printed at the end here).

    python examples/activation_offload.py
    python examples/activation_offload.py --boundaries-only
    python examples/activation_offload.py --smoke          # tiny model, 2 steps
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_lowmem import ActivationCheckpointing, ActivationOffload


class LitLM(L.LightningModule):
    def __init__(self, n_layer: int, n_embd: int, seq_len: int) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=256, n_layer=n_layer, n_embd=n_embd, n_head=4, n_positions=seq_len)
        config.use_cache = False  # training: no KV cache (checkpointing refuses one)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boundaries-only", action="store_true", help="with ActivationCheckpointing: block inputs only")
    parser.add_argument("--min-bytes", type=int, default=1024, help="saved tensors smaller than this stay put")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps")
    args = parser.parse_args()

    L.seed_everything(0)
    n_layer, n_embd, seq_len, steps = (2, 32, 32, 2) if args.smoke else (12, 256, 512, 30)
    data = torch.randint(0, 256, (64, seq_len))  # stand-in for your tokenized dataset
    offload = ActivationOffload(min_bytes=args.min_bytes, boundaries_only=args.boundaries_only)  # the addition
    callbacks = [ActivationCheckpointing(policy="all"), offload] if args.boundaries_only else [offload]
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )
    trainer.fit(LitLM(n_layer, n_embd, seq_len), DataLoader(data, batch_size=2))
    moved = trainer.callback_metrics["activation_offload/bytes_per_step"]
    print(f"activations moved to the host per step: {int(moved) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()

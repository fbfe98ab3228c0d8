"""Fine-tune a Hugging Face causal LM with fp32 masters and AdamW on the host: one import, one flag.

A plain Lightning script of the usual kind; the only lowmem lines are ``import lightning_lowmem`` and
``strategy="lowmem_offload"``. The accelerator keeps bf16 weights (2 B/param) and activations; the fp32
masters, gradients and AdamW state live in host RAM. Clipping and accumulation work as usual, and the
checkpoint is Lightning's single file with fp32 weights that a plain fp32 model loads.

    python examples/offload.py                      # GPT-2 (4 layers, 256 wide) on the stdlib's text
    python examples/offload.py --precision 16-mixed # fp16 with dynamic loss scaling (on a GPU)
    python examples/offload.py --smoke              # tiny model, 2 steps
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

import lightning_lowmem  # noqa: F401  (registers strategy="lowmem_offload")
from lightning_lowmem.demo.data import StdlibTextDataModule
from lightning_lowmem.demo.module import CausalLMModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16-true", help="bf16-true, bf16-mixed, 16-true, 16-mixed or 32-true")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and 2 steps")
    args = parser.parse_args()

    size = {"n_layer": 2, "n_embd": 64, "n_head": 2} if args.smoke else {"n_layer": 4, "n_embd": 256, "n_head": 4}
    model = CausalLMModule(model_type="gpt2", config={**size, "n_positions": 128}, learning_rate=1e-3, warmup_steps=5)
    data = StdlibTextDataModule(seq_len=64 if args.smoke else 128, batch_size=2 if args.smoke else 4,
                                max_bytes=60_000 if args.smoke else 1_000_000)
    class ShowMemory(L.Callback):
        def on_train_end(self, trainer, pl_module):  # before teardown gives the fp32 module back
            for role, parts in trainer.strategy.memory_breakdown().to_dict().items():
                print(role, {k: f"{v / 2**20:.2f} MiB" for k, v in parts.items() if v})

    trainer = L.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        devices=1,
        strategy="lowmem_offload",  # <- the one flag: fp32 masters + optimizer on the host
        precision=args.precision,
        accumulate_grad_batches=1 if args.smoke else 4,
        gradient_clip_val=1.0,
        max_steps=2 if args.smoke else args.steps,
        limit_val_batches=1 if args.smoke else 4,
        val_check_interval=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=not args.smoke,
        callbacks=[ShowMemory()],
    )
    trainer.fit(model, datamodule=data)
    print(f"trained {trainer.global_step} steps; final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")


if __name__ == "__main__":
    main()

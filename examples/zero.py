"""Fine-tune a Hugging Face causal LM with DeepSpeed ZeRO-3 CPU offload on a GPU or on the CPU: one import, one flag.

A plain Lightning script of the usual kind; the lowmem lines are ``import lightning_lowmem`` and
``strategy="lowmem_zero3_offload"``. The module's AdamW is swapped for DeepSpeedCPUAdam (logged), the
Trainer's accumulation, clipping and precision go into the DeepSpeed config, and the directory checkpoint
DeepSpeed writes is consolidated into one plain fp32 state dict that the bare Hugging Face model loads.

    python examples/zero.py                                   # GPT-2 (4 layers, 256 wide) on the stdlib's text
    python examples/zero.py --strategy lowmem_zero2_offload   # ZeRO-2: optimizer state offloaded only
    torchrun --nproc-per-node 2 examples/zero.py --devices 2  # two processes (GPUs, or CPU with gloo)
    python examples/zero.py --smoke                           # tiny model, 2 steps
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning as L
import torch

import lightning_lowmem
from lightning_lowmem.demo.data import StdlibTextDataModule
from lightning_lowmem.demo.module import CausalLMModule, build_causal_lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="lowmem_zero3_offload")
    parser.add_argument("--precision", default=None, help="default: 16-mixed on a GPU (as in Hugging Face's DeepSpeed docs), bf16-mixed on a CPU")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and 2 steps")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    size = {"n_layer": 2, "n_embd": 64, "n_head": 2} if args.smoke else {"n_layer": 4, "n_embd": 256, "n_head": 4}
    config = {**size, "n_positions": 128}
    model = CausalLMModule(model_type="gpt2", config=config, learning_rate=1e-3, warmup_steps=5)
    data = StdlibTextDataModule(seq_len=64 if args.smoke else 128, batch_size=2 if args.smoke else 4,
                                max_bytes=60_000 if args.smoke else 1_000_000)
    trainer = L.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=args.devices,
        strategy=args.strategy,  # <- the one flag
        precision=args.precision or ("16-mixed" if cuda else "bf16-mixed"),
        accumulate_grad_batches=1 if args.smoke else 4,
        gradient_clip_val=1.0,
        max_steps=2 if args.smoke else args.steps,
        limit_val_batches=1 if args.smoke else 4,
        val_check_interval=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=not args.smoke,
    )
    trainer.fit(model, datamodule=data)

    # DeepSpeed writes a directory of shards; consolidate it into one fp32 file a plain model loads
    out = Path(tempfile.mkdtemp(prefix="lowmem_zero_"))
    trainer.save_checkpoint(out / "last.ckpt")
    if trainer.is_global_zero:
        lightning_lowmem.zero.consolidate(out / "last.ckpt", out / "model.safetensors", strip_prefix="model.")
        from safetensors.torch import load_file

        plain = build_causal_lm("gpt2", config)
        plain.load_state_dict(load_file(out / "model.safetensors"))
        print(f"trained {trainer.global_step} steps; final train_loss {float(trainer.callback_metrics['train_loss']):.3f};"
              f" plain fp32 weights in {out / 'model.safetensors'}")


if __name__ == "__main__":
    main()

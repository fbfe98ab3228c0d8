"""Fine-tune with 8-bit AdamW state, and optionally the optimizer step fused into backward, by adding callbacks.

The LightningModule below is what a project already has: a causal LM whose ``configure_optimizers``
returns ``torch.optim.AdamW`` with a warm-up schedule. Two callbacks change how it trains, not the code:

* ``LowBitOptimizer(kind="adamw8bit")`` swaps that AdamW for bitsandbytes' ``AdamW8bit`` (same param
  groups, hyper-parameters and scheduler): optimizer state ~2 B/param instead of 8.
* ``OptimizerInBackward()`` steps each parameter as soon as its gradient exists and frees it: the
  gradients (4 B/param in fp32) never all exist at once.

    python examples/low_bit_optimizer.py                 # a few hundred steps on stdlib text
    python examples/low_bit_optimizer.py --in-backward   # also fuse the step into backward
    python examples/low_bit_optimizer.py --smoke         # tiny model, 2 steps
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from lightning_lowmem import LowBitOptimizer, OptimizerInBackward  # the one import the suite needs
from lightning_lowmem.core.accounting import optimizer_state_bytes
from lightning_lowmem.demo.data import StdlibTextDataModule
from lightning_lowmem.demo.module import CausalLMModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps")
    parser.add_argument("--in-backward", action="store_true", help="add OptimizerInBackward")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    L.seed_everything(0)
    if args.smoke:
        config = {"n_layer": 1, "n_embd": 64, "n_head": 2, "n_positions": 64}
        steps, seq, batch, max_bytes = 2, 64, 2, 20_000
    else:
        config = {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 256}
        steps, seq, batch, max_bytes = args.steps, 256, 8, 1_000_000
    model = CausalLMModule(model_type="gpt2", config=config, learning_rate=1e-3, warmup_steps=min(10, steps))
    data = StdlibTextDataModule(seq_len=seq, batch_size=batch, max_bytes=max_bytes)

    callbacks: list[L.Callback] = [LowBitOptimizer(kind="adamw8bit")]
    if args.in_backward:
        callbacks.append(OptimizerInBackward())
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
        limit_val_batches=0 if args.smoke else 4, val_check_interval=min(100, steps),
    )
    trainer.fit(model, data)

    optimizer = trainer.optimizers[0]
    n_params = sum(p.numel() for p in model.parameters())
    n_8bit = sum(1 for s in optimizer.state.values() if s["state1"].dtype == torch.uint8)
    print(
        f"{type(optimizer).__name__}: {optimizer_state_bytes(optimizer) / n_params:.2f} B of optimizer state per "
        f"parameter ({n_8bit} of {len(optimizer.state)} tensors in 8 bit); fp32 AdamW would hold 8."
    )


if __name__ == "__main__":
    main()

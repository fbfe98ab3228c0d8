"""8-bit AdamW moments inside the host step: ``LowBitOptimizer("adamw8bit")`` under ``lowmem_offload`` and
``lowmem_offload_params``, with and without ``optimizer_in_backward=True``, against bitsandbytes' ``AdamW8bit`` used by
hand on fp32 masters in plain PyTorch (``reference_loop``), step by step.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.helpers.runif import RunIf
from tests.helpers.streams import assert_copies_were_deferred
from tests.strategies.test_offload_integration import LM, Batches, batches_of, reference_loop, trainer

pytestmark = [pytest.mark.bnb, pytest.mark.integration, RunIf(bitsandbytes=True)]
MIN_8BIT = 256  # every matrix of the tiny GPT-2 gets 8-bit moments; biases and norms keep 32-bit ones


class Snapshots(Callback):
    """The masters after every step, the optimizer's class, and the host bytes/param by part at the end."""

    def __init__(self) -> None:
        self.masters: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.masters.append({n: m.detach().clone() for n, m in trainer.strategy.masters.items()})

    def on_train_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.optimizer = type(opt).__name__
        self.state_dtypes = {n: opt.state[m]["state1"].dtype for n, m in trainer.strategy.masters.items()}
        self.host = trainer.strategy.host_bytes_per_param()


@pytest.mark.parametrize("offload_params", [False, True], ids=["offload", "offload_params"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["serial", "in_backward"])
def test_8bit_adamw_steps_like_bitsandbytes_by_hand(offload_params, in_backward, transfer_mode):
    """The masters equal the hand-written loop's at every step (``torch.equal``: the same bitsandbytes kernel on the
    same fp32 masters and gradients; measured max |diff| 0). Host optimizer state: masters 4 + ~2 B/param."""
    steps = 5
    torch.manual_seed(0)
    module = LM("adamw")
    data = Batches(2 * steps)
    want: list[dict[str, torch.Tensor]] = []
    reference_loop(module, batches_of(data, 2), precision="bf16-true", kind="adamw8bit", fused=None, steps=steps,
                   accumulate=1, clip=None, snapshots=want, min_8bit_size=MIN_8BIT)
    snaps = Snapshots()
    strategy = OffloadStrategy(optimizer_in_backward=in_backward, offload_params=offload_params)
    trainer(strategy=strategy, steps=steps, callbacks=[LowBitOptimizer("adamw8bit", min_8bit_size=MIN_8BIT), snaps]).fit(
        module, DataLoader(data, batch_size=2))
    assert snaps.optimizer == "AdamW8bit" and set(snaps.state_dtypes.values()) == {torch.uint8, torch.float32}
    assert len(snaps.masters) == steps
    for step, (got, ref) in enumerate(zip(snaps.masters, want)):
        assert got.keys() == ref.keys()
        for name, m in ref.items():
            assert torch.equal(got[name], m), f"{name} differs at step {step}: max |diff| {(got[name] - m).abs().max()}"
    assert snaps.host.get("gradients", 0.0) == (0.0 if in_backward else pytest.approx(4.0))
    # fp32 masters (4) + 8-bit moments (2 B + absmax) and the 32-bit moments of the small tensors
    assert 5.0 < snaps.host["optimizer_state"] < 6.5, snaps.host
    assert_copies_were_deferred(transfer_mode)


def test_stable_embedding_under_optimizer_in_backward_and_streaming():
    """bitsandbytes finds its per-parameter override (32-bit state for the embeddings) though the host step hands it
    one master at a time."""
    torch.manual_seed(0)
    snaps = Snapshots()
    strategy = OffloadStrategy(optimizer_in_backward=True, offload_params=True)
    callbacks = [LowBitOptimizer("adamw8bit", min_8bit_size=MIN_8BIT, stable_embedding=True), snaps]
    trainer(strategy=strategy, steps=2, callbacks=callbacks).fit(LM("adamw"), DataLoader(Batches(4), batch_size=2))
    embeddings = {n for n in snaps.state_dtypes if n.endswith(("wte.weight", "wpe.weight"))}
    assert len(embeddings) == 2 and all(snaps.state_dtypes[n] == torch.float32 for n in embeddings)
    assert snaps.state_dtypes["model.transformer.h.0.attn.c_attn.weight"] == torch.uint8

"""lowmem_offload's host-RAM check counts the state of the optimizer that really steps (a ``LeanOptimizer``'s, not the
configured AdamW's 8 B/param); each figure against the real tensors after ``Trainer.fit``, and a run that fits only by
the right count is allowed (refused by one byte less)."""

from __future__ import annotations

import importlib.util

import lightning as L
import pytest
import torch

import lightning_lowmem  # noqa: F401  (registers lowmem_offload)
from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
from lightning_lowmem.core import host_memory as _host_memory
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore:.*does not have many workers.*")]

PACKAGES = {"galore": "galore_torch", "apollo": "apollo_torch", "apollo_mini": "apollo_torch",
            "adam_mini": "adam_mini", "adamw8bit": "torchao", "adamw4bit": "torchao"}
#: rank 8 (the defaults, 128 and 256, are above this model's sides); APOLLO-Mini is rank 1 already
OPTIONS = {"galore": {"rank": 8}, "apollo": {"rank": 8}}


class Model(L.LightningModule):
    """An embedding, two linears and a head: 2-D weights to project, and 4608-value ones torchao quantizes."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 48)
        self.a, self.b = torch.nn.Linear(48, 96), torch.nn.Linear(96, 48)
        self.head = torch.nn.Linear(48, 64, bias=False)

    def training_step(self, batch, batch_idx):
        return self.head(self.b(torch.tanh(self.a(self.emb(batch[0]))))).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        tokens = torch.randint(0, 64, (16, 4), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)


def trainer_of(strategy, callbacks=(), steps=2):
    return L.Trainer(accelerator="cpu", strategy=strategy, precision="bf16-true", max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=list(callbacks))


def fit(strategy, callbacks=(), steps=2):
    trainer = trainer_of(strategy, callbacks, steps)
    trainer.fit(Model())
    return trainer


def predicted(strategy, callbacks=()):
    """The check's figure, by part, with the Trainer's precision (bf16 compute weights beside the masters)."""
    model, trainer = Model(), trainer_of(strategy, callbacks)
    return trainer.strategy.host_bytes_needed(model, [model.configure_optimizers()], callbacks=trainer.callbacks)


def real_state_bytes(optimizer):
    """Every tensor the optimizer's state holds, by hand: torchao's moments by their codes, scales and map, GaLore's
    and APOLLO's projection matrix on the projector object."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if hasattr(value, "codes"):
                parts = [value.codes, value.scale, value.qmap]
            elif isinstance(value, torch.Tensor):
                parts = [value]
            else:
                parts = [getattr(value, "ortho_matrix", None)]
            total += sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))
    return total


@pytest.mark.parametrize("kind", list(PACKAGES))
def test_lean_state_is_counted_as_the_swapped_optimizer_keeps_it(kind):
    if importlib.util.find_spec(PACKAGES[kind]) is None:
        pytest.skip(f"{PACKAGES[kind]} is not installed")
    callback = LeanOptimizer(kind, **OPTIONS.get(kind, {}))
    expected = predicted(OffloadStrategy(), [callback])["optimizer_state"]
    adamw = predicted(OffloadStrategy())["optimizer_state"]
    real = real_state_bytes(fit(OffloadStrategy(), [callback]).optimizers[0])
    if kind == "adam_mini":
        # an upper bound: one second moment per row of each 2-D weight; this model's names match no rule of
        # Adam-mini's, so it keeps one per tensor
        rows = 64 + 96 + 48 + 64
        assert real <= expected <= real + 4 * rows
    else:
        assert expected == real
    assert expected < 0.65 * adamw


def _available(monkeypatch, nbytes):
    class Host:
        available = nbytes

    monkeypatch.setattr(_host_memory.psutil, "virtual_memory", lambda: Host())


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None, reason="galore-torch is not installed")
def test_a_lean_run_that_fits_only_by_its_own_state_is_allowed(monkeypatch):
    callback = LeanOptimizer("galore", rank=8)
    lean = predicted(OffloadStrategy(), [callback])["total"]
    adamw = predicted(OffloadStrategy())["total"]
    assert lean < adamw
    _available(monkeypatch, lean)
    assert fit(OffloadStrategy(), [LeanOptimizer("galore", rank=8)]).global_step == 2
    with pytest.raises(_host_memory.HostMemoryError, match="LowBitOptimizer") as exc:
        fit(OffloadStrategy())  # the configured AdamW's state does not fit there
    _available(monkeypatch, lean - 1)
    with pytest.raises(_host_memory.HostMemoryError) as exc:
        fit(OffloadStrategy(), [LeanOptimizer("galore", rank=8)])
    state = predicted(OffloadStrategy(), [callback])["optimizer_state"]
    assert f"optimizer state {state / 2**10:.2f} KiB" in str(exc.value)
    assert "LowBitOptimizer" not in str(exc.value)  # it already replaces the optimizer: no 8-bit advice


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (pip install lightning-lowmem[torchao])")
@pytest.mark.parametrize("kind", ["adamw8bit", "adamw4bit"])
def test_torchao_scales_and_map_are_fp32_for_a_bf16_parameter(kind):
    from torchao.optim import AdamW4bit, AdamW8bit

    from lightning_lowmem.callbacks.lean_optimizer.state_bytes import torchao_bytes

    p = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    opt = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[kind]([p])
    p.grad = torch.randn_like(p)
    opt.step()
    assert real_state_bytes(opt) == torchao_bytes(p.numel(), kind, None, param_bytes=2)
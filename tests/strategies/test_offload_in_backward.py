"""``OffloadStrategy(optimizer_in_backward=True)`` steps each master alone as its gradient reaches the host.

Each case trains the same module through ``Trainer.fit`` with the step in backward and with the normal step after
backward (``optimizer_in_backward=False``, which ``tests/strategies/test_offload_integration.py`` holds to plain
Lightning), and compares the weights, the buffers and the optimizer state with ``torch.equal``. On the CUDA transfer
logic (the deferred stand-in) the gradients are handed over as their copies land, in completion orders drawn at random.
"""

from __future__ import annotations

import threading
import warnings

import lightning as L
import pytest
import torch

from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

DIM, N_BATCHES = 8, 6


class Net(L.LightningModule):
    """Linear layers around a BatchNorm (running statistics: buffers); records every optimizer step call."""

    def __init__(self, optimizer: str = "adamw", fail_at: int | None = None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.optimizer, self.fail_at, self.step_threads = optimizer, fail_at, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=0.02)

        def pre_hook(*_):
            self.step_threads.append(threading.get_ident())
            if self.fail_at is not None and len(self.step_threads) == self.fail_at:
                raise RuntimeError("planted optimizer error")

        opt.register_step_pre_hook(pre_hook)
        return opt


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N_BATCHES * 4, DIM, generator=g), torch.randn(N_BATCHES * 4, 1, generator=g) * 3
    return [(x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]) for i in range(N_BATCHES)]


class Checkpointed(Net):
    """Two blocks under ``torch.utils.checkpoint``: ``shared`` applies the same block twice (its weights' gradient
    hooks fire once in each reentrant segment's inner backward), else two blocks of their own."""

    def __init__(self, reentrant: bool = True, shared: bool = True, **kw):
        super().__init__(**kw)
        self.reentrant, self.shared = reentrant, shared
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(1 if shared else 2))

    def training_step(self, batch, batch_idx):
        x = torch.tanh(self.net[1](self.net[0](batch[0])))
        for k in range(2):
            block = self.blocks[0 if self.shared else k]
            x = torch.utils.checkpoint.checkpoint(lambda t, m=block: torch.tanh(m(t)), x, use_reentrant=self.reentrant)
        return torch.nn.functional.mse_loss(self.net[5](x).float(), batch[1].float())


def _fit(in_backward: bool, *, precision="bf16-true", progress=None, seed=0, net=None, module=Net, **trainer_kw):
    torch.manual_seed(0)
    module = module(**(net or {}))
    strategy = OffloadStrategy(optimizer_in_backward=in_backward)
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision=precision, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
    ops = (lambda: DeferredOps(progress, seed=seed)) if progress is not None else None
    with warnings.catch_warnings(), cpu_stand_in(ops):
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_data(), batch_size=None))
    opt_state = trainer.optimizers[0].state
    state = [(k, v.clone()) for p in module.parameters() for k, v in sorted(opt_state.get(p, {}).items())
             if isinstance(v, torch.Tensor)]
    return module, [t.detach().clone() for t in (*module.parameters(), *module.buffers())], state, strategy


@pytest.mark.parametrize("progress", [None, "random"])
def test_a_weight_whose_gradient_arrives_twice_in_one_backward_is_refused(progress):
    """A block shared by two reentrant-checkpointed segments: each inner backward hands over part of its gradient, and
    stepping at the first part cannot be plain Lightning's step with their sum (before: trained silently otherwise)."""
    with pytest.raises(ValueError, match=r"`blocks\.0\.(weight|bias)` arrived twice in one backward.*"
                                           r"use_reentrant=False.*optimizer_in_backward=False"):
        _fit(True, module=Checkpointed, progress=progress)


@pytest.mark.parametrize("reentrant, shared", [(True, False), (False, True)])
def test_checkpointed_blocks_whose_gradients_arrive_once_step_exactly(reentrant, shared):
    _same(module=Checkpointed, net={"reentrant": reentrant, "shared": shared}, progress="random")


def _same(**kw):
    module, want, want_state, _ = _fit(False, **kw)
    assert module.step_threads
    module, got, got_state, strategy = _fit(True, **kw)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(want, got))
    assert len(want_state) == len(got_state) > 0
    for (ka, a), (kb, b) in zip(want_state, got_state):
        assert ka == kb and torch.equal(a, b), ka
    return module, strategy


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
@pytest.mark.parametrize("progress", [None, "eager"])
def test_each_master_steps_alone_as_with_the_normal_step(optimizer, precision, progress):
    module, _ = _same(precision=precision, net={"optimizer": optimizer}, progress=progress)
    assert len(module.step_threads) == N_BATCHES * len(list(module.parameters()))  # one call per parameter and step


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_completion_orders_of_the_stream_stand_in(seed):
    """On the CUDA transfer's one staging ring (two of the largest gradients: it wraps many times a step, each master
    stepped as the ring needs its slot, during backward)."""
    _same(progress="random", seed=seed)


def test_an_error_in_a_step_is_raised_by_fit():
    with pytest.raises(RuntimeError, match="planted optimizer error"):
        _fit(True, net={"fail_at": 3})

"""``OffloadStrategy(optimizer_in_backward=True)`` steps each master on a host worker while backward goes on.

Each case trains the same module through ``Trainer.fit`` with the step in backward and with the normal step after
backward (``optimizer_in_backward=False``, which ``tests/strategies/test_offload_integration.py`` holds to plain
Lightning), and compares the weights, the buffers and the optimizer state with ``torch.equal``. On the CUDA transfer
logic (the deferred stand-in) each gradient goes to the worker as its copy lands, so completion orders are drawn at
random, and the stepped masters are rounded into their staging slots by the worker (counted).
"""

from __future__ import annotations

import threading
import warnings

import lightning as L
import pytest
import torch

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in
from lightning_lowmem.strategies.offload.host_worker import HostWorker
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from lightning_lowmem.strategies.offload.transfer import StreamTransfer

DIM, N_BATCHES = 8, 6


class Net(L.LightningModule):
    """Linear layers around a BatchNorm (running statistics: buffers); records the thread of every optimizer step."""

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


@pytest.fixture
def handed(monkeypatch):
    """How many steps were handed to the worker from inside backward (the hook) and after it (the drain), and how
    many stepped masters the worker rounded into staging slots."""
    counts = {"in_backward": 0, "after": 0, "staged": 0}
    submit, stage = HostWorker.submit, StreamTransfer.stage_weights

    def counting_submit(self, fn, *args, nbytes=0):
        counts["in_backward" if torch_internals.in_backward() else "after"] += 1
        return submit(self, fn, *args, nbytes=nbytes)

    def counting_stage(self, pairs):
        counts["staged"] += len(pairs)
        return stage(self, pairs)

    monkeypatch.setattr(HostWorker, "submit", counting_submit)
    monkeypatch.setattr(StreamTransfer, "stage_weights", counting_stage)
    return counts


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_steps_run_on_the_host_worker_not_the_autograd_thread(handed, optimizer, precision):
    module, strategy = _same(precision=precision, net={"optimizer": optimizer}, progress="eager")
    main = threading.get_ident()  # NOTE: CPU autograd runs backward on the thread that called it
    assert module.step_threads and main not in module.step_threads
    assert set(module.step_threads) <= strategy._in_backward.threads
    n_params = len(list(module.parameters()))
    assert handed["in_backward"] == N_BATCHES * n_params and handed["after"] == 0  # NOTE: "eager": copies land at once


def test_on_the_plain_cpu_path_each_step_runs_in_the_hook():
    """Backward and the step share the CPU's cores there: a worker would only add the hand-over."""
    module, strategy = _same()
    assert set(module.step_threads) == {threading.get_ident()} and not strategy._in_backward.threads


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_completion_orders_of_the_stream_stand_in(handed, seed):
    module, _ = _same(progress="random", seed=seed)
    n_params = len(list(module.parameters()))
    assert handed["in_backward"] + handed["after"] == N_BATCHES * n_params
    assert handed["in_backward"] > 0  # NOTE: copies that land during backward go to the worker then (the rest at the drain)
    assert handed["staged"] == N_BATCHES * n_params  # NOTE: every stepped master rounded by the worker, none by the upload


@pytest.mark.parametrize(("bound", "most"), [(0, 400), (1000, 800), (10**6, 4000)])
def test_the_queue_keeps_at_most_its_bound_alive(bound, most):
    release, done = threading.Event(), []
    worker = HostWorker("test", max_bytes=bound)
    worker.submit(release.wait)  # NOTE: the worker is busy until the bound makes the queue wait for it
    for k in range(10):
        if 400 * (k + 1) > bound:
            release.set()  # NOTE: this submit waits for the oldest items: they must be able to finish
        worker.submit(done.append, k, nbytes=400)
    release.set()
    worker.wait()
    assert done == list(range(10)) and worker.most_bytes == most
    worker.close()


def test_a_gradient_of_its_own_counts_toward_the_bound_a_staging_slot_does_not(monkeypatch):
    seen = []
    submit = HostWorker.submit

    def recording_submit(self, fn, *args, nbytes=0):
        seen.append(nbytes)
        return submit(self, fn, *args, nbytes=nbytes)

    monkeypatch.setattr(HostWorker, "submit", recording_submit)
    _fit(True, progress="eager")
    assert seen and set(seen) == {0}  # NOTE: every gradient came through its staging slot


def test_an_error_in_a_step_on_the_worker_is_raised_by_fit():
    with pytest.raises(RuntimeError, match="planted optimizer error"):
        _fit(True, net={"fail_at": 3})


def test_the_worker_runs_every_step_then_raises_the_first_error():
    worker, done = HostWorker("test", max_bytes=0), []

    def step(k):
        done.append(k)
        if k in (1, 2):
            raise ValueError(f"step {k}")

    for k in range(4):
        worker.submit(step, k)
    with pytest.raises(ValueError, match="step 1"):
        worker.wait()
    assert done == [0, 1, 2, 3]
    worker.close()


def test_under_a_dispatch_mode_the_work_runs_on_the_calling_thread():
    """A dispatch mode (MemoryTracker, the dry run's FakeTensorMode) sees only its own thread's ops."""
    seen = []

    class Ops(torch_internals.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    worker, t = HostWorker("test", max_bytes=0), torch.ones(3)
    with Ops():
        worker.submit(torch.Tensor.add_, t, 1.0)
    assert not worker.threads and seen and torch.equal(t, torch.full((3,), 2.0))
    worker.close()


def test_bad_bound_is_refused():
    with pytest.raises(ValueError, match=r"HostWorker\('x', max_bytes=-1\)"):
        HostWorker("x", max_bytes=-1)


def test_unstage_drops_only_the_slots_named():
    transfer = StreamTransfer(torch.device("cpu"), [torch.zeros(2), torch.zeros(3)], DeferredOps("eager"))
    transfer.stage_weights([(0, torch.ones(2)), (1, torch.ones(3))])
    transfer.unstage([1])
    assert transfer._staged == {0}
    transfer.unstage()
    assert not transfer._staged

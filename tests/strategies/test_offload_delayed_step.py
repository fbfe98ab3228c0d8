"""``OffloadStrategy(host_pass="delayed")``: DeepSpeed's delayed parameter update, against a plain-PyTorch loop.

The reference (:func:`reference`) is written from the definition: each window's gradients are taken at the compute
weights, clipped as serially, and handed over with the learning rate of that moment; the step handed over the window
before is applied then (to fp32 masters, with its own learning rate), and its weights become the compute weights. So
window ``t+1`` computes on the weights before step ``t``. At the end of each epoch (and of training) the pending step
is applied at once. Weights, buffers (BatchNorm's running statistics) and the optimizer state must match bit for bit
(``32-true``, ``host_optimizer="as_is"``: the same kernels).
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lowmem import LowBitOptimizer
from lightning_lowmem.strategies.offload.delayed_step import DelayedLanding, DelayedStep
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.test_resume_across_processes import differences, run_child

DIM, N_BATCHES, LR = 6, 6, 0.05


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR)


class Net(L.LightningModule):
    def __init__(self, kind: str = "adamw", nan_at: int | None = None, write_at: int | None = None):
        super().__init__()
        self.net, self.kind, self.nan_at, self.write_at = _net(), kind, nan_at, write_at
        self.step_threads: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if batch_idx == self.nan_at:
            loss = loss * float("nan")  # NOTE: non-finite gradients; the BatchNorm statistics stay finite
        if batch_idx == self.write_at:
            with torch.no_grad():
                self.net[0].weight.clamp_(-0.1, 0.1)  # NOTE: a write to the compute weights outside any hook
        return loss

    def configure_optimizers(self):
        opt = _optimizer(self.kind, self.parameters())
        opt.register_step_pre_hook(lambda *_: self.step_threads.append(threading.get_ident()))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, DIM, generator=g), torch.randn(4, 1, generator=g)) for _ in range(N_BATCHES)]


def fit(*, epochs=2, accumulate=1, clip=None, host_pass="delayed", callbacks=(), net=Net, strategy_kw=None, **net_kw):
    torch.manual_seed(0)
    module = net(**net_kw)
    strategy = OffloadStrategy(host_pass=host_pass, host_optimizer="as_is", **(strategy_kw or {}))
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision="32-true", max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accumulate_grad_batches=accumulate, gradient_clip_val=clip, callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_batches(), batch_size=None))
    opt = trainer.optimizers[0]
    state = [v.clone() for p in module.parameters() for _, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]
    return module, [t.detach().clone() for t in (*module.state_dict().values(),)], state, strategy


def reference(*, epochs=2, accumulate=1, clip=None, kind="adamw", nan_at=None):
    """Delayed updates by hand: compute weights ``net``, fp32 masters stepped one window late."""
    torch.manual_seed(0)
    net = _net()
    masters = [nn.Parameter(p.detach().clone()) for p in net.parameters()]
    opt = _optimizer(kind, masters)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    pending = None  # (gradients, learning rate) of the step handed over

    def land():
        nonlocal pending
        if pending is None:
            return
        grads, lr = pending
        now = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = lr
        for m, g in zip(masters, grads):
            m.grad = g
        opt.step()
        opt.param_groups[0]["lr"] = now
        with torch.no_grad():
            for p, m in zip(net.parameters(), masters):
                p.copy_(m)
        pending = None

    batches = _batches()
    for _ in range(epochs):
        for w in range(len(batches) // accumulate):
            grads = None
            for b in range(w * accumulate, (w + 1) * accumulate):
                x, y = batches[b]
                loss = nn.functional.mse_loss(net(x), y) * (float("nan") if b == nan_at else 1.0) / accumulate
                got = torch.autograd.grad(loss, list(net.parameters()))
                grads = list(got) if grads is None else [a + g for a, g in zip(grads, got)]
            if clip is not None:
                holders = [torch.zeros_like(m) for m in masters]
                for h, g in zip(holders, grads):
                    h.grad = g
                torch.nn.utils.clip_grad_norm_(holders, clip)
            land()  # NOTE: where the guard skips this window's step, the pending one lands all the same
            if all(bool(g.isfinite().all()) for g in grads):
                pending = (grads, opt.param_groups[0]["lr"])
            sched.step()  # NOTE: Lightning steps the scheduler after a skipped step too
        land()  # NOTE: the end of the epoch
    state = [v.clone() for m in masters for _, v in sorted(opt.state[m].items()) if torch.is_tensor(v)]
    return [t.detach().clone() for t in net.state_dict().values()], state


def _equal(got, want):
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (2, None), (1, 0.05)])
def test_matches_the_delayed_update_written_by_hand(kind, accumulate, clip):
    module, weights, state, strategy = fit(kind=kind, accumulate=accumulate, clip=clip)
    want_weights, want_state = reference(kind=kind, accumulate=accumulate, clip=clip)
    _equal(weights, want_weights)
    _equal(state, want_state)
    assert strategy._delayed.submitted == 2 * N_BATCHES // accumulate
    main = threading.get_ident()
    assert module.step_threads and main not in module.step_threads


def test_differs_from_the_serial_step():
    """The delayed update changes what is trained (the reference above is not plain training)."""
    _, delayed, _, _ = fit()
    _, serial, _, _ = fit(host_pass="serial")
    assert not all(torch.equal(a, b) for a, b in zip(delayed, serial))


def test_a_skipped_step_lands_the_pending_one():
    _, weights, state, strategy = fit(nan_at=3, epochs=1)
    want_weights, want_state = reference(nan_at=3, epochs=1)
    _equal(weights, want_weights)
    _equal(state, want_state)
    assert strategy.skipped_steps == 1


def test_the_clip_and_the_guard_run_on_the_worker(monkeypatch):
    """Off the critical path: the main thread neither clips nor reads the gradients for the guard."""
    from lightning_lowmem.strategies.offload.masters import HostMasters

    want_weights, want_state = reference(clip=0.05, nan_at=3)
    clip_threads, guard_threads = [], []
    clip, guard = torch.nn.utils.clip_grad_norm_, HostMasters.nonfinite_grads
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **k: clip_threads.append(threading.get_ident()) or clip(*a, **k))
    monkeypatch.setattr(HostMasters, "nonfinite_grads",
                        lambda *a, **k: guard_threads.append(threading.get_ident()) or guard(*a, **k))
    _, weights, state, _ = fit(clip=0.05, nan_at=3)
    _equal(weights, want_weights)
    _equal(state, want_state)
    assert len(clip_threads) == 2 * N_BATCHES and threading.get_ident() not in clip_threads
    assert not guard_threads  # NOTE: the worker checks the stand-ins' gradients itself


class ClipsItself(Net):
    """Overrides ``configure_gradient_clipping`` and reads the gradients after its clip (so it clips on the main
    thread, before the step is handed over): the norms it saw."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[float] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.seen.append(float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])))


def test_an_overridden_configure_gradient_clipping_clips_before_the_step_is_handed_over():
    module, weights, state, _ = fit(clip=0.05, net=ClipsItself)
    want_weights, want_state = reference(clip=0.05)
    _equal(weights, want_weights)
    _equal(state, want_state)
    assert len(module.seen) == 2 * N_BATCHES and max(module.seen) <= 0.05 * (1 + 1e-5)


def test_nonfinite_raise_comes_when_the_step_lands_naming_its_global_step():
    from lightning_lowmem.strategies.offload.host_step import NonFiniteGradientError

    with pytest.raises(NonFiniteGradientError, match=r"at global step 3 in `net\.0\.weight`"):
        fit(nan_at=3, strategy_kw={"nonfinite": "raise"})


def test_consecutive_skips_are_counted_as_the_steps_land():
    from lightning_lowmem.strategies.offload.host_step import NonFiniteGradientError

    class AlwaysNan(Net):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * float("nan")

    with pytest.raises(NonFiniteGradientError, match=r"2 optimizer steps in a row .*the last at global step 1,"):
        fit(net=AlwaysNan, strategy_kw={"max_consecutive_skips": 2})


class ReadsWeights(L.Callback):
    """Reads the module's weights where plain Lightning shows the trained ones: after the epoch, before validation."""

    def __init__(self):
        self.seen: list[tuple[str, torch.Tensor]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen.append(("epoch_end", pl_module.net[0].weight.detach().clone()))

    def on_train_end(self, trainer, pl_module):
        self.seen.append(("train_end", pl_module.net[0].weight.detach().clone()))


def test_the_step_lands_before_epoch_end_and_train_end_hooks_read_the_weights():
    reads = ReadsWeights()
    module, _, _, strategy = fit(callbacks=[reads])
    assert [k for k, _ in reads.seen] == ["epoch_end", "epoch_end", "train_end"]
    after_one_epoch = reference(epochs=1)[0][0]  # NOTE: net.0.weight, the first entry of the state dict
    assert torch.equal(reads.seen[0][1], after_one_epoch)
    assert torch.equal(reads.seen[-1][1], module.net[0].weight) and strategy._delayed.pending is None
    assert not any(isinstance(cb, DelayedLanding) for cb in module.trainer.callbacks)  # NOTE: removed after fit


class ReadsMasters(L.Callback):
    """User hooks that see the masters and their gradients (inside the strategy's view): they wait for the step."""

    def __init__(self):
        self.norms: list[float] = []

    def on_before_zero_grad(self, trainer, pl_module, optimizer):  # NOTE: between a forward and its backward
        self.norms.append(float(pl_module.net[0].weight.norm()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.norms.append(float(pl_module.net[0].weight.grad.norm()))


def test_hooks_that_read_the_masters_wait_for_the_step_and_change_nothing_trained():
    reads = ReadsMasters()
    _, weights, state, _ = fit(callbacks=[reads])
    want_weights, want_state = reference()
    _equal(weights, want_weights)
    _equal(state, want_state)
    assert len(reads.norms) == 4 * N_BATCHES


def test_a_write_to_the_compute_weights_while_a_step_is_pending_is_refused():
    with pytest.raises(RuntimeError, match=r"host_pass='delayed'.*`net\.0\.weight`.*masters_view\(write_back=True\)"):
        fit(write_at=2)


@pytest.mark.parametrize(("net_kw", "strategy_kw", "callbacks", "match"), [
    ({"kind": "rmsprop"}, {}, [], r"cannot step `RMSprop`: it steps torch's `Adam`, `AdamW` and `SGD` only"),
    ({}, {"optimizer_in_backward": True}, [], r"`optimizer_in_backward=True` both move the step"),
])
def test_what_it_cannot_run_is_refused_before_the_first_step(net_kw, strategy_kw, callbacks, match):
    torch.manual_seed(0)
    module = Net(**net_kw)
    before = [p.detach().clone() for p in module.parameters()]
    trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(host_pass="delayed", **strategy_kw), max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, torch.utils.data.DataLoader(_batches(), batch_size=None))
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_an_8bit_optimizer_swapped_in_is_refused():
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(host_pass="delayed"), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[LowBitOptimizer()])
    with pytest.raises(ValueError, match=r"cannot step `AdamW8bit`"):
        trainer.fit(Net(), torch.utils.data.DataLoader(_batches(), batch_size=None))


class ManualNet(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]))
        opt.step()


class ZeroInPlace(Net):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize(("module", "match"), [
    (ManualNet, r"needs automatic optimization"),
    (ZeroInPlace, r"`ZeroInPlace.optimizer_zero_grad` is overridden"),
])
def test_what_it_cannot_run_is_refused_at_setup(module, match):
    trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(host_pass="delayed"), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module(), torch.utils.data.DataLoader(_batches(), batch_size=None))


def test_the_host_ram_check_counts_a_second_set_of_gradient_buffers():
    module = Net()
    opt = module.configure_optimizers()["optimizer"]
    n = sum(p.numel() for p in module.parameters())
    for mode, per_param in (("serial", 4), ("delayed", 8)):
        need = OffloadStrategy(host_pass=mode).host_bytes_needed(module, [opt])
        assert need["gradient_buffers"] == per_param * n


def test_the_dry_run_counts_the_landing_slots_on_cuda():
    """CUDA: the pinned landing slots the worker rounds into are a second set of staging buckets (planned by the
    host-RAM check in ``test_deferred_pinned_staging_counted_exactly``); the dry run's CUDA correction counts them."""
    from lightning_lowmem import estimate_memory

    def staging(**kw):
        est = estimate_memory({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2}, 1, 16,
                              precision="bf16-true", target="cuda", strategy=OffloadStrategy(**kw))
        return next(c.bytes for c in est.corrections if c.name == "pinned_staging")

    serial = staging(host_pass="serial")
    assert serial > 0 and staging(host_pass="delayed") == 2 * serial
    assert staging(host_pass="delayed", offload_params=True) == staging(offload_params=True)  # NOTE: landed by the host


def test_the_worker_steps_over_stand_ins_and_gives_the_buffers_back():
    from lightning_lowmem.strategies.offload.masters import HostMasters

    masters = HostMasters()
    masters.build(nn.Linear(3, 2), loading=False, precision=None, grad_buffers=True)
    opt = torch.optim.AdamW(masters.p_host, lr=0.1)
    delayed = DelayedStep()
    pool = {id(b) for b in masters.grad_host}
    for _ in range(3):
        for i, p in enumerate(masters.p_host):
            p.grad = None  # NOTE: what the optimizer's zero_grad does at the next window
            masters.fold(i, torch.ones_like(p))
        delayed.submit(opt, masters)
        assert all(masters.grad_host[i] is not masters.p_host[i].grad for i in range(2))  # NOTE: the next window's
        pool |= {id(b) for b in masters.grad_host}
        with pytest.raises(RuntimeError, match="still pending"):
            delayed.submit(opt, masters)
        assert delayed.take_due() is opt
    # NOTE: two sets of buffers in all, taking turns: none allocated after the first window
    assert len(pool) == 4 and {id(b) for b in (*masters.grad_host, *delayed._spare.values())} == pool
    assert int(opt.state[masters.p_host[0]]["step"]) == 3
    delayed.close()


@pytest.mark.slow
def test_resumes_in_a_new_process_identically(tmp_path):
    """A checkpoint lands the pending step: the uninterrupted run and the resumed one (with the same
    ``ModelCheckpoint``) both continue from landed weights after it, and land again at the next checkpoint.

    NOTE: so a checkpoint changes what the run trains after it (its step lands one window early)."""
    base = {"strategy": "lowmem_offload", "strategy_args": {"host_pass": "delayed"}, "precision": "32-true",
            "steps": 7, "ckpt_dir": str(tmp_path), "save_every": 3}
    run_child(dict(base, out=str(tmp_path / "straight.pt")))
    run_child(dict(base, resume=str(tmp_path / "step=3.ckpt"), out=str(tmp_path / "resumed.pt")))
    straight, resumed = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert int(straight["global_step"]) == int(resumed["global_step"]) == 7
    assert not differences(straight, resumed)


@pytest.mark.parametrize("variant", ["offload_params", "cuda_transfer_logic"])
def test_parameter_streaming_and_the_cuda_transfer_logic_change_nothing(variant, monkeypatch):
    """The delayed update on a GPT-2 whose blocks stream from the host, and on the CUDA transfer logic (the deferred
    stand-in, copies landing in random order), equals it on the plain CPU path (bf16 compute weights). On the CUDA
    logic the worker rounds each stepped master into its landing slot, and the landing only queues their copies."""
    from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in
    from lightning_lowmem.strategies.offload.transfer import StreamTransfer
    from tests.helpers.models import random_batch, tiny_lm_module

    staged_by, landed, stage_landing, land = [], [], StreamTransfer.stage_landing, StreamTransfer.land
    monkeypatch.setattr(StreamTransfer, "stage_landing",
                        lambda self, pairs: staged_by.append(threading.get_ident()) or stage_landing(self, pairs))
    monkeypatch.setattr(StreamTransfer, "land", lambda self, pairs: landed.append((len(pairs), land(self, pairs))) or landed[-1][1])

    batches = [random_batch(2, 16, seed=i) for i in range(5)]

    def run(offload_params=False, stand_in=False):
        torch.manual_seed(0)
        module = tiny_lm_module("gpt2", config={"n_layer": 2, "n_embd": 32})
        strategy = OffloadStrategy(host_pass="delayed", offload_params=offload_params)
        trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision="bf16-true", max_steps=5, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            gradient_clip_val=1.0)
        with cpu_stand_in(lambda: DeferredOps("random", seed=0)) if stand_in else contextlib.nullcontext():
            trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
        assert strategy._delayed.submitted == 5
        return [p.detach().clone() for p in module.parameters()]

    plain = run()
    other = run(offload_params=True) if variant == "offload_params" else run(stand_in=True)
    _equal(other, plain)
    if variant == "cuda_transfer_logic":
        # NOTE: 4 steps land at the later steps, the 5th at the end of training; each lands every master
        assert len(staged_by) == 5 and threading.get_ident() not in staged_by
        assert len(landed) == 5 and all(n == len(got) > 0 for n, got in landed)
    else:
        assert not staged_by and not landed  # NOTE: the host copies the next window's fetches read: at the landing

"""``OffloadStrategy(host_pass="overlap")``: the overlapped host pass is the serial step bit for bit.

Each case trains the same module twice through ``Trainer.fit``, once with ``host_pass="serial"`` (today's step) and
once with ``"overlap"``, and compares the weights and the optimizer state with ``torch.equal``. Each case also
asserts how many steps the speculative pass kept (``stood``) and how many windows it undid (``restored``: the serial
step ran, or skipped), so a case that silently fell back to the serial path cannot pass as "exact".
"""

from __future__ import annotations

import threading
import warnings

import lightning as L
import pytest
import torch

from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in
from lightning_lowmem.strategies.offload import host_pass as host_pass_module
from lightning_lowmem.strategies.offload.host_pass import HostPass
from lightning_lowmem.strategies.offload.host_pass_checks import why_not_bitsandbytes
from lightning_lowmem.strategies.offload.masters import HostMasters
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from lightning_lowmem.strategies.offload.transfer import StreamTransfer

DIM, N_BATCHES = 8, 8


class Net(L.LightningModule):
    """Three linear layers; ``bad`` lists batch indices whose input holds a NaN."""

    def __init__(self, optimizer: str = "adamw", bad: tuple[int, ...] = (), manual: bool = False):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                       torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.optimizer, self.bad, self.step_threads = optimizer, bad, []
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx in self.bad:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        elif self.optimizer in ("adamw8bit", "lion8bit", "paged_adamw8bit"):
            bnb = pytest.importorskip("bitsandbytes")
            kind = {"adamw8bit": bnb.optim.AdamW8bit, "lion8bit": bnb.optim.Lion8bit,
                    "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[self.optimizer]
            opt = kind(self.parameters(), lr=0.02, min_8bit_size=16)  # NOTE: 8-bit state for every weight here
        elif self.optimizer == "groups":  # a bucket spans both: each parameter must step with its own group's values
            biases = [p for n, p in self.named_parameters() if n.endswith("bias")]
            weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
            opt = torch.optim.AdamW([{"params": biases, "weight_decay": 0.0, "lr": 0.05}, {"params": weights}], lr=0.02)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=0.02)
        opt.register_step_pre_hook(lambda *_: self.step_threads.append(threading.get_ident()))
        return opt


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N_BATCHES * 4, DIM, generator=g), torch.randn(N_BATCHES * 4, 1, generator=g) * 3
    return [(x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]) for i in range(N_BATCHES)]


@pytest.fixture
def counted(monkeypatch):
    """Small buckets (several per step) and counts of the steps the pass kept and undid."""
    counts = {"stood": 0, "restored": 0, "staged": 0}
    monkeypatch.setattr(host_pass_module, "BUCKET_BYTES", 4 * 300)
    stands, restore, stage = HostPass.stands, HostPass.restore, StreamTransfer.stage_weights

    def counting_stage(self, pairs):
        counts["staged"] += len(pairs)
        return stage(self, pairs)

    def counting_stands(self):
        out = stands(self)
        counts["stood"] += out
        return out

    def counting_restore(self, why):
        if not self.restored and self.finished:  # NOTE: a window the pass ran to its end, undone
            counts["restored"] += 1
        return restore(self, why)

    monkeypatch.setattr(HostPass, "stands", counting_stands)
    monkeypatch.setattr(HostPass, "restore", counting_restore)
    monkeypatch.setattr(StreamTransfer, "stage_weights", counting_stage)
    return counts


def _fit(mode, *, module=None, precision="bf16-true", callbacks=(), seed=None, **kw):
    torch.manual_seed(0)
    module = Net(**(module or {}))
    trainer_kw = {k: kw.pop(k) for k in ("accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm")
                  if k in kw}
    strategy = OffloadStrategy(host_pass=mode, **kw)
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision=precision, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=list(callbacks), **trainer_kw)
    loader = torch.utils.data.DataLoader(_data(), batch_size=None)
    ops = (lambda: DeferredOps("random", seed=seed)) if seed is not None else None
    with warnings.catch_warnings(), cpu_stand_in(ops):
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    opt_state = trainer.optimizers[0].state  # NOTE: by parameter (the pass creates the state in gradient order)
    state = [(k, v.clone()) for p in module.parameters() for k, v in sorted(opt_state.get(p, {}).items())
             if isinstance(v, torch.Tensor)]
    return module, [p.detach().clone() for p in module.parameters()], state, strategy.skipped_steps


def _same(counted, want_stood, want_restored=0, **kw):
    _, w_serial, s_serial, skips_serial = _fit("serial", **kw)
    assert counted["stood"] == 0 and counted["restored"] == 0
    _, w_overlap, s_overlap, skips_overlap = _fit("overlap", **kw)
    for a, b in zip(w_serial, w_overlap):
        assert torch.equal(a, b)
    assert len(s_serial) == len(s_overlap) > 0
    for (ka, a), (kb, b) in zip(s_serial, s_overlap):
        assert ka == kb and torch.equal(a, b), ka
    assert skips_serial == skips_overlap
    assert (counted["stood"], counted["restored"]) == (want_stood, want_restored)


@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("host_optimizer", ["auto", "as_is"])
def test_no_clipping_is_exact(counted, accumulate, host_optimizer):
    _same(counted, N_BATCHES // accumulate, accumulate_grad_batches=accumulate, host_optimizer=host_optimizer)


def test_without_the_guard_nothing_steps_twice(counted):
    # NOTE: no guard and no clip take no norms; the tail once took "not yet normed" for "not yet stepped" and stepped
    # every earlier bucket a second time
    _same(counted, N_BATCHES, nonfinite="ignore")


def test_fp32_and_sgd(counted):
    _same(counted, N_BATCHES, precision="32-true", module={"optimizer": "sgd"})


def test_param_groups(counted):
    _same(counted, N_BATCHES, module={"optimizer": "groups"})


@pytest.mark.parametrize("optimizer, clip, seed", [("adamw8bit", None, None), ("adamw8bit", 1e-3, None),
                                                  ("lion8bit", None, None), ("adamw8bit", None, 1), ("adamw8bit", 1e-3, 2)])
def test_bitsandbytes_8bit_optimizers(counted, optimizer, clip, seed):
    # NOTE: 8-bit state quantized in blocks within each tensor: a bucket's step is the full step's for its parameters;
    # `seed`: random completion orders of the stream stand-in
    restored = N_BATCHES if clip else 0
    _same(counted, N_BATCHES - restored, restored, module={"optimizer": optimizer}, gradient_clip_val=clip, seed=seed)


def test_bitsandbytes_paged_or_with_overrides_stays_serial(counted):
    bnb = pytest.importorskip("bitsandbytes")
    _same(counted, 0, module={"optimizer": "paged_adamw8bit"})
    p = torch.nn.Parameter(torch.zeros(4))
    manager = bnb.optim.GlobalOptimManager.get_instance()
    assert why_not_bitsandbytes(bnb.optim.AdamW8bit([p])) is None
    manager.override_config(p, key_value_dict={"optim_bits": 32})  # e.g. StableEmbedding's
    try:
        assert "per-parameter overrides" in why_not_bitsandbytes(bnb.optim.AdamW8bit([p]))
    finally:
        manager.pid2config.pop(id(p), None)


@pytest.mark.parametrize("clip, restored", [(1e3, 0), (1e-3, N_BATCHES)])
def test_norm_clipping_that_does_not_and_that_does_trigger(counted, clip, restored):
    _same(counted, N_BATCHES - restored, restored, gradient_clip_val=clip)


def test_nan_in_one_batch_is_skipped_as_serially(counted):
    # NOTE: the NaN reaches every gradient: that window is undone (what stepped put back) and skipped as serially
    _same(counted, N_BATCHES - 1, 1, module={"bad": (3,)})


def test_nan_with_clipping_and_accumulation(counted):
    _same(counted, 1, 1, module={"bad": (2,)}, gradient_clip_val=1e3, accumulate_grad_batches=4)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_completion_orders_of_the_stream_stand_in(counted, seed):
    # NOTE: on the CUDA transfer logic every stepped bucket is rounded into the staging slots during backward (counted);
    # an undone window (the NaN, the clips that trigger) leaves speculative weights there, which must never be uploaded
    n_params = len(list(Net().parameters()))
    _same(counted, N_BATCHES - 1, 1, module={"bad": (5,)}, gradient_clip_val=1e3, seed=seed)
    assert counted["staged"] >= n_params * (N_BATCHES - 1)
    counted.update(stood=0, restored=0, staged=0)
    _same(counted, 0, N_BATCHES, gradient_clip_val=1e-3, seed=seed, accumulate_grad_batches=1)
    assert counted["staged"] > 0


class Halve(L.Callback):
    """Writes every weight after each step, through the masters (the staged slots are stale then)."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        with trainer.strategy.masters_view(write_back=True), torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(0.5)


def test_weights_written_after_a_staged_step_are_uploaded_as_written(counted):
    _same(counted, N_BATCHES, callbacks=[Halve()], seed=1)
    assert counted["staged"] > 0


class SharedBlock(L.LightningModule):
    """One block applied twice under reentrant checkpointing: its gradient lands twice in one backward, the first
    time into a bucket that steps and stages at once (the first window knows no last bucket)."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.head = torch.nn.Linear(DIM, 24), torch.nn.Linear(24, 24), torch.nn.Linear(24, 1)

    def training_step(self, batch, batch_idx):
        x = self.inp(batch[0])
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.block(t)), x, use_reentrant=True)
        return torch.nn.functional.mse_loss(self.head(x).float(), batch[1].float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)


@pytest.mark.parametrize("progress", ["eager", "random"])
def test_a_gradient_that_lands_twice_after_its_bucket_stepped_and_staged(counted, progress):
    # NOTE: "eager" hands each gradient to the worker as it lands, and the second landing waits for the worker: the
    # bucket has stepped and staged by then (counted); "random" may find the twice-landed gradient first
    def fit(mode):
        torch.manual_seed(0)
        module = SharedBlock()
        trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(host_pass=mode), precision="bf16-true",
                            max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        with warnings.catch_warnings(), cpu_stand_in(lambda: DeferredOps(progress, seed=1)):
            warnings.simplefilter("ignore")
            trainer.fit(module, torch.utils.data.DataLoader(_data(), batch_size=None))
        state = trainer.optimizers[0].state
        return [t.detach().clone() for p in module.parameters() for t in (p, *state[p].values())]

    serial = fit("serial")
    assert counted["staged"] == 0
    for a, b in zip(serial, fit("overlap")):
        assert torch.equal(a, b)
    assert (counted["staged"] > 0 or progress == "random") and counted["stood"] == 0 and counted["restored"] == 3


@pytest.mark.parametrize("accumulate", [1, 4])
def test_value_clipping_is_exact(counted, accumulate):
    # NOTE: 0.01 clamps a good share of this model's gradients (checked below), so the clamp does act
    _same(counted, N_BATCHES // accumulate, gradient_clip_val=0.01, gradient_clip_algorithm="value",
          accumulate_grad_batches=accumulate)
    counted["stood"] = 0
    _, w_clipped, *_ = _fit("overlap", gradient_clip_val=0.01, gradient_clip_algorithm="value")
    _, w_free, *_ = _fit("overlap")
    assert not any(torch.equal(a, b) for a, b in zip(w_clipped, w_free))


@pytest.mark.parametrize("seed", [1, 2])
def test_value_clipping_with_a_nan_under_random_completion_orders(counted, seed):
    # NOTE: a clamp keeps a NaN, so the guard skips that step, serially as in the pass
    _same(counted, N_BATCHES - 1, 1, module={"bad": (4,)}, gradient_clip_val=0.01, gradient_clip_algorithm="value",
          seed=seed)


class GradNorms(L.Callback):
    """A user's callback reading the last step's gradients after the step (plain Lightning shows them unscaled and
    clipped)."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append([None if p.grad is None else p.grad.abs().max().item() for p in pl_module.parameters()])


@pytest.mark.parametrize("case, want", [
    ({"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}, (N_BATCHES, 0)),
    ({"precision": "16-true"}, (N_BATCHES - 3, 3)),  # the first three steps overflow at the initial scale
])
def test_a_user_hook_reading_the_gradients_after_the_step_sees_them_as_serially(counted, case, want):
    serial, overlap = GradNorms(), GradNorms()
    _same(counted, *want, callbacks=[GradNorms()], **case)
    _fit("serial", callbacks=[serial], **case)
    _fit("overlap", callbacks=[overlap], **case)
    assert serial.seen == overlap.seen
    if "gradient_clip_val" in case:
        assert max(max(s) for s in serial.seen) <= 0.01  # they read the clamped ones


def _reference_step(p_ref, grads, clip_value):
    """The serial step: Lightning's value clip on the masters' gradients, then the optimizer."""
    opt = torch.optim.AdamW(p_ref)
    for p, g in zip(p_ref, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_value_(p_ref, clip_value)
    opt.step()
    return opt


def _pass_over(grads_per_param, clip_value, *, again=None, scaler=None):
    masters = HostMasters()
    masters.build(torch.nn.Linear(4, 4), loading=False, precision=None, grad_buffers=True)
    p_ref = [torch.nn.Parameter(p.detach().clone()) for p in masters.p_host]
    opt = torch.optim.AdamW(masters.p_host)
    hp = HostPass(masters, bucket_bytes=4)  # one bucket per parameter: each steps as soon as its gradient lands
    hp.arm(opt, clip_norm=None, guard=scaler is None, clip_value=clip_value, scaler=scaler)
    for i, g in enumerate(grads_per_param):
        assert hp.submit(i, g)
    hp.barrier()
    if again is not None:
        assert hp.submit(0, again)  # NOTE: master 0 stepped already: a second gradient undoes the speculation
    hp.finish()
    return masters, opt, p_ref, hp


def test_value_clipping_turns_an_inf_into_the_clip_as_serially():
    grads = [torch.full((4, 4), 3.0), torch.tensor([float("inf"), -float("inf"), 0.1, -0.2])]
    masters, opt, p_ref, hp = _pass_over(grads, 0.5)
    assert hp.clip_stands(0.5, "value") and hp.stands()  # NOTE: clamped to +-0.5 the inf is finite: no skip
    ref = _reference_step(p_ref, grads, 0.5)
    for a, b in zip(masters.p_host, p_ref):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], ref.state[b]["exp_avg"])
    assert torch.equal(masters.p_host[1].grad, grads[1])  # the landed gradient, its infs unclamped
    hp.disarm(), hp.close()


def test_a_restore_after_value_clipping_finds_the_gradients_unclamped():
    grads = [torch.full((4, 4), 3.0), torch.full((4,), -2.0)]
    again = torch.full((4, 4), -2.8)
    masters, opt, p_ref, hp = _pass_over(grads, 0.5, again=again)
    assert not hp.clip_stands(0.5, "value") and hp.failed == "a gradient arrived twice in one backward"
    # the serial step that follows: clamp(3.0 - 2.8) = 0.2, where a gradient clamped in place would give 0.5 - 2.8
    assert torch.allclose(masters.p_host[0].grad, torch.full((4, 4), 0.2))
    torch.nn.utils.clip_grad_value_(masters.p_host, 0.5)
    opt.step()
    _reference_step(p_ref, [grads[0] + again, grads[1]], 0.5)
    for a, b in zip(masters.p_host, p_ref):
        assert torch.equal(a, b)
    hp.disarm(), hp.close()


def test_a_restore_after_the_pass_stood_in_for_the_unscale_and_the_clip_gives_the_gradients_both():
    # NOTE: a restore at the step (compute weights written by other code after the clip) comes after the precision
    # plugin took the pass's word for the unscale and the clip: the serial step that follows needs both done
    from lightning_lowmem.strategies.offload.loss_scaler import DynamicLossScaler

    grads = [torch.full((4, 4), 96.0), torch.tensor([8.0, -64.0, 0.5, -1.0])]
    before = [g.clone() for g in grads]
    masters, _, p_ref, hp = _pass_over(grads, 0.5, scaler=DynamicLossScaler(init_scale=16.0))
    stepped = [p.detach().clone() for p in masters.p_host]
    assert hp.unscale_stands() and hp.clip_stands(0.5, "value")
    assert not any(torch.equal(a, b) for a, b in zip(stepped, p_ref))  # it stepped
    assert all(torch.equal(p.grad, g) for p, g in zip(masters.p_host, before))  # still scaled and unclamped
    hp.restore("compute weights written by other code before the step")
    for p, p0, g in zip(masters.p_host, p_ref, before):
        assert torch.equal(p, p0) and torch.equal(p.grad, (g / 16.0).clamp(-0.5, 0.5))
    hp.disarm(), hp.close()


def test_a_clip_other_than_the_one_armed_undoes_the_pass():
    masters, _, _, hp = _pass_over([torch.ones(4, 4), torch.ones(4)], 0.5)
    assert not hp.clip_stands(0.25, "value") and hp.restored
    with pytest.raises(ValueError, match=r"HostPass.arm\(clip_norm=1.0, clip_value=0.5\)"):
        hp.arm(torch.optim.SGD(masters.p_host), clip_norm=1.0, guard=True, clip_value=0.5)
    hp.disarm(), hp.close()


@pytest.mark.parametrize("clip, want", [
    ({}, (5, 3)),  # the first three steps overflow at the initial scale (the NaN batch among them): undone, skipped
    ({"gradient_clip_val": 1e3}, (5, 3)),
    ({"gradient_clip_val": 1e-3}, (0, 8)),  # the clip triggers: the pass is undone and the gradients unscaled then
    ({"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}, (5, 3)),
])
def test_fp16_loss_scaling_is_exact(counted, clip, want):
    _same(counted, *want, precision="16-true", module={"bad": (2,)}, **clip)


@pytest.mark.parametrize("seed", [1, 2])
def test_fp16_with_accumulation_under_random_completion_orders(counted, seed):
    _same(counted, 1, 1, precision="16-true", module={"bad": (5,)}, accumulate_grad_batches=4, seed=seed)


def test_cases_that_stay_serial(counted):
    _same(counted, 0, module={"manual": True})


def test_lowmem_offload_params(counted):
    from tests.helpers.models import random_batch, tiny_lm_module

    batches = [random_batch(2, 16, seed=i) for i in range(3)]

    def run(mode):
        torch.manual_seed(0)
        module = tiny_lm_module("gpt2", config={"n_layer": 2, "n_embd": 32})
        trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(host_pass=mode, offload_params=True),
                            precision="bf16-true", max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1e3)
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
        return [p.detach().clone() for p in module.parameters()]

    for a, b in zip(run("serial"), run("overlap")):
        assert torch.equal(a, b)
    assert counted["stood"] == 3


def test_host_work_is_not_on_the_autograd_thread(monkeypatch, counted):
    fold_threads = []
    fold = HostMasters.fold

    def recording_fold(self, i, grad):
        fold_threads.append(threading.get_ident())
        return fold(self, i, grad)

    monkeypatch.setattr(HostMasters, "fold", recording_fold)
    module, *_ = _fit("overlap")
    main = threading.get_ident()  # NOTE: CPU autograd runs backward on the thread that called it
    assert fold_threads and module.step_threads
    assert main not in fold_threads and main not in module.step_threads
    assert counted["stood"] == N_BATCHES


def test_bad_host_pass_is_refused():
    with pytest.raises(ValueError, match="host_pass='eager'"):
        OffloadStrategy(host_pass="eager")


def test_a_window_whose_step_never_came_gives_the_masters_back():
    masters = HostMasters()
    masters.build(torch.nn.Linear(4, 4), loading=False, precision=None, grad_buffers=True)
    before = [p.detach().clone() for p in masters.p_host]
    opt = torch.optim.AdamW(masters.p_host)
    hp = HostPass(masters, bucket_bytes=4)  # one bucket per parameter: both step before the end
    hp.arm(opt, clip_norm=None, guard=True)
    for i, p in enumerate(masters.p_host):
        assert hp.submit(i, torch.ones_like(p))
    hp.barrier()
    assert not any(torch.equal(a, b) for a, b in zip(before, masters.p_host))  # it stepped speculatively
    hp.disarm()  # NOTE: backward raised (an out-of-memory retry): no step took the result
    assert all(torch.equal(a, b) for a, b in zip(before, masters.p_host)) and not opt.state
    hp.close()


def test_overlap_asked_where_it_must_stay_serial_says_so_once():
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(host_pass="overlap"), precision="bf16-true",
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(_data(), batch_size=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(Net(manual=True), loader)
    said = [w for w in seen if "runs the step serially" in str(w.message)]
    assert len(said) == 1 and "manual optimization" in str(said[0].message)

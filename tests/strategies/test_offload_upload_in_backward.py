"""``host_pass="overlap"``: each bucket stepped during backward is uploaded into its compute weights at once.

Every case compares with ``host_pass="serial"`` bit for bit (weights, buffers, optimizer state) through ``Trainer.fit``
and counts the uploads the worker made during backward, so a case that never uploads cannot pass as exact. The stand-in
runs the CUDA transfer logic with copies that land at once (``eager``: a backward that read an uploaded weight would
read the new value) or at random (``random``).
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
from lightning_lowmem.strategies.offload.host_step import HostStep
from lightning_lowmem.strategies.offload.masters import HostMasters
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

DIM, STEPS = 8, 6


def _data(n=STEPS):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, DIM, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


class Uses(L.LightningModule):
    """Weights read more than once in a step: ``mode`` "tied" applies one block twice, "checkpointed" does so under
    non-reentrant checkpointing, "reentrant" checkpoints two unshared blocks reentrantly; BatchNorm's buffers move too;
    ``share_from``: from that batch on, one block is applied twice under reentrant checkpointing; ``nan_at``: in that
    batch the first layer's gradients (the last to land) are NaN; ``write``: in batch 3 a tensor hook writes a compute
    weight during backward (other code): ``"early"`` the first layer's bias as backward starts, ``"late"`` the head's
    weight near its end, once the host pass's worker has caught up (it uploaded the head's new value by then)."""

    def __init__(self, mode: str = "tied", share_from: int | None = None, nan_at: int | None = None,
                 write: str | None = None):
        super().__init__()
        self.mode, self.share_from, self.nan_at, self.write = mode, share_from, nan_at, write
        self.inp, self.norm = torch.nn.Linear(DIM, 24), torch.nn.BatchNorm1d(24)
        self.a, self.b, self.head = torch.nn.Linear(24, 24), torch.nn.Linear(24, 24), torch.nn.Linear(24, 1)

    def training_step(self, batch, batch_idx):
        h = self.inp(batch[0])
        if batch_idx == self.nan_at:
            h.register_hook(lambda g: g * float("nan"))
        if batch_idx == 3 and self.write == "late":
            h.register_hook(self._halve_head)
        x = torch.tanh(self.norm(h))
        if self.share_from is not None and batch_idx >= self.share_from:
            for k in range(2):
                x = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=True)
                if k == 0 and self.trainer.strategy._pass is not None:  # NOTE: between the two blocks' backwards the
                    x.register_hook(lambda g: self.trainer.strategy._pass.barrier())  # worker catches up (uploads)
        elif self.mode == "reentrant":
            for block in (self.a, self.b):
                x = torch.utils.checkpoint.checkpoint(lambda t, m=block: torch.tanh(m(t)), x, use_reentrant=True)
        else:
            for block in (self.a, self.b, self.a):
                if self.mode == "checkpointed":
                    x = torch.utils.checkpoint.checkpoint(lambda t, m=block: torch.tanh(m(t)), x, use_reentrant=False)
                else:
                    x = torch.tanh(block(x))
        loss = torch.nn.functional.mse_loss(self.head(x).float(), batch[1].float())
        if batch_idx == 3 and self.write == "early":
            loss.register_hook(self._halve_inp_bias)
        return loss

    def _halve_inp_bias(self, grad):
        with torch.no_grad():
            self.inp.bias.mul_(0.5)
        return grad

    def _halve_head(self, grad):
        host_pass = self.trainer.strategy._pass
        if host_pass is not None:
            host_pass.barrier()
        with torch.no_grad():
            self.head.weight.mul_(0.5)
        return grad

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)


@pytest.fixture
def uploads(monkeypatch):
    """Small buckets; the masters the worker uploaded during backward and its threads, and the pairs the step uploaded."""
    monkeypatch.setattr(host_pass_module, "BUCKET_BYTES", 4 * 300)
    seen = {"worker": 0, "streamed": 0, "threads": set(), "restored": 0, "at_step": []}
    upload_now, to_device = HostStep._upload_now, HostStep._weights_to_device

    def counting_upload(self, indices, worker):
        if worker:
            seen["worker"] += len(indices)
            seen["threads"].add(threading.get_ident())
            streamed = self._stream.shapes if self._stream is not None else {}
            seen["streamed"] += sum(id(self._masters.p_device[i]) in streamed for i in indices)
        else:
            seen["restored"] += len(indices)
        return upload_now(self, indices, worker)

    def counting_to_device(self, optimizer, uploaded=frozenset()):
        seen["at_step"].append(len(self._masters.pairs(optimizer)) - len(uploaded))
        return to_device(self, optimizer, uploaded)

    monkeypatch.setattr(HostStep, "_upload_now", counting_upload)
    monkeypatch.setattr(HostStep, "_weights_to_device", counting_to_device)
    return seen


def _fit(mode, make, *, progress=None, seed=1, precision="bf16-true", steps=STEPS, **trainer_kw):
    torch.manual_seed(0)
    module = make()
    trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(host_pass=mode), precision=precision,
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **trainer_kw)
    ops = (lambda: DeferredOps(progress, seed=seed)) if progress is not None else None
    with warnings.catch_warnings(), cpu_stand_in(ops):
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_data(steps), batch_size=None))
    state = trainer.optimizers[0].state
    return [t.detach().clone() for p in module.parameters() for t in (p, *state[p].values())] + [
        b.detach().clone() for b in module.buffers()]


def _same_as_serial(uploads, make, **kw):
    serial = _fit("serial", make, **kw)
    assert uploads["worker"] == 0
    uploads["at_step"].clear()
    overlap = _fit("overlap", make, **kw)
    assert len(serial) == len(overlap)
    for a, b in zip(serial, overlap):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["tied", "checkpointed", "reentrant"])
@pytest.mark.parametrize("progress", [None, "eager", "random"])
def test_weights_read_again_in_one_step_upload_during_backward_exactly(uploads, mode, progress):
    _same_as_serial(uploads, lambda: Uses(mode), progress=progress)
    assert uploads["worker"] > 0 and threading.get_ident() not in uploads["threads"]
    n_params = len(list(Uses().parameters()))
    # NOTE: the first window uploads nothing during backward; later ones leave only the final buckets to the step
    assert uploads["at_step"][0] == n_params and max(uploads["at_step"][1:]) < n_params
    assert uploads["restored"] == 0


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_other_precisions(uploads, precision):
    _same_as_serial(uploads, Uses, precision=precision, progress="random")
    assert uploads["worker"] > 0


def test_a_weight_shared_by_reentrant_blocks_from_the_first_step_is_never_uploaded_during_backward(uploads):
    _same_as_serial(uploads, lambda: Uses(share_from=0), progress="eager")
    assert uploads["worker"] == 0


def test_a_weight_shared_by_reentrant_blocks_later_raises_with_the_cause_and_the_fix(uploads):
    with pytest.raises(RuntimeError, match=r"`a\.(weight|bias)` arrived twice in one backward.*use_reentrant=False"):
        _fit("overlap", lambda: Uses(share_from=2), progress="eager")
    assert uploads["worker"] > 0


@pytest.mark.parametrize("clip, progress", [(1e-3, "eager"), (1e-3, "random"), (None, "random")])
def test_a_restore_puts_the_uploaded_weights_back(uploads, clip, progress):
    # NOTE: a clip that triggers undoes every window's pass; a NaN in the first layer's gradients (batch 3 under
    # `clip=None`) skips its step after the later layers' buckets uploaded: the weights must be those before it
    _same_as_serial(uploads, lambda: Uses(nan_at=None if clip else 3), progress=progress, gradient_clip_val=clip)
    assert uploads["worker"] > 0 and uploads["restored"] > 0


@pytest.mark.parametrize("progress", [None, "eager"])
def test_a_weight_written_during_backward_before_its_upload_is_kept_as_serially(uploads, progress):
    _same_as_serial(uploads, lambda: Uses(write="early"), progress=progress)
    assert uploads["worker"] > 0


@pytest.mark.parametrize("progress", [None, "eager"])
def test_a_weight_written_during_backward_after_its_upload_raises(uploads, progress):
    with pytest.raises(RuntimeError, match=r"`head\.weight` was written .* after .* uploaded"):
        _fit("overlap", lambda: Uses(write="late"), progress=progress)


def test_a_window_whose_step_never_came_puts_the_uploaded_weights_back():
    masters = HostMasters()
    masters.build(torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3))), loading=False, precision=None,
                  grad_buffers=True)
    device = [p.detach().clone() for p in masters.p_host]
    threads = set()

    def uploader(indices, worker):
        threads.add((threading.get_ident(), worker))
        for i in indices:
            device[i].copy_(masters.p_host[i])

    opt = torch.optim.AdamW(masters.p_host)
    hp = HostPass(masters, bucket_bytes=4)  # one bucket per parameter: all but the final ones step (and upload) at once
    for window in range(2):
        hp.arm(opt, clip_norm=None, guard=True, uploader=uploader)
        for i, p in enumerate(masters.p_host):
            hp.arrived(i)
            hp.submit(i, torch.ones_like(p))
        if window == 0:
            hp.finish()
            assert hp.stands() and not threads  # NOTE: the first window uploads nothing
            hp.disarm()
            for d, p in zip(device, masters.p_host):
                d.copy_(p)  # the step's own upload
            before = [p.detach().clone() for p in masters.p_host]
    hp.barrier()
    assert hp.uploaded and not any(torch.equal(before[i], device[i]) for i in hp.uploaded)
    hp.disarm()  # NOTE: backward raised: no step took the result
    assert all(torch.equal(a, b) for a, b in zip(before, device))
    assert {w for _, w in threads} == {True, False} and (threading.get_ident(), False) in threads
    hp.close()


class DetachedRead(Uses):
    """``a.weight`` read early in the forward through ``detach()`` (saved for backward), then used as a layer later: its
    gradient lands before the early read's node runs, and a hook waits there for the pass's worker (which uploaded it)."""

    def training_step(self, batch, batch_idx):
        x = torch.tanh(self.inp(batch[0]))
        y = torch.nn.functional.linear(x, self.a.weight.detach())
        if self.trainer.strategy._pass is not None:
            y.register_hook(lambda g: self.trainer.strategy._pass.barrier())
        x = torch.tanh(self.a(torch.tanh(self.b(x + y))))
        return torch.nn.functional.mse_loss(self.head(x).float(), batch[1].float())


@pytest.mark.parametrize("progress", [None, "eager"])
def test_a_weight_saved_through_detach_and_read_after_its_upload_gets_our_error(uploads, progress):
    _fit("serial", DetachedRead, progress=progress)  # plain maths: trains
    with pytest.raises(RuntimeError, match=r"autograd found a tensor it saved for backward changed in place.*"
                                           r"`detach\(\)`.*host_pass='serial'") as raised:
        _fit("overlap", DetachedRead, progress=progress)
    assert "modified by an inplace operation" in str(raised.value.__cause__)


def _fit_streamed(mode, kind, checkpointing, progress, **trainer_kw):
    """``lowmem_offload_params`` (every block streamed from its host copy) on a tiny GPT-2 (tied embeddings) or LLaMA."""
    from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
    from tests.helpers.models import random_batch, tiny_lm_module

    torch.manual_seed(0)
    config = {"n_layer": 3, "n_embd": 32} if kind == "gpt2" else {"num_hidden_layers": 3, "hidden_size": 32}
    module = tiny_lm_module(kind, config=config, learning_rate=1e-2)
    trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(host_pass=mode, offload_params=True),
                        precision="bf16-true", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ActivationCheckpointing("all")] if checkpointing else [], **trainer_kw)
    batches = [random_batch(2, 16, seed=i) for i in range(4)]
    ops = (lambda: DeferredOps(progress, seed=1)) if progress is not None else None
    with warnings.catch_warnings(), cpu_stand_in(ops):
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    state = trainer.optimizers[0].state
    return [t.detach().clone() for p in module.parameters() for t in (p, *state[p].values())]


@pytest.mark.parametrize("kind, checkpointing, progress", [("gpt2", False, None), ("gpt2", True, "random"),
                                                           ("llama", True, "eager"), ("llama", False, "random")])
def test_streamed_blocks_round_into_their_host_copies_during_backward_exactly(uploads, kind, checkpointing, progress):
    """``offload_params``: a streamed weight's upload is its host copy, which the next forward's fetch reads; its
    block's fetches in this backward were done before its gradient landed, so the worker rounds it there at once."""
    serial = _fit_streamed("serial", kind, checkpointing, progress)
    assert uploads["worker"] == 0
    overlap = _fit_streamed("overlap", kind, checkpointing, progress)
    assert len(serial) == len(overlap)
    for a, b in zip(serial, overlap):
        assert torch.equal(a, b)
    assert uploads["streamed"] > 0 and threading.get_ident() not in uploads["threads"]
    assert uploads["restored"] == 0


def test_streamed_blocks_uploaded_during_backward_are_put_back_by_a_restore(uploads):
    serial = _fit_streamed("serial", "gpt2", True, "random", gradient_clip_val=1e-3)
    overlap = _fit_streamed("overlap", "gpt2", True, "random", gradient_clip_val=1e-3)
    for a, b in zip(serial, overlap):
        assert torch.equal(a, b)
    assert uploads["streamed"] > 0 and uploads["restored"] > 0


def test_a_module_with_a_backward_hook_keeps_every_upload_at_the_step(uploads):
    """A module's backward hook may read a weight whose gradient has landed (the upload would have rewritten it): the
    pass still steps during backward, and the upload waits for the step."""
    class Hooked(Uses):
        def __init__(self):
            super().__init__()
            self.seen = []
            self.b.register_full_backward_hook(lambda m, gi, go: self.seen.append(m.weight.detach().clone()))

    _same_as_serial(uploads, Hooked, progress="eager")
    assert uploads["worker"] == 0
    n_params = len(list(Uses().parameters()))
    assert uploads["at_step"] == [n_params] * STEPS

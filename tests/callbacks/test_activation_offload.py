"""Unit tests of the saved-tensor offload engine and the ActivationOffload constructor (no Trainer)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.callbacks.activation_offload.engine import SavedTensorOffloader, StreamCopier, SyncCopier
from lightning_lowmem.core.accounting import is_host
from lightning_lowmem.core.streams import DeferredOps
from tests.helpers.models import random_batch, tiny_gpt2, tiny_llama

CPU = torch.device("cpu")


def _engine(**kwargs) -> SavedTensorOffloader:
    return SavedTensorOffloader(CPU, kwargs.pop("copier", SyncCopier()), **kwargs)


def _skip(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers(), *batch.values()]


def _hf_step(model, batch, engine=None):
    if engine is None:
        return model(**batch).loss
    engine.begin_step(_skip(model, batch))
    with engine.hooks():
        return model(**batch).loss


# --- numerics: bit-identical to training without offload ------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "ckpt", "boundaries_only", "progress"),
    [
        ("gpt2", None, False, None),
        ("llama", None, False, None),
        ("gpt2", "hf", True, None),  # Hugging Face gradient checkpointing (non-reentrant torch.utils.checkpoint)
        ("llama", "hf", False, None),
        ("gpt2", "hf", True, "lazy"),  # the CUDA copier with deferred copies (DeferredOps)
        ("llama", None, False, "random"),
    ],
)
def test_hf_gradients_and_weights_bit_identical(arch, ckpt, boundaries_only, progress):
    """``progress``: None runs the plain CPU copier; else the CUDA copier on ``DeferredOps`` (copies deferred)."""
    torch.manual_seed(0)
    # NOTE: dropout on: offloading must not touch the RNG stream, and checkpoint's RNG replay must still match.
    model = tiny_gpt2(dropout=0.1) if arch == "gpt2" else tiny_llama()
    model.config.use_cache = False
    if ckpt == "hf":
        model.activation_checkpointing_enable({"use_reentrant": False})
    ref = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    ops = DeferredOps(progress, seed=1) if progress else None
    copier = StreamCopier(CPU, ops) if ops else SyncCopier()
    engine = _engine(min_bytes=1024, prefetch=2, boundaries_only=boundaries_only, copier=copier)
    for step in range(2):
        batch = random_batch(2, 16, seed=step)
        torch.manual_seed(100 + step)
        _hf_step(model, batch, engine).backward()
        torch.manual_seed(100 + step)
        _hf_step(ref, batch).backward()
        assert engine.stats.bytes_offloaded > 0
        assert engine.stats.bytes_restored == engine.stats.bytes_offloaded
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, p_ref.grad), f"step {step}: gradient of {name} differs"
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, p_ref), f"step {step}: weight {name} differs"
    assert engine.host_bytes_live == 0  # every host copy freed with the graph
    if ops is not None:  # the copies really were deferred, and every one landed
        assert ops.copies_queued == ops.copies_run > 0 and ops.most_in_flight > 1
    if boundaries_only:
        assert engine.stats.boundary_saves == model.config.n_layer
        assert engine.stats.storages_offloaded == model.config.n_layer  # only the block inputs


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_boundaries_bit_identical(reentrant):
    """``torch.utils.checkpoint`` called directly, both flavours: only the block inputs go to the host."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Block(32) for _ in range(4))
    ref = copy.deepcopy(blocks)
    x = torch.randn(8, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    def run(mods, inp):
        h = inp * 1.0  # a non-leaf block input, so the first boundary is an activation too
        for m in mods:
            h = checkpoint(m, h, use_reentrant=reentrant)
        return (h * h).sum()

    engine = _engine(min_bytes=0, boundaries_only=True)
    engine.begin_step(_skip(blocks, {"x": x}))
    with engine.hooks():
        loss = run(blocks, x)
    assert engine.stats.boundary_saves == 4
    assert engine.stats.storages_offloaded == 4
    assert engine.stats.tensors_kept >= 1  # `h * h` saves h twice; not a boundary, so it stays
    loss.backward()
    run(ref, x_ref).backward()
    assert torch.equal(x.grad, x_ref.grad)
    for p, p_ref in zip(blocks.parameters(), ref.parameters()):
        assert torch.equal(p.grad, p_ref.grad)


# --- aliasing: views, in-place ops, tensors saved twice --------------------------------------------------------


class _Provoker(torch.nn.Module):
    """Built to provoke every aliasing case the engine must get right (see the comments in forward)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.register_buffer("scale", torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(x.size(-1), dim=-1)  # three views of one storage, all saved by matmuls
        att = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        h = att @ v
        h = h.relu_()  # in-place: relu_ saves its own output (a version bump on the same storage)
        sq = h * h  # the same tensor saved twice by one op
        strided = sq[:, ::2]  # a strided view, saved by sin
        out = strided.sin().sum() + (sq * self.scale).sum()  # a buffer, saved: must stay in place
        u = self.proj(x)  # a fresh storage ...
        dead = u.sin()  # ... saved by sin at this version, but `dead` is never used: its backward never runs
        u.mul_(2.0)  # so modifying u now is legal; the next save must see the new values (a new version)
        out = out + u.cos().sum()
        acc = x.sum() * 0
        for i in range(4):  # temporaries freed in forward: their addresses may be reused by the next one
            t = (x * (i + 1)).exp()
            acc = acc + t.sum()
        del dead
        return out + acc + self.proj(h.transpose(-1, -2).transpose(-1, -2)).sum()  # a view of a view


def test_views_inplace_and_repeats_come_back_correct():
    torch.manual_seed(0)
    model = _Provoker()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, 16)
    engine = _engine(min_bytes=0, prefetch=1)
    engine.begin_step(_skip(model, {"x": x}))
    with engine.hooks():
        loss = model(x)
    stats = engine.stats
    assert stats.tensors_offloaded > stats.storages_offloaded  # views and repeats shared one host copy
    loss.backward()
    ref(x).backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, p_ref.grad), f"gradient of {name} differs"


def test_views_restored_as_views_of_one_storage():
    base = torch.randn(4, 6)
    view = base.t()[1:, ::2]
    engine = _engine(min_bytes=0)
    engine.begin_step([])
    packed_base, packed_view = engine.pack(base), engine.pack(view)
    assert engine.stats.storages_offloaded == 1 and engine.stats.bytes_offloaded == base.numel() * 4
    out_view, out_base = engine.unpack(packed_view), engine.unpack(packed_base)
    assert out_base.untyped_storage().data_ptr() == out_view.untyped_storage().data_ptr()
    assert out_view.stride() == view.stride() and out_view.storage_offset() == view.storage_offset()
    assert torch.equal(out_view, view) and torch.equal(out_base, base)
    assert out_base.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_version_bump_gets_a_second_copy():
    t = torch.randn(64)
    before = t.clone()
    engine = _engine(min_bytes=0)
    engine.begin_step([])
    first = engine.pack(t)
    t.mul_(3)
    second = engine.pack(t)
    assert engine.stats.storages_offloaded == 2
    assert torch.equal(engine.unpack(second), t)
    # the first save was changed in place after it was saved: autograd would refuse it, and so does the engine
    assert torch.equal(first.entry.host.view(torch.float32), before)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*version 1; expected version 0"):
        engine.unpack(first)


def test_host_copy_marked_and_original_freed():
    """On the CPU path the compute-role copy is freed in forward; the host copy is marked as host."""
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    refs = {}

    def forward():
        h = lin(x)
        refs["h"] = StorageWeakRef(h.untyped_storage())
        return h.sin().sum()  # sin saves its input h, and nothing else holds h

    loss_plain = forward()
    assert not refs["h"].expired()  # without offload, autograd keeps h alive until backward
    engine = _engine(min_bytes=0)
    engine.begin_step(_skip(lin, {"x": x}))
    with engine.hooks():
        loss = forward()
    assert refs["h"].expired()  # with offload, only the host copy is left
    entries = [r() for r in engine._order]
    assert entries and all(is_host(e.host) for e in entries)
    assert engine.host_bytes_live == engine.stats.bytes_offloaded == 32 * 64 * 4
    (loss + loss_plain).backward()
    del entries
    assert engine.host_bytes_live == 0


def test_bytes_offloaded_match_what_the_hooks_saw():
    torch.manual_seed(0)
    model = tiny_gpt2()
    batch = random_batch(2, 32)
    min_bytes = 4096
    seen: list[torch.Tensor] = []

    def census(t):
        seen.append(t)  # NOTE: kept alive, so no storage address is reused during the census
        return t

    with torch.autograd.graph.saved_tensors_hooks(census, lambda t: t):
        model(**batch).loss.backward()
    skip = {t.untyped_storage().data_ptr() for t in _skip(model, batch)}
    offloaded = [t for t in seen if t.untyped_storage().data_ptr() not in skip and t.numel() * t.element_size() >= min_bytes]
    unique = {(t.untyped_storage()._cdata, t._version): t.untyped_storage().nbytes() for t in offloaded}
    kept = [t for t in seen if t.untyped_storage().data_ptr() not in skip and t.numel() * t.element_size() < min_bytes]

    engine = _engine(min_bytes=min_bytes)
    _hf_step(model, batch, engine).backward()
    assert engine.stats.bytes_offloaded == sum(unique.values())
    assert engine.stats.storages_offloaded == len(unique)
    assert engine.stats.tensors_offloaded == len(offloaded)
    assert engine.stats.bytes_kept == sum(t.numel() * t.element_size() for t in kept)


class _RecordingCopier(SyncCopier):
    def __init__(self, engine_ref: list) -> None:
        self.engine_ref = engine_ref
        self.ahead: list[int] = []

    def to_device(self, host, device):
        self.ahead.append(len(self.engine_ref[0]._prefetched))
        return super().to_device(host, device)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_prefetch_bookkeeping(prefetch):
    torch.manual_seed(0)
    model = tiny_gpt2()
    batch = random_batch(2, 16)
    holder: list = []
    copier = _RecordingCopier(holder)
    engine = _engine(min_bytes=1024, prefetch=prefetch, copier=copier)
    holder.append(engine)
    _hf_step(model, batch, engine).backward()
    stats = engine.stats
    assert stats.bytes_restored == stats.bytes_offloaded  # each storage restored exactly once
    if prefetch == 0:
        assert stats.prefetched == 0 and stats.restore_misses == stats.storages_offloaded
    else:
        assert stats.prefetched + stats.restore_misses == stats.storages_offloaded
        # backward mostly meets what was prefetched (3 covers attention's 4 saves asked for in pack order)
        assert stats.restore_misses < stats.storages_offloaded * (0.6 if prefetch == 1 else 0.15), stats
    assert max(copier.ahead) <= prefetch  # never more restores ahead of need than allowed
    assert not engine._held and not engine._prefetched  # nothing left on the device after backward


def test_retain_graph_second_backward_restores_again():
    torch.manual_seed(0)
    model = tiny_llama()
    ref = copy.deepcopy(model)
    batch = random_batch(2, 16)
    engine = _engine(min_bytes=0)
    loss = _hf_step(model, batch, engine)
    loss.backward(retain_graph=True)
    loss.backward()
    loss_ref = _hf_step(ref, batch)
    loss_ref.backward(retain_graph=True)
    loss_ref.backward()
    assert engine.stats.bytes_restored == 2 * engine.stats.bytes_offloaded
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, p_ref.grad)


def test_host_watch_called_before_each_host_allocation():
    calls = []
    engine = _engine(min_bytes=0, before_host_alloc=lambda n, live: calls.append((n, live)))
    engine.begin_step([])
    a, b = torch.randn(10), torch.randn(20)
    engine.pack(a), engine.pack(b), engine.pack(a[2:])
    assert calls == [(40, 0), (80, 40)]


# --- bad input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_bytes": -1}, ValueError, r"`min_bytes=-1`; it must be 0 or more"),
        ({"min_bytes": 1.5}, TypeError, r"`min_bytes=1.5`; expected an int"),
        ({"prefetch": -2}, ValueError, r"`prefetch=-2`"),
        ({"prefetch": True}, TypeError, r"`prefetch=True`"),
        ({"pin_memory": "yes"}, TypeError, r"`pin_memory='yes'`"),
        ({"boundaries_only": 1}, TypeError, r"`boundaries_only=1`"),
        ({"min_bytes": -1, "prefetch": -1}, ValueError, r"min_bytes=-1.*prefetch=-1"),  # every problem at once
    ],
)
def test_constructor_rejects_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        ActivationOffload(**kwargs)


def test_memory_breakdown_reports_host_activations():
    cb = ActivationOffload()
    assert cb.memory_breakdown().host["activations"] == 0
    cb.last_step.host_bytes_peak, cb.last_step.host_bytes_reserved = 1234, 2048  # pinned: the allocator's RAM
    assert cb.memory_breakdown().host["activations"] == 2048
    assert cb.memory_breakdown().total("device") == 0

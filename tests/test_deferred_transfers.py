"""The CUDA transfer logic on the CPU, with copies deferred (``DeferredOps``), and the hazards it exposes.

Each ``test_deferred_*`` test is one hazard that a GPU shows only sometimes and plain CPU copies never: run as a
group with ``pytest -k deferred``. A deferred run must equal the plain CPU run (``HostTransfer``) bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

import lightning_lowmem  # noqa: F401  (registers "lowmem_offload")
from lightning_lowmem.core.host_memory import pinned_bytes
from lightning_lowmem.core.streams import CudaOps, DeferredOps, cpu_stand_in
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.measure import tracker as measure
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from lightning_lowmem.strategies.offload.transfer import StreamTransfer
from tests.helpers.models import GPT2_TINY, random_batch
from tests.helpers.runif import RunIf

TINY = {**GPT2_TINY, "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 16, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _trainer(**kwargs: Any) -> L.Trainer:
    kwargs.setdefault("strategy", "lowmem_offload")
    kwargs.setdefault("precision", "32-true")
    kwargs.setdefault("max_steps", 2)
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, **kwargs)


def _data(n: int = 4, batch_size: int = 2) -> DataLoader:
    return DataLoader([random_batch(batch_size, 16, seed=i) for i in range(n)], batch_size=None)


def _deferred(progress: str = "run_ahead", built: list[DeferredOps] | None = None):
    built = [] if built is None else built

    def factory() -> DeferredOps:
        built.append(DeferredOps(progress))  # type: ignore[arg-type]
        return built[-1]

    return cpu_stand_in(factory)


class MasterGrads(Callback):
    """The masters' gradients as ``on_after_backward`` and ``on_before_optimizer_step`` see them."""

    def __init__(self) -> None:
        self.after_backward: list[dict[str, torch.Tensor | None]] = []
        self.before_step: list[dict[str, torch.Tensor | None]] = []

    @staticmethod
    def _grads(trainer: L.Trainer) -> dict[str, torch.Tensor | None]:
        return {n: None if m.grad is None else m.grad.clone() for n, m in trainer.strategy.masters.items()}

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.after_backward.append(self._grads(trainer))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.before_step.append(self._grads(trainer))


def _assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want) > 0
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for name in w:
            assert (g[name] is None) == (w[name] is None), f"{name} at {step}: {g[name]} vs {w[name]}"
            if w[name] is not None:
                assert torch.equal(g[name], w[name]), f"gradient of {name} differs at {step}"


def _fit_grads(module: L.LightningModule, deferred: bool, data: Any = None, **kwargs: Any) -> MasterGrads:
    record = MasterGrads()
    built: list[DeferredOps] = []
    callbacks = [*kwargs.pop("callbacks", []), record]
    with _deferred(built=built) if deferred else contextlib.nullcontext():
        trainer = _trainer(callbacks=callbacks, **kwargs)
        trainer.fit(module, data if data is not None else _data())
    if deferred:
        assert built and sum(o.copies_queued for o in built) > 0
    return record


# --- the seam itself --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("progress", ["lazy", "run_ahead", "random"])
def test_deferred_ops_land_copies_only_when_the_host_must_see_them(progress):
    ops = DeferredOps(progress, seed=3)
    side = ops.side_stream()
    src, dst = torch.arange(4.0), torch.zeros(4)
    ops.copy(dst, src, side)
    first = ops.record_event(side)
    src.add_(10)  # NOTE: the copy reads its source when it runs, as a GPU copy queued behind compute would
    ops.copy(dst, torch.ones(4), side)
    second = ops.record_event(side)
    if progress != "random":
        assert not ops.query(first) and torch.equal(dst, torch.zeros(4))
    ops.synchronize(first)
    if progress == "lazy":
        assert torch.equal(dst, torch.arange(4.0) + 10) and not ops.query(second)
    ops.wait_event(ops.compute_stream(), second)  # compute waits: the copies must have landed
    assert torch.equal(dst, torch.ones(4)) and ops.query(second) and ops.in_flight() == 0


def test_deferred_ops_restored_tensor_reads_nan_until_the_copy_lands():
    ops = DeferredOps("lazy")
    side = ops.side_stream()
    out = ops.to_device(torch.ones(3), torch.device("cpu"), side)
    assert out.isnan().all()
    ops.wait_stream(ops.compute_stream(), side)
    assert torch.equal(out, torch.ones(3))


def test_deferred_ops_streams_wait_on_each_other_and_complete_out_of_order():
    ops = DeferredOps("lazy")
    a, b = ops.side_stream(), ops.side_stream()
    x, y = torch.zeros(1), torch.zeros(1)
    ops.copy(x, torch.ones(1), a)
    ops.wait_stream(b, a)  # b's later work starts after a's copy
    ops.copy(y, x, b)
    assert ops.query(ops.record_event(a)) is False
    ops.advance(b)  # b's first item is the wait: it runs a's copy, out of order with anything else on a
    assert x.item() == 1 and y.item() == 0
    ops.advance(b)
    assert y.item() == 1 and ops.in_flight() == 0
    with pytest.raises(ValueError, match="progress='sometimes'"):
        DeferredOps("sometimes")  # type: ignore[arg-type]


# --- hazard 1: on_after_backward sees every gradient ------------------------------------------------------------


def test_deferred_on_after_backward_sees_complete_master_gradients():
    """Lightning calls ``on_after_backward`` inside the precision plugin's ``post_backward``: the copies must be in."""
    torch.manual_seed(0)
    module = CausalLMModule(config=TINY, learning_rate=1e-2)
    plain = _fit_grads(copy.deepcopy(module), deferred=False, accumulate_grad_batches=2)
    deferred = _fit_grads(module, deferred=True, accumulate_grad_batches=2)
    _assert_same(deferred.after_backward, plain.after_backward)
    _assert_same(deferred.before_step, plain.before_step)


# --- hazard 3: a staging slot is not rewritten while unread ------------------------------------------------------


class SharedBlock(L.LightningModule):
    """One block applied twice under reentrant checkpointing: its gradient hook fires twice in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(12, 24), nn.Linear(24, 24), nn.Linear(24, 3)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = self.inp(batch)
        for _ in range(2):
            x = checkpoint(lambda t: torch.tanh(self.block(t)), x, use_reentrant=True)
        return self.head(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_deferred_staging_slot_not_rewritten_while_unread():
    torch.manual_seed(0)
    module = SharedBlock()
    data = DataLoader([torch.randn(4, 12, generator=torch.Generator().manual_seed(i)) for i in range(2)], batch_size=None)
    plain = _fit_grads(copy.deepcopy(module), deferred=False, data=data)
    deferred = _fit_grads(module, deferred=True, data=data)
    _assert_same(deferred.before_step, plain.before_step)


# --- hazard 4: pinned staging counted as the pinned allocator takes it -------------------------------------------


def test_deferred_pinned_staging_counted_exactly():
    """Planned (host-RAM check) == reported (``memory_breakdown``) == what the pinned allocator reserves."""
    torch.manual_seed(0)
    module = CausalLMModule(config=TINY, learning_rate=1e-2)
    seen: dict[str, int] = {}

    class Inspect(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
            s = trainer.strategy
            assert isinstance(s._transfer, StreamTransfer)
            storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in s._transfer._staging}
            seen["allocated"] = sum(pinned_bytes(n) for n in storages.values())
            seen["buffers"] = len(storages)
            seen["reported"] = s.memory_breakdown().host["other"]

    strategy = OffloadStrategy()
    with _deferred():
        _trainer(strategy=strategy, precision="bf16-true", max_steps=1, callbacks=[Inspect()]).fit(module, _data(2))
        seen["planned"] = strategy.host_bytes_needed(module, [])["staging_or_compute_weights"]
    assert seen["reported"] == seen["planned"] == seen["allocated"] > 0
    assert seen["buffers"] < len(list(module.parameters()))  # flat buckets, not one buffer per parameter


# --- hazard 6: CudaPeakWindow matches devices by index ------------------------------------------------------------


def test_deferred_cuda_peak_window_folds_resets_of_its_device_named_without_index(monkeypatch):
    """``CudaPeakWindow("cuda")`` is ``cuda:0``: a reset through ``reset_cuda_peak_stats("cuda:0")`` must not hide its peak."""
    peak = {"allocated": 0}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: peak["allocated"])
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: peak["allocated"])
    monkeypatch.setattr(cuda, "memory_stats", lambda device=None: {"active_bytes.all.peak": peak["allocated"]})
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: peak.update(allocated=0))
    for name, other in (("cuda", "cuda:0"), ("cuda:0", "cuda"), (None, "cuda"), ("cuda", None)):
        window = measure.CudaPeakWindow(name)
        peak["allocated"] = 100
        measure.reset_cuda_peak_stats(other)  # another component resets the global peak
        assert window.read() == (100, 100, 100), name
        window.close()


def test_staging_layout_first_fit_aligned_and_large_slots_share_their_rounding():
    from lightning_lowmem.strategies.offload.transfer import staging_layout

    sizes, slots = staging_layout([100, 600, 70000, 300, 60000], bucket_bytes=1024)
    assert slots == [(0, 0), (1, 0), (2, 0), (0, 512), (2, 70144)]  # 512 B aligned; the 128 KiB bucket's tail is used
    assert sizes == [812, 600, 130144]
    assert all(s % 512 == 0 for _, s in slots)


@RunIf(min_cuda_gpus=1)
def test_cuda_stream_transfer_folds_every_gradient_exactly_once_in_queue_order():
    """The real CUDA ops: gradients (one parameter twice in a row, hazard 3) folded as the CPU path folds them."""
    device = torch.device("cuda", torch.cuda.current_device())
    params = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in (3000, 17, 100_000)]
    transfer = StreamTransfer(device, params, CudaOps(device))
    grads = [(i, torch.randn(p.shape, dtype=torch.bfloat16, device=device)) for i, p in [(0, params[0]), (2, params[2]),
                                                                                         (2, params[2]), (1, params[1])]]
    got: dict[int, torch.Tensor] = {}
    want: dict[int, torch.Tensor] = {}

    def fold(into: dict[int, torch.Tensor], i: int, g: torch.Tensor) -> None:
        into[i] = g.float() if i not in into else into[i] + g.float()

    for i, g in grads:
        transfer.grad_to_host(i, g * 1, lambda i, g: fold(got, i, g))  # `g * 1`: a fresh gradient, dropped at once
        fold(want, i, g.cpu())
    transfer.synchronize()
    assert got.keys() == want.keys() and all(torch.equal(got[i], want[i]) for i in want)
    assert all(t.is_pinned() for t in transfer.staging())
    assert transfer.staging_bytes() == sum(pinned_bytes(b.numel()) for b in transfer._buckets)


# --- hazard H1: streamed blocks bounded while the device lags behind the host ---------------------------------------


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_deferred_param_stream_device_memory_stays_bounded_when_the_device_lags(prefetch):
    """The host queues a whole forward before the GPU runs it; a released block's buffers are reusable only after
    compute passes the release (``record_stream``). Without back-pressure each fetch took new memory: the allocator's
    reserved bytes grew toward every block of the model. Now: ``prefetch + 1`` fetched and one released block."""
    from lightning_lowmem.demo.module import CausalLMModule

    built: list[DeferredOps] = []
    torch.manual_seed(0)
    module = CausalLMModule(model_type="gpt2", config={**TINY, "n_layer": 8}, learning_rate=1e-2)
    blocks = module.model.transformer.h
    block_bytes = sum(p.numel() * 2 for p in blocks[0].parameters())  # bf16 compute weights
    strategy = OffloadStrategy(offload_params=True, prefetch=prefetch)

    def factory() -> DeferredOps:
        built.append(DeferredOps("lazy", device_lags=True))
        return built[-1]

    with cpu_stand_in(factory):
        _trainer(strategy=strategy, precision="bf16-true", max_steps=2).fit(module, _data())
    ops = next(o for o in built if o.copies_queued)  # the parameter stream's ops
    assert ops.reserved_peak <= (prefetch + 2) * block_bytes, (ops.reserved_peak / block_bytes, prefetch)
    assert ops.reserved_peak >= (prefetch + 1) * block_bytes  # it did stream (the count is of real fetches)


def test_deferred_param_stream_host_view_waits_for_queued_fetches():
    """Loading a checkpoint writes the host copies (``host_view``): no queued fetch may still be reading them."""
    from lightning_lowmem.strategies.offload.param_stream import ParamStream

    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
    ops = DeferredOps("lazy")
    with cpu_stand_in(lambda: ops):
        stream = ParamStream(model, [True] * 4, prefetch=2, device=torch.device("cpu"))
    stream.detach_weights()
    stream.attach()
    stream._pre(0)  # block 0 ready, blocks 1 and 2 prefetched: their copies are queued, not landed
    stream._post(0, None)  # NOTE: pops the saved-tensor hooks `_pre` pushed (they are process-wide)
    assert ops.in_flight() > 0
    with stream.host_view():
        assert ops.in_flight() == 0  # every fetch landed before the host copies can be written
        for p in model.parameters():
            p.data.zero_()
    stream.remove()

"""The offload engine's host side: RAM as the allocators hold it, host allocation failures, an aborted backward."""

from __future__ import annotations

import weakref

import pytest
import torch

from lightning_lowmem.callbacks.activation_offload import copiers as _offload_copiers
from lightning_lowmem.callbacks.activation_offload.engine import SavedTensorOffloader, StreamCopier, SyncCopier
from lightning_lowmem.core.host_memory import HostMemoryError, PinnedHostCache, pinned_bytes
from lightning_lowmem.core.streams import DeferredOps

CPU = torch.device("cpu")


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 1))


def _forward(net, engine, x):
    engine.begin_step([*net.parameters(), x])
    with engine.hooks():
        return net(x).sum()


def test_pinned_cache_rounds_caches_and_reuses_by_size_class():
    cache = PinnedHostCache(cuda=True)
    assert cache.cost(3000) == 4096
    cache.take(3000), cache.take(5000)
    assert (cache.live, cache.reserved) == (4096 + 8192, 4096 + 8192)
    cache.give(3000)
    assert cache.reserved == 4096 + 8192 and cache.cost(2500) == 0 and cache.cost(5000) == 8192
    cache.take(2500)  # served by the cached 4 KiB block: no new RAM
    assert cache.reserved == 4096 + 8192
    plain = PinnedHostCache(cuda=False)
    plain.take(3000), plain.give(3000)
    assert plain.reserved == 0 and plain.cost(3000) == 3000


@pytest.mark.parametrize("pins", [True, False])
def test_engine_counts_host_ram_as_the_allocator_holds_it(pins):
    """Pinned (the CUDA copier, here on the deferred stand-in): rounded to powers of two, kept after backward and
    reused by the next step, so the RAM held is not the live bytes; unpinned it follows the live bytes."""
    net, x = _net(), torch.randn(12, 24)
    engine = SavedTensorOffloader(CPU, StreamCopier(CPU, DeferredOps("lazy", pins=pins)), min_bytes=0)
    _forward(net, engine, x).backward()
    first = engine.stats
    assert first.bytes_offloaded > 0 and engine.host_bytes_live == 0
    if pins:
        assert first.host_bytes_reserved >= pinned_bytes(first.host_bytes_peak) > first.host_bytes_peak
        assert engine.host_bytes_reserved == first.host_bytes_reserved  # freed blocks stay with the allocator
        _forward(net, engine, x).backward()
        assert engine.stats.host_bytes_reserved == first.host_bytes_reserved  # the second step reuses them
    else:
        assert first.host_bytes_reserved == first.host_bytes_peak and engine.host_bytes_reserved == 0


def test_host_allocation_failure_is_host_memory_not_a_device_oom(monkeypatch):
    """A failed cudaHostAlloc says "CUDA error: out of memory": raised as host memory, not taken for a device OOM."""
    cuda_message = RuntimeError("CUDA error: out of memory")

    def failing(*args, **kwargs):
        raise cuda_message

    monkeypatch.setattr(_offload_copiers.torch, "empty", failing)
    with pytest.raises(HostMemoryError, match=r"host buffer for an offloaded activation failed.*host RAM, not device"
                                              r" memory") as info:
        SyncCopier().to_host(torch.zeros(64, dtype=torch.uint8))
    assert not isinstance(info.value, torch.OutOfMemoryError) and info.value.__cause__ is cuda_message


def test_a_backward_aborted_by_an_error_leaves_no_device_copies_held():
    """Autograd runs queued callbacks only when a backward succeeds: after an OOM inside backward, the engine's
    end-of-backward cleanup never ran, and the restored copies it held stayed alive into the retry."""
    net, x = _net(), torch.randn(12, 24)
    engine = SavedTensorOffloader(CPU, SyncCopier(), min_bytes=0, prefetch=4)
    loss = _forward(net, engine, x)

    def oom(grad):
        raise torch.OutOfMemoryError("stand-in: out of memory in backward")

    handle = net[2].weight.register_hook(oom)  # raises after the head's backward ran and prefetches were issued
    with pytest.raises(torch.OutOfMemoryError):
        loss.backward()
    held = [weakref.ref(e.restored) for e in list(engine._held) if e.restored is not None]
    assert held  # the failed backward left restored copies held
    del loss
    handle.remove()
    _forward(net, engine, x)  # the retry's forward
    assert all(ref() is None for ref in held)

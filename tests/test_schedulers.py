"""``repoint_scheduler``: chained schedulers follow a swapped optimizer (LowBitOptimizer's and ZeroStrategy's swap)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim import lr_scheduler as S

from lightning_lowmem.core.schedulers import repoint_scheduler


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


def _chained(opt):
    return S.ChainedScheduler([S.LinearLR(opt, start_factor=0.1, total_iters=3), S.ExponentialLR(opt, gamma=0.9)])


def _sequential(opt):
    warm = S.LinearLR(opt, start_factor=0.1, total_iters=2)
    return S.SequentialLR(opt, [warm, S.CosineAnnealingLR(opt, T_max=4)], milestones=[2])


def _chained_of_sequential(opt):
    return S.ChainedScheduler([_sequential(opt), S.ExponentialLR(opt, gamma=0.9)])


def _all_schedulers(scheduler):
    yield scheduler
    for child in getattr(scheduler, "_schedulers", ()):
        yield from _all_schedulers(child)


@pytest.mark.parametrize("build", [_chained, _sequential, _chained_of_sequential], ids=["chained", "sequential", "nested"])
def test_every_chained_scheduler_drives_the_new_optimizer_as_it_drove_the_old(build):
    """The swapped optimizer sees the learning rates a twin that keeps its original optimizer sees, step by step."""
    params = _params()
    ref_opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 5e-3}], lr=1e-2)
    ref_sched = build(ref_opt)
    old = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 5e-3}], lr=1e-2)
    sched = build(old)
    new = torch.optim.SGD([dict(g) for g in old.param_groups], lr=1e-2)  # a different class over copies of the groups
    repoint_scheduler(sched, old, new)
    old_lrs = [g["lr"] for g in old.param_groups]

    assert all(s.optimizer is new for s in _all_schedulers(sched))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() has been overridden" / "before optimizer.step()"
        for _ in range(7):
            new.step()
            sched.step()
            ref_opt.step()
            ref_sched.step()
            assert [g["lr"] for g in new.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert [g["lr"] for g in old.param_groups] == old_lrs  # no inner scheduler still writes into the old one


def test_schedulers_of_another_optimizer_are_left_alone():
    a, b = torch.optim.SGD(_params(), lr=1.0), torch.optim.SGD(_params(), lr=1.0)
    sched = _chained(b)
    repoint_scheduler(sched, a, torch.optim.SGD(a.param_groups, lr=1.0))
    assert all(s.optimizer is b for s in _all_schedulers(sched))

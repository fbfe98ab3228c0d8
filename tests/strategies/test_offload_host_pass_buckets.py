"""The buckets of the overlapped host pass (``host_pass="overlap"``): which step speculatively during backward, which
wait for its end (the final ones: checked, then stepped at the step without a copy), how they shrink as backward ends.

Each case runs windows of gradients straight through a :class:`HostPass` and through plain AdamW on copies of the
masters, and compares the weights and the optimizer state with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.strategies.offload.host_pass import HostPass
from lightning_lowmem.strategies.offload.masters import HostMasters


def _same(masters, opt, p_ref, ref):
    for a, b in zip(masters.p_host, p_ref):
        assert torch.equal(a, b)
        assert all(torch.equal(opt.state[a][k], ref.state[b][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def _windows(hp, masters, opt, ref, windows, clip_value=None):
    """Run each window's ``{index: gradient}`` through the pass (in that order) and through ``ref`` (plain AdamW on
    copies, after ``clip_grad_value_``); yield after each ``finish``, before the step, with what the pass stepped
    speculatively."""
    for window in windows:
        hp.arm(opt, clip_norm=None, guard=True, clip_value=clip_value)
        for i, g in window.items():
            assert hp.submit(i, g)
        hp.finish()
        yield list(hp._stepped)  # NOTE: `_keep` lists the masters it copied before their speculative step
        stood = (clip_value is None or hp.clip_stands(clip_value, "value")) and hp.stands()
        hp.disarm()
        opt.zero_grad()
        if stood:
            for p, i in zip(ref.param_groups[0]["params"], range(len(masters.p_host))):
                p.grad = window[i].clone() if i in window else None
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(ref.param_groups[0]["params"], clip_value)
            ref.step()
            ref.zero_grad()


def test_the_last_bucket_is_checked_before_it_steps_and_keeps_no_copy():
    masters = HostMasters()
    masters.build(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), loading=False, precision=None,
                  grad_buffers=True)
    p_ref = [torch.nn.Parameter(p.detach().clone()) for p in masters.p_host]
    opt, ref = torch.optim.AdamW(masters.p_host), torch.optim.AdamW(p_ref)
    hp = HostPass(masters, bucket_bytes=4)  # every gradient fills a bucket alone
    g = [torch.randn_like(p) for p in masters.p_host]
    nan = torch.full_like(g[0], float("nan"))
    windows = [
        {3: g[3], 2: g[2], 1: g[1], 0: g[0]},  # the first window does not know which gradient comes last
        {3: g[3], 2: g[2], 1: g[1], 0: g[0]},  # master 0 fills the last bucket: checked at the end, stepped at the step
        {3: g[3], 2: g[2], 1: g[1], 0: nan},  # a NaN in the last bucket: it never steps, the others are put back
        {3: g[3], 2: g[2], 1: g[1]},  # master 0 never comes: waiting for it, master 1 stepped speculatively
        {3: g[3], 2: g[2], 1: g[1], 0: g[0]},  # master 1's bucket is held as the probable last; master 0 runs it
    ]
    seen = []
    for stepped in _windows(hp, masters, opt, ref, windows):
        seen.append(stepped)
        assert (hp.failed == "a non-finite gradient") == (len(seen) == 3)
    assert seen == [[3, 2, 1, 0], [3, 2, 1], [3, 2, 1], [3, 2, 1], [3, 2, 1]]
    _same(masters, opt, p_ref, ref)
    hp.close()


@pytest.mark.parametrize("clip_value", [None, 0.3])
def test_a_full_bucket_before_a_small_last_one_waits_for_the_end_too(clip_value):
    # NOTE: GPT-2's tied embedding lands just before the position embedding: the bucket it fills is held (the rest of
    # what the last backward handed over fits in one more bucket); both are checked at the end, stepped at the step
    masters = HostMasters()
    masters.build(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), loading=False, precision=None,
                  grad_buffers=True)  # 16, 4, 8, 2 values
    p_ref = [torch.nn.Parameter(p.detach().clone()) for p in masters.p_host]
    opt, ref = torch.optim.AdamW(masters.p_host), torch.optim.AdamW(p_ref)
    hp = HostPass(masters, bucket_bytes=40)
    g = [torch.randn_like(p) for p in masters.p_host]
    window = {2: g[2], 0: g[0], 1: g[1], 3: g[3]}  # 2 and 0 fill a bucket; 1 and 3 (24 B) would not
    seen = list(_windows(hp, masters, opt, ref, [window] * 3, clip_value))
    assert seen == [[2, 0], [], []]  # the first window does not know what comes; then nothing steps speculatively
    _same(masters, opt, p_ref, ref)
    hp.close()


def _pass_on(module, bucket_bytes):
    masters = HostMasters()
    masters.build(module, loading=False, precision=None, grad_buffers=True)
    p_ref = [torch.nn.Parameter(p.detach().clone()) for p in masters.p_host]
    return masters, torch.optim.AdamW(masters.p_host), p_ref, torch.optim.AdamW(p_ref), HostPass(masters, bucket_bytes)


def test_buckets_shrink_as_backward_ends_so_the_final_ones_are_small(monkeypatch):
    torch.manual_seed(0)
    masters, opt, p_ref, ref, hp = _pass_on(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(32)]), 4096)
    runs = []
    run_bucket = HostPass._run_bucket
    monkeypatch.setattr(HostPass, "_run_bucket", lambda self, b=None: runs.append(1) or run_bucket(self, b))
    g = [torch.randn_like(p) for p in masters.p_host]  # weights of 1 KiB, biases of 64 B: 34 KiB in all
    window = {i: g[i] for i in reversed(range(len(g)))}
    counts, finals = [], []
    for _ in _windows(hp, masters, opt, ref, [window] * 3):
        counts.append(len(runs))
        finals.append(sum(masters.p_host[i].numel() * 4 for b in [*hp._final] for i in b))
        runs.clear()
    # NOTE: the first window knows nothing of what comes: 8 buckets of 4 KiB (4 blocks each), all speculative; then
    # they halve below 8 KiB still to come (down to 256 B at most): the final bucket is the first block alone
    assert counts == [8, 10, 10] and finals == [0, 1088, 1088]  # 4 KiB speculatively, then 2 KiB, 1 KiB: left 1 KiB
    _same(masters, opt, p_ref, ref)
    hp.close()


def test_a_parameter_larger_than_what_is_left_waits_for_the_end_and_the_rest_joins_it():
    # NOTE: GPT-2's tied embedding (larger than a bucket) lands last but for the position embedding: a speculative step
    # of it would end after backward, its copy included; it is held, and the position embedding's bucket joins it
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(16, 16) for _ in range(8)]
    masters, opt, p_ref, ref, hp = _pass_on(torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), *blocks), 4096)
    g = [torch.randn_like(p) for p in masters.p_host]  # 0: 16 KiB, landing before the last (1: the first block's weight)
    window = {i: g[i] for i in [*reversed(range(2, len(g))), 0, 1]}
    seen, finals = [], []
    for stepped in _windows(hp, masters, opt, ref, [window] * 3):
        seen.append(set(stepped))
        finals.append(sorted(i for b in hp._final for i in b))
    assert 0 in seen[0] and all(0 not in s and 1 not in s for s in seen[1:])
    # NOTE: held with the bucket it closed (the first blocks' but for 1), and 1 joins it
    assert finals == [[1], [*range(9)], [*range(9)]]
    _same(masters, opt, p_ref, ref)
    hp.close()


def test_gradients_waiting_for_the_worker_are_bounded_by_a_bucket():
    """A gradient handed over stays alive until the worker folds it: past a bucket of them the autograd thread waits
    (a staging slot, which exists anyway, counts nothing: ``nbytes=0``)."""
    torch.manual_seed(0)
    masters, opt, _, _, hp = _pass_on(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)]), 2048)
    g = [torch.randn_like(p) for p in masters.p_host]
    hp.arm(opt, clip_norm=None, guard=True)
    for i in reversed(range(len(g))):
        assert hp.submit(i, g[i], nbytes=g[i].numel() * 4)
    hp.finish()
    assert 1024 <= hp._worker.most_bytes <= 2048  # NOTE: 1 KiB weights: at least one waited, never more than 2 KiB
    assert hp.stands()
    hp.disarm()
    hp.close()

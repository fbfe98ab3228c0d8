"""LowBitOptimizer alone: bad input, which optimizers convert, param groups, state dtypes, LR schedules."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from lightning_lowmem.callbacks.low_bit_optimizer import _TARGETS, KINDS, LowBitOptimizer
from lightning_lowmem.core.schedulers import repoint_scheduler
from tests.helpers.models import tiny_gpt2
from tests.helpers.runif import RunIf

pytestmark = [pytest.mark.bnb, RunIf(bitsandbytes=True)]


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}]


def _fill_grads(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_bad_arguments_are_reported_together():
    with pytest.raises(ValueError, match=r"`kind='adamw4bit'`; expected one of 'adamw8bit'.*`min_8bit_size=-1`"):
        LowBitOptimizer(kind="adamw4bit", min_8bit_size=-1)
    with pytest.raises(TypeError, match="stable_embedding='yes'"):
        LowBitOptimizer(stable_embedding="yes")  # type: ignore[arg-type]


def test_missing_bitsandbytes_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise ImportError
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-lowmem\[bnb\]'"):
        LowBitOptimizer().target_class()


def test_optimizer_without_8bit_equivalent_lists_the_kinds():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"`torch.optim.sgd.SGD`: it has no 8-bit equivalent.*'adamw8bit'.*'lion8bit'"):
        LowBitOptimizer().convert(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"would change the algorithm. For this optimizer use kind='adamw8bit' or"):
        LowBitOptimizer(kind="lion8bit").convert(torch.optim.AdamW(model.parameters()))


def test_options_bitsandbytes_cannot_honour_are_refused():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), weight_decay=0.01, amsgrad=True)
    with pytest.raises(ValueError, match=r"amsgrad=True.*L2 added to the gradient"):
        LowBitOptimizer(kind="adam8bit").convert(opt)
    # Adam without weight decay is the same maths as bitsandbytes' Adam: accepted
    LowBitOptimizer(kind="adam8bit").convert(torch.optim.Adam(model.parameters()))
    # NOTE: bitsandbytes' kernels raise deep inside the first step on float64 (and the planner's dry run crashed on it)
    wide = torch.nn.Linear(4, 4).double()
    with pytest.raises(ValueError, match=r"param group 0 holds 2 float64 parameter\(s\).*cast them to float32"):
        LowBitOptimizer().convert(torch.optim.AdamW(wide.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_convert_keeps_groups_and_gives_uint8_state_over_min_size(kind):
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=1)
    if kind == "lion8bit":
        original = bnb.optim.Lion32bit(_groups(model), lr=1e-4, betas=(0.9, 0.99))
    else:
        original = (torch.optim.Adam if kind == "adam8bit" else torch.optim.AdamW)(
            _groups(model) if kind != "adam8bit" else model.parameters(), lr=1e-3, betas=(0.8, 0.95), eps=1e-7
        )
    min_size = 2048
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged on CPU warns that it falls back to non-paged
        new = LowBitOptimizer(kind=kind, min_8bit_size=min_size).convert(original)
        assert type(new).__name__ == _TARGETS[kind][0]
        for g_old, g_new in zip(original.param_groups, new.param_groups, strict=True):
            assert all(a is b for a, b in zip(g_old["params"], g_new["params"], strict=True))
            for key in ("lr", "betas", "weight_decay") + (("eps",) if kind != "lion8bit" else ()):
                assert g_new[key] == g_old[key], key
        _fill_grads(model)
        new.step()
    sizes = set()
    for group in new.param_groups:
        for p in group["params"]:
            state = new.state[p]
            expected = torch.uint8 if p.numel() >= min_size else torch.float32
            assert state["state1"].dtype == expected, (p.shape, state["state1"].dtype)
            if kind != "lion8bit":
                assert state["state2"].dtype == expected
            sizes.add(expected)
    assert sizes == {torch.uint8, torch.float32}  # adversarial: both branches are exercised


def test_already_target_class_is_kept():
    import bitsandbytes as bnb

    opt = bnb.optim.AdamW8bit(torch.nn.Linear(4, 4).parameters())
    assert LowBitOptimizer(kind="adamw8bit").convert(opt) is opt


def test_lr_schedule_identical_after_repointing():
    """Sequential warm-up + cosine schedule: the re-pointed scheduler drives the 8-bit optimizer's groups
    exactly as it drives the original's (compared with a twin that keeps the original optimizer)."""
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=1)

    def build():
        opt = torch.optim.AdamW(_groups(model), lr=1e-3)
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
        return opt, torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])

    ref_opt, ref_sched = build()
    opt, sched = build()
    new = LowBitOptimizer().convert(opt)
    repoint_scheduler(sched, opt, new)
    assert sched.optimizer is new and all(s.optimizer is new for s in sched._schedulers)
    assert [g["initial_lr"] for g in new.param_groups] == [g["initial_lr"] for g in ref_opt.param_groups]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() has been overridden" warning from torch
        for _ in range(8):
            _fill_grads(model)
            new.step()
            sched.step()
            # the reference only needs the lr sequence, so it steps without gradients
            for p in model.parameters():
                p.grad = None
            ref_opt.step()
            ref_sched.step()
            assert [g["lr"] for g in new.param_groups] == [g["lr"] for g in ref_opt.param_groups]


@pytest.mark.slow  # two fresh imports of bitsandbytes (~10 s each on 2 cores)
def test_bitsandbytes_4bit_kernel_notice_dropped_from_our_import_only():
    """bitsandbytes logs on import (AVX512-bf16 CPUs) that its optional 4-bit CPU kernel is missing; the 8-bit
    optimizers never use it, so our import drops that one message, and only during our import."""
    import subprocess

    notice = "Failed to load CPU gemm_4bit_forward"
    ours = subprocess.run(
        [sys.executable, "-c", ("from lightning_lowmem.core.optional import require; require('bitsandbytes', 'test')\n"
         "import logging; assert not logging.getLogger('bitsandbytes.backends.cpu.ops').filters")],
        capture_output=True, text=True, check=False,
    )
    assert ours.returncode == 0, ours.stderr[-1000:]
    assert notice not in ours.stderr
    theirs = subprocess.run([sys.executable, "-c", "import bitsandbytes"], capture_output=True, text=True, check=False)
    if notice not in theirs.stderr:
        pytest.skip("this CPU's bitsandbytes import gives no 4-bit kernel notice to drop")

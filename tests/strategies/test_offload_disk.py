"""``OffloadStrategy(disk=...)`` / ``strategy="lowmem_offload_disk"``: masters and optimizer state in files.

Each case trains the same module through ``Trainer.fit`` with the step in backward in RAM and with the disk tier, and
compares the weights, the buffers and the optimizer state with ``torch.equal`` (the tier changes where the bytes live,
not one operation), with budgets that hold every parameter, one at a time, or less than one (the training thread
then waits for each read and write). The resume in a new process is ``tests/test_resume_across_processes.py``'s.
"""

from __future__ import annotations

import errno
import os
import warnings

import lightning as L
import pytest
import torch

from lightning_lowmem.core.host_memory import pinned_bytes
from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in
from lightning_lowmem.strategies.offload.disk_tier import DiskTier
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.helpers.models import random_batch, tiny_lm_module
from tests.strategies.test_offload_in_backward import Net, _data
from tests.test_resume_across_processes import assert_resumes_identical


class Seen(L.Callback):
    """What the tier holds during the fit: the files in its directory, the breakdown, the tier's counters."""

    def __init__(self, directory):
        self.directory, self.files, self.breakdown, self.stats = directory, set(), None, None

    def on_train_batch_end(self, trainer, *args):
        self.files |= set(os.listdir(self.directory))
        self.breakdown = trainer.strategy.memory_breakdown()
        self.stats = vars(trainer.strategy._tier.stats).copy() if trainer.strategy._tier is not None else None
        self.staging = trainer.strategy._transfer.staging_bytes()


def _fit(module, data, *, precision="bf16-true", epochs=2, **strategy_kw):
    torch.manual_seed(0)
    module = module()
    strategy = OffloadStrategy(optimizer_in_backward=True, **strategy_kw)
    seen = Seen(strategy_kw.get("disk") or ".")
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision=precision, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[seen])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    opt_state = trainer.optimizers[0].state
    state = [(k, v.clone()) for p in module.parameters() for k, v in sorted(opt_state.get(p, {}).items())
             if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in (*module.parameters(), *module.buffers())], state, seen


def _assert_same(a, b):
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert [k for k, _ in a[1]] == [k for k, _ in b[1]] and all(torch.equal(x, y) for (_, x), (_, y) in zip(a[1], b[1]))


@pytest.mark.parametrize("budget", [1, 4096, "1GiB"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_disk_tier_trains_bit_identically_to_ram(tmp_path, optimizer, budget):
    module = lambda: Net(optimizer=optimizer)
    in_ram = _fit(module, _data())
    on_disk = _fit(module, _data(), disk=tmp_path, disk_buffer=budget)
    _assert_same(in_ram, on_disk)
    seen = on_disk[2]
    assert seen.files == set()  # NOTE: unlinked as soon as opened: a killed run leaves nothing behind
    masters = sum(p.numel() * 4 for p in Net().parameters())
    assert seen.breakdown.disk["optimizer_state"] >= masters  # the masters and the state tensors of a page or more
    assert seen.stats["read_bytes"] > 0 and seen.stats["write_bytes"] > 0


def test_a_hugging_face_model_trains_bit_identically_on_disk(tmp_path):
    data = [random_batch(seed=i) for i in range(3)]
    in_ram = _fit(tiny_lm_module, data, epochs=1)
    on_disk = _fit(tiny_lm_module, data, epochs=1, disk=tmp_path, disk_buffer="64KiB")
    _assert_same(in_ram, on_disk)
    breakdown = on_disk[2].breakdown
    assert breakdown.host["optimizer_state"] < breakdown.disk["optimizer_state"] / 50  # only sub-page state in RAM
    assert breakdown.host["other"] <= 64 * 2**10 + max(
        p.numel() * 12 for p in tiny_lm_module().parameters())  # the budget, or one parameter's master and moments


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cuda_transfer_stages_the_tier_through_one_ring_exactly(tmp_path, seed):
    """On the CUDA logic (the deferred stand-in, copies landing in random orders) the gradients and uploads take turns
    in one pinned ring of two of the largest weights (not a slot per parameter): it wraps many times a step, each
    slot taken again only after its copy landed and its gradient stepped, and the run equals the CPU path's."""
    data = [random_batch(seed=i) for i in range(3)]
    in_ram = _fit(tiny_lm_module, data, epochs=1)
    with cpu_stand_in(lambda: DeferredOps("random", seed=seed)):
        on_disk = _fit(tiny_lm_module, data, epochs=1, disk=tmp_path)
    _assert_same(in_ram, on_disk)
    largest = max(p.numel() * 2 for p in tiny_lm_module().parameters())
    assert on_disk[2].staging == pinned_bytes(2 * -(-largest // 512) * 512)


def test_the_registered_name_puts_the_tier_in_the_default_root_dir(tmp_path):
    trainer = L.Trainer(strategy="lowmem_offload_disk", accelerator="cpu", precision="bf16-true", max_steps=2,
                        default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(), torch.utils.data.DataLoader(_data(), batch_size=None))
    assert trainer.strategy.optimizer_in_backward and trainer.strategy.disk is True
    assert trainer.global_step == 2


def test_a_run_on_the_disk_tier_resumes_identically_in_a_new_process(tmp_path):
    assert_resumes_identical(tmp_path, "lowmem_offload_disk", "bf16-true", steps=4, save_at=[1])


def test_bad_flags_are_refused_together(tmp_path):
    with pytest.raises(ValueError) as err:
        OffloadStrategy(disk=tmp_path / "missing", disk_buffer="lots")
    message = str(err.value)
    assert "missing" in message and "not a directory" in message
    assert "optimizer_in_backward=True" in message and "disk_buffer='lots'" in message
    with pytest.raises(TypeError, match="expected a directory"):
        OffloadStrategy(disk=3, optimizer_in_backward=True)


def test_a_disk_too_small_is_refused_at_setup_with_the_figures(tmp_path, monkeypatch):
    from lightning_lowmem.strategies.offload import strategy as strategy_module

    class Usage:
        free = 1000

    monkeypatch.setattr(strategy_module.shutil, "disk_usage", lambda _: Usage())
    with pytest.raises(ValueError, match=r"needs 0\.00 GiB .* and 0\.00 GiB are free there"):
        _fit(Net, _data(), disk=tmp_path)


def test_a_full_disk_is_an_error_naming_the_tier_not_a_crash(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, budget=2**20)

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="disk tier in .* is full: placing `master` of parameter 0") as err:
        tier.place(0, torch.ones(10))
    assert err.value.errno == errno.ENOSPC
    tier.close()


def test_the_budget_bounds_what_is_read_ahead(tmp_path):
    tier = DiskTier(tmp_path, budget=3 * 4096)
    values = [tier.place(i, torch.full((1024,), float(i))) for i in range(8)]
    tier.wait()
    tier.plan(range(8))
    assert tier.bytes_in_ram <= 3 * 4096
    for i in range(8):
        tier.acquire(i)
        assert tier.bytes_in_ram <= 3 * 4096
        values[i].add_(1)
        tier.release(i)
    tier.wait()
    assert tier.bytes_in_ram == 0
    assert [float(v[0]) for v in values] == [float(i + 1) for i in range(8)]
    tier.close()


def test_a_resume_maps_the_checkpoint_instead_of_reading_it_into_ram(tmp_path):
    strategy = OffloadStrategy(optimizer_in_backward=True, disk=tmp_path)
    path = tmp_path / "c.ckpt"
    strategy.checkpoint_io.save_checkpoint({"state_dict": {"w": torch.arange(4096.0)}}, path)
    loaded = strategy.checkpoint_io.load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(4096.0))
    assert _mapped_from(loaded["state_dict"]["w"], path)  # file-backed, not read into RAM
    assert not _mapped_from(OffloadStrategy().checkpoint_io.load_checkpoint(path)["state_dict"]["w"], path)


def _mapped_from(t: torch.Tensor, path) -> bool:
    """Whether ``t``'s memory lies in a mapping of the file ``path`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        spans = [line.split()[0].split("-") for line in maps if line.rstrip().endswith(str(path))]
    return any(int(lo, 16) <= t.data_ptr() < int(hi, 16) for lo, hi in spans)


def test_an_empty_tensor_is_kept_as_it_is(tmp_path):
    tier = DiskTier(tmp_path, budget=2**20)
    empty = torch.empty(0, 3)
    assert tier.place(0, empty) is empty and tier.bytes_on_disk == 0
    tier.close()

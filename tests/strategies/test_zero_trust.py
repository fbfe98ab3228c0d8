"""lowmem_zero*: ZeRO checkpoint directories you can trust. Nothing run from a forged file (at resume and in
``consolidate``), damage found through the digest manifest, a full disk named and cleaned up, an unwritable
checkpoint directory refused before the first step."""

from __future__ import annotations

import json
import os
import shutil

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_lowmem.core.digest import MANIFEST, DigestMismatchError
from lightning_lowmem.core.disk_full import DiskFullError
from lightning_lowmem.core.trusted_load import UntrustedCheckpointError
from lightning_lowmem.strategies.zero.checkpoint import zero_checkpoint_problem
from tests.helpers.checkpoints import flip_tensor_bytes, forge
from tests.helpers.runif import RunIf

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.integration,
    RunIf(deepspeed=True),
    pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.*:FutureWarning"),
]


def _trainer(strategy, **kwargs):
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False, **kwargs)


class _Steps:
    count = 0


def _module():
    from lightning_lowmem.demo.module import CausalLMModule
    from tests.helpers.models import GPT2_TINY

    class Counting(CausalLMModule):
        def training_step(self, batch, batch_idx):
            _Steps.count += 1
            return super().training_step(batch, batch_idx)

    return Counting(config=dict(GPT2_TINY, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _loader(n=8):
    from tests.helpers.models import random_batch

    full = random_batch(n, 16, seed=1)
    return torch.utils.data.DataLoader([{k: v[i] for k, v in full.items()} for i in range(n)], batch_size=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Real ``lowmem_zero2`` and ``lowmem_zero3`` checkpoint directories after 2 steps, saved under umask 077."""
    out = {}
    previous = os.umask(0o077)
    try:
        for name in ("lowmem_zero2", "lowmem_zero3"):
            directory = tmp_path_factory.mktemp(name) / "last.ckpt"
            trainer = _trainer(name, max_steps=2)
            trainer.fit(_module(), _loader())
            trainer.save_checkpoint(directory)
            out[name] = directory
    finally:
        os.umask(previous)
    return out


def _copy(src, tmp_path):
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def test_the_save_writes_a_manifest_last_and_honours_the_umask(checkpoints):
    for directory in checkpoints.values():
        manifest = json.loads((directory / MANIFEST).read_text())["files"]
        on_disk = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
        assert sorted(manifest) == [p for p in on_disk if p != MANIFEST]  # every file, and no note left behind
        assert all(p.stat().st_mode & 0o077 == 0 for p in [directory, *directory.rglob("*")])  # umask 077: owner only
        assert zero_checkpoint_problem(directory) is None


@pytest.mark.parametrize(
    ("preset", "victim"),
    [("lowmem_zero2", "mp_rank_00_model_states.pt"), ("lowmem_zero2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
     ("lowmem_zero3", "zero_pp_rank_0_mp_rank_00_model_states.pt")],
)
def test_a_forged_file_runs_nothing_at_resume_or_consolidate(checkpoints, tmp_path, preset, victim):
    from lightning_lowmem.zero import consolidate

    ckpt = _copy(checkpoints[preset], tmp_path)
    (ckpt / MANIFEST).unlink(missing_ok=True)  # a forger rewrites or drops the manifest: the weights-only load is what stops it
    file = ckpt / "checkpoint" / victim
    marker = tmp_path / "PAYLOAD_RAN"
    forge(file, marker)
    _Steps.count = 0
    with pytest.raises(UntrustedCheckpointError) as at_resume:
        _trainer(preset, max_steps=3).fit(_module(), _loader(), ckpt_path=str(ckpt))
    with pytest.raises(UntrustedCheckpointError) as at_consolidate:
        consolidate(ckpt, tmp_path / "out.pt")
    assert not marker.exists() and _Steps.count == 0 and not (tmp_path / "out.pt").exists()
    for exc, opt_in in ((at_resume, "weights_only=False"), (at_consolidate, "trusted=True")):
        assert f"Refused to load '{file}': it holds " in str(exc.value) and "pathlib" in str(exc.value)
        assert opt_in in str(exc.value)
    consolidate(ckpt, tmp_path / "out.pt", trusted=True)  # the opt-in: the payload is real
    assert marker.exists()


@pytest.mark.parametrize("victim", ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
def test_flipped_tensor_bytes_are_found_at_resume_and_consolidate(checkpoints, tmp_path, victim):
    from lightning_lowmem.zero import consolidate

    ckpt = _copy(checkpoints["lowmem_zero2"], tmp_path)
    file = ckpt / "checkpoint" / victim
    flip_tensor_bytes(file)
    assert zero_checkpoint_problem(ckpt) is None  # the structure is intact: only the digest tells
    match = rf"'{file}' does not match its SHA-256 digest in '.*{MANIFEST}'"
    _Steps.count = 0
    with pytest.raises(DigestMismatchError, match=match):
        _trainer("lowmem_zero2", max_steps=3).fit(_module(), _loader(), ckpt_path=str(ckpt))
    with pytest.raises(DigestMismatchError, match=match):
        consolidate(ckpt, tmp_path / "out.pt")
    assert _Steps.count == 0


def test_a_directory_without_manifest_still_loads(checkpoints, tmp_path):
    """DeepSpeed's own checkpoints (and earlier lowmem ones) have no manifest: read as before, weights-only."""
    from lightning_lowmem.zero import consolidate

    ckpt = _copy(checkpoints["lowmem_zero2"], tmp_path)
    (ckpt / MANIFEST).unlink(missing_ok=True)
    trainer = _trainer("lowmem_zero2", max_steps=3)
    trainer.fit(_module(), _loader(), ckpt_path=str(ckpt))
    assert trainer.global_step == 3
    assert consolidate(ckpt, tmp_path / "out.pt")


def test_a_full_disk_during_a_save_is_named_and_the_temp_directory_removed(checkpoints, tmp_path, monkeypatch):
    """A real ENOSPC: the optimizer shard's path in the new temp directory is a link to /dev/full."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    ckpt = _copy(checkpoints["lowmem_zero2"], tmp_path)
    before = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    trainer = _trainer("lowmem_zero2", max_steps=2)
    trainer.fit(_module(), _loader())

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)
        if ".tmp-" in str(path) and os.path.basename(path) == "checkpoint":
            os.symlink("/dev/full", os.path.join(path, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))

    monkeypatch.setattr(CheckpointEngine, "makedirs", makedirs)
    with pytest.raises(DiskFullError) as exc:
        trainer.save_checkpoint(ckpt)
    message = str(exc.value)
    assert message.startswith("No space left on ") and f"while writing '{ckpt}' (its file checkpoint/zero_pp_rank_0" in message
    assert "needed ~" in message and "free " in message and "unexpected pos" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the temp directory is gone
    assert {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


def test_a_checkpoint_dir_that_cannot_be_created_is_refused_before_the_first_step(tmp_path):
    (tmp_path / "notes.txt").write_text("a file where the run's folder should be")
    dirpath = tmp_path / "notes.txt" / "checkpoints"
    _Steps.count = 0
    with pytest.raises(ValueError) as exc:
        _trainer("lowmem_zero2", max_steps=2, enable_checkpointing=True,
                 callbacks=[ModelCheckpoint(dirpath=dirpath)]).fit(_module(), _loader())
    assert f"the checkpoint directory '{dirpath}' cannot be created: '{tmp_path / 'notes.txt'}' is a file" in str(exc.value)
    assert _Steps.count == 0


def test_lowmem_consolidate_of_a_forged_checkpoint_is_one_line(checkpoints, tmp_path, capsys):
    from lightning_lowmem.cli import main

    ckpt = _copy(checkpoints["lowmem_zero2"], tmp_path)
    (ckpt / MANIFEST).unlink(missing_ok=True)  # else the size recorded in it already tells the file was rewritten
    file = ckpt / "checkpoint" / "mp_rank_00_model_states.pt"
    marker = tmp_path / "PAYLOAD_RAN"
    forge(file, marker)
    assert main(["consolidate", str(ckpt), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lowmem: error: Refused to load '{file}'") and "`lowmem consolidate --trusted DIR OUT`" in err
    assert len(err.strip().splitlines()) == 2  # the error line and the LOWMEM_TRACEBACK hint
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_a_zero3_fit_leaves_torch_functional_linear_as_it_found_it(checkpoints):
    """ZeRO-3's `zero.Init` swaps `torch.nn.functional.linear` process-wide; after fit the original is back."""
    assert "lowmem_zero3" in checkpoints  # NOTE: the fixture ran a `lowmem_zero3` fit in this process
    assert torch.nn.functional.linear is torch._C._nn.linear


def test_universal_checkpoint_loading_is_refused_before_the_first_step():
    """DeepSpeed's universal loader unpickles its files itself (no checkpoint engine): refused when the engine is built."""
    from lightning_lowmem.strategies.zero import ZeroStrategy

    _Steps.count = 0
    strategy = ZeroStrategy(stage=2, config={"checkpoint": {"load_universal": True}})
    with pytest.raises(ValueError, match=r"The DeepSpeed config selects universal-checkpoint loading .*weights-only"):
        _trainer(strategy, max_steps=1).fit(_module(), _loader())
    assert _Steps.count == 0

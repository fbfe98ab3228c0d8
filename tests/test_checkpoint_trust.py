"""Single-file checkpoints (``lowmem_offload``) you can trust: nothing run from a forged file, damage found at load,
a full disk named, an unwritable checkpoint directory refused before the first step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_lowmem  # noqa: F401
from lightning_lowmem.core.checkpoint_io import AtomicCheckpointIO
from lightning_lowmem.core.digest import DigestMismatchError
from lightning_lowmem.core.disk_full import DiskFullError
from lightning_lowmem.core.trusted_load import UntrustedCheckpointError
from tests.helpers.checkpoints import flip_tensor_bytes, forge

ROOT = Path(__file__).resolve().parents[1]


class Counting(BoringModel):
    steps = 0

    def training_step(self, batch, batch_idx):
        type(self).steps += 1
        return super().training_step(batch, batch_idx)


def _trainer(max_steps, **kwargs):
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", strategy="lowmem_offload", max_steps=max_steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **kwargs)


@pytest.fixture
def saved(tmp_path):
    """A `lowmem_offload` checkpoint after 2 steps (written by AtomicCheckpointIO: it carries its digest)."""
    trainer = _trainer(2)
    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    return tmp_path / "last.ckpt"


@pytest.mark.integration
def test_flipped_tensor_bytes_are_refused_at_resume_naming_the_file(saved):
    flip_tensor_bytes(saved)  # 4 KiB inside the largest tensor; the zip directory is intact, torch.load reads it
    assert torch.load(saved, weights_only=True)["global_step"] == 2
    Counting.steps = 0
    with pytest.raises(DigestMismatchError) as exc:
        _trainer(4).fit(Counting(), ckpt_path=str(saved))
    assert f"The checkpoint '{saved}' does not match the SHA-256 digest recorded in it" in str(exc.value)
    assert Counting.steps == 0


@pytest.mark.integration
def test_a_checkpoint_without_digest_still_loads(tmp_path):
    """Plain Lightning's checkpoint (TorchCheckpointIO: no digest) resumes under lowmem_offload."""
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    resumed = _trainer(3)
    resumed.fit(BoringModel(), ckpt_path=str(tmp_path / "plain.ckpt"))
    assert resumed.global_step == 3


@pytest.mark.integration
@pytest.mark.parametrize("force_env", [False, True])
def test_a_forged_checkpoint_runs_nothing(saved, tmp_path, monkeypatch, force_env):
    """The payload would create `marker`; with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 torch's own default is off too."""
    marker = tmp_path / "PAYLOAD_RAN"
    forge(saved, marker)
    if force_env:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UntrustedCheckpointError) as exc:
        _trainer(3).fit(BoringModel(), ckpt_path=str(saved))
    assert not marker.exists()
    message = str(exc.value)
    assert f"Refused to load '{saved}': it holds " in message and "pathlib" in message
    assert "trainer.fit(model, ckpt_path=..., weights_only=False)" in message
    # the opt-in names the file as trusted: then it is unpickled fully (the payload is real)
    _trainer(3).fit(BoringModel(), ckpt_path=str(saved), weights_only=False)
    assert marker.exists()


def test_a_full_disk_during_a_save_is_named(tmp_path):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(1 << 18)}}, target)
    before = target.read_bytes()
    os.symlink("/dev/full", tmp_path / f".last.ckpt.tmp-{os.getpid()}")  # the kernel answers ENOSPC
    with pytest.raises(DiskFullError, match=r"^No space left on .* while writing '.*last\.ckpt' \(needed ~4\.00 MiB"):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(1 << 20)}}, target)
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.integration
def test_a_checkpoint_dir_under_a_file_is_refused_before_the_first_step(tmp_path):
    (tmp_path / "notes.txt").write_text("a file where the run's folder should be")
    dirpath = tmp_path / "notes.txt" / "checkpoints"
    Counting.steps = 0
    with pytest.raises(ValueError) as exc:
        _trainer(2, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=dirpath)]).fit(Counting())
    assert f"the checkpoint directory '{dirpath}' cannot be created: '{tmp_path / 'notes.txt'}' is a file" in str(exc.value)
    assert "ModelCheckpoint(dirpath=...)" in str(exc.value) and Counting.steps == 0


_READ_ONLY_SCRIPT = """
import sys
import lightning as L
import lightning_lowmem
from lightning.pytorch.callbacks import ModelCheckpoint
from tests.test_checkpoint_trust import Counting
try:
    L.Trainer(accelerator="cpu", strategy="lowmem_offload", max_steps=2, logger=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0,
              callbacks=[ModelCheckpoint(dirpath=sys.argv[1], every_n_train_steps=1)]).fit(Counting())
except Exception as err:
    print("ERROR", type(err).__name__, err)
print("STEPS", Counting.steps)
"""


@pytest.mark.integration
def test_a_read_only_checkpoint_dir_is_refused_before_the_first_step(tmp_path):
    """A real read-only directory. Root writes anywhere, so as root (CI) the run is a child process without the
    capabilities that bypass file permissions (``setpriv``), to which the 0o555 directory is read-only."""
    import shutil

    locked = tmp_path / "checkpoints"
    locked.mkdir()
    os.chmod(locked, 0o555)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root, needs util-linux's setpriv to drop CAP_DAC_OVERRIDE")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(_READ_ONLY_SCRIPT), str(locked)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert "STEPS 0" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"the checkpoint directory '{locked}' cannot be written: Permission denied" in out.stdout

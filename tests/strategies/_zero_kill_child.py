"""Child process of the kill tests: ZeRO-2 (or ``lowmem_offload``) on the CPU, ``last.ckpt`` saved every step.

    python _zero_kill_child.py DIR MAX_STEPS KILL [--resume] [--offload]

``KILL`` is ``none``, ``announce`` (print ``SAVE_START n`` before each save, for the parent to kill at a random
moment of it), ``plain@write_model`` (DeepSpeed's own in-place save, the control) or ``PHASE@N``: SIGKILL this
process inside the N-th save of this run, at ``PHASE``:

- ``write_model`` / ``write_optim``: halfway through writing ``*model_states.pt`` / ``*optim_states.pt``;
- ``before_latest``: every shard written, ``latest`` not yet;
- ``before_swap``: the temp directory complete and fsync-ed, not yet swapped in;
- ``mid_swap_fallback``: without ``RENAME_EXCHANGE``, between renaming the previous checkpoint away and the new
  one into place (the only moment the target name is missing);
- ``after_swap``: the new checkpoint in place, the previous one half deleted.

With ``--offload`` (``lowmem_offload``, one file): ``write_file`` (half the bytes of the temp file written) and
``before_replace`` (the temp file complete and fsync-ed, not yet renamed).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_lowmem.core import atomic as _atomic
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.strategies.zero.strategy import ZeroStrategy
from tests.helpers.models import GPT2_TINY, random_batch


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    directory, max_steps, kill = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    resume = "--resume" in sys.argv
    offload = "--offload" in sys.argv
    devices = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--devices=")), 1)  # >1: under torchrun
    phase, _, nth = kill.partition("@")
    target_save = int(nth) if nth else -1
    saves = {"n": 0}

    original_save = ZeroStrategy.save_checkpoint

    def counted_save(self, checkpoint, filepath, storage_options=None):
        saves["n"] += 1
        print(f"SAVE_START {saves['n']} step={checkpoint['global_step']}", flush=True)
        if phase == "plain":
            return DeepSpeedStrategy.save_checkpoint(self, checkpoint, filepath, storage_options)
        return original_save(self, checkpoint, filepath, storage_options)

    ZeroStrategy.save_checkpoint = counted_save
    if offload:
        from lightning_lowmem.core import checkpoint_io as aio
        from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

        offload_save = OffloadStrategy.save_checkpoint

        def counted_offload_save(self, checkpoint, filepath, storage_options=None):
            saves["n"] += 1
            print(f"SAVE_START {saves['n']} step={checkpoint['global_step']}", flush=True)
            return offload_save(self, checkpoint, filepath, storage_options)

        OffloadStrategy.save_checkpoint = counted_offload_save
        torch_save, os_replace = torch.save, os.replace

        def half_save(obj, f, *args, **kwargs):
            if armed() and phase == "write_file" and hasattr(f, "write"):
                buffer = io.BytesIO()
                torch_save(obj, buffer)
                f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                f.flush()  # NOTE: the atomic writer's hashing file object has no fileno; the bytes are in the page cache
                die()
            return torch_save(obj, f, *args, **kwargs)

        def replace(src, dst):
            if armed() and phase == "before_replace" and str(dst).endswith("last.ckpt"):
                die()
            return os_replace(src, dst)

        aio.torch.save = half_save
        _atomic.os.replace = replace

    def armed() -> bool:
        return saves["n"] == target_save

    if not offload:  # NOTE: DeepSpeed writes its shards through the checkpoint engine ZeroStrategy gives it
        from lightning_lowmem.strategies.zero.checkpoint_engine import CheckedCheckpointEngine as tce

        engine_save, engine_commit = tce.save, tce.commit

        def save(self, state_dict, path):
            kind = "write_model" if path.endswith("model_states.pt") else "write_optim"
            if armed() and phase in (kind, "plain") and (phase == "plain" or kind == phase):
                buffer = io.BytesIO()
                torch.save(state_dict, buffer)
                with open(path, "wb") as f:  # half the bytes reach the disk, then the process dies
                    f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                die()
            return engine_save(self, state_dict, path)

        def commit(self, info):
            if armed() and phase == "before_latest":
                die()
            return engine_commit(self, info)

        tce.save, tce.commit = save, commit

    replace_dir, rename, remove = _atomic.replace_dir, os.rename, _atomic._remove

    def replace(new, target):
        if armed() and phase == "before_swap":
            die()
        saves["swapping"] = True
        try:
            return replace_dir(new, target)
        finally:
            saves["swapping"] = False

    def rename_then_die(src, dst):
        rename(src, dst)
        if armed() and ".old-" in str(dst):
            die()

    def remove_half(path):
        if armed() and phase == "after_swap" and saves.get("swapping") and path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            for p in files[: len(files) // 2 or 1]:
                p.unlink()
            die()
        return remove(path)

    _atomic.replace_dir, _atomic._remove = replace, remove_half
    if phase == "mid_swap_fallback":
        _atomic._exchange = lambda a, b: False
        _atomic.os.rename = rename_then_die  # NOTE: `core.atomic` calls `os.rename`; only the fallback renames to `.old-`

    class Report(L.Callback):
        def on_train_start(self, trainer, pl_module):
            print(f"START step={trainer.global_step}", flush=True)

    full = random_batch(32, 16, seed=1)
    data = [{k: v[i] for k, v in full.items()} for i in range(32)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    L.seed_everything(0)
    module = CausalLMModule(config=dict(GPT2_TINY, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="lowmem_offload" if offload else "lowmem_zero2", max_steps=max_steps,
        precision="bf16-true" if offload else "32-true", logger=False,
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=1), Report()],
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(module, loader, ckpt_path=os.path.join(directory, "last.ckpt") if resume else None)
    print(f"DONE step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()

"""The checkpoints of ``lowmem_zero*``: atomic directory saves and checked loads (a part of
:class:`~lightning_lowmem.strategies.zero.strategy.ZeroStrategy`).

DeepSpeed writes its directory checkpoint into ``.NAME.tmp-PID/`` beside the target, which is fsync-ed and swapped
in (:mod:`~lightning_lowmem.strategies.zero.checkpoint` says why); a load names a damaged or foreign checkpoint
before DeepSpeed opens it and replays the CPU Adam steps a resume needs. :class:`ZeroCheckpoints` is a base of
``ZeroStrategy`` and reads its state; it is not used on its own.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core import atomic as _atomic
from lightning_lowmem.core import trusted_load as _trusted_load
from lightning_lowmem.strategies.zero import checkpoint as zckpt
from lightning_lowmem.strategies.zero import resume as _zero_resume
from lightning_lowmem.strategies.zero.checkpoint import zero_checkpoint_problem


class ZeroCheckpoints:
    """The checkpoints of ``ZeroStrategy`` (see the module docstring)."""

    # ---- checkpoints: atomic directory saves, checked loads ---------------------------------------------------

    def _writes_shared_files(self) -> bool:
        """Whether this process writes the checkpoint's shared files (``latest``, the swap): DeepSpeed's rank 0."""
        engine = getattr(self, "deepspeed_engine", None)
        if engine is not None and engine.use_node_local_storage():
            return self.local_rank == 0
        return self.is_global_zero

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: lightning_internals.PATH, storage_options: Any | None = None) -> None:
        """DeepSpeed's directory checkpoint, written to ``.NAME.tmp-PID/`` beside ``filepath``, fsync-ed, swapped in.

        The previous checkpoint at ``filepath`` stays complete until the new one is; a process killed midway
        leaves at most the temp directory, removed at the next save (see ``strategies.zero.checkpoint``).
        """
        if storage_options is not None or not lightning_internals.is_local_file_protocol(filepath):
            super().save_checkpoint(checkpoint, filepath, storage_options)  # the parent refuses storage_options
            return
        target = Path(self.broadcast(str(Path(filepath).absolute())))
        tmp = Path(self.broadcast(str(_atomic.temp_path(target))))
        writer = self._writes_shared_files()
        if writer:
            target.parent.mkdir(parents=True, exist_ok=True)
            _atomic.clean_orphans(target, keep=tmp)
            if tmp.exists():
                shutil.rmtree(tmp)  # an earlier save of this process that failed midway
        self.barrier("lowmem_zero_save_begin")
        with zckpt.recorded_saves(tmp, target):  # digests as written; a full disk named, `tmp` removed on failure
            super().save_checkpoint(checkpoint, tmp)  # every process writes its shards (DeepSpeed ends with a barrier)
            if writer:
                zckpt.write_manifest(tmp)  # last
                _atomic.fsync_tree(tmp)
        if writer:
            _atomic.replace_dir(tmp, target)
        self.barrier("lowmem_zero_save_end")

    @override
    def load_checkpoint(self, checkpoint_path: lightning_internals.PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if (self.load_full_weights and self.zero_stage_3) or not lightning_internals.is_local_file_protocol(checkpoint_path):
            # NOTE: explicit, so that neither TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD nor Lightning's remote-URL default unpickles
            return super().load_checkpoint(checkpoint_path, True if weights_only is None else weights_only)
        path = Path(checkpoint_path)
        if self._writes_shared_files():
            _atomic.recover(path)  # a previous version left under `.NAME.old-PID` by a kill mid-swap
        self.barrier("lowmem_zero_load")

        problem = zero_checkpoint_problem(path) or _zero_resume.stage_mismatch(path, 3 if self.zero_stage_3 else 2)
        if problem is not None:
            raise (FileNotFoundError if not path.exists() else ValueError)(
                f"Cannot resume from `ckpt_path={str(checkpoint_path)!r}` with `{type(self).__name__}`: {problem}"
            )

        try:
            # NOTE: DeepSpeed unpickles its files fully; weights-only unless the caller passed `weights_only=False`
            with _trusted_load.checked_loads(path, trusted=weights_only is False, opt_in=_trusted_load.TRAINER_OPT_IN):
                checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        except (RuntimeError, KeyError) as err:  # NOTE: another model shape / optimizer: say so, naming the file
            readable = _zero_resume.load_error(err, self.deepspeed_engine.optimizer, f"`ckpt_path={str(path)!r}`")
            if readable is None:
                raise
            raise readable from err
        _zero_resume.replay_cpu_adam_steps(self.deepspeed_engine.optimizer)  # NOTE: see `strategies.zero.resume`
        return checkpoint


__all__ = ["ZeroCheckpoints"]

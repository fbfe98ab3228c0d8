"""A ``TorchCheckpointIO`` whose local writes are atomic and whose loads say what is wrong with a bad file.

Writes go through :func:`~lightning_lowmem.core.atomic.atomic_write` and carry their SHA-256 (``core.digest``); a
full disk is named (``core.disk_full``). Loads check the file first and are weights-only unless the caller passed
``weights_only=False`` (Lightning's flag). See docs/reliability.md.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core import atomic as _atomic
from lightning_lowmem.core import digest as _digest
from lightning_lowmem.core import disk_full as _disk_full
from lightning_lowmem.core import trusted_load as _trusted_load


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's single-file ``torch.save`` format, written to a temp file and renamed into place; ``mmap``: a local
    file's tensors are loaded mapped (pages read as they are copied, never all in RAM at once: the disk tier's)."""

    def __init__(self, mmap: bool = False) -> None:
        super().__init__()
        self.mmap = mmap

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: lightning_internals.PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not lightning_internals.is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if Path(path).is_dir():
            raise IsADirectoryError(
                f"Cannot write the checkpoint to {str(path)!r}: it is a directory (a DeepSpeed checkpoint of an earlier "
                "`lowmem_zero*` run?). Save under another name, or remove the directory first."
            )
        needed = _disk_full.tensor_bytes(checkpoint)
        _atomic.atomic_write(path, lambda f: torch.save(checkpoint, f), digest=True, needed=needed)

    @override
    def load_checkpoint(
        self, path: lightning_internals.PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"weights_only": True if weights_only is None else weights_only}
        if map_location is not None:
            kwargs["map_location"] = map_location
        if not lightning_internals.is_local_file_protocol(path):
            return self._load(path, kwargs)
        problem = single_file_problem(path)
        if problem is not None:
            raise (FileNotFoundError if not os.path.lexists(path) else ValueError)(problem)
        damage = _digest.file_problem(path)
        if damage is not None:
            raise _digest.DigestMismatchError(f"The checkpoint {str(path)!r} {damage}. {_FIX}")
        try:
            return self._load(path, kwargs)
        except (EOFError, pickle.UnpicklingError, RuntimeError, OSError, zipfile.BadZipFile) as err:
            if isinstance(err, FileNotFoundError):
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ValueError(
                f"Cannot read the checkpoint {str(path)!r} ({os.path.getsize(path):,} bytes; {type(err).__name__}: "
                f"{first}): the file is damaged. {_FIX}"
            ) from err

    def _load(self, path: lightning_internals.PATH, kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            if self.mmap and lightning_internals.is_local_file_protocol(path):
                return torch.load(path, mmap=True, **kwargs)
            return super().load_checkpoint(path, **kwargs)
        except pickle.UnpicklingError as err:
            if kwargs["weights_only"] is False or "Weights only load failed" not in str(err):
                raise
            raise _trusted_load.refusal(path, err, _trusted_load.TRAINER_OPT_IN) from None


_FIX = (
    "Pass another `ckpt_path` (an earlier checkpoint, or `ckpt_path=None` to start from scratch); the previous "
    "`last.ckpt` of a run that was killed while saving is still complete."
)


def single_file_problem(path: lightning_internals.PATH) -> str | None:
    """What is wrong with ``path`` as a single-file Lightning checkpoint, or None (reads no tensors)."""
    p = Path(path)
    if not os.path.lexists(p):
        return f"The checkpoint {str(path)!r} does not exist. Check `ckpt_path` (relative paths start at {os.getcwd()!r})."
    if p.is_dir():
        if (p / "latest").is_file() or (p / "checkpoint").is_dir():
            return (
                f"{str(path)!r} is a DeepSpeed checkpoint directory (written by a `lowmem_zero*` / DeepSpeed strategy), "
                "and `lowmem_offload` reads single-file checkpoints. Resume it with the strategy that wrote it, or "
                f"convert its weights with `lowmem consolidate {path} model.ckpt` and load those into the module "
                "(`module.load_state_dict(torch.load('model.ckpt'))`; the optimizer state is not carried over)."
            )
        return f"{str(path)!r} is a directory, not a checkpoint file. Pass the `.ckpt` file inside it as `ckpt_path`."
    reason = torch_file_problem(p)
    return None if reason is None else f"The checkpoint {str(path)!r} {reason}. {_FIX}"


#: the pickled magic number that opens torch's legacy (non-zip) format, whatever the pickle protocol
_LEGACY_MAGIC = b"\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."


def torch_file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a complete ``torch.save`` file (``"is empty (0 bytes)..."``), or None: reads its first
    bytes and a zip archive's central directory, which a file cut short has lost."""
    size = os.path.getsize(path)
    if size == 0:
        return "is empty (0 bytes): its save was interrupted or the disk was full"
    with open(path, "rb") as f:
        head = f.read(32)
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):
            return (
                f"is truncated ({size:,} bytes: a `torch.save` archive whose end is missing; its save was interrupted "
                "or the disk was full)"
            )
        return None
    if head[:1] == b"\x80" and _LEGACY_MAGIC in head:  # torch's legacy (non-zip) format: a pickle of its magic first
        return None
    return f"is not a `torch.save` file ({size:,} bytes, neither a zip archive nor a pickle: it starts with {head[:4]!r})"

"""DeepSpeed directory checkpoints of ``ZeroStrategy``: written to ``.NAME.tmp-PID/``, hashed as written
(:func:`recorded_saves`, a full disk named), swapped into place, and checked before they are read
(:func:`zero_checkpoint_problem`, naming the damaged file instead of DeepSpeed's ``EOFError``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem.core import digest as _digest
from lightning_lowmem.core import disk_full as _disk_full
from lightning_lowmem.core.checkpoint_io import torch_file_problem

_NOTE = ".lowmem-sha256"

_FIX = (
    "Use an earlier checkpoint. (A `lowmem_zero*` save killed midway leaves the previous checkpoint complete under "
    "its name, with at most a `.NAME.tmp-PID` directory beside it; this damage came from elsewhere: a copy cut "
    "short, a full disk, another tool.)"
)


def zero_checkpoint_problem(path: str | os.PathLike, tag: str | None = None, stage: int | None = None) -> str | None:
    """What is wrong with ``path`` as a DeepSpeed checkpoint directory (for a ZeRO-``stage`` run), or None: its tag
    folder, a ``*model_states.pt``, complete ``torch.save`` files (headers only), the digest manifest, the stage."""
    p = Path(path)
    if not p.exists():
        return f"{str(path)!r} does not exist."
    if not p.is_dir():
        return (
            f"{str(path)!r} is a file, not a DeepSpeed checkpoint directory (a `lowmem_zero*` strategy writes a directory "
            "holding `latest` and a tag folder); a single-file Lightning checkpoint has nothing to consolidate, and is "
            "resumed with `lowmem_offload` or a plain strategy (or `ZeroStrategy(load_full_weights=True)` for weights only)."
        )
    if tag is None:
        latest = p / "latest"
        if not latest.is_file():
            found = sorted(c.name for c in p.iterdir())[:8]
            return (
                f"{str(path)!r} is not a DeepSpeed checkpoint directory: it has no `latest` file (it holds "
                f"{found or 'nothing'}). Pass the directory that `Trainer.save_checkpoint` / `ModelCheckpoint` wrote with "
                "a `lowmem_zero*` strategy, or name the tag folder with `--tag`."
            )
        tag = latest.read_text().strip()
        if not tag:
            return f"{str(latest)!r} is empty: the checkpoint's save was interrupted. {_FIX}"
    folder = p / tag
    if not folder.is_dir():
        return f"{str(path)!r} names the tag {tag!r}, but {str(folder)!r} is not a directory. {_FIX}"
    files = sorted(folder.glob("*.pt"))
    if not any(f.name.endswith("model_states.pt") for f in files):
        return f"{str(folder)!r} holds no `*model_states.pt` file, so it is not a complete DeepSpeed checkpoint. {_FIX}"
    for f in files:
        reason = torch_file_problem(f)
        if reason is not None:
            return f"The DeepSpeed checkpoint {str(path)!r} is damaged: {str(f)!r} {reason}. {_FIX}"
    try:
        listed = _digest.read_manifest(p)
        problem = None if listed is None else _digest.manifest_problem(p, listed)
        if problem is None and listed is not None and (p / "latest").is_file():
            problem = _digest.entry_problem(p / "latest", listed.get("latest"), p / _digest.MANIFEST)
    except _digest.DigestMismatchError as err:
        problem = str(err)
    if problem is not None:
        return f"The DeepSpeed checkpoint {str(path)!r} is damaged: {problem}. {_FIX}"
    # NOTE: ZeRO-3's model shards are `zero_pp_rank_*_model_states.pt`; ZeRO-1/2 write `mp_rank_*` ones (and
    # `zero_pp_rank_*_optim_states.pt`)
    written = 3 if any(f.name.startswith("zero_pp_rank_") and f.name.endswith("model_states.pt") for f in files) else 2
    if stage is None or (written == 3) == (stage == 3):
        return None
    was = "ZeRO-3 (parameters partitioned: `zero_pp_rank_*_model_states.pt`)" if written == 3 else (
        "ZeRO-1/2 (one `mp_rank_*_model_states.pt` with the whole model)")
    presets = "`lowmem_zero3` / `lowmem_zero3_offload`" if written == 3 else "`lowmem_zero2` / `lowmem_zero2_offload`"
    return (
        f"it was written by {was}, and this strategy runs ZeRO-{stage}; DeepSpeed cannot read one stage's shards "
        f"into the other. Resume with the strategy that wrote it ({presets}), or convert it to one fp32 state dict "
        "with `lowmem consolidate DIR model.pt` and load that as the model's initial weights (a new optimizer state)."
    )


class FullDisk(Exception):
    """A write of ``path`` hit a full disk (``cause``); raised through DeepSpeed, named after the cleanup."""

    def __init__(self, cause: OSError, path: Path, remaining: int) -> None:
        super().__init__(str(cause))
        self.cause, self.path, self.remaining = cause, path, remaining


def write_hashed(obj: Any, path: str | os.PathLike, root: Path, zipfile_serialization: bool) -> None:
    """``torch.save(obj, path)`` with its SHA-256 computed as written, noted beside it (``.NAME.lowmem-sha256``,
    relative to ``root``) for :func:`write_manifest`; a full disk raised as :class:`FullDisk`."""
    target = Path(path).absolute()
    sink = None
    try:
        with open(target, "wb") as handle:
            sink = _digest.HashingWriter(handle)
            torch.save(obj, sink, _use_new_zipfile_serialization=zipfile_serialization)
    except Exception as err:
        full = _disk_full.full_disk_error(sink.error if sink is not None else None) or _disk_full.full_disk_error(err)
        if full is None:
            raise
        raise FullDisk(full, target, max(0, _disk_full.tensor_bytes(obj) - (sink.written if sink is not None else 0))) from err
    note = {target.relative_to(root).as_posix(): {"bytes": sink.written, "sha256": sink.hexdigest()}}
    target.with_name(f".{target.name}{_NOTE}").write_text(json.dumps(note))


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()) if root.is_dir() else 0


@contextlib.contextmanager
def recorded_saves(engine: Any, tmp: str | os.PathLike, target: str | os.PathLike) -> Iterator[None]:
    """While DeepSpeed writes ``tmp`` through ``engine`` (a ``CheckedCheckpointEngine``): each file hashed as written;
    on any error ``tmp`` removed, and a full disk raised as ``DiskFullError``."""
    tmp, target = Path(tmp).absolute(), Path(target).absolute()
    try:
        with engine.writing_into(tmp):
            yield
    except BaseException as err:
        full = err if isinstance(err, FullDisk) else None
        cause = full.cause if full is not None else _disk_full.full_disk_error(err)
        written = _tree_bytes(tmp) if cause is not None else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if cause is None:
            raise
        path = full.path if full is not None else Path(getattr(cause, "filename", None) or tmp).absolute()
        part = f"its file {path.relative_to(tmp).as_posix()}" if path.is_relative_to(tmp) and path != tmp else ""
        needed = max(written + (full.remaining if full is not None else 0), _tree_bytes(target))
        raise _disk_full.disk_full_error(cause, target, needed or None, part) from err


def write_manifest(tmp: str | os.PathLike) -> None:
    """Gather the per-file digest notes of every rank under ``tmp`` and write ``lowmem_manifest.json`` (last)."""
    tmp = Path(tmp)
    known: dict[str, dict[str, Any]] = {}
    for note in tmp.rglob(f".*{_NOTE}"):
        with contextlib.suppress(ValueError, OSError):
            known.update(json.loads(note.read_text()))
        note.unlink()
    _digest.write_manifest(tmp, known)

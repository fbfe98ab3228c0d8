"""A full disk during a save, said in one line: which device, which file, how much was needed, how much is free.

The atomic writers keep the write's own ``OSError`` (``torch.save`` loses the errno) and turn ``ENOSPC``/``EDQUOT``
into :class:`DiskFullError`, after removing their temporary files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from typing_extensions import override

from lightning_lowmem.core.accounting import unique_storage_bytes
from lightning_lowmem.core.tensors import tensors_in
from lightning_lowmem.core.units import fmt_bytes

_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """No space left on the device (or the quota) while writing a checkpoint; the previous one is intact."""

    @override
    def __str__(self) -> str:
        return str(self.strerror)  # NOTE: the sentence alone, without OSError's "[Errno 28] ...: 'filename'"


def full_disk_error(err: BaseException | None) -> OSError | None:
    """The ``ENOSPC``/``EDQUOT`` ``OSError`` behind ``err`` (itself, a cause or a context), or None."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _FULL:
            return err
        err = err.__cause__ or err.__context__
    return None


def _existing(path: str | os.PathLike) -> Path:
    """``path``'s nearest existing ancestor (itself when it exists)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def device_of(path: str | os.PathLike) -> str:
    """``/dev/sda1 (mounted at /data)`` for the filesystem holding ``path`` (its nearest existing ancestor)."""
    mount = _existing(path)
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    source = None
    with contextlib.suppress(OSError), open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 2 and fields[1].replace("\\040", " ") == str(mount):
                source = fields[0]  # NOTE: the last entry for a mount point is the one in effect
    return f"{source} (mounted at {mount})" if source else f"the filesystem mounted at {mount}"


def disk_full_error(cause: OSError, path: str | os.PathLike, needed: int | None, part: str = "") -> DiskFullError:
    """The error to raise for ``cause`` (ENOSPC/EDQUOT) while writing ``path`` (``part``: which file of it); call it
    after the cleanup, so that the free space it reports is what the user has now."""
    try:
        free: int | None = shutil.disk_usage(_existing(path)).free
    except OSError:
        free = None
    what = "no space left on" if cause.errno == errno.ENOSPC else "the disk quota is exceeded on"
    amounts = ", ".join(
        x for x in (f"needed ~{fmt_bytes(needed)}" if needed else "", f"free {fmt_bytes(free)}" if free is not None else "") if x
    )
    error = DiskFullError(
        cause.errno,
        f"{what.capitalize()} {device_of(path)} while writing {str(path)!r}"
        + (f" ({part})" if part else "")
        + (f" ({amounts})" if amounts else "")
        + ". What was written was removed; the previous checkpoint there, if any, is intact. Free space on that device, "
        "or save elsewhere (`ModelCheckpoint(dirpath=...)`, `Trainer(default_root_dir=...)`), or keep fewer "
        "checkpoints (`ModelCheckpoint(save_top_k=...)`).",
    )
    error.filename = str(path)
    return error


def tensor_bytes(obj: object) -> int:
    """The bytes of the distinct tensor storages in a (nested) checkpoint: about what ``torch.save`` writes."""
    return unique_storage_bytes(tensors_in(obj))

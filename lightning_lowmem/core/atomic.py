"""Crash-safe writes: a file or a directory is at its final path complete, or not at all.

One protocol for every checkpoint and report the package writes (``AtomicCheckpointIO``, the ZeRO
directory checkpoints of ``ZeroStrategy``, ``consolidate``):

1. write to a temp name in the *same directory* as the target, ``.NAME.tmp-PID``;
2. ``fsync`` every file written, then the directories holding them;
3. rename into place: ``os.replace`` for a file; for a directory an atomic exchange
   (``renameat2(RENAME_EXCHANGE)``) with the previous one, which is removed only afterwards;
4. ``fsync`` the parent directory, so that the rename itself survives a power loss.

A process killed at any point leaves the previous version at the target and, at most, a
``.NAME.tmp-PID`` (or ``.NAME.old-PID``) orphan beside it; :func:`clean_orphans` removes those of
dead processes (and puts back a previous version that a kill left only under its ``.old`` name) at
the next save.

Why not Lightning's ``_atomic_save`` (what ``TorchCheckpointIO`` uses): it serializes into an in-memory ``BytesIO``
first (a second copy of every tensor in host RAM, when the host is fullest), "moves" a temp file from the system temp
directory (a copy when ``/tmp`` is another filesystem, and a kill leaves the orphan there), fsyncs nothing, and
writes single files only (DeepSpeed's checkpoints are directories, rewritten in place).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from lightning_lowmem.core import digest as _digest
from lightning_lowmem.core import disk_full as _disk_full

_ORPHAN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


def temp_path(target: str | os.PathLike, pid: int | None = None) -> Path:
    """The temp name a write to ``target`` by process ``pid`` (this one by default) uses: ``.NAME.tmp-PID``."""
    target = Path(target)
    return target.with_name(f".{target.name}.tmp-{os.getpid() if pid is None else pid}")


def _old_path(target: Path, pid: int | None = None) -> Path:
    return target.with_name(f".{target.name}.old-{os.getpid() if pid is None else pid}")


def fsync_path(path: str | os.PathLike) -> None:
    """``fsync`` a file or a directory by path (directories: the entries in it, i.e. creations and renames)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    except OSError as err:
        # NOTE: some filesystems (and Windows for directories) refuse fsync on a directory; the data is then
        # as durable as that filesystem makes renames, which is the best available.
        if err.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """``fsync`` every file under ``root``, then every directory, deepest first, then ``root``."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(dirpath)


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[IO[bytes]], Any],
    *,
    mode: int | None = None,
    digest: bool = False,
    needed: int | None = None,
) -> str | None:
    """Write ``path`` through ``write(file)`` atomically: temp file beside it, fsync, ``os.replace``, fsync the dir.

    Stale temp files of dead processes beside ``path`` are removed first (:func:`clean_orphans`). The file's
    permissions follow the process's umask, as ``open`` gives them (``mode`` forces others).
    ``digest=True`` appends the SHA-256 of what ``write`` wrote as the zip comment of a ``torch.save`` archive
    (``core.digest``; checked at load) and returns it. A full disk raises ``DiskFullError`` naming the device,
    the file, ``needed`` (an estimate of the bytes to write) and the free space, after removing the temp file.
    """

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_orphans(path)
    tmp = temp_path(path)
    sink = None
    try:
        with open(tmp, "wb") as f:
            sink = _digest.HashingWriter(f, digest=digest)
            write(sink)  # type: ignore[arg-type]
            recorded = sink.seal()
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        full = _disk_full.full_disk_error(sink.error if sink is not None else None) or _disk_full.full_disk_error(err)
        if full is not None:
            written = sink.written if sink is not None else 0
            raise _disk_full.disk_full_error(full, path, max(needed or 0, written) or None) from err
        raise
    fsync_path(path.parent)
    return recorded


def atomic_write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> None:
    """:func:`atomic_write` of a text file."""
    atomic_write(path, lambda f: f.write(text.encode(encoding)))


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    renameat2 = getattr(_libc(), "renameat2", None) if os.name == "posix" else None
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False  # an old kernel, or a filesystem without the flag: fall back to two renames
    raise OSError(err, os.strerror(err), str(a), None, str(b))


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def replace_dir(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put the complete directory ``new`` at ``target``, keeping the previous ``target`` until ``new`` is in place.

    ``new`` must be on the same filesystem (a sibling, see :func:`temp_path`) and already fsync-ed. With
    ``RENAME_EXCHANGE`` there is no instant at which ``target`` is missing; without it (other kernels and
    filesystems) the previous version is first renamed to ``.NAME.old-PID``, which :func:`clean_orphans`
    puts back if a kill lands between the two renames.
    """
    new, target = Path(new), Path(target)
    if not os.path.lexists(target):
        os.rename(new, target)
    elif _exchange(new, target):
        fsync_path(target.parent)
        _remove(new)  # NOTE: `new` now names the previous version
    else:
        old = _old_path(target)
        _remove(old)
        os.rename(target, old)
        os.rename(new, target)
        fsync_path(target.parent)
        _remove(old)
    fsync_path(target.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # NOTE: a read-only directory: the orphan stays, the save or load itself is unaffected


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (a zombie counts as dead)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True


def clean_orphans(target: str | os.PathLike, *, keep: str | os.PathLike | None = None) -> list[Path]:
    """Remove the ``.NAME.tmp-PID`` / ``.NAME.old-PID`` leftovers of dead processes in ``target``'s directory.

    A ``.NAME.old-PID`` whose ``NAME`` is missing is the previous version of a directory swap that a kill
    interrupted between its two renames: it is renamed back to ``NAME`` instead. ``keep`` is never touched
    (the temp name of a save in progress on another rank). Returns the paths removed or restored.

    NOTE: liveness is judged by PID on *this* machine: two machines writing one shared checkpoint
    directory at once must not both save (they would overwrite each other's checkpoints anyway).
    """
    directory = Path(target).parent
    keep_name = Path(keep).name if keep is not None else None
    found: list[tuple[str, str, int, Path]] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        m = _ORPHAN.match(entry.name)
        if m and entry.name != keep_name and not pid_alive(int(m["pid"])):
            found.append((m["name"], m["kind"], int(m["pid"]), Path(entry.path)))
    done: list[Path] = []
    for name, kind, _, path in sorted(found, key=lambda t: t[1] != "old"):  # restores before removals
        final = directory / name
        if kind == "old" and not os.path.lexists(final):
            try:
                os.rename(path, final)
                fsync_path(directory)
            except OSError:
                continue
        else:
            _remove(path)
        done.append(path)
    return done


def recover(target: str | os.PathLike) -> bool:
    """Put back the previous version of ``target`` if a kill left it only under ``.NAME.old-PID``; True if it did."""
    target = Path(target)
    if os.path.lexists(target):
        return False
    for entry in os.scandir(target.parent) if target.parent.is_dir() else ():
        m = _ORPHAN.match(entry.name)
        if m and m["kind"] == "old" and m["name"] == target.name and not pid_alive(int(m["pid"])):
            os.rename(entry.path, target)
            fsync_path(target.parent)
            return True
    return False

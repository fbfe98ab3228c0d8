"""Crash-safe writes: a file or a directory is at its final path complete, or not at all (docs/reliability.md).

Write to ``.NAME.tmp-PID`` in the target's directory, fsync the files and directories, rename into place
(``os.replace``; for a directory an atomic ``renameat2(RENAME_EXCHANGE)`` with the previous one), fsync the parent.
A kill leaves the previous version and at most a ``.tmp-PID``/``.old-PID`` orphan, which :func:`clean_orphans`
removes at the next save. Lightning's ``_atomic_save`` buffers in RAM, fsyncs nothing and writes single files only.
"""

from __future__ import annotations

import contextlib
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


def fsync_path(path: str | os.PathLike) -> None:
    """``fsync`` a file or a directory by path (directories: the entries in it, i.e. creations and renames)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    except OSError as err:
        # NOTE: some filesystems (and Windows) refuse fsync on a directory: renames are then as durable as they get
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
    """Write ``path`` through ``write(file)`` atomically (orphans beside it removed first; ``mode`` overrides the
    umask's permissions). ``digest=True`` appends the SHA-256 as the zip comment and returns it. A full disk raises
    ``DiskFullError`` naming ``needed`` (an estimate of the bytes to write), after removing the temp file.
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

    ``new`` must be a sibling, already fsync-ed. Without ``RENAME_EXCHANGE`` the previous version is first renamed
    to ``.NAME.old-PID``, which :func:`clean_orphans` puts back if a kill lands between the two renames.
    """
    new, target = Path(new), Path(target)
    if not os.path.lexists(target):
        os.rename(new, target)
    elif _exchange(new, target):
        fsync_path(target.parent)
        _remove(new)  # NOTE: `new` now names the previous version
    else:
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
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
        with contextlib.suppress(OSError):  # NOTE: a read-only directory: the orphan stays, the save or load goes on
            path.unlink(missing_ok=True)


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

    A ``.NAME.old-PID`` whose ``NAME`` is missing (a directory swap interrupted) is renamed back instead. ``keep`` is
    never touched (another rank's save in progress). Returns the paths removed or restored. NOTE: liveness is judged
    by PID on *this* machine: two machines must not save into one directory at once.
    """
    directory = Path(target).parent
    keep_name = Path(keep).name if keep is not None else None
    found: list[tuple[str, str, Path]] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        m = _ORPHAN.match(entry.name)
        if m and entry.name != keep_name and not pid_alive(int(m["pid"])):
            found.append((m["name"], m["kind"], Path(entry.path)))
    done: list[Path] = []
    for name, kind, path in sorted(found, key=lambda t: t[1] != "old"):  # restores before removals
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

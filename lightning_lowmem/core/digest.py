"""SHA-256 digests of the checkpoints the package writes, checked when they are read back (docs/reliability.md).

A single ``torch.save`` file carries its digest as the zip comment (``lowmem-sha256:<64 hex>``, the last 78 bytes,
computed while it is written); a directory (DeepSpeed's) gets ``lowmem_manifest.json``, written last. A file without
a digest is read as before. The digest finds damage, not tampering (that is ``core.trusted_load``'s job).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import IO, Any

_PREFIX = b"lowmem-sha256:"
_COMMENT_BYTES = len(_PREFIX) + 64
_EOCD = b"PK\x05\x06"  # the zip "end of central directory" record: 22 bytes + the comment, at the file's end
_EOCD_BYTES = 22
MANIFEST = "lowmem_manifest.json"
_CHUNK = 1 << 20


class DigestMismatchError(ValueError):
    """A checkpoint's bytes differ from those its digest was computed from when it was written."""


class HashingWriter:
    """The file object a writer function gets: passes bytes on, hashes them, counts them, keeps the OSError.

    ``error`` keeps the ``OSError`` that ``torch.save`` loses (``core.disk_full``). The hash leaves out the last 2
    bytes seen (the zip comment length, rewritten by :meth:`seal`). NOTE: no ``seek``: it would make the hash wrong.
    """

    def __init__(self, file: IO[bytes], digest: bool = True) -> None:
        self._file = file
        self._hash = hashlib.sha256() if digest else None
        self._held = b""  # the last (up to) 2 bytes, not hashed yet
        self._tail = b""  # the last (up to) 22 bytes, to find the zip's end record
        self.written = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            n = self._file.write(view)
        except OSError as err:
            self.error = err
            raise
        self.written += len(view)
        if self._hash is not None and len(view):
            if len(view) >= 2:
                self._hash.update(self._held)
                self._hash.update(view[:-2])
                self._held = bytes(view[-2:])
            else:
                joined = self._held + bytes(view)
                self._hash.update(joined[:-2])
                self._held = joined[-2:]
        self._tail = (self._tail + bytes(view[-_EOCD_BYTES:]))[-_EOCD_BYTES:]
        return len(view) if n is None else n

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as err:
            self.error = err
            raise

    def hexdigest(self) -> str | None:
        """The SHA-256 of every byte written so far (None when not hashing)."""
        if self._hash is None:
            return None
        h = self._hash.copy()
        h.update(self._held)
        return h.hexdigest()

    def seal(self) -> str | None:
        """Append the digest as the zip comment if what was written is a zip archive without one; its hex or None."""
        if self._hash is None or len(self._tail) < _EOCD_BYTES or not self._tail.startswith(_EOCD):
            return None
        if self._tail[-2:] != b"\x00\x00":
            return None  # the archive already has a comment: leave it alone
        hexdigest = self._hash.hexdigest()
        self._file.seek(-2, os.SEEK_END)
        self._file.write(struct.pack("<H", _COMMENT_BYTES) + _PREFIX + hexdigest.encode())
        return hexdigest


def _sha256(path: str | os.PathLike, limit: int | None = None) -> str:
    h = hashlib.sha256()
    remaining = float("inf") if limit is None else limit
    with open(path, "rb") as f:
        while remaining > 0 and (chunk := f.read(min(_CHUNK, remaining))):
            h.update(chunk)
            remaining -= len(chunk)
    return h.hexdigest()


def recorded_digest(path: str | os.PathLike) -> str | None:
    """The digest a file carries in its zip comment (written by :class:`HashingWriter`), or None."""
    size = os.path.getsize(path)
    if size < _EOCD_BYTES + _COMMENT_BYTES:
        return None
    with open(path, "rb") as f:
        f.seek(size - _EOCD_BYTES - _COMMENT_BYTES)
        tail = f.read()
    record, comment = tail[:_EOCD_BYTES], tail[_EOCD_BYTES:]
    if (not record.startswith(_EOCD) or record[-2:] != struct.pack("<H", _COMMENT_BYTES)
            or not comment.startswith(_PREFIX)):
        return None
    return comment[len(_PREFIX):].decode("ascii", "replace")


def file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path``'s bytes are not those it was written with (its embedded digest differs), or None (also for a
    file without a digest). Reads the whole file once."""
    expected = recorded_digest(path)
    if expected is None:
        return None
    found = _sha256(path, os.path.getsize(path) - _COMMENT_BYTES - 2)
    if found == expected:
        return None
    return (
        f"does not match the SHA-256 digest recorded in it when it was written (recorded {expected[:16]}..., "
        f"the bytes now give {found[:16]}...): it was changed or damaged after the save (disk, copy, another tool)"
    )


def write_manifest(root: str | os.PathLike, known: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write ``root/lowmem_manifest.json`` (call it last): every file under ``root`` with its size and SHA-256, from
    ``known`` (relative path -> ``{"bytes": n, "sha256": hex}`` computed while writing) or read."""
    root = Path(root)
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        entry = (known or {}).get(rel)
        size = path.stat().st_size
        if entry is None or entry.get("bytes") != size:
            entry = {"bytes": size, "sha256": _sha256(path)}
        files[rel] = entry
    out = root / MANIFEST
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"format": 1, "algorithm": "sha256", "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return out


def read_manifest(root: str | os.PathLike) -> dict[str, dict[str, Any]] | None:
    """The ``files`` table of ``root``'s manifest, None without one; ValueError for an unreadable manifest."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        if not isinstance(files, dict):
            raise TypeError("`files` is not a mapping")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise DigestMismatchError(f"{str(path)!r} is not a readable manifest ({type(err).__name__}: {err})") from err
    return files


def manifest_problem(root: str | os.PathLike, files: dict[str, dict[str, Any]]) -> str | None:
    """Cheap check of ``root`` against its manifest: every listed file present with its size (nothing is read)."""
    root = Path(root)
    for rel, entry in sorted(files.items()):
        path = root / rel
        if not path.is_file():
            return f"{str(path)!r} is listed in {MANIFEST} but missing"
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"{str(path)!r} has {size:,} bytes, but {MANIFEST} recorded {entry.get('bytes'):,} when it was written"
    return None


def entry_problem(path: str | os.PathLike, entry: dict[str, Any] | None, manifest: str | os.PathLike) -> str | None:
    """Why ``path`` differs from its manifest ``entry`` (size, then SHA-256), or None. Reads the file."""
    if entry is None:
        return f"{str(path)!r} is not listed in {str(manifest)!r}: the directory was changed after it was written"
    size = os.path.getsize(path)
    if size != entry.get("bytes"):
        return f"{str(path)!r} has {size:,} bytes, but {str(manifest)!r} recorded {entry.get('bytes'):,}"
    found = _sha256(path)
    if found != entry.get("sha256"):
        return (
            f"{str(path)!r} does not match its SHA-256 digest in {str(manifest)!r} (recorded "
            f"{str(entry.get('sha256'))[:16]}..., the bytes now give {found[:16]}...): it was changed or damaged "
            "after the save"
        )
    return None

"""Damaged and forged checkpoints for the trust tests: a pickled payload, flipped tensor bytes."""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

import torch


class _Payload:
    """Unpickling this creates ``marker`` (what a real payload would do with ``os.system``)."""

    def __init__(self, marker: str | os.PathLike) -> None:
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def forge(file: str | os.PathLike, marker: str | os.PathLike) -> None:
    """Rewrite the ``torch.save`` file ``file`` with a payload that creates ``marker`` when fully unpickled."""
    state = torch.load(file, weights_only=False, map_location="cpu")
    state["lowmem_test_payload"] = _Payload(marker)
    torch.save(state, file)


def flip_tensor_bytes(file: str | os.PathLike, n: int = 4096) -> tuple[int, int]:
    """Invert ``n`` bytes inside the largest tensor record of a ``torch.save`` zip (its directory left intact).

    Returns the (offset, length) flipped.
    """
    with zipfile.ZipFile(file) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(file, "r+b") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        length = min(n, info.file_size)
        offset = start + (info.file_size - length) // 2
        f.seek(offset)
        data = f.read(length)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
    return offset, length

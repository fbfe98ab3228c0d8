"""A ``TorchCheckpointIO`` whose local writes are atomic: temp file in the same directory, fsync, ``os.replace``.

A crash or a full disk mid-write leaves the previous checkpoint intact instead of a truncated file
that ``torch.load`` fails on at resume time. Remote (fsspec) paths use Lightning's own writer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's single-file ``torch.save`` format, written to a temp file and renamed into place."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: same directory as the target, so os.replace is a rename on one filesystem (atomic on POSIX)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

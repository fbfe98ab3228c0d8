"""Checkpoint loads that run no code from the file: ``torch.load(weights_only=True)``, opt-in to anything else.

The ``lowmem_zero*`` presets read DeepSpeed's checkpoints through :func:`checked_load` (after :class:`ManifestCheck`)
instead of DeepSpeed's ``weights_only=False``. :data:`DEEPSPEED_GLOBALS` is what DeepSpeed's files need beyond
torch's allow-list (found with ``get_unsafe_globals_in_checkpoint`` on real ZeRO-1/2/3 checkpoints; plain data
classes). Opt-in: Lightning's ``weights_only=False`` or ``consolidate(..., trusted=True)``. See docs/reliability.md.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem.core import digest as _digest

#: (module, name) of the classes in DeepSpeed checkpoints, and where they appear
DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # ZeRO-1/2/3 optimizer states: the static loss scaler
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # the same, fp16 with dynamic loss scaling (CUDA)
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # ZeRO-1/2/3 optimizer states: `zero_stage`
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # ZeRO-1/2 optimizer states: `param_slice_mappings`
)

TRAINER_OPT_IN = (
    "If you trust this checkpoint (you or your own job wrote it), pass Lightning's `weights_only=False` with it: "
    "`trainer.fit(model, ckpt_path=..., weights_only=False)` (also `validate`/`test`/`predict`)"
)
CONSOLIDATE_OPT_IN = (
    "If you trust this checkpoint (you or your own job wrote it), pass `trusted=True` to `consolidate` "
    "(`lowmem consolidate --trusted DIR OUT`)"
)


class UntrustedCheckpointError(ValueError):
    """A checkpoint holds objects that only a full (code-running) unpickling could load; nothing was run."""


def deepspeed_globals() -> list[Any]:
    """The classes of :data:`DEEPSPEED_GLOBALS` that this DeepSpeed has (none without DeepSpeed)."""
    found = []
    for module, name in DEEPSPEED_GLOBALS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


def _path_of(f: Any) -> Path | None:
    return Path(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None


def refusal(f: Any, err: BaseException, opt_in: str) -> UntrustedCheckpointError:
    """The error for a weights-only load of ``f`` that failed with ``err``: the file, what it holds, the opt-in."""
    where = repr(str(_path_of(f))) if _path_of(f) is not None else "the checkpoint stream"
    try:
        if isinstance(f, io.IOBase) and f.seekable():
            f.seek(0)
        names = list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    except (RuntimeError, ValueError, OSError, pickle.UnpicklingError):  # NOTE: only for the message
        names = []
    if names:
        held = f"holds {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}, which a weights-only load does not allow"
    else:
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        reason = next((line for line in lines if "WeightsUnpickler" in line), lines[0] if lines else "")
        held = f"cannot be read by a weights-only load ({reason[:300]})"
    return UntrustedCheckpointError(
        f"Refused to load {where}: it {held}. Unpickling it fully could run code from the file, so nothing from it "
        "was loaded or run. " + opt_in + "."
    )


def weights_only_load(f: Any, opt_in: str, **kwargs: Any) -> Any:
    """``torch.load(f, weights_only=True)`` with :data:`DEEPSPEED_GLOBALS` allowed; refusal names ``f`` and ``opt_in``."""
    with torch.serialization.safe_globals(deepspeed_globals()):
        try:
            return torch.load(f, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            raise refusal(f, err, opt_in) from None


class ManifestCheck:
    """Checks files of ``directory`` against its ``lowmem_manifest.json`` (size and SHA-256; an unlisted file is
    refused) before they are read, each hashed once. Without a manifest (DeepSpeed's own) nothing is checked."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = str(directory)
        self.root = Path(directory).resolve()
        self.files = _digest.read_manifest(self.root)
        self._verified: set[tuple[str, int, int]] = set()

    def __call__(self, f: Any) -> None:
        path = _path_of(f)
        if self.files is None or path is None or not path.resolve().is_relative_to(self.root):
            return
        resolved = path.resolve()
        st = resolved.stat()
        key = (str(resolved), st.st_size, st.st_mtime_ns)
        if key in self._verified:
            return
        entry = self.files.get(resolved.relative_to(self.root).as_posix())
        problem = _digest.entry_problem(path, entry, self.root / _digest.MANIFEST)
        if problem is not None:
            raise _digest.DigestMismatchError(
                f"The checkpoint {self.directory!r} is damaged: {problem}. Use an earlier checkpoint (or an intact copy "
                "of this one)."
            )
        self._verified.add(key)


def checked_load(f: Any, check: ManifestCheck | None, *, trusted: bool, opt_in: str, **kwargs: Any) -> Any:
    """``f`` checked by ``check``, then loaded weights-only (fully when ``trusted``: the caller's opt-in)."""
    if check is not None:
        check(f)
    if trusted:
        return torch.load(f, weights_only=False, **kwargs)
    return weights_only_load(f, opt_in, **kwargs)

"""Checkpoint loads that run no code from the file: ``torch.load(weights_only=True)``, opt-in to anything else.

A pickle can call any importable function while it is read, so a checkpoint from elsewhere (a download, a
shared directory) can run code the moment it is loaded. ``torch.load(weights_only=True)`` allows only tensors,
containers, primitives and an allow-list of classes. DeepSpeed 0.19 reads its own checkpoints with
``weights_only=False``; :func:`checked_loads` routes those reads (``Trainer.fit(ckpt_path=DIR)`` under a
``lowmem_zero*`` strategy, ``lowmem consolidate``) through a weights-only load, and checks each file
against the directory's digest manifest (``core.digest``) first.

What DeepSpeed's files need beyond torch's own allow-list (found by writing real ZeRO-1/2/3 checkpoints, with
and without optimizer/parameter offload, fp32 and bf16, on the CPU with DeepSpeed 0.19.8, and listing what
``torch.serialization.get_unsafe_globals_in_checkpoint`` reports) is :data:`DEEPSPEED_GLOBALS`: plain data
classes whose unpickling only sets attributes. ``DynamicLossScaler`` is not among what was observed (fp16 needs a
GPU here); it is the fp16 counterpart that DeepSpeed's fp16 optimizers pickle in the same place.

Opting in (the checkpoint is yours): ``trainer.fit(..., ckpt_path=..., weights_only=False)`` (Lightning's own
flag, passed to the strategy) or ``consolidate(..., trusted=True)`` / ``lowmem consolidate --trusted``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem.core import digest as _digest
from lightning_lowmem.core.hooks import swapped

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
    if isinstance(f, (str, os.PathLike)):
        return Path(os.fspath(f))
    return None


def _unsafe_globals(f: Any) -> list[str]:
    try:
        if isinstance(f, io.IOBase) and f.seekable():
            f.seek(0)
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    except (RuntimeError, ValueError, OSError, pickle.UnpicklingError):  # NOTE: only for the message
        return []


def refusal(f: Any, err: BaseException, opt_in: str) -> UntrustedCheckpointError:
    """The error for a weights-only load of ``f`` that failed with ``err``: the file, what it holds, the opt-in."""
    where = repr(str(_path_of(f))) if _path_of(f) is not None else "the checkpoint stream"
    names = _unsafe_globals(f)
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


def weights_only_load(f: Any, opt_in: str, *, original: Any = None, **kwargs: Any) -> Any:
    """``torch.load(f, weights_only=True)`` with :data:`DEEPSPEED_GLOBALS` allowed; refusal names ``f`` and ``opt_in``."""
    load = original or torch.load
    if kwargs.pop("pickle_module", None) is not None:
        raise UntrustedCheckpointError(f"Refused to load {f!r} with a custom `pickle_module`. {opt_in}.")
    kwargs.pop("weights_only", None)
    with torch.serialization.safe_globals(deepspeed_globals()):
        try:
            return load(f, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            raise refusal(f, err, opt_in) from None


@contextlib.contextmanager
def checked_loads(directory: str | os.PathLike, *, trusted: bool, opt_in: str) -> Iterator[None]:
    """While inside, every ``torch.load`` is weights-only (unless ``trusted``) and files of ``directory`` are checked.

    A file listed in ``directory``'s ``lowmem_manifest.json`` must have its recorded size and SHA-256 (each file
    is hashed once); a file of ``directory`` that the manifest does not list is refused too.

    NOTE: swaps the ``torch.load`` attribute of the ``torch`` module, which is how DeepSpeed calls it; another
    thread loading with ``weights_only=False`` meanwhile would get a weights-only load as well (a refusal at
    worst, never a less safe load).
    """
    root = Path(directory).resolve()
    files = _digest.read_manifest(root)
    original = torch.load
    verified: set[tuple[str, int, int]] = set()

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        path = _path_of(f)
        if files is not None and path is not None:
            resolved = path.resolve()
            if resolved.is_relative_to(root):
                st = resolved.stat()
                key = (str(resolved), st.st_size, st.st_mtime_ns)
                if key not in verified:
                    entry = files.get(resolved.relative_to(root).as_posix())
                    problem = _digest.entry_problem(path, entry, root / _digest.MANIFEST)
                    if problem is not None:
                        raise _digest.DigestMismatchError(
                            f"The checkpoint {str(directory)!r} is damaged: {problem}. Use an earlier checkpoint (or an "
                            "intact copy of this one)."
                        )
                    verified.add(key)
        if trusted:
            return original(f, *args, **kwargs)
        kwargs.update(zip(("map_location", "pickle_module"), args))  # torch.load's positional parameters
        return weights_only_load(f, opt_in, original=original, **kwargs)

    with swapped(torch, load=load):
        yield

"""``consolidate``: a DeepSpeed ZeRO directory checkpoint -> one plain fp32 state dict (also ``lowmem consolidate``).

NOTE: DeepSpeed's ``zero_to_fp32`` unpickles the files itself (no seam to read through): the weights-only read is a
check before it, so a file replaced between the two is not covered. Consolidate a directory nobody else writes to.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import torch

from lightning_lowmem.core import atomic as _atomic
from lightning_lowmem.core import digest as _digest
from lightning_lowmem.core import trusted_load as _trusted_load
from lightning_lowmem.core.optional import require
from lightning_lowmem.strategies.zero.checkpoint import zero_checkpoint_problem


def consolidate(
    checkpoint_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    tag: str | None = None,
    strip_prefix: str = "",
    trusted: bool = False,
) -> dict[str, torch.Tensor]:
    """Merge a DeepSpeed ZeRO directory checkpoint into one fp32 state dict and write it to ``out_file``.

    ``checkpoint_dir`` is what ``Trainer.save_checkpoint(path)`` / ``ModelCheckpoint`` wrote with a ``lowmem_zero*``
    strategy. The keys are the LightningModule's; ``strip_prefix="model."`` gives the wrapped model's. A
    ``.safetensors`` ``out_file`` is written with safetensors, anything else with ``torch.save``, atomically.

    The files are read weights-only (a forged checkpoint's code is refused; ``trusted=True`` lifts that) and must match
    the SHA-256 recorded in ``lowmem_manifest.json``.

    Returns:
        the state dict that was written.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` does not exist.
        ValueError: ``checkpoint_dir`` is not a complete DeepSpeed checkpoint directory (names the damaged file),
            a file differs from its recorded digest, a file needs ``trusted=True``, ``out_file`` is a directory, in a
            missing directory or unwritable, or ``strip_prefix`` matches no key.
    """
    if not isinstance(trusted, bool):
        raise TypeError(f"Passed `trusted={trusted!r}`; expected True or False.")
    require("deepspeed", "`lowmem consolidate` / `lightning_lowmem.zero.consolidate`")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    target = _check_out_file(out_file)  # NOTE: before the (long) read, so a bad output path fails at once
    ckpt = Path(checkpoint_dir).expanduser()
    problem = zero_checkpoint_problem(ckpt, tag)
    if problem is not None:
        raise (FileNotFoundError if not ckpt.exists() else ValueError)(
            f"Passed `checkpoint_dir={str(checkpoint_dir)!r}`: {problem}"
        )
    check = _trusted_load.ManifestCheck(ckpt)
    try:
        for file in sorted((ckpt / (tag or (ckpt / "latest").read_text().strip())).glob("*.pt")):
            check(file)
            if not trusted:  # NOTE: memory-mapped, so only the pickle is read, not the tensors
                _trusted_load.weights_only_load(file, _trusted_load.CONSOLIDATE_OPT_IN, map_location="cpu",
                                                mmap=zipfile.is_zipfile(file))
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=tag)
    except (_trusted_load.UntrustedCheckpointError, _digest.DigestMismatchError):
        raise
    except (EOFError, RuntimeError, ValueError, KeyError, OSError) as err:
        raise ValueError(
            f"Cannot consolidate `checkpoint_dir={str(checkpoint_dir)!r}`: DeepSpeed failed to read it "
            f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}). It was probably "
            "written by another DeepSpeed version or layout, or damaged; use an earlier checkpoint."
        ) from err
    # NOTE: Lightning wraps the module; its checkpoints may carry the wrapper's prefix.
    keys = [key.removeprefix("_forward_module.") for key in state]
    if strip_prefix and not any(key.startswith(strip_prefix) for key in keys):
        heads = sorted({key.split(".", 1)[0] + "." for key in keys if "." in key})[:5]
        raise ValueError(  # NOTE: before writing: the keys would come out unstripped, not as asked
            f"Passed `strip_prefix={strip_prefix!r}`, but no key of the checkpoint starts with it (they start with "
            f"{', '.join(repr(h) for h in heads) or 'no common prefix'}). Give one of those, or leave it out."
        )
    out = {key.removeprefix(strip_prefix): value.float() if value.is_floating_point() else value
           for key, value in zip(keys, state.values())}
    if target.suffix == ".safetensors":
        from safetensors.torch import save

        # NOTE: safetensors refuses shared storages (tied embeddings): each tensor gets its own copy.
        data = save({k: v.detach().clone().contiguous() for k, v in out.items()})
        _atomic.atomic_write(target, lambda f: f.write(data))
    else:
        _atomic.atomic_write(target, lambda f: torch.save(out, f))
    return out


def _check_out_file(out_file: str | os.PathLike) -> Path:
    """``out_file`` as a path to write, or a ValueError saying why it cannot be one."""
    text = os.fspath(out_file)
    target = Path(text).expanduser()
    if not text or text.endswith(("/", os.sep)) or target.is_dir():
        raise ValueError(
            f"Passed `out_file={text!r}`, which is a directory; give the file to write, e.g. "
            f"`{os.path.join(text or '.', 'model.pt')}` (`.safetensors` for safetensors, anything else for torch.save)."
        )
    parent = target.parent
    existing = next((a for a in (parent, *parent.parents) if a.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"Passed `out_file={text!r}`, but {str(existing)!r} is a file, not a directory.")
    if existing != parent:  # NOTE: as `lowmem plan --write`: a mistyped directory is not created
        raise ValueError(f"Passed `out_file={text!r}`, but the directory {str(parent)!r} does not exist; create it "
                         f"(`mkdir -p {parent}`) or give a path in an existing one.")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"Passed `out_file={text!r}`, but this process cannot write to {str(existing)!r}.")
    return target

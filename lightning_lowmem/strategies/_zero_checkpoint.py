"""DeepSpeed directory checkpoints: written atomically, checked before they are read (private helper of ``zero.py``).

DeepSpeed's ``engine.save_checkpoint(dir)`` rewrites ``dir/checkpoint/*.pt`` and ``dir/latest`` in place,
so a kill while ``last.ckpt/`` is rewritten leaves a directory whose ``latest`` names a tag holding a
0-byte or truncated ``mp_rank_00_model_states.pt``, and the only copy of the previous checkpoint is
gone. ``ZeroStrategy.save_checkpoint`` therefore has DeepSpeed write ``.NAME.tmp-PID/`` beside the target,
fsyncs it, and swaps it into place (:func:`lightning_lowmem._atomic.replace_dir`); the previous
checkpoint stays complete until the new one is.

:func:`zero_checkpoint_problem` says what is wrong with a directory before DeepSpeed opens it, naming the
file, so that resume and ``lowmem consolidate`` fail with that instead of ``EOFError``.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_lowmem.strategies._atomic_checkpoint_io import torch_file_problem

_FIX = (
    "Use an earlier checkpoint. (A `lowmem_zero*` save killed midway leaves the previous checkpoint complete under "
    "its name, with at most a `.NAME.tmp-PID` directory beside it; this damage came from elsewhere: a copy cut "
    "short, a full disk, another tool.)"
)


def zero_checkpoint_problem(path: str | os.PathLike, tag: str | None = None) -> str | None:
    """What is wrong with ``path`` as a DeepSpeed checkpoint directory, or None if it looks complete.

    Checks: a directory; ``latest`` (or ``tag``) names a folder; that folder holds a
    ``*model_states.pt``; every ``.pt`` in it is a complete ``torch.save`` file (its first bytes and zip
    directory; the tensors are not read).
    """
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
    return None

"""``OffloadStrategy(load_weights=...)``: a local Hugging Face safetensors directory read tensor by tensor straight into
the masters of a module built without weights (docs/techniques/param-streaming.md). Host peak while loading: masters
(4 B/param) + the compute-dtype weights + one tensor; cost: one read of each shard.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem._internals import torch as torch_internals

INDEX = "model.safetensors.index.json"


def shard_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory, in the index's order (ValueError if none)."""
    root = Path(directory)
    index = root / INDEX
    if index.is_file():
        files = list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
        return [root / f for f in files]
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    found = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not found:
        raise ValueError(
            f"Passed `load_weights={str(directory)!r}`; expected a local directory holding a Hugging Face "
            f"`save_pretrained` checkpoint in safetensors (`model.safetensors` or `{INDEX}` with its shards). "
            "Save one with `model.save_pretrained(path, safe_serialization=True)`."
        )
    return found


def match_prefix(keys: Iterable[str], names: Iterable[str]) -> str:
    """The prefix that turns checkpoint keys into module names most often (``"model."`` for a wrapped HF model)."""
    names = list(names)
    votes: Counter[str] = Counter()
    for key in keys:
        for name in names:
            if name == key or name.endswith("." + key):
                votes[name[: len(name) - len(key)]] += 1
    return votes.most_common(1)[0][0] if votes else ""


def materialize_meta(module: torch.nn.Module) -> None:
    """Give meta parameters uninitialized fp32 host storage (``to_empty``), keeping tied weights tied (``to_empty``
    makes one new Parameter per owning module: the first is given to all)."""
    if not any(p.is_meta for p in module.parameters()):
        return
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for mod in module.modules():
        for name, p in torch_internals.module_parameters(mod).items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, name))
    module.to_empty(device="cpu")
    for group in owners.values():
        first = torch_internals.module_parameters(group[0][0])[group[0][1]]
        for mod, name in group[1:]:
            torch_internals.module_parameters(mod)[name] = first


@torch.no_grad()
def load_into(targets: Mapping[str, torch.Tensor], directory: str | Path) -> dict[str, int]:
    """Copy every checkpoint tensor into ``targets[module name]`` (converting its dtype); returns counts. ValueError
    names the module tensors the checkpoint lacks."""
    from safetensors import safe_open

    files = shard_files(directory)
    with safe_open(str(files[0]), framework="pt", device="cpu") as first:
        prefix = match_prefix(list(first.keys()), targets)
    loaded: set[str] = set()
    unused: list[str] = []
    largest = 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for key in shard.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                name = prefix + key
                target = targets.get(name)
                if target is None:
                    unused.append(key)
                    continue
                tensor = shard.get_tensor(key)  # NOTE: one tensor at a time, from the memory-mapped file
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"`load_weights`: `{key}` in {path.name} has shape {tuple(tensor.shape)}, the module's `{name}` "
                        f"{tuple(target.shape)}; the directory holds another model's weights."
                    )
                largest = max(largest, tensor.numel() * tensor.element_size())
                target.copy_(tensor)
                loaded.add(name)
                del tensor
    missing = [n for n in targets if n not in loaded]
    if missing:
        shown = ", ".join(f"`{n}`" for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        extra = f"; its keys matching nothing: {', '.join(unused[:5])}" if unused else ""
        raise ValueError(
            f"`load_weights={str(directory)!r}` has no weights for {shown} (keys read with prefix {prefix!r}{extra}). "
            "Pass the directory of this model's `save_pretrained`, or build the module with its weights."
        )
    return {"files": len(files), "tensors": len(loaded), "largest_tensor_bytes": largest}


def loading_problems(load_weights: str | os.PathLike | None, module: torch.nn.Module, trainer: Any) -> tuple[bool, list[str]]:
    """Decide whether ``load_weights`` is read (not on resume: the checkpoint's weights win); what cannot work."""
    meta_params = [n for n, p in module.named_parameters() if p.is_meta]
    meta_buffers = [n for n, b in module.named_buffers() if b.is_meta]
    resuming = getattr(trainer, "ckpt_path", None) is not None
    loading = load_weights is not None and not resuming
    problems = []
    if meta_params and not loading:
        why = "resuming from `ckpt_path` (the checkpoint loads into real tensors only)" if resuming else (
            "no `load_weights` to fill them")
        problems.append(
            f"{len(meta_params)} parameters are on the meta device (`{meta_params[0]}`, ...) and {why}: pass "
            "`OffloadStrategy(load_weights=<save_pretrained directory>)`, or build the module under "
            "`trainer.init_module(empty_init=True)` to resume"
        )
    if meta_buffers:
        problems.append(
            f"buffers on the meta device ({', '.join(f'`{n}`' for n in meta_buffers[:3])}): checkpoints do not hold "
            "computed buffers (rotary `inv_freq`); build the module under `trainer.init_module(empty_init=True)` "
            "instead of the meta device (its weights still come from `load_weights` without an fp32 copy)"
        )
    return loading, problems

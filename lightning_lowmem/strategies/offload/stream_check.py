"""The first-use check of parameter streaming: no operation may read a released streamed weight (its NaN placeholder).

NOTE: a ``TorchDispatchMode`` on the first training (and validation) step only, matching non-view ops' tensor arguments
against the placeholders' storages; skipped for models holding ``torch.compile``-d modules (another dispatch path).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import storage_key_or_none

# NOTE: ops that read metadata only (a `.data` assignment dispatches `_has_compatible_shallow_copy_type`)
_METADATA = {"_has_compatible_shallow_copy_type", "is_same_size", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "size", "stride", "numel", "dim", "is_nonzero", "_version"}


class ReleasedReadCheck(torch_internals.TorchDispatchMode):
    """Raises ValueError at the first op that reads a released streamed weight (``names``: ``{id(param): name}``)."""

    def __init__(self, placeholder_keys: set[tuple[str, int]], names: dict[int, str]) -> None:
        super().__init__()
        self.keys = placeholder_keys
        self.names = dict(names)
        self._alive: list[torch.Tensor] = []  # NOTE: views followed by id: kept alive so no id is reused

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        released = [t for t in torch_internals.tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and storage_key_or_none(t) in self.keys]
        if not released or func.__name__.split(".")[0] in _METADATA:
            return out
        name = next((self.names[id(t)] for t in released if id(t) in self.names), None)
        if func.is_view:
            if name is not None and isinstance(out, torch.Tensor):
                self.names[id(out)] = name
                self._alive.append(out)
            return out
        what = f"the streamed weight `{name}`" if name is not None else "a streamed weight"
        raise ValueError(
            f"lowmem_offload_params cannot stream this model: `{func}` read {what} while its block was not on the "
            "device. A streamed block's weights are fetched by the hooks of the block module itself, so they must be "
            "used only inside that module's forward (the model calls the block, not its sub-layers one by one, and "
            "uses no block's weight elsewhere). Call the block module for every use of its weights, or keep the "
            "blocks resident: `OffloadStrategy(offload_params=False)` (strategy='lowmem_offload')."
        )



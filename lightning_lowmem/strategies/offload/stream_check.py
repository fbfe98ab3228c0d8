"""The first-use check of parameter streaming: no operation may read a released streamed weight.

A streamed weight is on the device only between its block's forward pre-hook and post-hook (and in backward, from
the output-gradient hook); elsewhere its ``.data`` is the released placeholder (NaN, no memory). A model that reads
it elsewhere trains on NaN: its steps are skipped or its weights become NaN, silently wrong. It happens when:

* the module whose hooks stream the weights is not the one the model calls (a block list the model walks itself,
  a block's sub-layer called directly);
* a weight of a block is used outside the block (``F.linear(x, self.layers[0].weight)`` elsewhere in the model).

A block called twice in a step, or blocks called out of their order, are correct (each call fetches; backward
rebuilds every saved weight on the fetched copy) and pass.

NOTE: a ``TorchDispatchMode`` on the first training (and validation) step only: every non-view op's tensor arguments
are compared with the placeholders' storages (by storage identity, fake-tensor safe); views of a released weight
are followed to name the weight. Metadata (``.shape``, ``.dtype``) does not dispatch and is allowed. Not run on a
model holding ``torch.compile``-d modules: under a dispatch mode a compiled region runs another path (another
rounding), so the check would change the first step; such a model is not checked.
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
        if func.is_view:
            name = next((self.names[id(t)] for t in released if id(t) in self.names), None)
            if name is not None and isinstance(out, torch.Tensor):
                self.names[id(out)] = name
                self._alive.append(out)
            return out
        name = next((self.names[id(t)] for t in released if id(t) in self.names), None)
        what = f"the streamed weight `{name}`" if name is not None else "a streamed weight"
        raise ValueError(
            f"lowmem_offload_params cannot stream this model: `{func}` read {what} while its block was not on the "
            "device. A streamed block's weights are fetched by the hooks of the block module itself, so they must be "
            "used only inside that module's forward (the model calls the block, not its sub-layers one by one, and "
            "uses no block's weight elsewhere). Call the block module for every use of its weights, or keep the "
            "blocks resident: `OffloadStrategy(offload_params=False)` (strategy='lowmem_offload')."
        )



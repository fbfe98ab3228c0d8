"""The tensors in a nested batch, module input or output (what Lightning walks to move a batch)."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a nested batch, module input or output, in order.

    Walks what Lightning's ``apply_to_collection`` walks to move a batch to its device (mappings, lists, tuples,
    namedtuples, dataclasses): a batch Lightning could move is a batch whose tensors are all found here.

    Example:
        >>> from collections import UserDict
        >>> batch = UserDict(input_ids=torch.zeros(2, 3), extra=[(torch.ones(1), "text")])
        >>> [tuple(t.shape) for t in tensors_in(batch)]
        [(2, 3), (1,)]
    """
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    # NOTE: apply_to_collection rebuilds the collection around what `keep` returns; only `found` is used.
    apply_to_collection(value, torch.Tensor, keep)
    return found

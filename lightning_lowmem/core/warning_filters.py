"""Narrow warning filters (message, category and issuing module) for what our dependencies warn about on the user's
behalf, installed only while the strategy that makes them warn is set up; other warnings are untouched."""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch.utilities.warnings import PossibleUserWarning

#: DeepSpeed's ZeRO calls these torch.distributed functions, deprecated since torch 2.6, on every step (ZeRO-3: ~40 per
#: optimizer step); the user cannot act on them.
DEEPSPEED_COLLECTIVES = (
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    FutureWarning,
    r"torch\.distributed\.c10d_logger",
)
#: Lightning asks for `sync_dist=True` on epoch-level logs whenever the strategy is a distributed one; in a single
#: process (one GPU, or the CPU, under a `lowmem_zero*` preset) there is nothing to sync.
SYNC_DIST_ONE_PROCESS = (
    r"It is recommended to use `self\.log\(.*sync_dist=True\)` when logging on epoch level in distributed setting",
    PossibleUserWarning,
    r"lightning\.pytorch\.trainer\.connectors\.logger_connector\.result",
)


def install(*specs: tuple[str, type[Warning], str]) -> list[Any]:
    """Put an ``ignore`` filter for each ``(message regex, category, module regex)`` first; return them for :func:`remove`."""
    added = []
    for message, category, module in specs:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
        added.append(warnings.filters[0])
    return added


def remove(added: list[Any]) -> None:
    """Remove exactly the filters :func:`install` added (by identity; a user's equal filter stays)."""
    for entry in added:
        for i, existing in enumerate(warnings.filters):
            if existing is entry:
                # NOTE: an "ignore" filter leaves no entry in the per-module warning registries, so nothing is stale
                del warnings.filters[i]
                break

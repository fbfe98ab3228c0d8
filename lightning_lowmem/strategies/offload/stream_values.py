"""Streamed weights without an fp32 master (frozen, or packed 4-bit): their value is their host copy in the stream,
which every reader reads (the views, an unfreeze, the checkpoint, the module given back), never the placeholder
parameter. Against an fp32 master each: 4 B/param less host RAM, no gradient buffer, no optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_lowmem.core.accounting import storage_key
from lightning_lowmem.strategies.offload.masters import HostMasters
from lightning_lowmem.strategies.offload.param_stream import ParamStream
from lightning_lowmem.strategies.offload.transfer import HostTransfer

Pairs = Sequence[tuple[int, nn.Parameter, nn.Parameter]]
#: ``(block, parameter, host copy)`` of a streamed weight a view shows as its host copy
Shown = list[tuple[int, nn.Parameter, Tensor]]


def copy_to_compute(transfer: HostTransfer, stream: ParamStream | None, pairs: Pairs) -> None:
    """Round each ``(i, master, module parameter)`` master into its compute weight (a streamed one: its host copy)."""
    if stream is not None:
        # NOTE: a streamed weight's compute copy is its host copy: the next fetch carries it to the device
        host = stream.host_of()
        stream.update_host([(p_host, host[id(p)]) for _, p_host, p in pairs if id(p) in host])
        pairs = [pair for pair in pairs if id(pair[2]) not in host]
    transfer.weights_to_device(pairs)


def unmastered(stream: ParamStream | None, masters: HostMasters) -> Shown:
    """``(block, parameter, host copy)`` of every floating-point streamed weight that has no master (packed 4-bit
    ones are left out: a view does not show their quantization state)."""
    if stream is None:
        return []
    index = masters.device_index
    return [(b, p, h) for b, (ps, hs) in enumerate(zip(stream.params, stream.host)) for p, h in zip(ps, hs)
            if id(p) not in index and p.is_floating_point()]


def value_of(stream: ParamStream | None) -> Callable[[nn.Parameter], Tensor]:
    """What holds a parameter's value when it has no master: a streamed one's host copy, another's compute weight."""
    host: dict[int, Tensor] = {}

    def value(p: nn.Parameter) -> Tensor:
        if stream is not None and not host:
            host.update(stream.host_of())  # NOTE: built at the first call only: most calls (every batch) make none
        return host.get(id(p), p)

    return value


def show(stream: ParamStream | None, masters: HostMasters) -> Shown:
    """Give each floating-point streamed weight without a master its host copy as ``.data``; return them.

    NOTE: code in a view may write these in place (SWA): the stream is settled first, or a fetch copies torn bytes.
    """
    shown = unmastered(stream, masters)
    if shown:
        assert stream is not None
        stream.update_host(())
        for _, p, h in shown:
            p.data = h
    return shown


@torch.no_grad()
def restore(stream: ParamStream | None, shown: Shown) -> None:
    """Release the weights :func:`show` showed (a new tensor code gave one is copied into its host copy first).

    NOTE: a block fetched inside the view is released too, or the stream counts placeholders fetched (NaN next forward).
    """
    if not shown:
        return
    assert stream is not None
    fetched = set(stream.fetched_blocks())
    for b, p, h in shown:
        if b not in fetched and storage_key(p) != storage_key(h):
            if p.shape != h.shape:
                raise ValueError(
                    f"lowmem_offload_params: a streamed frozen weight of shape {tuple(h.shape)} was given a tensor of "
                    f"shape {tuple(p.shape)} inside a view of the masters; a parameter's shape cannot change during "
                    "training. Write its values in place instead (`with torch.no_grad(): p.copy_(new)`)."
                )
            h.copy_(p.detach())
    if fetched:
        stream.release_all()
    for _, p, _ in shown:
        p.data = stream.released(p)

"""Streamed weights whose value is their host copy in the stream (private helper of ``lowmem_offload_params``).

Under ``offload_params`` each weight of a streamed block lives on the host as one copy in the compute dtype
(:class:`~lightning_lowmem.strategies.offload.param_stream.ParamStream`); it is on the device only while its block
runs, and between uses the parameter holds a placeholder (NaN). A weight with an fp32 master has its value in the
master, which the step rounds into the host copy (:func:`copy_to_compute`). A weight without one, a frozen
floating-point weight whose compute dtype holds its whole value (``*-true``: see
:func:`~lightning_lowmem.strategies.offload.masters.frozen_without_master`) or a packed 4-bit weight
(:mod:`~lightning_lowmem.strategies.offload.packed_weights`), has its value in the host copy alone, so every reader
of the value reads that copy, never the parameter:

* the hooks' views (:class:`~lightning_lowmem.strategies.offload.masters_view.MastersView`: weight averaging, the
  gradient hooks, ``masters_view()``) show each frozen floating-point one as its host copy (:func:`show`), as they
  show a resident frozen weight as its compute weight;
* an unfreeze (``BackboneFinetuning``, ``requires_grad_(True)``) makes its master from the host copy
  (:func:`value_of`, ``HostMasters.master_unfrozen``);
* the checkpoint (``HostState.lightning_module_state_dict``) and the module given back after fit
  (``packed_weights.give_back_streamed``) take the host copies.

Memory: none of its own. Against an fp32 master per streamed frozen weight, 4 B/param less host RAM, no gradient
buffer and no optimizer state (LLaMA-70B's bf16 base under LoRA: 255 GiB).
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
        # NOTE: a streamed weight's compute copy is its host copy: the step rounds the master into it (the
        # same fp32 -> compute dtype rounding as the device path); the next fetch carries it to the device.
        host = stream.host_of()
        stream.update_host([(p_host, host[id(p)]) for _, p_host, p in pairs if id(p) in host])
        pairs = [pair for pair in pairs if id(pair[2]) not in host]
    transfer.weights_to_device(pairs)


def unmastered(stream: ParamStream | None, masters: HostMasters) -> Shown:
    """``(block, parameter, host copy)`` of every floating-point streamed weight that has no master.

    NOTE: packed 4-bit weights are left out: their layer reads them with a quantization state of its own, which a
    view does not show with them.
    """
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

    NOTE: [written in a view] code in a view may write these in place (``StochasticWeightAveraging`` writes its average
    into every parameter): a fetch still queued on the side stream would copy half-written bytes, so the stream is
    settled first (every block released, the last fetch waited for).
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
    """Leave the view: the weights :func:`show` showed are released again; a new tensor code gave one (``p.data =
    new``) is copied into its host copy first, so the change is kept, as for a resident weight.

    NOTE: [fetched in a view] a block fetched while the view was open (a forward run inside it) is released first: its
    weights must not be left placeholders while the stream counts them fetched (the next forward would read NaN).
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


def hide(stream: ParamStream | None, shown: Shown) -> None:
    """Inside a view's ``hidden()``: the weights :func:`show` showed hold their placeholders for a while."""
    for _, p, _ in shown:
        p.data = stream.released(p)  # type: ignore[union-attr]


def unhide(shown: Shown) -> None:
    for _, p, h in shown:
        p.data = h

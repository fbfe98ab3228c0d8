"""The buffers of the overlapped host pass (private helper of :mod:`~lightning_lowmem.strategies.offload.host_pass`).

:class:`KeptCopies` keeps a copy of each master and its optimizer state before the pass steps it speculatively, and
puts them back when the speculation does not stand. :class:`WorkingGrads` holds one bucket's working gradients (value
clipping, fp16). Both are kept between steps and reused: a fresh allocation of a bucket's size each step costs page
faults that take 5x the work itself (38.6M fp32 values on this machine's CPU: 37.6 ms against a 6.5 ms clamp).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_lowmem.core.accounting import mark_host


class KeptCopies:
    """Copies of masters and their optimizer state, by master index, from before a speculative step.

    Memory: 4 B/param for the master plus the bytes of its optimizer state (8 B/param for AdamW), for every master it
    ever copied (``lowmem_offload``'s host-RAM check counts every trainable one). Cost: one copy per step of each.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> state = {p: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2)}}
        >>> kept = KeptCopies()
        >>> kept.keep(0, p, state)
        >>> with torch.no_grad():
        ...     _ = p.add_(1.0); _ = state[p]["exp_avg"].add_(1.0); state[p]["more"] = 3
        >>> kept.put_back(0, p, state)
        >>> p.tolist(), state[p]["exp_avg"].tolist(), "more" in state[p]
        ([1.0, 1.0], [0.0, 0.0], False)
    """

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Tensor, dict[str, Any] | None]] = {}  # i -> (master copy, state copy)

    @torch.no_grad()
    def keep(self, i: int, p: Tensor, state: dict[Tensor, dict[str, Any]]) -> None:
        """Copy master ``i`` (``p``) and ``state[p]`` (the optimizer's state) into the buffers kept for ``i``."""
        kept = self._kept.get(i)
        if kept is None or kept[0].shape != p.shape:
            kept = (torch.empty_like(p.detach()), None)
            mark_host(kept[0])
        kept[0].copy_(p.detach())
        s = state.get(p)
        if not s:
            self._kept[i] = (kept[0], None)
            return
        old, new = kept[1] or {}, {}
        for k, v in s.items():
            if isinstance(v, Tensor):
                buf = old.get(k)
                if not isinstance(buf, Tensor) or buf.shape != v.shape or buf.dtype != v.dtype:
                    buf = torch.empty_like(v)
                    mark_host(buf)
                new[k] = buf.copy_(v)
            else:
                new[k] = v
        self._kept[i] = (kept[0], new)

    @torch.no_grad()
    def put_back(self, i: int, p: Tensor, state: dict[Tensor, dict[str, Any]]) -> None:
        """Restore master ``i`` (``p``) and ``state[p]`` as :meth:`keep` found them (state it added is dropped)."""
        kept, kept_state = self._kept[i]
        p.copy_(kept)
        if kept_state is None:
            state.pop(p, None)
            return
        now = state[p]
        for k in list(now):
            if k not in kept_state:
                del now[k]
        for k, v in kept_state.items():
            if isinstance(v, Tensor) and isinstance(now.get(k), Tensor):
                now[k].copy_(v)
            else:
                now[k] = v.clone() if isinstance(v, Tensor) else v

    def clear(self) -> None:
        self._kept.clear()


class WorkingGrads:
    """Copies of gradients (clamped when asked), in views of one flat buffer per dtype, reused between steps.

    Memory: the largest set of gradients asked for at once (one bucket: ``BUCKET_BYTES`` plus its largest gradient).

    Example:
        >>> work = WorkingGrads()
        >>> g = torch.tensor([-2.0, 0.5, 3.0])
        >>> work.views([g], clip_value=1.0)[0].tolist(), g.tolist()
        ([-1.0, 0.5, 1.0], [-2.0, 0.5, 3.0])
    """

    def __init__(self) -> None:
        self._flat: dict[torch.dtype, Tensor] = {}

    def views(self, grads: list[Tensor], clip_value: float | None, dtype: torch.dtype | None = None) -> list[Tensor]:
        """Copies of ``grads`` (clamped to ``clip_value`` as ``torch.nn.utils.clip_grad_value_`` clamps, when given), in
        ``dtype`` (default: each gradient's own).

        NOTE: copies, not in place: after a restore the serial step must find the gradients as they landed (a gradient
        folded again after its bucket stepped would otherwise add to a clamped or unscaled one).
        """
        keys = [dtype or g.dtype for g in grads]
        need: dict[torch.dtype, int] = {}
        for g, key in zip(grads, keys):
            need[key] = need.get(key, 0) + g.numel()
        for key, n in need.items():
            flat = self._flat.get(key)
            if flat is None or flat.numel() < n:
                self._flat[key] = flat = torch.empty(n, dtype=key)
                mark_host(flat)
        out, used = [], dict.fromkeys(need, 0)
        for g, key in zip(grads, keys):
            at = used[key]
            used[key] = at + g.numel()
            view = self._flat[key][at : at + g.numel()].view(g.shape)
            out.append(view.copy_(g) if clip_value is None else torch.clamp(g, min=-clip_value, max=clip_value, out=view))
        return out

    def holds(self, t: Tensor) -> bool:
        """Whether ``t`` is (a view of) one of the buffers: a copy :meth:`views` made, which the next call rewrites."""
        return any(t.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in self._flat.values())

    def clear(self) -> None:
        self._flat.clear()


__all__ = ["KeptCopies", "WorkingGrads"]

"""The bookkeeping under :class:`~lightning_lowmem.measure.tracker.MemoryTracker`: live bytes per storage, and peaks.

:class:`StorageLedger` keeps one record per tensor storage (bytes, category, role, when it was created, whether
a forward created it), the live bytes by role and category, and snapshots of the bytes by category at the
highest moment of each scope: overall, each phase, each window. Re-tagging a storage (it became a gradient or
optimizer state, was marked host, or turned out to be a forward temporary) moves its bytes in every snapshot
taken while it was alive (the rules are in :mod:`lightning_lowmem.measure.tracker`'s docstring). What decides a
storage's category (the module, the optimizers, the phases) and the dispatch mode that feeds it are the
tracker's.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from lightning_lowmem._internals import torch as torch_internals

_W, _G, _O, _A, _X = range(5)  # indices into CATEGORIES: weights, gradients, optimizer_state, activations, other
_DEV, _HOST = 0, 1  # indices into ROLES
_CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to 512 B


class _Snap:
    """Bytes by category at the moment a role's total was highest (within a scope: overall or one phase)."""

    __slots__ = ("cats", "phase", "seq", "total")

    def __init__(self) -> None:
        self.seq = -1
        self.total = -1
        self.cats = [0, 0, 0, 0, 0]
        self.phase: str | None = None


class _Rec:
    __slots__ = ("cat", "fwd", "nbytes", "ref", "role", "seq")

    def __init__(self, nbytes: int, cat: int, role: int, seq: int, fwd: int) -> None:
        self.nbytes = nbytes
        self.cat = cat
        self.role = role
        self.seq = seq
        self.fwd = fwd  # forward-phase epoch that created it (0: not created in forward)
        self.ref: weakref.ref | None = None


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if torch_internals.inner_tensors(t) is not None:  # NOTE: a wrapper's storage holds nothing; its inner tensors count
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some wrapper subclasses
        return None


class StorageLedger:
    """Live bytes by role and category, one record per storage, with retroactively corrected peak snapshots.

    A subclass sets ``device`` (CPU storages are ``host`` when it is an accelerator), ``timeline_enabled`` and
    ``_lock`` before calling :meth:`_reset`, and feeds it storages (``_see``, ``_add``, ``_retag``).
    """

    device: torch.device
    timeline_enabled: bool
    _lock: threading.RLock

    # --- state --------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._recs: dict[int, _Rec] = {}
        self._live = ([0] * 5, [0] * 5)
        self._tot = [0, 0]
        self._seq = 0
        self._peak = (_Snap(), _Snap())
        self._phase_snaps: dict[str, tuple[_Snap, _Snap]] = {}
        self._phase: str | None = None
        self._cur = self._peak  # the current phase's snapshots (or the overall ones outside phases)
        self._win: tuple[_Snap, _Snap] | None = None  # the current window's snapshots (see `set_window`)
        self._win_events: list[list[Any]] | None = None
        #: ``{window: [[seq, device bytes by category, host bytes by category], ...]}`` (see `set_window`)
        self.window_events: dict[str, list[list[Any]]] = {}
        self._in_fwd = False
        self._fwd_epoch = 0
        self._host_keys: set[int] = set()
        self._phase_order: list[str] = []
        self._timeline: list[tuple[int, int, int, int, int, int, int]] = []
        self._host_on_accel = self.device.type not in ("cpu", "meta")

    # --- the hot path ---------------------------------------------------------------------------------
    def _see(self, t: torch.Tensor, mutates: bool = True) -> None:
        st = _storage(t)
        if st is None:
            return
        key = torch_internals.storage_key(st)
        rec = self._recs.get(key)
        if rec is not None:
            if mutates:
                n = self._nbytes(st, t)
                if n != rec.nbytes:  # resize_, set_, out= variants
                    self._resize(rec, n)
            return
        self._add(st, t, key, _A if self._in_fwd else _X)

    def _nbytes(self, st: torch.UntypedStorage, t: torch.Tensor) -> int:
        n = st.nbytes()
        if self._host_on_accel and t.is_cuda and n % _CUDA_BLOCK:
            n += _CUDA_BLOCK - n % _CUDA_BLOCK
        return n

    def _add(self, st: torch.UntypedStorage, t: torch.Tensor, key: int, cat: int) -> _Rec | None:
        n = self._nbytes(st, t)
        role = _HOST if (key in self._host_keys or (self._host_on_accel and t.device.type == "cpu")) else _DEV
        with self._lock:
            self._seq += 1
            rec = _Rec(n, cat, role, self._seq, self._fwd_epoch if cat == _A else 0)
            rec.ref = weakref.ref(st, self._finaliser(key))
            self._recs[key] = rec
            if n:
                self._live[role][cat] += n
                self._tot[role] += n
                self._update_peaks(role)
        return rec

    def _finaliser(self, key: int):  # type: ignore[no-untyped-def]
        def on_free(_ref: weakref.ref) -> None:
            self._free(key)

        return on_free

    def _update_peaks(self, role: int) -> None:
        total = self._tot[role]
        if self._win_events is not None:
            self._win_events.append([self._seq, self._live[_DEV].copy(), self._live[_HOST].copy()])
        for snap in (self._peak[role], self._cur[role], *((self._win[role],) if self._win is not None else ())):
            if total > snap.total:
                snap.total = total
                snap.cats = self._live[role].copy()
                snap.seq = self._seq
                snap.phase = self._phase
        if self.timeline_enabled:
            d = self._live[_DEV]
            self._timeline.append((len(self._phase_order) - 1, d[0], d[1], d[2], d[3], d[4], self._tot[_HOST]))

    def _free(self, key: int) -> None:
        with self._lock:
            rec = self._recs.pop(key, None)
            # NOTE: a freed storage's key (its address) is reused by later storages: drop its host mark.
            self._host_keys.discard(key)
            if rec is None:
                return
            if rec.cat == _A and self._in_fwd and rec.fwd == self._fwd_epoch:
                # NOTE: created and freed inside one forward: a temporary, not a saved activation.
                self._retag(rec, _X, rec.role, retro=True)
            self._live[rec.role][rec.cat] -= rec.nbytes
            self._tot[rec.role] -= rec.nbytes
            self._seq += 1
            if self.timeline_enabled:
                d = self._live[_DEV]
                self._timeline.append((len(self._phase_order) - 1, d[0], d[1], d[2], d[3], d[4], self._tot[_HOST]))

    def _resize(self, rec: _Rec, n: int) -> None:
        with self._lock:
            delta = n - rec.nbytes
            rec.nbytes = n
            self._live[rec.role][rec.cat] += delta
            self._tot[rec.role] += delta
            self._seq += 1
            if delta > 0:
                self._update_peaks(rec.role)

    def _snapshots(self) -> Iterator[tuple[_Snap, _Snap]]:
        yield self._peak
        yield from self._phase_snaps.values()

    def _retag(self, rec: _Rec, cat: int, role: int, *, retro: bool) -> None:
        """Move ``rec`` to ``(cat, role)``; with ``retro``, also in every peak snapshot taken while it was alive."""
        if rec.cat == cat and rec.role == role:
            return
        with self._lock:
            n = rec.nbytes
            self._live[rec.role][rec.cat] -= n
            self._tot[rec.role] -= n
            self._live[role][cat] += n
            self._tot[role] += n
            if retro and n:
                moved = role != rec.role
                for snaps in self._snapshots():
                    # NOTE: the record is alive now, so it was alive at every snapshot taken since its creation.
                    old, new = snaps[rec.role], snaps[role]
                    if old.seq >= rec.seq:
                        old.cats[rec.cat] -= n
                        if moved:
                            old.total -= n
                    if new.seq >= rec.seq:
                        new.cats[cat] += n
                        if moved:
                            new.total += n
                for events in self.window_events.values():  # NOTE: the same correction, event by event
                    for event in events:
                        if event[0] >= rec.seq:
                            event[1 + rec.role][rec.cat] -= n
                            event[1 + role][cat] += n
            rec.cat, rec.role = cat, role
            if cat != _A:
                rec.fwd = 0
            if self._tot[role] > self._cur[role].total or self._tot[role] > self._peak[role].total or (
                self._win is not None and self._tot[role] > self._win[role].total
            ):
                self._update_peaks(role)

    # --- scopes (phases, windows) and their peaks ---------------------------------------------------------
    def _open(self, snaps: tuple[_Snap, _Snap]) -> None:
        """A scope (phase or window) starts from what is live now."""
        with self._lock:
            self._seq += 1
            for role in (_DEV, _HOST):
                if self._tot[role] > snaps[role].total:
                    snaps[role].total = self._tot[role]
                    snaps[role].cats = self._live[role].copy()
                    snaps[role].seq = self._seq
                    snaps[role].phase = self._phase

    def _best(self, role: int) -> _Snap:
        # NOTE: a storage marked host after it was counted moves out of the device-role snapshots taken while it
        # was alive, so the overall snapshot may no longer be the highest moment: take the best of all scopes.
        best = self._peak[role]
        for snaps in self._phase_snaps.values():
            if snaps[role].total > best.total:
                best = snaps[role]
        return best

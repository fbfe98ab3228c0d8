"""Measured memory: live tensor-storage bytes over a training step, by phase, category and role.

:class:`MemoryTracker` is a ``TorchDispatchMode`` that registers each new untyped storage once (views, in-place ops
and tied weights add nothing) and drops it through a weakref finaliser when it is freed. It keeps live bytes and
peaks, overall and per phase, in the five categories of :mod:`lightning_lowmem.core.accounting` and the ``device``
and ``host`` roles, on real CPU/CUDA tensors and under ``FakeTensorMode`` (storage ``nbytes`` are counted). Docs:
``docs/techniques/memory-report.md``.

Example:
    >>> model = torch.nn.Linear(64, 64)      # 16,640 bytes of fp32 weights
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> x = torch.randn(8, 64)
    >>> tracker = MemoryTracker(module=model, optimizers=[opt])
    >>> with tracker:
    ...     with tracker.phase("forward"):
    ...         loss = model(x).sum()
    ...     with tracker.phase("backward"):
    ...         loss.backward()
    ...     with tracker.phase("optimizer"):
    ...         opt.step()
    ...         opt.zero_grad()
    >>> tracker.peak_bytes > 0, tracker.peak_phase   # device-role peak, bytes; where it happened
    (True, 'optimizer')
    >>> tracker.peak_bytes_role("host")          # host-role peak, bytes
    0
    >>> tracker.peaks["backward"].total          # device-role peak inside the "backward" phase(s)
    33288
    >>> tracker.peaks["backward"].by_category    # bytes per category at that moment
    {'weights': 16640, 'gradients': 16640, 'optimizer_state': 0, 'activations': 4, 'other': 4}
    >>> sorted(tracker.report())                 # everything above as a JSON-able dict
    ['device', 'live_at_end', 'peak', 'peak_bytes', 'peak_bytes_host', 'peak_phase', 'phases']

Under a fake mode, enter the tracker *inside* it: a dispatch mode only sees the ops of the modes entered after it. What
each category and role holds, and what it does not see: docs/techniques/memory-report.md, "What it measures".
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from typing_extensions import Self, override

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core import accounting as _cat
from lightning_lowmem.core.accounting import CATEGORIES, ROLES, MemoryBreakdown, Role
from lightning_lowmem.core.tensors import tensors_in
from lightning_lowmem.measure.cuda_peak import CudaPeaks, CudaPeakWindow, reset_cuda_peak_stats

__all__ = ["CudaPeakWindow", "CudaPeaks", "MemoryTracker", "PhasePeak", "reset_cuda_peak_stats"]

_FORWARD = "forward"
_BACKWARD = "backward"
_OPTIMIZER = "optimizer"
_W, _G, _O, _A, _X = range(5)  # indices into CATEGORIES: weights, gradients, optimizer_state, activations, other
_DEV, _HOST, _DISK = 0, 1, 2  # indices into ROLES
_CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to 512 B


class _Mode(torch_internals.TorchDispatchMode):
    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    @classmethod
    @override
    def ignore_compile_internals(cls) -> bool:
        # NOTE: [compiled regions] False (torch's default) would run a `torch.compile`d submodule eagerly in sampled
        # steps only (rounding otherwise than inductor); True: it sees the compiled artifact's allocations, not its ops.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        tracker = self.tracker
        tracker._ops += 1
        kind = _KIND.get(func)
        if kind is None:
            # NOTE: only ops that write into an argument (in-place, out=, resize_, set_) can change the size of
            # a storage we already count; the others' outputs that share a storage are views.
            kind = _KIND[func] = (torch_internals.op_is_mutable(func), torch_internals.op_is_view(func))
        mutates, view = kind
        if func is _BERNOULLI and tracker.bool_masks:
            tracker._as_mask(args[0])
        if view and tracker._phase is None:
            # NOTE: outside a phase a view of a storage made before tracking (a loader's in-memory dataset sliced into a
            # micro-batch) is no allocation: counted as `other` it put host data in the device peak. Inside, it counts.
            return out
        see = tracker._see
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                see(o, mutates)
            elif isinstance(o, (tuple, list)):
                for oo in o:
                    if isinstance(oo, torch.Tensor):
                        see(oo, mutates)
        return out


_KIND: dict[Any, tuple[bool, bool]] = {}  # op -> (writes into an argument, returns a view)
_BERNOULLI = torch.ops.aten.bernoulli_.float  # what CPU's dropout fills its mask with


def _exit_mode(mode: torch_internals.TorchDispatchMode, exc: tuple[Any, ...]) -> None:
    """Leave ``mode`` even when a mode entered after it is still active (two callbacks' hooks interleaving)."""
    stack = torch_internals.dispatch_mode_stack()
    if not stack or stack[-1] is mode or not any(m is mode for m in stack):
        mode.__exit__(*exc)
        return
    # NOTE: a dispatch mode can only leave from the top of the stack; lift the later ones off and put them back,
    # so their own `__exit__` still finds them on top.
    above = []
    while torch_internals.dispatch_mode_stack()[-1] is not mode:
        above.append(torch_internals.pop_dispatch_mode())
    mode.__exit__(*exc)
    for m in reversed(above):
        torch_internals.push_dispatch_mode(m)


@dataclass(slots=True, eq=False)
class _Snap:
    """Bytes by category at the moment a role's total was highest (within a scope: overall, one phase, one window)."""

    seq: int = -1
    total: int = -1
    cats: list[int] = field(default_factory=lambda: [0, 0, 0, 0, 0])
    phase: str | None = None


@dataclass(slots=True, eq=False)
class _Rec:
    """One tracked storage: its bytes, category, role, creation sequence number and forward epoch."""

    nbytes: int
    cat: int
    role: int
    seq: int
    fwd: int  # forward-phase epoch that created it (0: not created in forward)
    ref: weakref.ref | None = None
    mask: bool = False  # counted at 1 B per element (see `MemoryTracker.bool_masks`)


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if torch_internals.inner_tensors(t) is not None:  # NOTE: a wrapper's storage holds nothing; its inner tensors count
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some wrapper subclasses
        return None


@dataclass
class PhasePeak:
    """The peak of one phase (the maximum over all its repetitions, e.g. accumulation micro-batches).

    ``total``/``by_category`` are the device role at the moment the device-role bytes were highest;
    ``host_total``/``host_by_category`` the host role at the moment the host-role bytes were highest.
    ``cuda_max_allocated``/``cuda_max_reserved`` are CUDA's own peaks over the phase (None off CUDA).
    """

    name: str
    total: int = 0
    by_category: dict[str, int] = field(default_factory=_cat._zeros)
    host_total: int = 0
    host_by_category: dict[str, int] = field(default_factory=_cat._zeros)
    disk_total: int = 0
    disk_by_category: dict[str, int] = field(default_factory=_cat._zeros)
    cuda_max_allocated: int | None = None
    cuda_max_reserved: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": {**self.by_category, "total": self.total},
            "host": {**self.host_by_category, "total": self.host_total},
            "disk": {**self.disk_by_category, "total": self.disk_total},
            "cuda_max_allocated": self.cuda_max_allocated,
            "cuda_max_reserved": self.cuda_max_reserved,
        }


class MemoryTracker:
    """Live tensor-storage bytes by phase, category and role, with peaks (see the module docstring).

    It saves nothing: it measures, at ~30 µs per aten op while active (see the module docstring).

    Args:
        module: the model whose parameters and buffers are ``weights`` (and their ``.grad``
            ``gradients``). ``None``: no storage is a weight.
        optimizers: optimizers whose state is ``optimizer_state``.
        device: the compute device; CPU storages count as ``host`` when it is an accelerator.
            Default: the device of ``module``'s first parameter (CPU without one).
        timeline: also record the bytes by category after every change (for a plot of one step);
            costs one tuple per allocation and free.
        bool_masks: count each storage ``bernoulli_`` fills (a dropout mask) at 1 B per element, as CUDA's fused
            dropout keeps it (CPU's keeps the input's dtype): for a CPU trace of a CUDA run (the dry run's
            ``target="cuda"``). :attr:`mask_elements` counts their elements.

    Attributes (after or during tracking):
        peak_bytes: the device-role peak, bytes.
        peaks: ``{phase name: PhasePeak}``.
        peak_phase: the phase in which the device-role peak happened (None: outside every phase).
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        optimizers: Iterable[torch.optim.Optimizer] | torch.optim.Optimizer | None = None,
        *,
        device: torch.device | str | None = None,
        timeline: bool = False,
        bool_masks: bool = False,
    ) -> None:
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"Passed `module` of type {type(module).__name__}; expected a `torch.nn.Module` or None.")
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        # NOTE: Lightning's LightningOptimizer wraps the optimizer; accept it and track the inner one.
        optimizers = [o if isinstance(o, torch.optim.Optimizer) else getattr(o, "optimizer", o) for o in optimizers or []]
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"Passed an optimizer of type {type(opt).__name__}; expected `torch.optim.Optimizer` instances."
                )
        self.module = module
        self.optimizers: list[torch.optim.Optimizer] = optimizers
        if device is None:
            first = next(iter(module.parameters()), None) if module is not None else None
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.timeline_enabled = timeline
        self.bool_masks = bool_masks
        self.mask_elements = 0
        self._lock = threading.RLock()
        self._mode: _Mode | None = None
        self._reset()

    def _reset(self) -> None:
        self._recs: dict[int, _Rec] = {}
        self._live = ([0] * 5, [0] * 5, [0] * 5)
        self._tot = [0, 0, 0]
        self._seq = 0
        self._peak = (_Snap(), _Snap(), _Snap())
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
        self._disk_keys: set[int] = set()  # storages a disk tier holds (`mark_disk`): counted on the disk, not in RAM
        self._phase_order: list[str] = []
        self._timeline: list[tuple[int, int, int, int, int, int, int]] = []
        self._host_on_accel = self.device.type not in ("cpu", "meta")
        self._weight_keys: set[int] = set()
        self._host_refs: list[weakref.ref] = []
        self._handles: list[Any] = []
        self._params: list[torch.Tensor] = []
        self._side: list[torch.Tensor] = []  # tensors of the parameters' quantization states (bitsandbytes)
        self._extra_params: list[torch.Tensor] = []  # optimizer parameters the module does not hold (masters)
        self._cuda_window: CudaPeakWindow | None = None
        self._cuda: dict[str, list[int]] = {}
        self._ops = 0

    def _see(self, t: torch.Tensor, mutates: bool = True) -> None:
        st = _storage(t)
        if st is None:
            return
        key = torch_internals.storage_key(st)
        rec = self._recs.get(key)
        if rec is not None:
            if mutates and not rec.mask:
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

    def _add(self, st: torch.UntypedStorage, t: torch.Tensor, key: int, cat: int) -> None:
        n = self._nbytes(st, t)
        role = _HOST if (key in self._host_keys or (self._host_on_accel and t.device.type == "cpu")) else _DEV
        role = _DISK if key in self._disk_keys else role
        with self._lock:
            self._seq += 1
            rec = _Rec(n, cat, role, self._seq, self._fwd_epoch if cat == _A else 0)
            rec.ref = weakref.ref(st, lambda _ref, key=key: self._free(key))
            self._recs[key] = rec
            if n:
                self._live[role][cat] += n
                self._tot[role] += n
                self._update_peaks(role)

    def _record_timeline(self) -> None:
        d = self._live[_DEV]
        self._timeline.append((len(self._phase_order) - 1, d[0], d[1], d[2], d[3], d[4], self._tot[_HOST]))

    def _update_peaks(self, role: int) -> None:
        total = self._tot[role]
        if self._win_events is not None:
            self._win_events.append([self._seq, *(live.copy() for live in self._live)])
        for snap in (self._peak[role], self._cur[role], *((self._win[role],) if self._win is not None else ())):
            if total > snap.total:
                snap.total = total
                snap.cats = self._live[role].copy()
                snap.seq = self._seq
                snap.phase = self._phase
        if self.timeline_enabled:
            self._record_timeline()

    def _free(self, key: int) -> None:
        with self._lock:
            rec = self._recs.pop(key, None)
            # NOTE: a freed storage's key (its address) is reused by later storages: drop its host mark.
            self._host_keys.discard(key)
            self._disk_keys.discard(key)
            if rec is None:
                return
            if rec.cat == _A and self._in_fwd and rec.fwd == self._fwd_epoch:
                # NOTE: created and freed inside one forward: a temporary, not a saved activation.
                self._retag(rec, _X, rec.role, retro=True)
            self._live[rec.role][rec.cat] -= rec.nbytes
            self._tot[rec.role] -= rec.nbytes
            self._seq += 1
            if self.timeline_enabled:
                self._record_timeline()

    def _resize(self, rec: _Rec, n: int) -> None:
        with self._lock:
            delta = n - rec.nbytes
            rec.nbytes = n
            self._live[rec.role][rec.cat] += delta
            self._tot[rec.role] += delta
            self._seq += 1
            if delta > 0:
                self._update_peaks(rec.role)

    def _as_mask(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (a mask ``bernoulli_`` fills) at 1 B per element (see ``bool_masks``)."""
        st = _storage(t)
        rec = None if st is None else self._recs.get(torch_internals.storage_key(st))
        if rec is not None and not rec.mask:
            rec.mask = True
            self.mask_elements += t.numel()
            self._resize(rec, t.numel())

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
                for snaps in (self._peak, *self._phase_snaps.values()):
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

    def _open(self, snaps: tuple[_Snap, _Snap]) -> None:
        """A scope (phase or window) starts from what is live now."""
        with self._lock:
            self._seq += 1
            for role in (_DEV, _HOST, _DISK):
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

    def _tag(self, t: torch.Tensor | None, cat: int) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        st = _storage(t)
        if st is None:
            return
        key = torch_internals.storage_key(st)
        rec = self._recs.get(key)
        if rec is None:
            self._add(st, t, key, cat)
            return
        n = self._nbytes(st, t)
        if n != rec.nbytes and not rec.mask:
            self._resize(rec, n)
        if rec.cat != cat:
            self._retag(rec, cat, rec.role, retro=True)

    def _scan(self) -> None:
        """Re-tag everything the module and the optimizers hold (on enter and exit)."""
        self._params = list(self.module.parameters()) if self.module is not None else []
        if self.module is not None:
            keys = set()
            self._side = [t for p in self._params for t in _cat.quant_state_tensors(p)]
            for t in [*self._params, *self.module.buffers(), *self._side]:
                self._tag(t, _W)
                st = _storage(t)
                if st is not None:
                    keys.add(torch_internals.storage_key(st))
            self._weight_keys = keys
        for opt in self.optimizers:
            self._scan_optimizer(opt)
        self._scan_grads()

    def _scan_grads(self) -> None:
        """Re-tag gradients (at every phase boundary): catches ``.grad`` set outside autograd's accumulation."""
        for p in (*self._params, *self._extra_params):
            self._on_grad(p)

    def _scan_optimizer(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if self._is_extra(p):
                    self._tag(p, _O)  # NOTE: a master copy the module does not hold (CPU-master strategies)
                self._on_grad(p)
        for state in opt.state.values():
            if isinstance(state, dict):
                for value in _cat.state_tensors(state):
                    self._tag(value, _O)

    def _is_extra(self, p: torch.Tensor) -> bool:
        """Whether ``p`` (an optimizer's parameter) is one the module does not hold."""
        st = _storage(p)
        return st is not None and torch_internals.storage_key(st) not in self._weight_keys

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._tag(p.grad, _G)

    def _note_host(self, t: torch.Tensor) -> int | None:
        """Count ``t``'s storage as host; forget it when that storage is freed (its address is then reused)."""
        st = _storage(t)
        if st is None:
            return None
        key = torch_internals.storage_key(st)
        if key not in self._host_keys:
            self._host_keys.add(key)
            self._host_refs.append(weakref.ref(st, lambda _r, key=key: self._host_keys.discard(key)))
        return key

    def _on_mark_host(self, t: torch.Tensor, role: str = "host") -> None:
        key = self._note_host(t)
        if key is None:
            return
        if role == "disk":
            self._disk_keys.add(key)
        rec = self._recs.get(key)
        new = _DISK if key in self._disk_keys else _HOST
        if rec is not None and rec.role != new:
            self._retag(rec, rec.cat, new, retro=True)

    def track(self, *tensors: Any, category: str = "other") -> None:
        """Count tensors that existed before tracking started (e.g. the batch), in ``category``.

        Accepts tensors or nested structures (dicts, lists, tuples) holding them. Storages already
        tracked keep their category.
        """
        if category not in CATEGORIES:
            raise ValueError(f"Passed `category={category!r}`; expected one of {CATEGORIES}.")
        cat = CATEGORIES.index(category)
        for t in tensors_in(tensors):
            st = _storage(t)
            if st is not None and torch_internals.storage_key(st) not in self._recs:
                self._add(st, t, torch_internals.storage_key(st), cat)

    def __enter__(self) -> Self:
        if self._mode is not None:
            raise RuntimeError("This MemoryTracker is already active; a tracker cannot be entered twice at once.")
        self._reset()
        for t in _cat.host_tensors():
            self._note_host(t)
        for t in _cat.disk_tensors():
            self._on_mark_host(t, "disk")
        _cat.add_host_listener(self._on_mark_host)
        self._phase_order.append("<start>")
        self._scan()
        for t in _cat.host_weight_copies([*self._params, *self._side]):
            self._tag(t, _W)  # NOTE: host copies of the module's weights made before tracking (`mark_host_weights`)
        if self.timeline_enabled:
            # NOTE: what existed before tracking is the baseline, not a ramp of "allocations".
            d = self._live[_DEV]
            self._timeline[:] = [(0, d[0], d[1], d[2], d[3], d[4], self._tot[_HOST])]
        for p in self._params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for opt in self.optimizers:
            extra = [p for group in opt.param_groups for p in group["params"] if self._is_extra(p)]
            self._extra_params += extra
            self._handles += [p.register_post_accumulate_grad_hook(self._on_grad) for p in extra if p.requires_grad]
            self._handles.append(opt.register_step_post_hook(self._scan_optimizer))
        if self.device.type == "cuda" and torch.cuda.is_available():
            self._cuda_window = CudaPeakWindow(self.device)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._mode is not None:
                _exit_mode(self._mode, exc)
        finally:
            self._mode = None
            if self._phase is not None:
                self._end_phase()
            self._scan()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            _cat.remove_host_listener(self._on_mark_host)
            if self._cuda_window is not None:
                self._cuda_window.close()
                self._cuda_window = None
            self._final = self.breakdown()
            # NOTE: drop the weakrefs, so storages freed after tracking do not call back into us.
            self._recs = {}
            self._host_refs = []

    @property
    def active(self) -> bool:
        return self._mode is not None

    def set_phase(self, name: str | None) -> None:
        """End the current phase (if any) and start ``name`` (None: outside every phase).

        For callers whose boundaries are hooks rather than a ``with`` block (a Lightning callback).
        A name may repeat (accumulation: forward, backward, forward, backward, optimizer); its peak is
        the maximum over the repetitions. ``"forward"`` is the phase whose surviving storages are
        activations.
        """
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Passed a phase name of type {type(name).__name__}; expected a str or None.")
        if self._mode is None:
            raise RuntimeError("`set_phase` needs an active tracker: call it inside `with tracker:`.")
        if self._phase is not None:
            self._end_phase()  # re-scans the gradients
        else:
            self._scan_grads()
        if name is None:
            return
        self._phase = name
        self._phase_order.append(name)
        snaps = self._phase_snaps.setdefault(name, (_Snap(), _Snap(), _Snap()))
        self._cur = snaps
        if name == _FORWARD:
            self._in_fwd = True
            self._fwd_epoch += 1
        self._open(snaps)
        if self._cuda_window is not None:
            self._cuda_window.lap()

    def _end_phase(self) -> None:
        name = self._phase
        assert name is not None
        if self._cuda_window is not None:
            allocated, reserved, _ = self._cuda_window.lap()
            prev = self._cuda.get(name, [0, 0])
            self._cuda[name] = [max(prev[0], allocated), max(prev[1], reserved)]
        self._in_fwd = False
        self._win = self._win_events = None
        self._scan_grads()
        if name == _OPTIMIZER:
            # NOTE: optimizers whose `step` bypasses torch's step hooks still get their state re-tagged here.
            for opt in self.optimizers:
                self._scan_optimizer(opt)
        if name == _BACKWARD:
            # NOTE: what forward created and backward did not free is no longer held for backward
            # (the loss, logits kept by the user): "other" from now on, not retroactively.
            for rec in list(self._recs.values()):
                if rec.cat == _A:
                    self._retag(rec, _X, rec.role, retro=False)
        self._phase = None
        self._cur = self._peak

    def set_window(self, name: str | None, events: bool = False) -> None:
        """Also keep the peaks of a part of the current phase, reported as ``peaks[f"{phase}@{name}"]``.

        A window only adds snapshots (the dry run's parts of a phase: before, in and after the repeated blocks).
        ``events``: also keep the live bytes by category (device, host) after every increase during the window's
        last occurrence, in :attr:`window_events`.
        """
        if self._phase is None:
            raise RuntimeError("`set_window` needs a current phase: call `set_phase` first.")
        if name is None:
            self._win = self._win_events = None
            return
        key = f"{self._phase}@{name}"
        self._win_events = None
        if events:
            self._win_events = self.window_events[key] = []
        snaps = self._phase_snaps.setdefault(key, (_Snap(), _Snap(), _Snap()))
        self._win = snaps
        self._open(snaps)

    @property
    def phase_name(self) -> str | None:
        """The current phase (None outside every phase)."""
        return self._phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute what happens inside the block to phase ``name`` (see :meth:`set_phase`)."""
        self.set_phase(name)
        try:
            yield
        finally:
            if self._mode is not None and self._phase == name:
                self.set_phase(None)

    @property
    def peak_bytes(self) -> int:
        """The highest device-role live bytes seen while tracking."""
        return max(self._best(_DEV).total, 0)

    def peak_bytes_role(self, role: Role) -> int:
        """The highest live bytes of ``role`` (``"device"``, ``"host"``, or ``"disk"``: a disk tier's) seen while
        tracking."""
        if role not in ROLES:
            raise ValueError(f"Passed `role={role!r}`; expected one of {ROLES}.")
        return max(self._best(ROLES.index(role)).total, 0)

    @property
    def peak_phase(self) -> str | None:
        """The phase in which the device-role peak happened (None: outside every phase)."""
        return self._best(_DEV).phase

    @property
    def peaks(self) -> dict[str, PhasePeak]:
        out = {}
        for name, (dev, host, disk) in self._phase_snaps.items():
            cuda = self._cuda.get(name)
            out[name] = PhasePeak(
                name=name,
                total=max(dev.total, 0),
                by_category=dict(zip(CATEGORIES, dev.cats)),
                host_total=max(host.total, 0),
                host_by_category=dict(zip(CATEGORIES, host.cats)),
                disk_total=max(disk.total, 0),
                disk_by_category=dict(zip(CATEGORIES, disk.cats)),
                cuda_max_allocated=cuda[0] if cuda else None,
                cuda_max_reserved=cuda[1] if cuda else None,
            )
        return out

    def peak_breakdown(self) -> MemoryBreakdown:
        """Bytes by category at the device-role peak (device), at the host-role peak (host) and on disk (its peak)."""
        return MemoryBreakdown(device=dict(zip(CATEGORIES, self._best(_DEV).cats)),
                               host=dict(zip(CATEGORIES, self._best(_HOST).cats)),
                               disk=dict(zip(CATEGORIES, self._best(_DISK).cats)))

    def breakdown(self) -> MemoryBreakdown:
        """Live bytes by category and role now (after exit: at exit)."""
        if self._mode is None and hasattr(self, "_final"):
            return self._final
        return MemoryBreakdown(*(dict(zip(CATEGORIES, live)) for live in self._live))

    def live_bytes(self, role: Role = "device") -> int:
        return self.breakdown().total(role)

    @property
    def num_ops(self) -> int:
        """Aten ops seen while tracking."""
        return self._ops

    def timeline(self) -> dict[str, Any]:
        """With ``timeline=True``: device-role bytes by category after every allocation and free.

        Returns ``{"phases": [phase names], "phase": [index into phases per event],
        "<category>": [bytes per event], ..., "host_total": [bytes per event]}``.
        """
        cols = list(zip(*self._timeline)) if self._timeline else [()] * 7
        return {"phases": list(self._phase_order), "phase": list(cols[0]),
                **{cat: list(cols[i + 1]) for i, cat in enumerate(CATEGORIES)}, "host_total": list(cols[6])}

    def report(self) -> dict[str, Any]:
        """A JSON-able summary: peaks (overall and per phase, both roles), the binding phase, live bytes."""
        return {
            "peak_bytes": self.peak_bytes,
            "peak_bytes_host": self.peak_bytes_role("host"),
            "peak_phase": self.peak_phase,
            "peak": self.peak_breakdown().to_dict(),
            "phases": {name: p.to_dict() for name, p in self.peaks.items()},
            "live_at_end": self.breakdown().to_dict(),
            "device": str(self.device),
        }

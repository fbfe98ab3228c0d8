"""The out-of-memory split behind ``AccumulationScheduler(on_oom="split")`` and ``OOMRecovery`` (private helper).

A loader batch runs as one or more *chunks* (slices along the batch dimension). When a chunk's forward or backward
raises ``torch.OutOfMemoryError``, its graph is released, it is split in two, and both halves run in its place;
the accumulation window keeps every sample exactly once and the owner's exact normalisation (``_weigh`` and the
rescale in ``on_before_optimizer_step``) applies to the chunks as to any micro-batch.

NOTE: [where the split runs] Lightning has no hook around a failing ``training_step``, and the backward runs
after ``training_step`` returned, inside the optimizer closure. The least invasive place that sees both is the
strategy: ``strategy.training_step`` and ``strategy.backward`` are wrapped on the strategy *instance* (removed at
teardown). The first chunk's forward runs in Lightning's ``training_step`` call; the backward of each chunk and
the forward + backward of the remaining chunks run in Lightning's ``backward`` call, i.e. after Lightning's
``zero_grad`` of a window's first batch (a chunk backpropagated inside ``training_step`` would be zeroed by it).
Every chunk goes through the real ``strategy.training_step`` and ``strategy.backward`` (precision context,
loss scaling, ``on_before_backward``/``on_after_backward``, ``lowmem_offload``'s host folding), as a micro-batch
of that size would. Hazard: the Lightning hooks of the batch (``on_train_batch_start/end``) run once per loader
batch, not per chunk; the module's ``self.log`` calls in ``training_step`` are recorded and made once per name
after the batch's last backward, the chunks' values averaged with the weights of the normalisation (so a
callback's ``on_after_backward`` reads the previous batch's logged values).

NOTE: [a failed backward] Autograd accumulates a parameter's gradient once per backward, after every use of the
parameter in the graph has contributed, so a parameter whose ``post_accumulate_grad`` hook fired before the
error holds exactly the failed chunk's contribution, and one whose hook did not fire holds none of it. The halves
then run with the first kind frozen (``requires_grad=False``: not in their graph, no gradient, less work) and
compute the second kind; the failed chunk's samples/tokens and loss, counted by its completed forward, are not
counted again. This needs no copy of the gradients (plain: ``.grad``; ``lowmem_offload``: the host buffers that
already hold the completed chunks) and discards nothing that is correct. Hazards: dropout draws new masks for the
halves, so the two kinds of parameters saw different masks in that one step; a parameter shared between two
*reentrant* checkpointed segments accumulates twice per backward, and one interrupted between the two would be
frozen with half its contribution (use ``use_reentrant=False``, as ``ActivationCheckpointing`` does).

NOTE: [no trace] What the failed attempt's forward changed in the module (buffers, metric states, rebound
attributes: ``ModuleState``) is put back before its halves run. ``BatchNorm`` in training mode normalises each
half over its own samples, which no split can undo: ``install`` names those layers in a warning.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.memory import is_oom_error
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities import apply_to_collection

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core import atomic as _atomic
from lightning_lowmem.core.hooks import swapped
from lightning_lowmem.core.kept_state import ModuleState
from lightning_lowmem.core.side_step import forward_only, stands_aside

log = logging.getLogger(__name__)


class MicroBatchOutOfMemoryError(torch.OutOfMemoryError):
    """A micro-batch of one sample does not fit; the last completed step was saved (see the message)."""


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and is_oom_error(err))


def split_batch(batch: Any, size: int) -> list[Any]:
    """Slices of ``size`` samples (the last may be smaller) of every tensor whose first dimension is the batch's."""
    n = extract_batch_size(batch)
    out = []
    for start in range(0, n, size):
        stop = min(start + size, n)
        out.append(apply_to_collection(
            batch, torch.Tensor, lambda t, a=start, b=stop: t[a:b] if t.dim() and t.size(0) == n else t
        ))
    return out


@dataclass
class _Chunk:
    batch: Any
    frozen: frozenset[int] = frozenset()  # parameters whose gradient for these samples is already accumulated
    counted: bool = False  # a completed forward of these samples counted them (its backward failed)
    before: tuple[Any, ...] | None = None  # the owner's window state before this chunk's forward counted it
    logged_at: int = 0  # where its entries start in the batch's logged calls
    state: Any = None  # the module's buffers, metric states and attributes before its forward (`ModuleState`)


@dataclass
class _Failure:
    phase: str
    size: int
    message: str
    allocated: int | None = None  # CUDA: bytes allocated when it failed
    requested: int | None = None  # CUDA: the allocation that failed


@dataclass
class _Logged:
    calls: list[tuple[str, Any, dict[str, Any]]] = field(default_factory=list)


# the owner's (AccumulationScheduler's) window state a chunk's `_weigh` changes
_WINDOW_STATE = ("_count", "_samples", "_micro_batches", "_k", "_k_loss", "_n_ref", "_reported")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class OOMSplitter:
    """Runs each loader batch as chunks, splitting a chunk in two when it runs out of memory (see the module)."""

    def __init__(self, owner: Any, regrow_after: int | None) -> None:
        self.owner = owner  # the AccumulationScheduler whose window and normalisation the chunks use
        self.regrow_after = regrow_after
        self.piece: int | None = None  # the largest chunk, when smaller than the loader's batch
        self.recoveries = 0
        self.bytes_freed = 0
        self.clean_windows = 0
        self._window_had_oom = False
        self._largest_batch = 0
        self._installed = False
        self._reset_batch()

    def _reset_batch(self) -> None:
        self._pending: list[_Chunk] = []
        self._current: _Chunk | None = None
        self._chunked = False
        self._logged: list[_Logged] = []  # per completed uncounted chunk
        self._weights: list[Any] = []
        self._reports: list[Any] = []
        self._inside = False
        self._allocated_before = 0

    # --- install / remove ------------------------------------------------------------------------------------------
    def install(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._installed:
            return
        strategy = self._strategy = trainer.strategy
        self._trainer, self._module = trainer, pl_module
        self._previous = {n: strategy.__dict__.get(n) for n in ("training_step", "backward")}
        self._ts, self._bw = strategy.training_step, strategy.backward
        # NOTE: instance attributes shadow the strategy's methods for this run only; `_call_strategy_hook` looks
        # them up on the instance. Registered after the strategy's setup, so `lowmem_offload`'s own gradient
        # hooks (host folding) run before ours: a parameter counts as done only once it reached the host.
        strategy.training_step = self._training_step  # type: ignore[method-assign]
        strategy.backward = self._backward  # type: ignore[method-assign]
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        self._frozen_now: frozenset[int] = frozenset()
        self._tracking, self._touched = False, set()
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._accumulated(i)) for i, p in enumerate(self._params)
        ]
        self._installed = True
        _warn_batch_statistics(type(self.owner).__name__, pl_module)

    def remove(self) -> None:
        if not self._installed:
            return
        for name, previous in self._previous.items():
            if previous is not None:
                setattr(self._strategy, name, previous)
            else:
                self._strategy.__dict__.pop(name, None)
        for hook in self._hooks:
            hook.remove()
        self._freeze(frozenset())
        self._hooks, self._params = [], []
        self._strategy = self._trainer = self._module = self._ts = self._bw = None
        self._reset_batch()
        self._installed = False

    def __getstate__(self) -> dict[str, Any]:
        # NOTE: only the settings and counters travel (`ddp_spawn` pickles callbacks); an installed run holds hooks
        state = {k: v for k, v in self.__dict__.items() if k in ("owner", "regrow_after", "piece", "recoveries",
                                                                   "bytes_freed", "clean_windows")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["owner"], state["regrow_after"])  # type: ignore[misc]
        self.__dict__.update(state)

    def _accumulated(self, i: int) -> None:
        if self._tracking:
            self._touched.add(i)

    def _freeze(self, frozen: frozenset[int]) -> None:
        for i in self._frozen_now - frozen:
            self._params[i].requires_grad_(True)
        for i in frozen - self._frozen_now:
            self._params[i].requires_grad_(False)
        self._frozen_now = frozen

    # --- the wrapped strategy methods ------------------------------------------------------------------------------
    def _standing_aside(self) -> bool:
        # NOTE: `_inside`: our own chunk's call; `stands_aside`: a side step (probe, micro-batch trial) or a module
        # detached from the Trainer, which run their step once, whole, whatever size it has; `forward_only`: an
        # epoch without backward (SWA's BatchNorm update), whose forward runs the whole batch, as in plain Lightning
        return self._inside or stands_aside(self._module) or forward_only(self._trainer)

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._standing_aside() or not args:
            return self._ts(*args, **kwargs)
        batch = args[0]
        self._reset_batch()
        self._rest, self._kwargs = args[1:], kwargs
        size = extract_batch_size(batch)
        self._largest_batch = max(self._largest_batch, size)
        pieces = split_batch(batch, self.piece) if self.piece is not None and self.piece < size else [batch]
        self._chunked = len(pieces) > 1
        self._pending = [_Chunk(p) for p in pieces]
        out = self._forward_next()
        if (out.get("loss") if isinstance(out, Mapping) else out) is None:
            self._emit()  # NOTE: no loss, no backward: Lightning skips it, and the logs are emitted here
        return out

    def _backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self._standing_aside() or self._current is None:
            return self._bw(closure_loss, optimizer, *args, **kwargs)
        result = self._backward_chunk(closure_loss, optimizer, args, kwargs)
        del closure_loss
        with self._fx("training_step"):
            while self._pending:
                out = self._forward_next()
                if out is None:
                    break
                loss = out.get("loss") if isinstance(out, Mapping) else out
                del out
                # NOTE: what Lightning's closure does with a step's loss (`ClosureResult.from_training_step_output`)
                closure = loss / self._trainer.accumulate_grad_batches
                del loss
                result = self._backward_chunk(closure, optimizer, args, kwargs)
                del closure
            self._emit()
        return result

    # --- one chunk -------------------------------------------------------------------------------------------------
    def _forward_next(self) -> Any:
        """The forward of the next pending chunk (splitting it while it runs out of memory); None when none is left."""
        while self._pending:
            chunk = self._pending.pop(0)
            if chunk.counted and len(chunk.frozen) == len(self._params):
                continue  # every parameter already holds these samples' gradient
            failure, logged = None, _Logged()
            chunk.before = tuple(getattr(self.owner, name) for name in _WINDOW_STATE)
            device = self._strategy.root_device
            # NOTE: a host-side counter, no device sync
            self._allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            self._freeze(chunk.frozen)
            self.owner._counting = not chunk.counted
            chunk.state = ModuleState(self._module)  # NOTE: [no trace] see `_backward_chunk`
            try:
                with self._capturing(logged):
                    out = self._ts(chunk.batch, *self._rest, **self._kwargs)
            except BaseException as err:
                self._freeze(frozenset())
                if not is_oom(err):
                    raise
                failure = self._describe(err, "forward", chunk)
                chunk.state.restore()
            finally:
                self.owner._counting = True
            if failure is None:
                self._current = chunk
                if not chunk.counted:
                    chunk.logged_at = len(self._logged)
                    self._logged.append(logged)
                    self._weights.append(self.owner._last_count)
                    self._reports.append(self.owner._reported)
                return out
            self._recover(chunk, chunk.frozen, chunk.counted, failure)
        return None

    def _backward_chunk(self, loss: torch.Tensor, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        chunk, self._current = self._current, None
        assert chunk is not None
        failure = None
        self._touched, self._tracking = set(), True
        try:
            return self._bw(loss, optimizer, *args, **kwargs)
        except BaseException as err:
            if not is_oom(err):
                raise
            failure = self._describe(err, "backward", chunk)
        finally:
            self._tracking = False
            self._freeze(frozenset())
        # NOTE: [no trace] the failed micro-batch's forward (all of it here, part of it when the forward failed) has
        # updated buffers (BatchNorm statistics, counters), metrics and attributes that its halves update again:
        # they go back to what they were before it, so each sample counts once, as in smaller micro-batches
        chunk.state.restore()
        # NOTE: the failed graph hangs off this loss (Lightning's closure keeps a reference to it until the step):
        # detaching it in place lets the graph's saved activations go now
        with contextlib.suppress(RuntimeError):
            loss.detach_()
        del loss
        if self._touched or chunk.counted:
            self._recover(chunk, chunk.frozen | frozenset(self._touched), True, failure)
        else:
            # NOTE: no gradient reached a parameter: the chunk is undone entirely (its counts, its loss, its logs)
            # and the halves run as if its forward had failed, exactly as micro-batches of their size
            for name, value in zip(_WINDOW_STATE, chunk.before):
                setattr(self.owner, name, value)
            del self._logged[chunk.logged_at:], self._weights[chunk.logged_at:], self._reports[chunk.logged_at:]
            self._recover(chunk, chunk.frozen, False, failure)
        return None

    # --- recovery --------------------------------------------------------------------------------------------------
    def _describe(self, err: BaseException, phase: str, chunk: _Chunk) -> _Failure:
        failure = _Failure(phase, extract_batch_size(chunk.batch), (str(err).strip().splitlines() or [""])[0])
        device = self._strategy.root_device
        if device.type == "cuda":
            failure.allocated = int(torch.cuda.memory_allocated(device))
            match = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", str(err))
            if match:
                failure.requested = int(float(match.group(1)) * _UNITS[match.group(2)])
        return failure

    def _recover(self, chunk: _Chunk, frozen: frozenset[int], counted: bool, failure: _Failure) -> None:
        self.recoveries += 1
        self._window_had_oom = True
        self._release()
        if failure.size <= 1:
            self._emergency(failure)
        first = failure.size - failure.size // 2
        self._pending[:0] = [_Chunk(half, frozen, counted) for half in split_batch(chunk.batch, first)]
        self._chunked = True
        if self.piece is None or first < self.piece:
            self.piece = first
            self.clean_windows = 0
            # NOTE: the rest of this batch at the new size too (a chunk as large as the one that failed would fail)
            self._pending = [
                _Chunk(piece, c.frozen, c.counted) for c in self._pending for piece in split_batch(c.batch, first)
            ]
            rank_zero_info(
                f"{type(self.owner).__name__}: out of memory in the {failure.phase} of a micro-batch of {failure.size}; "
                f"ran it as {first} + {failure.size - first} (same samples, same normalisation). Micro-batches of "
                f"at most {first} from now on"
                + (f"; trying twice that after {self.regrow_after} clean optimizer steps." if self.regrow_after else ".")
            )

    def _release(self) -> None:
        # NOTE: the failed call's frames (holding its activations) go with the exception, by reference counting,
        # unless some sit in reference cycles: a collection of the young generations finds those made during the
        # step. A full `gc.collect()` costs ~0.4 s with Lightning and transformers loaded (more than the failed
        # micro-batch's work on a small model), so on CUDA it runs only when the allocator still holds more than
        # before the failed chunk; on CPU (no allocator figures) the young collection is all.
        gc.collect(1)
        device = self._strategy.root_device
        if device.type == "cuda":
            if torch.cuda.memory_allocated(device) > self._allocated_before:
                gc.collect()
            before = torch.cuda.memory_reserved(device)
            torch.cuda.empty_cache()
            self.bytes_freed += max(0, before - torch.cuda.memory_reserved(device))

    def window_done(self) -> None:
        """After an optimizer step: count clean windows; grow the micro-batch back after ``regrow_after`` of them."""
        if self._window_had_oom or self.piece is None:
            self._window_had_oom = False
            return
        self.clean_windows += 1
        if self.regrow_after and self.clean_windows >= self.regrow_after:
            grown = 2 * self.piece
            self.piece = None if grown >= self._largest_batch else grown
            self.clean_windows = 0
            rank_zero_info(
                f"{type(self.owner).__name__}: {self.regrow_after} optimizer steps without running out of memory; "
                f"micro-batches of at most {grown if self.piece else self._largest_batch} again."
            )

    def _emergency(self, failure: _Failure) -> None:
        trainer = self._trainer
        self._pending, self._current = [], None
        self._freeze(frozenset())
        ckpt = getattr(trainer, "checkpoint_callback", None)
        directory = Path(getattr(ckpt, "dirpath", None) or trainer.default_root_dir)
        path = directory / "oom-emergency.ckpt"
        saved = f"Saved the last completed step (global step {trainer.global_step}) to {str(path)!r}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            save_atomic(trainer, path)
        except Exception as err:  # noqa: BLE001  NOTE: the error below matters more than the checkpoint
            saved = f"Could not save an emergency checkpoint to {str(path)!r} ({type(err).__name__}: {err})"
        if failure.allocated is not None:
            total = torch.cuda.get_device_properties(self._strategy.root_device).total_memory
            need = failure.allocated + (failure.requested or 0)
            needed = (f"it needed at least {_gib(need)} ({_gib(failure.allocated)} allocated + "
                      f"{_gib(failure.requested or 0)} requested) of the device's {_gib(total)}")
        else:
            needed = "the allocator gave no figures off CUDA"
        raise MicroBatchOutOfMemoryError(
            f"{type(self.owner).__name__}: a micro-batch of 1 sample runs out of memory in the {failure.phase} "
            f"({failure.message}); {needed}. {saved}; resume from it with `trainer.fit(..., ckpt_path=...)` once the "
            "step fits. Predict the peak of one sample with `lowmem estimate --config <your.yaml>` (or "
            "`lightning_lowmem.estimate_memory(model, batch_size=1, seq_len=...)`), then lower it: activation "
            "checkpointing (`ActivationCheckpointing`), masters and optimizer on the host (`strategy='lowmem_offload'`), "
            "activation offload (`ActivationOffload`), a chunked loss (`ChunkedLMLoss`), or shorter sequences."
        )

    # --- the module's logging --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _fx(self, name: str) -> Iterator[None]:
        # NOTE: `self.log` checks the hook it is called from; the chunks after the first run inside `backward`
        module = self._module
        previous = lightning_internals.current_hook(module)
        lightning_internals.set_current_hook(module, name)
        try:
            yield
        finally:
            lightning_internals.set_current_hook(module, previous)

    @contextlib.contextmanager
    def _capturing(self, logged: _Logged) -> Iterator[None]:
        """``self.log`` of the module records into ``logged`` (emitted once the batch's last forward is done).

        NOTE: not a ``side_step``: the chunks *are* the real step, so the RNG is not forked (their dropout draws
        are the run's) and the logs are kept, only deferred (``log_dict`` calls ``self.log`` for each key, so it is
        recorded too); the module's ``log`` is swapped as ``side_step`` swaps it.
        """

        def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            logged.calls.append((name, value, (args, kwargs)))

        self._inside = True
        try:
            with swapped(self._module, log=record):
                yield
        finally:
            self._inside = False

    def _emit(self) -> None:
        """One ``self.log`` per name for the loader batch: the chunks' values averaged with the weights of the
        normalisation (samples or tokens: the mean over the whole micro-batch), the reported loss likewise."""
        weights = [float(w) for w in self._weights]
        total = sum(weights) or 1.0
        if len(self._reports) > 1 and all(r is not None for r in self._reports):
            first = self._reports[0]
            mean = sum(r.double() * w for r, w in zip(self._reports, weights)) / total
            self.owner._reported = mean.to(first.dtype)
        names: dict[str, list[tuple[Any, float, tuple[tuple, dict[str, Any]]]]] = {}
        for logged, w in zip(self._logged, weights):
            for name, value, call in logged.calls:
                names.setdefault(name, []).append((value, w, call))
        for name, calls in names.items():
            value, _, (args, kwargs) = calls[-1]
            if len(calls) > 1 and all(_scalar(v) for v, _, _ in calls):
                ws = sum(w for _, w, _ in calls) or 1.0
                mean = sum(torch.as_tensor(v).detach().double().cpu() * w for v, w, _ in calls) / ws
                value = mean.to(value.device, value.dtype) if isinstance(value, torch.Tensor) else float(mean)
                sizes = [c[1].get("batch_size") for _, _, c in calls]
                if all(s is not None for s in sizes):
                    kwargs = {**kwargs, "batch_size": sum(sizes)}
            self._module.log(name, value, *args, **kwargs)
        self._logged, self._weights, self._reports = [], [], []


def _warn_batch_statistics(owner: str, module: torch.nn.Module) -> None:
    """Before the first step: name the layers in training mode whose output depends on the micro-batch's samples."""
    found = [(n, type(m).__name__) for n, m in module.named_modules() if isinstance(m, torch_internals.BatchNormBase) and m.training]
    if found:
        names = ", ".join(n for n, _ in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        rank_zero_warn(
            f"{owner}: the model has {'/'.join(sorted({k for _, k in found}))} layers ({names}) in training mode; "
            "if a micro-batch runs out of memory and is split, each part is normalised over its own samples and "
            "updates the running statistics once, so that step is not the unsplit micro-batch's (it is that of "
            "micro-batches of the parts' size). Use GroupNorm/LayerNorm (or keep these layers in eval mode) for an "
            "exact step, or filter this warning to accept it."
        )


def _scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return isinstance(value, float)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def save_atomic(trainer: L.Trainer, path: Path) -> None:
    """``trainer.save_checkpoint`` into a temp file beside ``path``, fsync-ed and renamed into place (``core.atomic``)."""
    tmp = _atomic.temp_path(path)
    _atomic.clean_orphans(path)
    trainer.save_checkpoint(tmp)
    _atomic.fsync_path(tmp)
    os.replace(tmp, path)
    _atomic.fsync_path(path.parent)

"""The overlapped host pass of ``lowmem_offload`` (``OffloadStrategy(host_pass="overlap")``).

The serial step waits for backward to end, then reads every fp32 gradient for the non-finite guard and the clipping
norm, then runs the optimizer over every master. Here, during the backward of the last micro-batch of an
accumulation window, each gradient is handed to one host worker thread as it lands; the worker folds it into its
fp32 buffer and, bucket by bucket, measures the per-tensor norms, keeps a copy of the masters and optimizer state
it is about to change, and steps those masters (the user's optimizer over a subset of its parameters). What is
left after backward is the last bucket, the parameters whose gradient came only from earlier micro-batches, and a
check of the speculation. Buckets shrink as the end of backward nears (by what the previous window's backward handed
over: see [shrinking buckets]), and the final buckets (the last one, and the one held back when less than it was
still to come: see [final buckets]) are checked at the end of backward, when every other bucket's norms are known,
and stepped at the step once it stands: no copy, never undone. The checks:

- no norm clipping and finite gradients: the update of every element depends only on that element's gradient,
  state and hyperparameters, so stepping by buckets is the serial step bit for bit (exact by construction);
- norm clipping: the global norm is reduced from the per-tensor norms as ``torch.nn.utils.clip_grad_norm_``
  reduces them; when its clamped coefficient is 1 the serial clip multiplies by 1.0 (a no-op) and the step stands;
- value clipping and fp16 loss scaling: each element is unscaled and clamped alone, so each bucket steps with
  working copies of its gradients, unscaled by the loss scaler's own kernel (an overflow in any bucket undoes the
  pass: the serial step skips, as today) and clamped as ``torch.nn.utils.clip_grad_value_`` clamps (the non-finite
  guard reads the clamped values, as it does after the serial clip). The gradient buffers stay as they landed; a
  restore unscales and clamps them then, so the serial step that follows finds them as it always does. Where a user
  hook reads them after the step (``on_train_batch_end`` & co., see ``masters_view``) the step unscales and clamps
  them too (``settle=True``: one pass over the gradients at the step, on the critical path);
- a clip that triggers, a non-finite gradient, a gradient that arrives twice (a weight used by two reentrant
  checkpointed blocks), or compute weights written by other code before the step: the masters and state the pass
  touched are restored from its copies and the serial step runs on the untouched gradient buffers (the same step,
  warning and counters as ``host_pass="serial"``).

On CUDA (and the CPU stand-in of the tests) each bucket's stepped masters are also rounded into the transfer's staging
slots as the bucket ends (``stager``): the upload after the step only queues their copies to the device, the fp32 ->
compute-dtype cast of every weight is off the critical path with the step. The plain CPU path has no staging: there
the compute weights are in host RAM and the cast into them is the upload.

From the second window on each bucket that steps during backward is also uploaded into its compute weights at once
(``uploader``): see [upload in backward] in :mod:`~lightning_lowmem.strategies.offload.host_pass_uploads`.

Cost: host RAM for the copies (4 B/param for the master plus the optimizer state, 8 B/param for AdamW) of every
master it steps speculatively, kept between steps and reused (``lowmem_offload``'s host-RAM check counts every
trainable one; about 2 B/param for an 8-bit state); that many more bytes read and written per step, off the critical
path; under value clipping or fp16 also a buffer for one bucket of working gradients, reused (at most ``BUCKET_BYTES``
plus the largest gradient). On the plain CPU path the gradients handed to the worker live until it folds them: at most a
bucket of them (:class:`~lightning_lowmem.strategies.offload.host_worker.HostWorker`), past that backward waits. Where the pass cannot be exact the step stays serial (:func:`~lightning_lowmem.strategies.offload.host_pass_checks.why_serial` names the cause):
optimizers other than ``torch.optim.Adam``/``AdamW``/``SGD`` and bitsandbytes' ``AdamW8bit``/``Adam8bit``/``Lion8bit``
(subclasses, paged ones, bitsandbytes' per-parameter overrides: see ``host_pass_checks``),
manual optimization, ``optimizer_in_backward`` and user code in
``on_after_backward``/``on_before_optimizer_step``/``configure_gradient_clipping``/``backward`` (it may read or
change the gradients before the step).

Example:
    >>> import torch
    >>> from lightning_lowmem.strategies.offload.masters import HostMasters
    >>> masters = HostMasters()
    >>> masters.build(torch.nn.Linear(2, 2), loading=False, precision=None, grad_buffers=True)
    >>> opt = torch.optim.AdamW(masters.p_host)
    >>> hp = HostPass(masters)
    >>> hp.arm(opt, clip_norm=None, guard=True)
    >>> for i, p in enumerate(masters.p_host):
    ...     _ = hp.submit(i, torch.ones_like(p))
    >>> hp.finish(); hp.stands(), int(opt.state[masters.p_host[0]]["step"])
    (True, 1)
    >>> hp.disarm(); hp.close()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.strategies.offload.host_pass_copies import KeptCopies, WorkingGrads
from lightning_lowmem.strategies.offload.host_pass_uploads import BackwardUploads
from lightning_lowmem.strategies.offload.host_worker import HostWorker
from lightning_lowmem.strategies.offload.masters import HostMasters
from lightning_lowmem.strategies.offload.transfer import StreamTransfer

HostPassMode = Literal["serial", "overlap", "delayed"]  # NOTE: "delayed": strategies/offload/delayed_step.py
HOST_PASSES: tuple[str, ...] = get_args(HostPassMode)
BUCKET_BYTES = 32 * 2**20  # fp32 bytes of gradients per bucket (8M parameters)
#: ``uploader(indices, worker)``: round masters ``indices`` into their compute weights now (``worker``: from the pass's
#: worker during backward; else on the main thread, after a restore)
Uploader = Callable[[list[int], bool], None]


class HostPass:
    """One host worker that folds, checks and steps the masters bucket by bucket during backward.

    Saves: the host step's time after backward (all but the last bucket runs while backward computes).
    Costs: a copy of the touched masters and optimizer state (host RAM, reused), one worker thread.
    """

    def __init__(self, masters: HostMasters, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.masters = masters
        self.bucket_bytes = bucket_bytes
        # NOTE: a gradient handed over stays alive until the worker folds it: at most `bucket_bytes` of them wait (a
        # staging slot, which exists anyway, counts nothing), past that the autograd thread waits for the worker
        self._worker = HostWorker("host-pass", bucket_bytes)
        self._kept = KeptCopies()
        self._working = WorkingGrads()  # value clipping, fp16: one bucket's working gradients
        self._expect: dict[int, int] = {}  # master -> fp32 bytes: the gradients the last armed backward handed over
        self._uploads = BackwardUploads(lambda i: masters.names[i])
        self.armed = False
        self._clear()

    def _clear(self) -> None:
        self.optimizer: Optimizer | None = None
        self.clip_norm: float | None = None
        self.clip_value: float | None = None
        self.scaler: Any = None
        self.settle = False
        self.guard = False
        self.stager: StreamTransfer | None = None
        self.uploader: Uploader | None = None
        self._uploads.clear()
        self._skipped: list[str] = []  # what the real gradients did not get because the pass stood in for it
        self.finished = False
        self.failed: str | None = None  # why the speculation does not stand (restored, or to restore)
        self.restored = False
        self.taken = False  # the step used the pass's result (`stands` said so)
        self._submitted: set[int] = set()
        self._stepped: list[int] = []  # in step order
        self._norms: dict[int, Tensor] = {}
        self._run: set[int] = set()  # masters a bucket has run for (stepped, or found the speculation failed)
        self._taken: dict[int, int] = {}  # master -> fp32 bytes: the gradients the worker folded in this backward
        self._left = sum(self._expect.values())  # bytes of those gradients the last backward handed over, still to come
        self._final: list[list[int]] = []  # buckets held for the end of backward, then checked: stepped at the step
        self._joined = 0  # bytes of the buckets that joined the held one (see [final buckets])
        self._final_views: list[Tensor] | None = None  # the working gradients of the last bucket checked
        self._bucket: list[int] = []
        self._bucket_bytes = 0
        self._where: dict[int, tuple[int, int]] = {}  # id(master) -> (param group, position in it)

    # --- main thread ---------------------------------------------------------------------------------------------
    def arm(self, optimizer: Optimizer, *, clip_norm: float | None, guard: bool, clip_value: float | None = None,
            scaler: Any = None, settle: bool = False, stager: StreamTransfer | None = None,
            uploader: Uploader | None = None) -> None:
        """The next backward is the last of the window: its gradients go to the worker (see :meth:`submit`).

        ``clip_norm``/``clip_value``: the Trainer's ``gradient_clip_val`` under the ``"norm"``/``"value"`` algorithm;
        ``scaler``: the fp16 loss scaler (its ``unscale_`` and ``scale``), whose scale holds until the step;
        ``settle``: code reads the gradients after the step, so a step that stands unscales and clamps them then;
        ``stager``: the CUDA transfer, whose staging slots each stepped bucket's rounded weights are written into
        (:meth:`~lightning_lowmem.strategies.offload.transfer.StreamTransfer.stage_weights`);
        ``uploader``: uploads each bucket as it steps, from the second window on (see [upload in backward]).
        """
        if clip_norm is not None and clip_value is not None:
            raise ValueError(f"HostPass.arm(clip_norm={clip_norm!r}, clip_value={clip_value!r}): give at most one.")
        self._clear()
        self.optimizer, self.clip_norm, self.guard, self.armed = optimizer, clip_norm, guard, True
        self.clip_value = None if clip_value is None else float(clip_value)
        self.scaler, self.settle, self.stager = scaler, settle, stager
        self.uploader = uploader if self._expect and not self._uploads.rereads else None
        # NOTE: where each parameter sits in the groups, once per window: a bucket's subset of the groups is built from
        # it (a scan of every group per bucket cost ~4 % of the worker's time for 2400 parameters in 120 buckets)
        self._where = {id(p): (g, k) for g, group in enumerate(optimizer.param_groups) for k, p in enumerate(group["params"])}

    @property
    def uploaded(self) -> set[int]:
        """Masters whose compute weights the worker uploaded in this backward (see [upload in backward])."""
        return self._uploads.uploaded

    def arrived(self, i: int) -> None:
        """Master ``i``'s gradient hook fired (autograd thread; the gradient may reach :meth:`submit` later)."""
        if self.armed and not self.finished:
            self._uploads.arrive(i)

    def written(self, indices: list[int]) -> None:
        """Other code wrote compute weights ``indices`` in this window (found at the step): the pass is undone."""
        self._uploads.check_written(indices)
        self.restore("compute weights written by other code before the step")

    def explain(self, err: RuntimeError) -> RuntimeError | None:
        """Ours for autograd's in-place error in a backward in which the worker uploaded weights (else None)."""
        return self._uploads.explain(err) if self.armed else None

    def submit(self, i: int, grad: Tensor, nbytes: int = 0) -> bool:
        """Hand master ``i``'s gradient to the worker (it folds it); False when not armed (the caller folds).
        ``nbytes``: what handing it over keeps alive (a staging slot: nothing)."""
        if not self.armed or self.finished:
            return False
        if i in self._submitted:
            self.failed = self.failed or "a gradient arrived twice in one backward"
        self._submitted.add(i)
        self._worker.submit(self._take, i, grad, nbytes=nbytes)
        return True

    @property
    def worker_threads(self) -> set[int]:
        """Idents of the threads that ran pass work (tests)."""
        return self._worker.threads

    def finish(self) -> None:
        """After backward: step what is left (on the worker) and wait for it; re-raise the worker's error."""
        if not self.armed or self.finished:
            return
        self._worker.submit(self._tail)
        self.finished = True
        self._worker.wait()

    def barrier(self) -> None:
        """Wait until the worker has read every gradient handed to it (a staging slot is about to be rewritten)."""
        self._worker.wait()

    def clip_stands(self, clip_val: float, algorithm: Any) -> bool:
        """Whether the pass's step already is the step after this clip (the speculative step stands).

        NOTE: a value clip stands when it is the one armed: every bucket stepped with its gradients clamped. A norm
        clip stands when it leaves the gradients unchanged: the total norm and coefficient are
        ``torch.nn.utils.clip_grad_norm_``'s, from the same per-tensor norms in the same order, and a coefficient
        clamped to 1 multiplies by 1.0, which changes no bit. Otherwise the pass is undone here, before the real clip
        runs on the untouched gradients.
        """
        armed = ("norm", self.clip_norm) if self.clip_norm is not None else ("value", self.clip_value)
        if (not self.finished or self.failed or armed[1] is None or algorithm != armed[0]
                or float(armed[1]) != float(clip_val)):
            self.restore(self.failed or "clipping other than the one armed")
            return False
        if algorithm == "value":
            self._skipped.append("clip")
            return True
        norms = [self._norms[i] for i in self._order() if i in self._norms]
        if norms:
            total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
            coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
            if not bool(coef == 1.0):
                self.restore("the gradient norm clip triggered")
                return False
        return True

    def unscale_stands(self) -> bool:
        """Whether the pass's step already is the step after the fp16 unscale and found no overflow (the real
        gradients stay scaled until a restore unscales them), else it is undone here, before the real unscale."""
        if not self.finished or self.failed or self.scaler is None:
            self.restore(self.failed or "not armed for the loss scaler")
            return False
        self._skipped.append("unscale")
        return True

    def stands(self) -> bool:
        """At the step: whether the pass stepped every master as the serial step would (else it is undone)."""
        if not self.armed or not self.finished:
            return False
        if self.failed or self.restored:
            self.restore(self.failed or "restored")
            return False
        if self._final:
            self._worker.submit(self._step_final)
            self._worker.wait()
        self.taken = True
        if self.settle:
            self._redo_skipped()  # NOTE: plain Lightning's hooks after the step see unscaled, clamped gradients
        return True

    def restore(self, why: str) -> None:
        """Put back the masters and optimizer state the pass changed (from its copies); the serial step follows."""
        self.failed = self.failed or why
        if self.restored or self.optimizer is None:
            return
        if self.taken:
            raise RuntimeError(f"HostPass.restore({why!r}) after the step took the pass's result (`stands`): the final "
                               "buckets stepped then, without a copy to restore them from.")
        self.barrier()
        for i in reversed(self._stepped):
            self._kept.put_back(i, self.masters.p_host[i], self.optimizer.state)
        if self.stager is not None:
            self.stager.unstage()  # NOTE: the staging slots hold the speculative weights: the upload rounds them again
        self._stepped, self._final = [], []  # NOTE: the final buckets never stepped (see `_tail`)
        self.restored = True
        if self.uploaded and self.uploader is not None:
            # NOTE: those compute weights hold the speculative step: back to the masters put back (the step that follows
            # may be skipped, or never come)
            self.uploader(sorted(self.uploaded), False)
        self.uploaded.clear()
        self._redo_skipped()

    @torch.no_grad()
    def _redo_skipped(self) -> None:
        """Give the real gradients what the pass stood in for (before the serial step, or for code that reads them
        after the step): the fp16 unscale, then the value clip, as ``MasterHalfPrecision.optimizer_step`` runs them,
        over the optimizer's parameters."""
        assert self.optimizer is not None
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if "unscale" in self._skipped:
            self.scaler.unscale_([p.grad for p in params if p.grad is not None])  # NOTE: the pass found no overflow
        if "clip" in self._skipped:
            torch.nn.utils.clip_grad_value_(params, self.clip_value)  # type: ignore[arg-type]
        self._skipped = []

    def disarm(self) -> None:
        """End the window. NOTE: a window whose step did not take the pass's result (backward raised, an
        out-of-memory retry, a step that never came) gets its masters and state back: nothing stepped is left."""
        if self.armed:
            with contextlib.suppress(Exception):
                self._worker.wait()  # NOTE: an error of the worker was raised by `finish` or is moot now
            if not self.taken:
                self.restore("the step did not take the pass's result")
        self.armed = False
        self._clear()

    def close(self) -> None:
        self.disarm()
        self._worker.close()
        self._kept.clear()
        self._working.clear()

    # --- the worker ------------------------------------------------------------------------------------------------
    def _order(self) -> list[int]:
        """Every master the optimizer holds, in its param order (the order of the serial clip's norms)."""
        assert self.optimizer is not None
        index = self.masters.host_index
        return [index[id(p)] for g in self.optimizer.param_groups for p in g["params"] if id(p) in index]

    def _take(self, i: int, grad: Tensor) -> None:
        self.masters.fold(i, grad)
        self._taken[i] = self.masters.p_host[i].numel() * 4
        self._left -= self._expect.get(i, 0)
        if self.failed:
            return
        if i in self._run:
            self.failed = "a gradient arrived after its parameter stepped"
            return
        self._add(i)

    def _capacity(self) -> int:
        """Bytes at which the bucket being filled closes: ``bucket_bytes``, then half of what the last backward still
        handed over after this point, down to a sixteenth of ``bucket_bytes``.

        NOTE: [shrinking buckets] what is left after backward is the final buckets' step, so they should be small; but
        each bucket costs a fixed ~0.4 ms of worker time (its step call, its norms), which adds up where the host step
        is the bottleneck (a GPU's backward outruns it). Halving near the end makes the final buckets small for a few
        buckets more (log2(16) at most).
        """
        if not self._expect:
            return self.bucket_bytes
        return max(min(self.bucket_bytes, self._left // 2), self.bucket_bytes // 16, 1)

    def _add(self, i: int) -> None:
        self._bucket.append(i)
        self._bucket_bytes += self.masters.p_host[i].numel() * 4
        capacity = self._capacity()
        if self._bucket_bytes < capacity:
            return
        if not self._expect or self._left >= max(capacity, self._bucket_bytes):
            self._run_bucket()
            return
        # NOTE: [final buckets] less than this bucket (or than the next one) is still to come by what the last backward
        # handed over: backward is about to end, and a speculative step would end after it, its copies included. The
        # bucket is held for the end of backward (see `_tail`): GPT-2's tied embedding (38.6M values), whose gradient
        # lands last but for the position embedding's, is one. The buckets that close after it join it up to
        # ``bucket_bytes`` in all; past that (more gradients came than the last backward had) the held one runs now,
        # speculatively as usual, and the new one is held instead.
        if self._final and self._joined + self._bucket_bytes <= self.bucket_bytes:
            self._final[-1] += self._bucket
            self._joined += self._bucket_bytes
        else:
            if self._final:
                self._run_bucket(self._final.pop())
            self._final.append(self._bucket)
            self._joined = 0
        self._bucket, self._bucket_bytes = [], 0

    def _tail(self) -> None:
        """After backward: check the final buckets (the held one, the last); `stands` steps them, copying nothing."""
        done = self._run.union(self._bucket, *self._final)
        p_host = self.masters.p_host
        # NOTE: parameters whose gradient came only from earlier micro-batches of the window step too (serially they
        # do: their `.grad` is set), in buckets of the same size (what a bucket holds at once stays bounded)
        for i in self._order():
            if i not in done and p_host[i].grad is not None:
                self._add(i)
        final, self._final = [*self._final, self._bucket], []
        self._bucket, self._bucket_bytes = [], 0
        for bucket in final:
            bucket = [i for i in bucket if p_host[i].grad is not None]
            self._run.update(bucket)
            if bucket and not self.failed:
                self._final_views = self._check(bucket)
                self._final.append(bucket)
        self._expect = dict(self._taken)  # NOTE: after the leftovers above: their buckets still went by the old one

    def _step_final(self) -> None:
        """Step the final buckets (at the step, once the speculation stands): no copy is kept, nothing can undo them."""
        final, self._final = self._final, []
        views, self._final_views = self._final_views, None
        for k, bucket in enumerate(reversed(final)):
            # NOTE: the working buffer holds the last bucket checked, which steps first (each element's update is its
            # own); an earlier one makes its copies again (the same kernels, the same values; `_check` found no overflow)
            self._step(bucket, views if k == 0 else self._working_grads(bucket))
            self._stage(bucket)

    @torch.no_grad()
    def _run_bucket(self, bucket: list[int] | None = None) -> None:
        """Check and step ``bucket`` (the one being filled) speculatively, keeping a copy of what it changes."""
        if bucket is None:
            bucket, self._bucket, self._bucket_bytes = self._bucket, [], 0
        p_host = self.masters.p_host
        bucket = [i for i in bucket if p_host[i].grad is not None]
        self._run.update(bucket)
        if self.failed or not bucket:
            return
        grads = self._check(bucket)
        if self.failed:
            return
        self._keep(bucket)
        self._step(bucket, grads)
        self._stage(bucket)
        if self.uploader is not None and not self.failed:
            self.uploaded.update(bucket)  # NOTE: before the copies are queued (`arrived` reads it on another thread)
            self.uploader(bucket, True)

    def _stage(self, bucket: list[int]) -> None:
        """Round ``bucket``'s stepped masters into the transfer's staging slots: the upload only copies them then."""
        if self.stager is not None:
            self.stager.stage_weights([(i, self.masters.p_host[i]) for i in bucket])

    @torch.no_grad()
    def _check(self, bucket: list[int]) -> list[Tensor] | None:
        """``_working_grads``, then the norms; ``failed`` where a non-finite gradient means the step cannot stand."""
        grads = self._working_grads(bucket)
        if self.failed:
            return None
        if self.guard or self.clip_norm is not None:
            read = [self.masters.p_host[i].grad for i in bucket] if grads is None else grads
            norms = torch_internals.foreach_norm(read)  # type: ignore[arg-type]
            self._norms.update(zip(bucket, norms))
            if not bool(torch.stack(norms).isfinite().all()):
                self.failed = "a non-finite gradient"  # NOTE: serially the guard (or a nan clip) skips the step
        return grads

    def _working_grads(self, bucket: list[int]) -> list[Tensor] | None:
        """fp16, value clipping: ``bucket``'s gradients unscaled, then clamped (``MasterHalfPrecision``'s order), in copies."""
        if self.clip_value is None and self.scaler is None:
            return None
        grads = self._working.views([self.masters.p_host[i].grad for i in bucket],  # type: ignore[misc]
                                    self.clip_value if self.scaler is None else None)
        if self.scaler is not None:
            if self.scaler.unscale_(grads):  # NOTE: the scaler's own kernel
                self.failed = "an fp16 gradient overflow"  # NOTE: serially the scaler skips the step
                return None
            if self.clip_value is not None:
                for g in grads:
                    g.clamp_(min=-self.clip_value, max=self.clip_value)
        return grads

    def _keep(self, bucket: list[int]) -> None:
        assert self.optimizer is not None
        for i in bucket:
            self._kept.keep(i, self.masters.p_host[i], self.optimizer.state)
            self._stepped.append(i)

    def _step(self, bucket: list[int], grads: list[Tensor] | None) -> None:
        """``optimizer.step()`` over the masters of ``bucket`` only (their groups' hyperparameters, their state),
        with ``grads`` in place of their gradients for that step when given."""
        optimizer = self.optimizer
        assert optimizer is not None
        p_host = [self.masters.p_host[i] for i in bucket]
        landed = [p.grad for p in p_host]
        if grads is not None:
            for p, g in zip(p_host, grads):
                p.grad = g
        groups = optimizer.param_groups
        chosen: dict[int, list[Tensor]] = {}
        for g, k in sorted(self._where[id(p)] for p in p_host if id(p) in self._where):  # in the groups' order
            chosen.setdefault(g, []).append(groups[g]["params"][k])
        subset = [{**groups[g], "params": params} for g, params in chosen.items()]
        # NOTE: the main thread does not read the param groups while backward runs (it waits in `finish`)
        optimizer.param_groups = subset
        try:
            optimizer.step()
        finally:
            optimizer.param_groups = groups
            for p, g in zip(p_host, landed):
                p.grad = g


__all__ = ["HOST_PASSES", "HostPass", "HostPassMode"]

"""The upload in backward of the overlapped host pass (:mod:`~lightning_lowmem.strategies.offload.host_pass`).

[upload in backward] From the second window on, each bucket that steps during backward also goes into its compute
weights at once (CUDA: a copy queued on the side stream, DMA while backward computes; the plain CPU path: the cast, on
the worker), so what is left to upload at the step is the final buckets. Exact because a weight's gradient hook fires
after every node of the backward that reads it has run: nothing in this backward reads it again. The exceptions, each
found, none assumed away (:class:`BackwardUploads` keeps the books):

- a gradient that arrives twice in one backward (a weight shared by two reentrant-checkpointed blocks: the second
  block's recompute reads the weight after its first gradient landed): the first window, which never uploads, finds
  it, and the run then never uploads during backward; found later (the graph changed) after the weight was uploaded,
  :meth:`BackwardUploads.arrive` raises;
- a compute weight written by other code during backward: never uploaded over (the step adopts the write); written
  after its upload, :meth:`BackwardUploads.check_written` raises (the write may have read the new value);
- a weight saved for backward through ``detach()`` and read after its gradient landed: it shares the version counter
  the upload bumps, so autograd raises; :meth:`BackwardUploads.explain` names our upload as the cause.

Under ``offload_params`` a streamed weight's upload rounds its master into its host copy, read by the next forward's
fetch (see ``upload_in_backward`` in :mod:`~lightning_lowmem.strategies.offload.stream_values`). A restore puts the
uploaded weights back from the masters it put back. A module with a backward hook keeps every upload at the step (the
strategy does not pass the uploader). The hazard left: code that reads a weight in backward without autograd knowing (a
tensor hook, a process-wide module backward hook, a tensor saved through ``.data``) sees the new value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lightning_lowmem.core.reentrant import reentrant_fix


class BackwardUploads:
    """Which compute weights the host pass's worker uploaded in this backward, and which gradients arrived in it.

    Saves: nothing (bookkeeping for the upload in backward, see the module docstring). Costs: two sets of indices.

    Example:
        >>> uploads = BackwardUploads(lambda i: ["w", "b"][i])
        >>> uploads.arrive(0); uploads.uploaded.add(0); uploads.arrive(1)
        >>> uploads.check_written([1])  # written before its upload: the step adopts the write
        >>> uploads.check_written([0])
        Traceback (most recent call last):
          ...
        RuntimeError: lowmem_offload(host_pass='overlap'): `w` was written in place during backward (by a hook?) after the pass had uploaded its new value: the write may have read that value, so this step cannot match plain Lightning's. Write weights in `on_train_batch_end` (or under `with trainer.strategy.masters_view(write_back=True):`), or pass `OffloadStrategy(host_pass='serial')`.
    """

    def __init__(self, name: Callable[[int], str]) -> None:
        self.name = name
        self.rereads = False  # a gradient arrived twice in one backward: no upload during backward for the run
        self.clear()

    def clear(self) -> None:
        """A new backward."""
        self.uploaded: set[int] = set()  # masters whose compute weights the worker wrote in this backward
        self._arrived: set[int] = set()

    def arrive(self, i: int) -> None:
        """Master ``i``'s gradient hook fired (on the autograd thread). A second time in one backward after its upload
        raises: the backward in between may have read the new weight."""
        if i in self._arrived:
            self.rereads = True
            if i in self.uploaded:
                raise RuntimeError(
                    f"lowmem_offload(host_pass='overlap'): the gradient of `{self.name(i)}` arrived twice in one "
                    "backward, after its new value was uploaded: the backward in between (a weight shared by two "
                    "reentrant-checkpointed blocks recomputes it) may have read the new weight, so this step cannot "
                    "match plain Lightning's. The first steps showed no such weight (the graph changed). "
                    + reentrant_fix("pass `OffloadStrategy(host_pass='serial')`"))
        self._arrived.add(i)

    def check_written(self, indices: Iterable[int]) -> None:
        """Other code wrote compute weights ``indices`` during this window: raise for one uploaded already."""
        late = sorted(self.uploaded.intersection(indices))
        if late:
            raise RuntimeError(
                f"lowmem_offload(host_pass='overlap'): `{self.name(late[0])}` was written in place during backward (by "
                "a hook?) after the pass had uploaded its new value: the write may have read that value, so this step "
                "cannot match plain Lightning's. Write weights in `on_train_batch_end` (or under `with "
                "trainer.strategy.masters_view(write_back=True):`), or pass `OffloadStrategy(host_pass='serial')`.")

    def explain(self, err: RuntimeError) -> RuntimeError | None:
        """Ours for autograd's in-place error in a backward in which the worker uploaded weights (else None)."""
        if not self.uploaded or "modified by an inplace operation" not in str(err):
            return None
        return RuntimeError(
            "lowmem_offload(host_pass='overlap'): autograd found a tensor it saved for backward changed in place. The "
            "pass uploads each bucket's new weights during backward once their gradients have landed, and this "
            "backward read one of them after that: a weight saved through `detach()` (which shares the weight's "
            "version counter) or used by a recomputed block. Read the weight through its parameter, or pass "
            f"`OffloadStrategy(host_pass='serial')`. Autograd said: {err}")


__all__ = ["BackwardUploads"]

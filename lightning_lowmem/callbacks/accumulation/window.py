"""The window edges, the loader check and the mid-window checkpoint of ``AccumulationScheduler`` (private helper).

A checkpoint can be written inside an accumulation window: ``ModelCheckpoint(train_time_interval=...)``, a
validation every ``val_check_interval`` batches that does not fall on a window edge, a SLURM requeue, a user's
``trainer.save_checkpoint`` in a hook. Lightning keeps no gradients in a checkpoint, so a resume from it continued
the window with the micro-batches after the save only, and the step differed from the uninterrupted run's.
:func:`window_state` puts the window in the callback's state (its counts and the gradients accumulated so far,
copied to the host: a checkpoint written mid-window is larger by one gradient per trainable parameter), and
:func:`restore_window` puts them back before the first batch of the resumed run, so the step is the same.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

#: NOTE: where the window's state cannot be written in one process's checkpoint
_NOT_SAVED = {
    "engine": "DeepSpeed keeps the window's gradients in its own buffers and does not checkpoint them",
    "world": "each process holds its own part of the window's gradients until the step, and the checkpoint is "
             "written by one of them",
}


def lightning_accumulation(
    batch_idx: int, ready: int, first: bool, last: bool, epoch_end: bool, window: int
) -> tuple[int, bool]:
    """The ``trainer.accumulate_grad_batches`` that makes Lightning zero and step exactly at this window's edges.

    Lightning zeroes the gradients before a batch when ``batch_idx % N == 0`` and steps after it when
    ``ready % N == 0`` or the epoch ends. Returns ``(N, zero_here)``: ``zero_here`` says the caller must zero
    the gradients itself (a window's first batch where no ``N`` makes Lightning do it without breaking the rest).
    ``N`` is ``window`` whenever that gives the right edges (windows aligned with ``batch_idx``).
    """
    for n in (window, ready, ready + 1):
        zeroes = batch_idx % n == 0
        steps = ready % n == 0 or epoch_end
        if steps == last and (first or not zeroes):
            return n, first and not zeroes
    raise RuntimeError(f"no accumulation value fits batch {batch_idx} (ready {ready}, first {first}, last {last})")


def check_first_batch(callback: Any, batch_size: int) -> None:
    """Refuse a loader whose batches are not the micro-batch the callback chose (checked on the epoch's first batch).

    NOTE: ``lightning_setattr`` also sets ``hparams.batch_size`` when only the hyper-parameters have one; a loader
    built with a fixed size then ignores it, and the run would accumulate the wrong effective batch.
    """
    if batch_size == callback._micro:
        return
    where = f"set `{callback.batch_arg_name}={callback._micro}` on the LightningModule or DataModule, but"
    if not callback._sets_loader:
        where = f"needs micro-batches of {callback._micro}, but neither the LightningModule nor the DataModule has a " \
                f"`{callback.batch_arg_name}` attribute for it to set, and"
    raise ValueError(
        f"AccumulationScheduler {where} the train loader gives batches of {batch_size}, so each optimizer step would "
        f"hold {batch_size}/{callback._micro} of `effective_batch_size`. Build the loader from that attribute "
        f"(`DataLoader(..., batch_size=self.{callback.batch_arg_name})`, or `self.hparams.{callback.batch_arg_name}` "
        "if it lives in the hyper-parameters), or pass `micro_batch_size` equal to the loader's batch size."
    )


def window_state(callback: Any, trainer: Any) -> dict[str, Any] | None:
    """The window in progress (None at a window edge): counts, the normalisation factor, the gradients so far."""
    if callback._pos == 0 or trainer is None:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    if progress.ready != progress.processed:
        # NOTE: inside a batch (the out-of-memory splitter's emergency checkpoint of the last completed step): the
        # window's counts already hold part of this batch; such a checkpoint resumes as it did before, without them
        return None
    reason = "engine" if callback._engine else "world" if trainer.world_size > 1 else None
    if reason is not None:
        rank_zero_warn(
            f"AccumulationScheduler: a checkpoint is being written inside an accumulation window ({callback._pos} of "
            f"{callback._window} micro-batches done), but {_NOT_SAVED[reason]}: a resume from it continues the window "
            "without them, so its next optimizer step differs from an uninterrupted run's. Save on window edges "
            "(`ModelCheckpoint(every_n_train_steps=...)`)."
        )
        return None
    grads = [
        None if p.grad is None else p.grad.detach().to("cpu", copy=True)
        for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]
    ]
    count = callback._count
    return {
        "pos": callback._pos, "window": callback._window, "samples": callback._samples,
        "micro_batches": callback._micro_batches,
        "count": float(count) if isinstance(count, torch.Tensor) else count, "count_is_tensor": isinstance(count, torch.Tensor),
        "k": None if callback._k is None else float(callback._k),
        "k_dtype": None if callback._k_loss is None else str(callback._k_loss.dtype).removeprefix("torch."),
        "grads": grads,
    }


def restore_window(callback: Any, trainer: Any, state: dict[str, Any]) -> None:
    """Put a window saved by :func:`window_state` back (after the optimizers and their state are restored)."""
    params = [p for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]]
    grads = state["grads"]
    mismatch = len(grads) != len(params) or any(
        g is not None and tuple(g.shape) != tuple(p.shape) for g, p in zip(grads, params))
    if mismatch:
        raise ValueError(
            f"AccumulationScheduler: the checkpoint was written inside an accumulation window and holds its gradients "
            f"for {len(grads)} parameters, but the optimizers of this run have {len(params)} (or other shapes): it "
            "was written by another model or `configure_optimizers`. Resume with the model that wrote it."
        )
    device = trainer.strategy.root_device
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(device=p.device)  # NOTE: in the dtype it had (bf16-true: bf16)
    callback._pos, callback._window = state["pos"], state["window"]
    callback._samples, callback._micro_batches = state["samples"], state["micro_batches"]
    count = state["count"]
    callback._count = torch.tensor(count, dtype=torch.float64, device=device) if state["count_is_tensor"] else count
    if state["k"] is not None:
        callback._k = torch.tensor(state["k"], dtype=torch.float64, device=device)
        callback._k_loss = callback._k.to(getattr(torch, state["k_dtype"]))
    callback._last = False
def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _int(value) and value > 0


def _divisibility_message(effective: int, micro: int, world: int) -> str:
    """Say why ``effective`` does not split into micro-batches, and the nearest values that do."""
    unit = micro * world
    below, above = (effective // unit) * unit, (effective // unit + 1) * unit
    nearest = f"{below} or {above}" if below else f"{above}"
    msg = (
        f"`effective_batch_size` {effective} is not a multiple of micro-batch {micro} x world size {world} = {unit}: "
        f"the nearest valid effective batch sizes are {nearest}"
    )
    if effective % world == 0:
        per_process = effective // world
        divisors = [d for d in range(1, per_process + 1) if per_process % d == 0]
        smaller = [d for d in divisors if d < micro]
        larger = [d for d in divisors if d > micro]
        options = [str(d) for d in (smaller[-1:] + larger[:1])]
        msg += f", or keep {effective} with micro-batch {' or '.join(options)}"
    return msg



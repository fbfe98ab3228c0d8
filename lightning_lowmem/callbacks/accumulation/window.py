"""The accumulation window of ``AccumulationScheduler``: its edges, its counts, the weight of each micro-batch's
gradient and the factor of the optimizer step.

NOTE: [exact normalisation] The step must get the gradient of the mean over every sample (``"samples"``: each
micro-batch's mean loss weighted by its samples) or every token (``"tokens"``: each micro-batch's sum of token
losses) of the window, over every process. Lightning divides each micro-batch's loss by
``trainer.accumulate_grad_batches`` (``N``) and DDP averages the gradients over the ``P`` processes. A tensor hook on
the loss Lightning hands to ``on_before_backward`` multiplies the gradient flowing from it by
``h = N * u / (reference * size)`` (``u``: the micro-batch's samples, 1 for tokens; ``reference``: the samples of one
micro-batch, or the power of two nearest its mean tokens; ``size``: the window's micro-batches), and before the step the accumulated
gradients take ``F = reference * size * P / total`` (``total``: the window's samples or tokens, every process). Equal
micro-batches in a full window make both exactly 1, and nothing is multiplied: the step is plain Lightning's
``accumulate_grad_batches``, bit for bit. A short or uneven window (the epoch's last), or token counts, is exact up to
the rounding of one more multiply. The forward values (``outputs["loss"]``, what ``self.log`` records) are untouched.
Hazard: ``on_before_optimizer_step`` of a callback listed before the scheduler would see the gradients before ``F``
(the scheduler refuses that order at setup).

NOTE: [mid-window checkpoint] A checkpoint can be written inside a window (``ModelCheckpoint(train_time_interval=
...)``, a validation off the window's edge, a SLURM requeue). Lightning keeps no gradients in a checkpoint, so the
scheduler saves the window (:meth:`Window.state_dict`, and the gradients so far, copied to the host) and puts it back
before the resumed run's first batch, so its step is the uninterrupted one's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class WindowStats:
    """What the last optimizer step was built from, summed over every process."""

    micro_batches: int
    samples: int
    tokens: torch.Tensor | None  # 0-dim, on the device (read it with ``int(...)``: a sync on CUDA)


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


class Window:
    """One accumulation window (see the module's notes): where it is, what its backward passes counted."""

    def __init__(self, tokens: bool) -> None:
        self.tokens = tokens
        self.pos = 0  # the position of the next micro-batch in the window
        self.size = 0  # micro-batches the window holds (fixed at its first)
        self.last = False  # the micro-batch under way closes the window
        #: samples (an int) or mean tokens (a float64 device tensor) of one micro-batch: the unit of the weights
        self.reference: Any = None
        self.pending: tuple[int, Any] | None = None  # (samples, count) of the micro-batch whose backward comes next
        self.stats: WindowStats | None = None  # what the last step was built from
        self.reset()

    def reset(self) -> None:
        """Forget the counts (after a step)."""
        self.samples = 0
        self.micro_batches = 0
        self.count: Any = 0  # samples or tokens backpropagated in this window, this process

    def start_epoch(self) -> None:
        """A new window (Lightning steps at the end of every epoch: windows never cross epochs)."""
        self.pos, self.pending = 0, None
        self.reset()

    def advance(self, size: int, batch_idx: int, ready: int, epoch_end: bool, counts: tuple[int, Any]) -> tuple[int, bool]:
        """Place the next micro-batch and hold its ``(samples, count)`` for its backward; ``size``: the micro-batches
        of the window it opens, if it does. Returns :func:`lightning_accumulation`'s ``(N, zero_here)``."""
        if self.pos == 0:
            self.size = size
        first, self.last = self.pos == 0, self.pos == self.size - 1 or epoch_end
        self.pos = 0 if self.last else self.pos + 1
        self.pending = counts
        return lightning_accumulation(batch_idx, ready, first, self.last, epoch_end, self.size)

    def weigh(self, accumulation: int, size: int, world_mean: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """Count the micro-batch whose backward starts; the factor ``h`` of its gradient (None: exactly 1)."""
        samples, count = self.pending  # type: ignore[misc]
        self.pending = None
        self.samples += samples
        self.micro_batches += 1
        self.count = self.count + count
        if self.reference is None:  # tokens, the first micro-batch of the run: its mean count over processes
            self.reference = _power_of_two(world_mean(count.clamp(min=1)))
        h = accumulation * (1 if self.tokens else samples) / (self.reference * size)
        return None if isinstance(h, float) and h == 1.0 else h

    def step_factor(self, world: int, world_sum: Callable[[torch.Tensor], torch.Tensor], device: Any) -> Any:
        """The factor ``F`` of the window's gradients (None: exactly 1); :attr:`stats` and the next reference set."""
        total, samples = self.count, self.samples
        if world > 1:  # NOTE: one all_reduce of two scalars per optimizer step (a sync point)
            both = torch.stack([torch.as_tensor(total, dtype=torch.float64, device=device),
                                torch.tensor(float(samples), dtype=torch.float64, device=device)])
            total, samples = world_sum(both).unbind()
        factor = self.reference * self.size * world / (total.clamp(min=1) if self.tokens else total)
        self.stats = WindowStats(self.micro_batches * world, int(samples), total if self.tokens else None)
        if self.tokens:  # NOTE: keeps the backpropagated gradients O(mean loss) (fp16 headroom) in the next window
            self.reference = _power_of_two(total.clamp(min=1) / (self.micro_batches * world))
        self.reset()
        return None if isinstance(factor, float) and factor == 1.0 else factor

    # --- [mid-window checkpoint] ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "size": self.size, "samples": self.samples, "micro_batches": self.micro_batches,
                "count": float(self.count), "reference": None if self.reference is None else float(self.reference)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos, self.size = state["pos"], state["size"]
        self.samples, self.micro_batches = state["samples"], state["micro_batches"]
        self.count = state["count"] if self.tokens else int(state["count"])  # NOTE: a float joins the next count
        if self.tokens:
            self.reference = state["reference"]
        self.last = False


def _power_of_two(mean: torch.Tensor) -> torch.Tensor:
    """The power of two nearest ``mean`` (on its device, no sync).

    NOTE: the tokens' reference: ``h = N / (reference * size)`` is then exact in any float dtype of the loss (``N ==
    size`` in an aligned window), so ``F`` divides out exactly the factor the gradients took (bf16-true: a mean
    token count would round in bf16 and scale the step by up to 2^-9).
    """
    return torch.exp2(torch.round(torch.log2(mean)))


def optimized_params(optimizers: list[Any]) -> list[torch.Tensor]:
    """What the optimizers step (under ``lowmem_offload`` the host masters), in order."""
    return [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]


def saved_gradients(optimizers: list[Any]) -> list[torch.Tensor | None]:
    """The window's gradients so far, copied to the host (a mid-window checkpoint holds them)."""
    return [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in optimized_params(optimizers)]


def restore_gradients(optimizers: list[Any], grads: list[torch.Tensor | None]) -> None:
    """Put :func:`saved_gradients` back (after the optimizers and their state are restored)."""
    params = optimized_params(optimizers)
    if len(grads) != len(params) or any(g is not None and g.shape != p.shape for g, p in zip(grads, params)):
        raise ValueError(
            f"AccumulationScheduler: the checkpoint was written inside an accumulation window and holds its gradients "
            f"for {len(grads)} parameters, but the optimizers of this run have {len(params)} (or other shapes): it "
            "was written by another model or `configure_optimizers`. Resume with the model that wrote it."
        )
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(device=p.device)  # NOTE: in the dtype it had (bf16-true: bf16)


__all__ = ["Window", "WindowStats", "lightning_accumulation", "restore_gradients", "saved_gradients"]

"""``AccumulationScheduler``'s window: edges, counts, weights ``h``, factor ``F`` (docs/techniques/accumulation.md).

NOTE: [exact normalisation] ``h`` and ``F`` are exactly 1 for equal micro-batches of a full window; a callback's
``on_before_optimizer_step`` listed before the scheduler sees gradients before ``F`` (refused at setup).
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


def lightning_accumulation(batch_idx: int, ready: int, first: bool, last: bool, epoch_end: bool,
                           window: int) -> tuple[int, bool]:
    """``(N, zero_here)``: the ``accumulate_grad_batches`` that makes Lightning zero (``batch_idx % N == 0``) and step
    (``ready % N == 0`` or the epoch's end) exactly at this window's edges (``window`` where that works), and whether
    the caller must zero the gradients itself (a window's first batch that no ``N`` zeroes)."""
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
        """Place the next micro-batch, hold its counts for its backward; :func:`lightning_accumulation`'s result."""
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
    """The power of two nearest ``mean`` (no sync): the tokens' reference, so ``h`` is exact in any float dtype."""
    return torch.exp2(torch.round(torch.log2(mean)))


def _optimized_params(optimizers: list[Any]) -> list[torch.Tensor]:
    return [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]


def saved_gradients(optimizers: list[Any]) -> list[torch.Tensor | None]:
    """The window's gradients so far, copied to the host (a mid-window checkpoint holds them)."""
    return [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in _optimized_params(optimizers)]


def restore_gradients(optimizers: list[Any], grads: list[torch.Tensor | None]) -> None:
    """Put :func:`saved_gradients` back (after the optimizers and their state are restored)."""
    params = _optimized_params(optimizers)
    if len(grads) != len(params) or any(g is not None and g.shape != p.shape for g, p in zip(grads, params)):
        raise ValueError(
            f"AccumulationScheduler: the checkpoint was written inside an accumulation window and holds its gradients "
            f"for {len(grads)} parameters, but the optimizers of this run have {len(params)} (or other shapes): it "
            "was written by another model or `configure_optimizers`. Resume with the model that wrote it."
        )
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(device=p.device)  # NOTE: in the dtype it had (bf16-true: bf16)


__all__ = ["Window", "WindowStats", "lightning_accumulation", "restore_gradients", "saved_gradients"]

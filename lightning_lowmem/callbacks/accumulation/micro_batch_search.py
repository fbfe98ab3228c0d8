"""The search behind ``AccumulationScheduler(micro_batch_size="auto", measure=...)``: the largest micro-batch whose
measured peak fits the budget.

NOTE: [no trial steps] The measurement is the caller's: a function of the micro-batch returning the peak bytes of a
training step (``None``: it does not run). The scheduler does not run ``training_step`` outside Lightning's loop
(such a trial changes the module, its RNG, its metrics and logs, which would then have to be undone one by one);
a dry run of the run on a fake copy of the model (``lightning_lowmem.dry_run``) measures without touching it.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_lowmem.core.units import fmt_bytes


def largest_fitting(
    candidates: list[int], budget: int, measure: Callable[[int], int | None]
) -> tuple[int, dict[int, int | None]]:
    """Binary search over ``candidates`` (ascending; the peak assumed to grow with the micro-batch).

    Returns the largest that fits and the peaks measured (``None``: it does not run).

    Raises:
        RuntimeError: even ``candidates[0]`` does not fit, naming what to switch on.
    """
    peaks: dict[int, int | None] = {}

    def fits(m: int) -> bool:
        peaks[m] = measure(m)
        return peaks[m] is not None and peaks[m] <= budget  # type: ignore[operator]

    if not fits(candidates[0]):
        first = peaks[candidates[0]]
        what = "does not run" if first is None else f"peaks at {fmt_bytes(first)}"
        raise RuntimeError(
            f"AccumulationScheduler: a micro-batch of {candidates[0]} {what}, over the budget of {fmt_bytes(budget)}. "
            "Switch on activation checkpointing (`ActivationCheckpointing` callback), keep the optimizer and "
            "fp32 master weights on the host (`strategy='lowmem_offload'`), offload activations "
            "(`ActivationOffload`), or raise `memory_budget`."
        )
    lo, hi = 0, len(candidates)  # candidates[lo] fits; candidates[hi] does not (or is past the end)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(candidates[mid]) else (lo, mid)
    return candidates[lo], peaks


__all__ = ["largest_fitting"]

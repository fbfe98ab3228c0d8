"""The search behind ``AccumulationScheduler(micro_batch_size="auto", measure=...)``: the largest micro-batch whose
measured peak fits the budget. NOTE: [no trial steps] the caller measures (a dry run on a fake copy); a trial
``training_step`` would change the module, its RNG, metrics and logs.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_lowmem.core.units import fmt_bytes


def largest_fitting(candidates: list[int], budget: int,
                    measure: Callable[[int], int | None]) -> tuple[int, dict[int, int | None]]:
    """Binary search over ascending ``candidates``: the largest that fits, and the peaks measured (``None``: fails).
    ``RuntimeError`` when even the first does not fit."""
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

"""The non-finite guard of ``lowmem_offload`` under bf16 and fp32 (fp16's loss scaler skips overflows itself)."""

from __future__ import annotations

import warnings
from typing import Literal, get_args

NonFinite = Literal["skip", "raise", "ignore"]
NONFINITE: tuple[str, ...] = get_args(NonFinite)


class NonFiniteGradientError(FloatingPointError):
    """``lowmem_offload`` refused to step on non-finite (inf/nan) gradients (``nonfinite="raise"``, or too many skips)."""


class NonFiniteGuard:
    """Counts the optimizer steps skipped for inf/nan gradients; warns once; raises per ``mode`` (``"skip"``: after
    ``max_consecutive_skips`` in a row; ``"raise"``: at the first). Memory: none; cost: a few Python numbers.

    Example:
        >>> guard = NonFiniteGuard("raise", max_consecutive_skips=10)
        >>> guard.skipped(["head.weight"], 1, step=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_lowmem.strategies.offload.nonfinite.NonFiniteGradientError: ... at global step 3 in `head.weight` ...
    """

    def __init__(self, mode: NonFinite, max_consecutive_skips: int) -> None:
        self.mode = mode
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0  # over the strategy's life
        self._in_a_row = 0
        self._warned = False

    def stepped(self) -> None:
        self._in_a_row = 0

    def skipped(self, names: list[str], count: int, step: object, partial: bool = False) -> None:
        """A step at global ``step`` was skipped for the non-finite gradients of ``names`` (``count`` in all);
        ``partial``: only those parameters' updates were skipped (the step in backward)."""
        self.skipped_steps += 1
        self._in_a_row += 1
        shown = (n if n.startswith(("the ", "tensor ")) else f"`{n}`" for n in names)
        what = ", ".join(shown) + (f" and {count - len(names)} more" if count > len(names) else "")
        if self.mode == "raise":
            raise NonFiniteGradientError(
                f"lowmem_offload: non-finite (inf/nan) gradient at global step {step} in {what} "
                "(`OffloadStrategy(nonfinite='raise')`). Look for the batch or loss that produced it "
                "(`Trainer(detect_anomaly=True)`), or pass `nonfinite='skip'` to skip such steps."
            )
        if self._in_a_row >= self.max_consecutive_skips:
            raise NonFiniteGradientError(
                f"lowmem_offload: {self._in_a_row} optimizer steps in a row had non-finite (inf/nan) gradients "
                f"(the last at global step {step}, in {what}); training is not progressing. Lower the learning "
                "rate, check the data and the loss for inf/nan (`Trainer(detect_anomaly=True)`), or raise "
                f"`OffloadStrategy(max_consecutive_skips={self.max_consecutive_skips})`."
            )
        if not self._warned:
            self._warned = True
            only = " (optimizer_in_backward: only those parameters' updates were skipped)" if partial else ""
            warnings.warn(
                f"lowmem_offload: non-finite (inf/nan) gradient at global step {step} in {what}: skipped the "
                f"optimizer step{only}; the masters and the optimizer state are unchanged. Skips are counted in "
                "`lowmem/skipped_steps`; this warning is shown once. "
                f"{self.max_consecutive_skips} skips in a row raise an error.",
                RuntimeWarning,
                stacklevel=3,
            )

"""The dry run's refusal, :class:`DryRunUnsupportedError`: in the lowest layer, so that a technique whose own code
cannot run on fake tensors (bitsandbytes' quantized parameters) can refuse a dry run in the dry run's words."""

from __future__ import annotations


class DryRunUnsupportedError(RuntimeError):
    """An op of the model cannot run on fake tensors; names the op and the model's line that called it."""

    def __init__(self, op: str, detail: str, where: str | None) -> None:
        self.op, self.where = op, where
        at = f" at {where}" if where else ""
        super().__init__(
            f"The dry run cannot execute `{op}`{at}: {detail}. Register a fake implementation with "
            "`torch.library.register_fake`, compute it from the batch instead (batch values are real in a dry run), "
            "or estimate in closed form with `estimate_memory(..., method='analytic')`."
        )


__all__ = ["DryRunUnsupportedError"]

"""``OOMRecovery``: removed; the name is kept so that a run naming it is refused with the fix."""

from __future__ import annotations

import lightning as L


class OOMRecovery(L.Callback):
    """Removed: it split a batch that ran out of memory by replacing the strategy's ``training_step`` and ``backward``
    (Lightning has no hook around a failing step). Raises ``ValueError`` with the fix (a lower batch through
    ``AccumulationScheduler``, Lightning's ``OnExceptionCheckpoint``)."""

    def __init__(self, loss_normalization: str = "samples", regrow_after: int | None = None) -> None:
        raise ValueError(
            f"OOMRecovery(loss_normalization={loss_normalization!r}, regrow_after={regrow_after!r}) was removed: "
            "Lightning has no hook around a failing `training_step`, and the split of a batch that ran out of memory "
            "replaced the strategy's `training_step` and `backward`. Lower the batch size whose step runs out of memory "
            "(`lowmem estimate` predicts its peak; `AccumulationScheduler(effective_batch_size=B, micro_batch_size=b)` "
            "keeps the optimizer's batch B), and add Lightning's `OnExceptionCheckpoint` to resume after an error."
        )


__all__ = ["OOMRecovery"]

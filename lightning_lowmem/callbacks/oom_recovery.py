"""``OOMRecovery``: survive an out-of-memory micro-batch without changing the step (runs without accumulation)."""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler, Normalization


class OOMRecovery(AccumulationScheduler):
    """Recover from ``torch.OutOfMemoryError`` in a training step by splitting the batch, keeping the step exact.

    ``AccumulationScheduler(on_oom="split")`` for a run that steps on every batch (no accumulation): when a batch's
    forward or backward runs out of memory, its graph is released and the batch runs as two halves whose gradients
    add up to the batch's (each sample once, the loss normalised over the whole batch), so the optimizer step, the
    LR schedule, the logged loss (once per step: the module's ``self.log`` values of the halves are averaged over
    samples or tokens) and ``global_step`` are those of a run without the error. Later batches run split to that
    size (a log line says so); ``regrow_after`` clean steps try twice the size again. A single sample that does not
    fit saves an atomic emergency checkpoint of the last completed step and raises an error that says what the
    step needed and how to lower it. On CUDA the allocator cache is emptied once per recovery; the count and the
    bytes freed are :attr:`oom_recoveries` / :attr:`oom_bytes_freed` and the metrics ``oom/recoveries`` /
    ``oom/bytes_freed``.

    Memory: nothing until an error; then the largest step is that of half the batch. Cost: one Python hook call per
    parameter per backward; a recovery loses the failed half-done forward/backward. The loss contract is
    ``AccumulationScheduler``'s (the gradient is normalised once, before the step, by the batch's sample or token
    count): ``"samples"``: ``training_step`` returns the batch's mean loss; ``"tokens"``: it returns
    ``{"loss": sum_of_token_losses, "num_tokens": n}``. Single process, not with DeepSpeed nor with an optimizer step
    inside backward (see ``AccumulationScheduler``). Use ``AccumulationScheduler(on_oom="split")`` for accumulation.

    Args:
        loss_normalization: ``"samples"`` or ``"tokens"`` (above).
        regrow_after: optimizer steps without an error before twice the split size is tried again; ``None``: never.

    Example (``tiny_model``/``tiny_data``: the demo ``CausalLMModule``/``StdlibTextDataModule``, small):

        >>> from lightning_lowmem import OOMRecovery
        >>> recovery = OOMRecovery(loss_normalization="tokens", regrow_after=100)
        >>> trainer = L.Trainer(callbacks=[recovery], max_steps=2,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(tiny_model(loss_reduction="sum"), tiny_data())
        >>> trainer.global_step, recovery.oom_recoveries
        (2, 0)
    """

    _drives_loader = False

    def __init__(self, loss_normalization: Normalization = "samples", regrow_after: int | None = None) -> None:
        problems, wrong_type = [], []
        if loss_normalization not in ("samples", "tokens"):
            problems.append(f"`loss_normalization={loss_normalization!r}`; expected 'samples' or 'tokens'")
        if regrow_after is not None and (
            not isinstance(regrow_after, int) or isinstance(regrow_after, bool) or regrow_after < 1
        ):
            (problems if isinstance(regrow_after, int) and not isinstance(regrow_after, bool) else wrong_type).append(
                f"`regrow_after={regrow_after!r}` must be a positive int (optimizer steps) or None")
        if problems or wrong_type:
            raise (TypeError if wrong_type else ValueError)("OOMRecovery: " + "; ".join(problems + wrong_type) + ".")
        # NOTE: a window of one loader batch: effective = micro = 1 gives an accumulation of 1 whatever the
        # loader's batch size (the counts come from the batches themselves); the loader is never resized
        super().__init__(1, 1, loss_normalization=loss_normalization, on_oom="split", regrow_after=regrow_after)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            if trainer.accumulate_grad_batches not in (1, self._trainer_accumulation):
                raise ValueError(
                    f"OOMRecovery: the Trainer has `accumulate_grad_batches={trainer.accumulate_grad_batches}`; "
                    "OOMRecovery is for runs without accumulation. Use `AccumulationScheduler(effective_batch_size=..., "
                    "micro_batch_size=..., on_oom='split')` instead (it keeps the effective batch on an error too)."
                )
            others = [type(c).__name__ for c in trainer.callbacks if isinstance(c, AccumulationScheduler) and c is not self]
            if others:
                raise ValueError(
                    f"OOMRecovery: remove it, or the `{others[0]}` callback: pass `on_oom='split'` to "
                    f"`{others[0]}` instead (both would drive the same window)."
                )
        super().setup(trainer, pl_module, stage)

    @override
    def resolved(self) -> Any:
        return self.fresh()


__all__ = ["OOMRecovery"]

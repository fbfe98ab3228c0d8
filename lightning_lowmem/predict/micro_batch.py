"""``dry_run_peak``: the ``measure`` of ``AccumulationScheduler(micro_batch_size="auto")``, by a dry run."""

from __future__ import annotations

from typing import Any

from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.predict.dry_run import dry_run
from lightning_lowmem.predict.run_spec import RunSpec


def dry_run_peak(trainer: Any, pl_module: Any, micro: int) -> int:
    """The device peak of this run at micro-batch ``micro``, predicted by a dry run on a fake copy of the module (the
    real one, its RNG and its data are not touched). Two micro-batches per step: the second one's backward runs with
    the first one's gradients alive, as in any window.

    Pass it as ``AccumulationScheduler(micro_batch_size="auto", measure=dry_run_peak)`` (YAML:
    ``measure: lightning_lowmem.dry_run_peak``). Cost: one dry run per micro-batch tried (a binary search).
    """
    scheduler = next(c for c in trainer.callbacks if isinstance(c, AccumulationScheduler))
    run = RunSpec.from_trainer(trainer, exclude=(scheduler,))
    run.callbacks.append(scheduler.fresh(effective_batch_size=2 * micro * trainer.world_size, micro_batch_size=micro,
                                         schedule=None, memory_budget=None, measure=None))
    return dry_run(pl_module, trainer.datamodule, run=run).peak_device


__all__ = ["dry_run_peak"]

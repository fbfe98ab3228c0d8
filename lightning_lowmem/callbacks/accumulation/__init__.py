"""``AccumulationScheduler``: an effective batch from micro-batches, the micro-batch searched or split on OOM.

``scheduler`` is the callback; ``window`` the accumulation window maths, ``micro_batch_search`` the search for the
largest micro-batch that fits, ``oom_split`` the split of a batch that ran out of memory.
"""

from lightning_lowmem.callbacks.accumulation.scheduler import (
    AccumulationScheduler,
    Choice,
    WindowStats,
    lightning_accumulation,
)

__all__ = ["AccumulationScheduler", "Choice", "WindowStats", "lightning_accumulation"]

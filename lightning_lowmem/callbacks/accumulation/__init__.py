"""``AccumulationScheduler``: an effective batch from micro-batches, the loss averaged over every sample or token.

``scheduler`` is the callback; ``window`` the accumulation window (its edges, weights and step factor), ``counts``
what a micro-batch counts, ``micro_batch_search`` the search for the largest micro-batch a measurement fits.
"""

from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler, Choice, lightning_accumulation
from lightning_lowmem.callbacks.accumulation.window import WindowStats

__all__ = ["AccumulationScheduler", "Choice", "WindowStats", "lightning_accumulation"]

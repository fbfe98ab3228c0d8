"""``AccumulationScheduler``: an effective batch from micro-batches, the loss averaged over every sample or token."""

from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler, Choice, lightning_accumulation
from lightning_lowmem.callbacks.accumulation.window import WindowStats

__all__ = ["AccumulationScheduler", "Choice", "WindowStats", "lightning_accumulation"]

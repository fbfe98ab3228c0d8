"""``ActivationOffload``: saved activations to host memory in forward, back in backward."""

from lightning_lowmem.callbacks.activation_offload.callback import METRIC_KEYS, ActivationOffload

__all__ = ["METRIC_KEYS", "ActivationOffload"]

"""``ActivationCheckpointing``: recompute the repeated blocks' activations in backward instead of keeping them."""

from lightning_lowmem.callbacks.activation_checkpointing.callback import (
    ActivationCheckpointing,
    CheckpointInfo,
    checkpoint_info,
    checkpointed_modules,
    find_repeated_blocks,
)

__all__ = ["ActivationCheckpointing", "CheckpointInfo", "checkpoint_info", "checkpointed_modules",
           "find_repeated_blocks"]

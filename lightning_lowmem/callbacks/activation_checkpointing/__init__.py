"""``ActivationCheckpointing``: recompute the repeated blocks' activations in backward instead of keeping them.

``callback`` is the callback; ``segments`` the checkpointed segments, ``probe`` the measurement of what each block
keeps (the ``selective`` and ``budget`` policies).
"""

from lightning_lowmem.callbacks.activation_checkpointing.callback import (
    ActivationCheckpointing,
    CheckpointInfo,
    checkpoint_info,
    checkpointed_modules,
    find_repeated_blocks,
)

__all__ = ["ActivationCheckpointing", "CheckpointInfo", "checkpoint_info", "checkpointed_modules",
           "find_repeated_blocks"]

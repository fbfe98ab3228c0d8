"""The fix every technique names for a gradient that arrives twice in one backward.

A weight shared by two reentrant-checkpointed segments has its gradient hooks called once in each; a technique that
acts when a gradient lands (a step or upload in backward, DeepSpeed's reduction) refuses it with this text.

Example:
    >>> reentrant_fix("remove the callback").endswith("or remove the callback.")
    True
"""

from __future__ import annotations


def reentrant_fix(alternative: str) -> str:
    """Checkpoint without reentrancy (plain torch and Hugging Face spelled out), or ``alternative``."""
    return ("Checkpoint without reentrancy (`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; Hugging Face: "
            "`gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})`) or "
            f"{alternative}.")


__all__ = ["reentrant_fix"]

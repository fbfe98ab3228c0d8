"""The fix every technique names for a gradient that arrives twice in one backward.

A weight shared by two reentrant-checkpointed segments (one block applied twice under
``torch.utils.checkpoint(..., use_reentrant=True)``, ALBERT-style sharing under older Hugging Face checkpointing)
has its gradient hooks called once in each segment's inner backward. A technique that acts when a gradient lands
(a step in backward, an upload in backward, DeepSpeed's reduction) refuses it with this text.

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

"""``ChunkedLMLoss``: a causal LM's cross-entropy computed chunk by chunk, never building the whole logits."""

from lightning_lowmem.callbacks.chunked_lm_loss.callback import (
    ChunkedLMLoss,
    chunked_causal_lm_loss,
    chunked_causal_lm_loss_sum,
    is_chunked,
)

__all__ = ["ChunkedLMLoss", "chunked_causal_lm_loss", "chunked_causal_lm_loss_sum", "is_chunked"]

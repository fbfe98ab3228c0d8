"""The samples and tokens of one ``AccumulationScheduler`` micro-batch, counted before its forward.

NOTE: [samples from the loader] a batch's first tensor need not be its samples: the loader's batch sampler says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size

#: the label Hugging Face and ``torch.nn.functional.cross_entropy`` ignore
IGNORE_INDEX = -100


def loader_batch_size(loader: Any) -> int | None:
    """The samples per batch ``loader`` says it gives (its batch sampler's ``batch_size``); None when it does not say."""
    size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def count_samples(loader: Any, batch: Any, batch_idx: int) -> int:
    """Samples in batch ``batch_idx`` of ``loader`` (see [samples from the loader])."""
    size = loader_batch_size(loader)
    if size is None:
        return extract_batch_size(batch)
    batch_sampler = loader.batch_sampler
    if getattr(batch_sampler, "drop_last", False):
        return size
    try:
        left = len(batch_sampler.sampler) - batch_idx * size
    except TypeError:  # an iterable dataset: no length; its short last batch is seen in the batch itself
        return min(size, extract_batch_size(batch))
    return max(1, min(size, left))


def labelled_tokens(batch: Any) -> torch.Tensor:
    """The tokens a causal-LM loss sums over: ``batch["labels"][..., 1:]`` not ``-100`` (``input_ids`` without labels;
    the labels are shifted inside the model)."""
    labels = batch.get("labels", batch.get("input_ids")) if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        raise TypeError(
            "AccumulationScheduler(loss_normalization='tokens') counts each micro-batch's tokens before its forward "
            "(the window's total is needed before the optimizer step); by default from `batch['labels'][..., 1:] != "
            f"-100` (`input_ids` without labels), but the batch is a {type(batch).__name__}"
            + (f" with keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else "")
            + ". Pass `count_tokens=<a function of the batch that counts the tokens your loss sums over>`; "
            "`training_step` must return `{'loss': sum_of_token_losses, 'num_tokens': n}`. Or pass "
            "`loss_normalization='samples'` for a per-micro-batch mean loss."
        )
    return (labels[..., 1:] != IGNORE_INDEX).sum()


__all__ = ["count_samples", "labelled_tokens", "loader_batch_size"]

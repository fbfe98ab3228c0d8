"""``tensors_in``: the one walker of nested batches and module outputs (checkpointing, offload, the memory tracker)."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch
from transformers import BatchEncoding

from lightning_lowmem.core.tensors import tensors_in
from lightning_lowmem.measure.tracker import MemoryTracker
from tests.helpers.models import random_batch, tiny_gpt2

Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class Holder:
    tensor: torch.Tensor
    name: str


def test_every_tensor_of_a_batch_encoding_nested_in_collections_in_order():
    encoding = BatchEncoding(random_batch(2, 8))
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    nested = [encoding, (a, "text", None), {"pair": Pair(b, 1)}, Holder(c, "c")]
    want = [*encoding.values(), a, b, c]
    got = tensors_in(nested)
    assert len(got) == len(want) == 6 and all(x is y for x, y in zip(got, want))
    assert list(encoding) == ["input_ids", "attention_mask", "labels"]  # the walk left the batch as it was


def test_model_output_tensors_in_field_order():
    model = tiny_gpt2(n_layer=1)
    batch = random_batch(2, 8)
    out = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    assert [t.shape for t in tensors_in(out)] == [torch.Size([]), out.logits.shape]
    assert tensors_in(out)[1] is out.logits


def test_memory_tracker_counts_a_batch_encoding():
    encoding = BatchEncoding(random_batch(2, 8))
    tracker = MemoryTracker()
    with tracker:
        tracker.track(encoding)
        assert tracker.live_bytes() == sum(t.untyped_storage().nbytes() for t in encoding.values()) > 0

"""The dry run (``dry_run``, ``MemoryReport``'s prediction, ``lowmem_auto``'s planning) of a Hugging Face
mixture-of-experts model at fp32 or bf16-mixed fails with torch's ``RuntimeError: Expected inputs of BF16 type but got
mat_a.dtype=torch.float32`` instead of predicting (or refusing with ``DryRunUnsupportedError``, naming the op and the
model's line). ``lowmem_auto`` on such a model therefore crashes at fit start.

Found by the conformance sweep (``hf_mixtral``). Suspected cause: transformers' MoE experts call ``torch._grouped_mm``;
its meta/fake implementation (``torch/_meta_registrations.py``) demands bf16 inputs, where the CPU kernel the real run
uses takes fp32. Fix direction: register a fake implementation matching the CPU kernel for the dry run (the output's
shape does not depend on the dtype), or at least turn the error into ``DryRunUnsupportedError``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import DryRunUnsupportedError, dry_run
from tests.conformance.corpus import MODULES

pytestmark = pytest.mark.integration


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="dry run of HF MoE (_grouped_mm) at fp32")
def test_dry_run_of_a_mixture_of_experts_predicts_or_refuses():
    torch.manual_seed(0)
    try:
        estimate = dry_run(MODULES["hf_mixtral"].build(), precision="32-true")
    except DryRunUnsupportedError:
        return  # a refusal naming the op and the line is acceptable
    assert estimate.peak_device > 0

"""The dry run (``dry_run``, ``MemoryReport``'s prediction, ``lowmem_auto``'s planning) of a Hugging Face
mixture-of-experts model at fp32 or bf16-mixed fails with torch's ``RuntimeError: Expected inputs of BF16 type but got
mat_a.dtype=torch.float32`` instead of predicting (or refusing with ``DryRunUnsupportedError``, naming the op and the
model's line). ``lowmem_auto`` on such a model therefore crashes at fit start.

Found by the conformance sweep (``hf_mixtral``). Suspected cause: transformers' MoE experts call ``torch._grouped_mm``;
its meta/fake implementation (``torch/_meta_registrations.py``) demands bf16 inputs, where the CPU kernel the real run
uses takes fp32. Fixed: the dry run gives ``_grouped_mm`` the CPU kernel's output (``memory/_kernels.py``,
``REPLACED``); ``tests/memory/test_kernels.py`` compares it with the real kernel's.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import dry_run
from tests.conformance.corpus import MODULES

pytestmark = pytest.mark.integration


def test_dry_run_of_a_mixture_of_experts_predicts():
    torch.manual_seed(0)
    estimate = dry_run(MODULES["hf_mixtral"].build(), precision="32-true")
    assert estimate.peak_device > 0
    assert any(note.startswith("aten._grouped_mm.default") for note in estimate.notes), estimate.notes


def test_dry_run_of_switch_transformers_runs_every_expert_as_its_bound():
    """Switch Transformers pick their experts by value (``for i in hit.nonzero(): self[f"expert_{i[0]}"]``): the dry
    run failed with ``KeyError: 'expert_FakeTensor(...)'`` (a fake index formatted into the module's name), so
    ``lowmem_auto`` crashed before the first step. Fixed: ``nonzero`` of fake values takes every element as selected
    (its upper bound, as before) and gives those indices as real values: every expert runs on every token, stated."""
    torch.manual_seed(0)
    estimate = dry_run(MODULES["hf_switch_transformers"].build(), precision="32-true")
    assert estimate.peak_device > 0
    assert any(b["op"] == "aten.nonzero.default" and "upper bound" in b["assumption"] for b in estimate.bounds), estimate.bounds

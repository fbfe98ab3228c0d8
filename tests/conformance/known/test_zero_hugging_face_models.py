"""The ZeRO presets on three Hugging Face families, against plain Lightning:

- Switch Transformers (sparse mixture of experts) under ZeRO-3 (``lowmem_zero3``, ``lowmem_zero3_offload``): at fp32
  every weight differs (|diff|/|update| 0.08, ZeRO-2 is within rounding); at bf16 the first forward fails in
  DeepSpeed's ZeRO-3 linear (``expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16``).
  Suspected causes: an expert no token was routed to has no gradient in that step; torch's optimizer skips such a
  parameter while ZeRO-3 steps its partition with a zero gradient (weight decay and momentum move it) or mis-fetches
  it; and the router computes in fp32 (``router_dtype``) through the F.linear ZeRO-3 replaces, which does not cast.
  Fix direction: refuse MoE modules (or parameters without a gradient) under ZeRO-3 with the reason, or follow
  DeepSpeed's MoE leaf-module registration; refuse the fp32 router at bf16.
- DeepSpeed's bf16 (``lowmem_zero*`` at ``bf16-mixed``) on BART, Marian, MobileBERT, Falcon and Qwen3-MoE: a few
  biases / LayerNorm parameters end 4-12x further from the fp32 run than plain Lightning's bf16-true (the whole model
  within 1.4x), where ``lowmem_offload`` bf16-true (fp32 masters too) stays within 2.1x on the same modules. Not
  explained yet: DeepSpeed's bf16 path rounds something plain bf16-true keeps (a candidate: gradients accumulated and
  reduced in bf16, ``grad_accum_dtype``/``communication_data_type`` default to the model's dtype). Needs a look
  before the presets' bf16 is called equivalent to Lightning's.

Found by the conformance sweep.
"""

from __future__ import annotations

import pytest

from tests.helpers.runif import RunIf

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed, RunIf(deepspeed=True),
              pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.*:FutureWarning")]


def _cell(module: str, flag: str) -> dict:
    from tests.conformance.cell import run_cell
    from tests.conformance.corpus import MODULES
    from tests.conformance.flags import FLAGS_BY_NAME

    return run_cell(MODULES[module], FLAGS_BY_NAME[flag])


@pytest.mark.xfail(strict=True, reason="ZeRO-3 on Switch Transformers: fp32 differs, bf16 crashes")
@pytest.mark.parametrize("flag", ["lowmem_zero3@32-true", "lowmem_zero3@bf16-mixed"])
def test_zero3_on_a_sparse_mixture_of_experts(flag):
    row = _cell("hf_switch_transformers", flag)
    assert row["verdict"] in ("exact", "close", "refused"), row


@pytest.mark.xfail(strict=True, reason="DeepSpeed's bf16: some biases 4-12x further from fp32 than plain bf16-true")
def test_zero_bf16_is_as_close_to_fp32_as_plain_bf16_true():
    """On Marian (BART and Qwen3-MoE are within the precision's own noise since the comparison takes plain bf16-true
    nudged by one bf16 ulp as a second sample of it: their 11x was plain's lucky sample)."""
    row = _cell("hf_marian", "lowmem_zero2@bf16-mixed")
    assert row["verdict"] in ("exact", "close"), row

"""The ZeRO presets on Hugging Face families, against plain Lightning:

- Switch Transformers (sparse mixture of experts) under ZeRO-3 (``lowmem_zero3``, ``lowmem_zero3_offload``) is
  refused before the first step. Two causes, both measured: (1) the router multiplies its input by jitter noise in
  place (``hidden_states *= ...uniform_(...)``, ``router_jitter_noise``), and the experts then read that same tensor.
  ZeRO-3's forward pre-hook on every submodule hands it an alias of its inputs made inside DeepSpeed's own autograd
  function, so the multiply changes the values the experts see but is missing from their gradient path: at fp32 every
  weight differed (|diff|/|update| 0.08; with the jitter set to 0 the cell is ``close``, 0.00031). (2) The router keeps
  ``self.dtype = router_dtype`` (fp32) and casts its classifier in forward; under ZeRO-3 that cast meets the
  partitioned parameter and DeepSpeed fetches it in bf16: ``expected m1 and m2 to have the same dtype`` in its linear.
- DeepSpeed's bf16 (``lowmem_zero*`` at ``bf16-mixed``) on BART, Marian, MobileBERT, Falcon and Qwen3-MoE: a few
  tensors 4-12x further from the fp32 run than plain bf16-true. Not a bug: in each, the excess is one or a few
  elements one or two AdamW steps (``lr`` = 2e-3 each) apart, e.g. BART ``encoder.layers.1.fc2.bias[5]`` +3.86e-3
  where the fp32 run moved it +1.7e-4 over 3 steps (a near-zero summed gradient whose sign flips under bf16 rounding),
  and Qwen3-MoE's router rows (a near-tie top-k choice). Plain Lightning's own bf16-mixed shows the same kind of
  outliers (BART ``decoder.layers.0.self_attn.v_proj.bias`` 18x, Marian 23x) and DeepSpeed's
  ``grad_accum_dtype``/``communication_data_type`` = fp32 change nothing (bit-identical). The comparison's per-tensor
  4x bound against plain bf16-true did not hold for Adam: it now takes plain bf16-true nudged by one bf16 ulp as a
  second sample of the precision's noise and allows each tensor one element's Adam step either way (``2 * lr``,
  ``compare.py``): every one of these cells is ``close`` (Marian's LayerNorm bias 4.02e-3 from fp32, 0.74 of its
  limit); the test below is the regression test.

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


@pytest.mark.parametrize("flag", ["lowmem_zero3@32-true", "lowmem_zero3@bf16-mixed"])
def test_zero3_on_a_sparse_mixture_of_experts(flag):
    row = _cell("hf_switch_transformers", flag)
    assert row["verdict"] in ("exact", "close", "refused"), row
    if row["verdict"] == "refused":  # before the first step, naming the cause
        assert "jitter" in row["detail"], row


def test_zero3_on_switch_without_router_jitter_at_bf16_is_refused_naming_the_router_dtype(monkeypatch):
    """Without the jitter, Switch at fp32 trains (``close``), at bf16 its fp32 router meets ZeRO-3's bf16 fetch."""
    from transformers.models.switch_transformers import modeling_switch_transformers as switch

    original = switch.SwitchTransformersTop1Router.__init__

    def without_jitter(self, config):
        original(self, config)
        self.jitter_noise = 0.0

    monkeypatch.setattr(switch.SwitchTransformersTop1Router, "__init__", without_jitter)
    row = _cell("hf_switch_transformers", "lowmem_zero3@bf16-mixed")
    assert row["verdict"] == "refused" and "router_dtype" in row["detail"], row


def test_zero_bf16_is_as_close_to_fp32_as_plain_bf16_true():
    """On Marian, the furthest: one LayerNorm bias element two Adam steps from the fp32 run."""
    row = _cell("hf_marian", "lowmem_zero2@bf16-mixed")
    assert row["verdict"] in ("exact", "close"), row

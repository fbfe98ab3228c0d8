"""``lowmem_offload`` at ``bf16-mixed`` on ALBERT (one layer's weights shared by every layer) is not bit-identical to
plain Lightning ``bf16-mixed``: 25 of 29 tensors differ after 3 steps, 1.4 % of the update on a weight in the README's
bf16-mixed recipe (``host_optimizer="as_is"``).

Found by the conformance sweep (``hf_albert``). Suspected cause: the README's documented exception, "a half weight
used twice in one backward has its two gradients summed in bf16 instead of fp32", which it sizes at 1e-6 apart after
4 steps on a GAN; a weight shared across every layer of a transformer is used L times per backward and the bf16 sum
costs far more. Fix direction: accumulate a weight's gradient contributions in fp32 (the host buffer, per
contribution) as plain mixed precision does, or state this case and its size next to the bit-identity claim.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.xfail(strict=True, reason="ALBERT's shared layers under lowmem_offload bf16-mixed: not bit-identical")
def test_offload_bf16_mixed_on_shared_layers_matches_plain():
    from tests.conformance.cell import run_cell
    from tests.conformance.corpus import MODULES
    from tests.conformance.flags import FLAGS_BY_NAME

    row = run_cell(MODULES["hf_albert"], FLAGS_BY_NAME["lowmem_offload@bf16-mixed"])
    assert row["verdict"] == "exact", row

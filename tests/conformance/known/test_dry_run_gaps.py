"""Two dry-run predictions (``MemoryReport``'s, the dry run of the same ``Trainer.fit`` on fake tensors) that miss the
measured peak, beyond the known LSTM/MLP gap:

- ``hf_mobilenet_v2``: the dry run fails (``RuntimeError: Given groups=1, weight of size [1280, 80, 1, 1], expected
  input[4, 8, 4, 4] to have 80 channels``), plain fp32 and ``lowmem_offload`` alike, and so does ``lowmem_auto``.
  Suspected cause: the depth extrapolation cuts the model's longest ``nn.ModuleList`` of same-class modules to 3, 4
  and 5 blocks; MobileNetV2's inverted-residual layers are one class with different channel counts, so a cut model
  feeds 8 channels where 80 are expected. Fix direction: extrapolate only lists whose blocks have equal parameter
  shapes (and fall back to the full trace otherwise, as the docs say it does when the lines disagree).
- ``hf_wav2vec2`` / ``hf_hubert`` at fp32: device peak predicted 17.3 % low (1,431,332 vs 1,731,788 bytes). Suspected
  cause: a CPU kernel of the convolutional feature encoder (``conv1d`` with ``GroupNorm``) keeps more than its output,
  which its fake kernel does not allocate (the README names the same kind of gap for CPU ``mse_loss``), to be located.

Found by the conformance sweep's per-module dry-run check (``tests/conformance/dryrun.py``).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.xfail(strict=True, reason="dry run: MobileNetV2 depth cut (crash); wav2vec2 -17 %")
@pytest.mark.parametrize("module", ["hf_mobilenet_v2", "hf_wav2vec2"])
def test_dry_run_predicts_the_measured_peak(module):
    from tests.conformance.corpus import MODULES
    from tests.conformance.dryrun import check

    row = check(MODULES[module], "plain@32-true")
    assert row["verdict"] in ("ok", "refused"), row

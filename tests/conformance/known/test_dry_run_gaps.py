"""Two dry-run predictions (``MemoryReport``'s, the dry run of the same ``Trainer.fit`` on fake tensors) that miss the
measured peak, beyond the known LSTM/MLP gap:

- ``hf_mobilenet_v2``: the dry run fails (``RuntimeError: Given groups=1, weight of size [1280, 80, 1, 1], expected
  input[4, 8, 4, 4] to have 80 channels``), plain fp32 and ``lowmem_offload`` alike, and so does ``lowmem_auto``.
  Suspected cause: the depth extrapolation cuts the model's longest ``nn.ModuleList`` of same-class modules to 3, 4
  and 5 blocks; MobileNetV2's inverted-residual layers are one class with different channel counts, so a cut model
  feeds 8 channels where 80 are expected. Fix direction: extrapolate only lists whose blocks have equal parameter
  shapes (and fall back to the full trace otherwise, as the docs say it does when the lines disagree).
- ``hf_wav2vec2`` / ``hf_hubert`` at fp32: device peak predicted 17.3 % low (1,431,332 vs 1,731,788 bytes). Suspected
  cause: a CPU kernel of the convolutional feature encoder. Found instead: no op's fake output differs from the real
  kernel's (compared op by op); the models' LayerDrop (``config.layerdrop=0.1``) skips encoder layers on real draws
  (``torch.rand([])`` is small, so real in the dry run too), and the dry run drew at another point of the random
  stream than the measured steps, predicting a step that skipped a layer. Fixed: the dry run turns LayerDrop off on
  its copy and predicts the largest step, that which skips none (``memory/depth.py``, ``keep_every_layer``).
- ``hf_mobilenet_v2``: fixed, the depth cut takes only lists whose later blocks are interchangeable (equal parameter
  and buffer shapes, equal printed configuration; ``memory/depth.py``, ``find_blocks``).

Found by the conformance sweep's per-module dry-run check (``tests/conformance/dryrun.py``).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("module", ["hf_mobilenet_v2", "hf_wav2vec2"])
def test_dry_run_predicts_the_measured_peak(module):
    from tests.conformance.corpus import MODULES
    from tests.conformance.dryrun import check

    row = check(MODULES[module], "plain@32-true")
    assert row["verdict"] in ("ok", "refused"), row

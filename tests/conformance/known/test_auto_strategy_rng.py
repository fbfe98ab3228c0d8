"""``strategy="lowmem_auto"`` trains differently from the recipe it chose, given explicitly, with the same seed,
when the model draws random numbers whose values it reads (Hugging Face's LayerDrop: ``torch.rand([]) < layerdrop``).

Found by the conformance sweep (``hf_wav2vec2``: ``lowmem_auto`` chose bf16-mixed + 8-bit AdamW; every weight
differs from that recipe run by hand; with ``layerdrop=0`` the two are bit-identical). Suspected cause: the planner's
dry runs execute the module's forward at fit start, and a draw whose value is read (not a fake tensor's) advances the
global torch RNG, so dropout and LayerDrop in training see other numbers. Fixed: the dry run forks the global RNGs
(CPU, device, Python's and NumPy's generators) and runs on a fake copy (the module's buffers untouched).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from tests.conformance.known._common import Classifier, differing, images, train

pytestmark = pytest.mark.integration


_DRAWS = {
    "torch": lambda: float(torch.rand([])),
    "python": random.random,
    "numpy": lambda: float(np.random.rand()),
}


class LayerDrop(nn.Module):
    """Skips its layer with probability 0.5 in training, reading the draw as a Python bool (as transformers does)."""

    def __init__(self, source: str = "torch") -> None:
        super().__init__()
        self.layer, self.source = nn.Linear(16, 16), source

    def forward(self, x):
        if self.training and _DRAWS[self.source]() < 0.5:
            return x
        return x + self.layer(x)


def _builder(source: str):
    def build():
        net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), LayerDrop(source), LayerDrop(source),
                            nn.BatchNorm1d(16), nn.Linear(16, 3))
        return Classifier(net, images(), lambda params: torch.optim.AdamW(params, lr=1e-2))

    return build


@pytest.mark.parametrize("source", list(_DRAWS))
def test_auto_matches_the_recipe_it_chose(source):
    """Torch's, Python's and NumPy's generators; the BatchNorm statistics (buffers) are compared too."""
    from lightning_lowmem.plan.auto import AutoStrategy

    _build = _builder(source)
    auto = AutoStrategy(device_budget="8GiB", hardware="rtx3060-12gb")  # priced for a GPU: plain Lightning fits and wins
    got = train(_build, strategy=auto)
    run = auto.plan.run
    assert str(run.strategy) == "auto" and run.accumulate_grad_batches == 1, run.describe()  # a plain-Lightning recipe
    want = train(_build, precision=run.precision, callbacks=[c.fresh() for c in run.callbacks])
    assert not differing(got, want)

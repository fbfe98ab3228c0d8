"""``AccumulationScheduler`` and ``OOMRecovery`` with Lightning's ``StochasticWeightAveraging``: one optimizer step
more than plain Lightning (``global_step`` 8 against 7 in the sweep) and other weights.

Found by the conformance sweep (``cnn_bn`` + ``StochasticWeightAveraging``, with ``AccumulationScheduler(8/4)``,
``OOMRecovery`` and the README's bf16-mixed recipe). Suspected cause: after its last epoch SWA runs one more epoch to
recompute the BatchNorm statistics of the averaged model, telling Lightning's automatic loop to skip backward and the
step (``_skip_backward``); these callbacks drive the micro-batch loop and the step themselves and do not see that
flag, so they step the optimizer in that epoch. Fix direction: honour Lightning's skip (no backward, no step) in the
callbacks' loop, or refuse SWA with the reason.
"""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn

from lightning_lowmem import OOMRecovery
from tests.conformance.known._common import Classifier, differing, images, train

pytestmark = pytest.mark.integration


def _build():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    return Classifier(net, images())


def _swa():
    return StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1, annealing_epochs=1)


@pytest.mark.xfail(strict=True, reason="OOMRecovery + StochasticWeightAveraging: a step in SWA's BatchNorm epoch")
def test_oom_recovery_with_swa_matches_plain():
    got = train(_build, steps=2, max_epochs=3, callbacks=[OOMRecovery(), _swa()])
    assert not differing(got, train(_build, steps=2, max_epochs=3, callbacks=[_swa()]))

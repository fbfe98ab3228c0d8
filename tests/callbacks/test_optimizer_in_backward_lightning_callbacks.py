"""The step in backward (``OptimizerInBackward``, ``OffloadStrategy(optimizer_in_backward=True)``) with Lightning's own
callbacks: refused at setup, before any step, where it cannot train as plain Lightning does (an accumulation schedule;
``StochasticWeightAveraging``'s BatchNorm epoch), and ``torch.equal`` with plain Lightning where it can (SWA without
BatchNorm; ``BackboneFinetuning``'s param group added when it unfreezes the backbone)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, GradientAccumulationScheduler, StochasticWeightAveraging
from torch import nn

from lightning_lowmem import OptimizerInBackward
from lightning_lowmem.strategies.offload import OffloadStrategy
from tests.conformance.known._common import Classifier, differing, images, train

pytestmark = pytest.mark.integration


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


class TwoBlocks(Classifier):
    """Two conv + BatchNorm blocks as the backbone (BackboneFinetuning keeps the BatchNorm layers trainable)."""

    def __init__(self) -> None:
        net = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                            nn.Conv2d(4, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                            nn.Linear(4 * 4 * 4, 3))
        super().__init__(net, images(), _sgd)
        self.backbone = self.net[:6]


class NoBatchNorm(Classifier):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)), images(),
                         _sgd)


TECHNIQUES = {
    "callback": lambda: {"callbacks": [OptimizerInBackward()]},
    "offload": lambda: {"strategy": OffloadStrategy(optimizer_in_backward=True, host_optimizer="as_is")},
}


def _with(technique: str, *callbacks):
    kwargs = TECHNIQUES[technique]()
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), *callbacks]
    return kwargs


@pytest.mark.parametrize("technique", TECHNIQUES)
@pytest.mark.parametrize(("build", "callback", "named"), [
    (NoBatchNorm, lambda: GradientAccumulationScheduler(scheduling={1: 2}), "GradientAccumulationScheduler"),
    (TwoBlocks, lambda: StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1), "StochasticWeightAveraging"),
], ids=["accumulation_schedule", "swa_with_batchnorm"])
def test_refused_at_setup_naming_the_callback(technique, build, callback, named):
    steps = []

    class Counts(build):
        def on_train_batch_start(self, batch, batch_idx):
            steps.append(batch_idx)

    with pytest.raises(ValueError, match=named) as err:
        train(Counts, steps=2, max_epochs=3, **_with(technique, callback()))
    assert "remove" in str(err.value) and steps == []  # before the first batch


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_swa_without_batchnorm_trains_as_plain_lightning(technique):
    def swa():
        return StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1, annealing_epochs=1)

    assert differing(train(NoBatchNorm, steps=2, max_epochs=3, **_with(technique, swa())),
                     train(NoBatchNorm, steps=2, max_epochs=3, callbacks=[swa()])) == []


def test_backbone_finetuning_param_group_is_stepped_as_plain_lightning_steps_it():
    """The conv weights unfrozen at epoch 1 arrive in a new param group: without a hook of their own, the hook of the
    next parameter to finish stepped them, and Lightning's step stepped them again."""

    def finetuning():
        return BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)

    got = train(TwoBlocks, steps=2, max_epochs=2, **_with("callback", finetuning()))
    assert differing(got, train(TwoBlocks, steps=2, max_epochs=2, callbacks=[finetuning()])) == []

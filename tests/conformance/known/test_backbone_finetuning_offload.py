"""Lightning's ``BackboneFinetuning`` under ``strategy="lowmem_offload"`` failed at the first epoch start with a
``KeyError`` (a ``Parameter``) inside Lightning's ``finetuning.py``, at every precision.

Found by the conformance sweep (``cnn_bn`` with every ``lowmem_offload`` flag). Cause: ``BaseFinetuning`` maps the
optimizer's param groups to the module's parameter names (``{p: n for n, p in pl_module.named_parameters()}``) and, when
it unfreezes, adds the module's parameters with ``add_param_group``; under ``lowmem_offload`` the groups hold the host
fp32 masters, and the backbone, frozen at setup, had no gradient hook. Fixed: its hooks see the module's parameters in
the groups (the groups it adds get the masters after), and parameters made trainable later are hooked at the next batch
start (``strategies/_masters_view.py``: ``wrap_finetuning``; ``tests/strategies/test_offload_finetuning.py``).
"""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn

from tests.conformance.known._common import Classifier, differing, images, train

pytestmark = pytest.mark.integration


class WithBackbone(Classifier):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)), images())
        self.backbone = self.net[:3]


def test_backbone_finetuning_under_offload_matches_plain_lightning():
    def run(**kwargs):
        return train(WithBackbone, steps=2, max_epochs=2,
                     callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)], **kwargs)

    from lightning_lowmem.strategies.offload import OffloadStrategy

    assert not differing(run(strategy=OffloadStrategy(host_optimizer="as_is")), run())

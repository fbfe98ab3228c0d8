"""Lightning's ``BackboneFinetuning`` under ``lowmem_offload``: its hooks see the module's parameters in the optimizer's
param groups (it maps them to names, and adds the unfrozen backbone with ``optimizer.add_param_group``); the group it adds
gets the masters, and the backbone's gradients, frozen at setup, reach them once it is unfrozen. ``torch.equal`` with
plain Lightning on every weight and buffer, over the epoch that unfreezes and the one after."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import BackboneFinetuning

from lightning_lowmem.strategies.offload import OffloadStrategy
from tests.callbacks.test_optimizer_in_backward_lightning_callbacks import TwoBlocks
from tests.conformance.known._common import differing, train

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "optimizer_in_backward"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_backbone_finetuning_trains_as_plain_lightning(precision, in_backward):
    def run(**kwargs):
        callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)
        return train(TwoBlocks, steps=2, max_epochs=3, precision=precision, callbacks=[callback], **kwargs)

    strategy = OffloadStrategy(host_optimizer="as_is", optimizer_in_backward=in_backward)
    assert differing(run(strategy=strategy), run()) == []

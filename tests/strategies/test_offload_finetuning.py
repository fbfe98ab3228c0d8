"""Lightning's ``BackboneFinetuning`` under ``lowmem_offload`` is refused at setup, naming the fix: its hooks match the
optimizer's parameters (the fp32 host masters) to the module's. Unfreezing in the user's own hook (``requires_grad_`` and
``optimizer.add_param_group`` with the module's parameters) trains as plain Lightning: the strategy gives the new
trainable parameters masters at the next batch. ``torch.equal`` on every weight and buffer, over the epoch that
unfreezes and the one after."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import BackboneFinetuning

from lightning_lowmem.strategies.offload import OffloadStrategy
from tests.callbacks.test_optimizer_in_backward_lightning_callbacks import TwoBlocks
from tests.conformance.known._common import differing, train

pytestmark = pytest.mark.integration


def test_backbone_finetuning_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"`BackboneFinetuning` .*fp32 host masters.*add_param_group"):
        train(TwoBlocks, steps=2, max_epochs=2, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
              strategy=OffloadStrategy())


class Unfreeze(L.Callback):
    """What the refusal names: the backbone frozen before training, unfrozen at epoch 1 with a param group of its own."""

    def setup(self, trainer, pl_module, stage):
        pl_module.backbone.requires_grad_(False)  # NOTE: before `configure_optimizers`, which takes the trainable ones

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.backbone.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters()), "lr": 0.01})


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "optimizer_in_backward"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_unfreezing_in_a_users_hook_trains_as_plain_lightning(precision, in_backward):
    def run(**kwargs):
        return train(TwoBlocks, steps=2, max_epochs=3, precision=precision, callbacks=[Unfreeze()], **kwargs)

    strategy = OffloadStrategy(host_optimizer="as_is", optimizer_in_backward=in_backward)
    assert differing(run(strategy=strategy), run()) == []

"""``lowmem_offload`` under ``*-mixed``: a weight stored in the compute dtype is used by its layer's op only, or the
first training step refuses (``strategies/offload/mixed_check.py``).

The conformance corpus's ``ema_teacher`` (a self-distillation teacher moved toward its student in ``training_step``)
trained otherwise before, silently: |diff|/|update| 1.45 on the teacher after 3 steps under ``bf16-mixed``.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.nn import functional as F

from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.conformance.corpus_kinds import EMATeacher


def _fit(module: L.LightningModule, precision: str = "bf16-mixed") -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(), precision=precision, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return trainer


def test_a_teacher_moved_in_place_toward_its_student_is_refused_naming_the_weight_and_the_call():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"stores `teacher\.0\.weight` in the compute dtype.*`TensorBase\.mul_`.*"
                                         r"precision='32-true' or 'bf16-true'"):
        _fit(EMATeacher())


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_other_precisions_keep_the_maths_of_plain_lightning_and_train_it(precision):
    torch.manual_seed(0)
    assert _fit(EMATeacher(), precision).global_step == 2


class Penalised(BoringModel):
    """A weight penalty read in ``training_step`` (``penalty``), or only the layer's metadata and its op (``layer_op``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.how == "penalty":
            out["loss"] = out["loss"] + 1e-3 * self.layer.weight.pow(2).sum()
        else:
            assert self.layer.weight.shape == (2, 32) and self.layer.weight.dtype == torch.bfloat16
            out["loss"] = out["loss"] + F.linear(batch, self.layer.weight.t().t(), self.layer.bias).sum() * 0
        return out


def test_a_weight_penalty_is_refused():
    with pytest.raises(ValueError, match=r"stores `layer\.weight`.*`TensorBase\.pow`"):
        _fit(Penalised("penalty"))


def test_metadata_views_and_the_layer_op_pass():
    assert _fit(Penalised("layer_op")).global_step == 2

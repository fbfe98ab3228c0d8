"""Lightning's own callbacks, run beside every flag on the callback hosts (``corpus.CALLBACK_HOSTS``).

Each companion is added, fresh, to both the technique's run and plain Lightning's, with the Trainer settings it
needs (epochs for the epoch-based ones, a validation loop for EarlyStopping, a logger for LearningRateMonitor).
Besides the weights and buffers, the decisions it takes are compared exactly (``observe``): the batch size a
``BatchSizeFinder`` chose, the LR a ``LearningRateFinder`` suggested, the epoch ``EarlyStopping`` stopped at, the LRs
``LearningRateMonitor`` logged, and the weights ``ModelCheckpoint`` wrote to ``last.ckpt``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import callbacks as lc

from tests.conformance.corpus import ModuleSpec


@dataclass(frozen=True)
class Companion:
    name: str
    build: Callable[[Path], list[Any]]
    trainer: dict[str, Any] = field(default_factory=dict)
    observe: Callable[[Any, Any, Path], dict[str, Any]] = lambda trainer, module, root: {}
    applies: Callable[[ModuleSpec], str | None] = lambda spec: None
    steps: int = 3  # optimizer steps of the run (for the record)


def _of(trainer: Any, cls: type) -> Any:
    return next(c for c in trainer.callbacks if isinstance(c, cls))


def _last_checkpoint(trainer: Any, module: Any, root: Path) -> dict[str, Any]:
    path = root / "ckpt" / "last.ckpt"
    if path.is_dir():  # DeepSpeed: a directory; its fp32 weights consolidated into one file
        from lightning_lowmem.zero import consolidate

        out = root / "consolidated.pt"
        consolidate(str(path), str(out))
        weights = torch.load(out, map_location="cpu", weights_only=True)
    else:
        weights = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {"ckpt_state": {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}}


def _backbone(spec: ModuleSpec) -> str | None:
    return None if "backbone" in spec.tags else "BackboneFinetuning needs a `backbone` attribute"


def _automatic(spec: ModuleSpec) -> str | None:
    return "Lightning's callback needs automatic optimization" if "manual" in spec.tags else None


EPOCHS = {"max_epochs": 3, "limit_train_batches": 2}
COMPANIONS: list[Companion] = [
    Companion("ModelCheckpoint(save_last)", lambda root: [lc.ModelCheckpoint(dirpath=root / "ckpt", save_last=True,
                                                                             every_n_train_steps=1, save_top_k=1)],
              {"enable_checkpointing": True}, _last_checkpoint),
    Companion("EarlyStopping", lambda root: [lc.EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)],
              {"max_epochs": 4, "limit_train_batches": 2, "limit_val_batches": 1},
              lambda t, m, root: {"stopped_epoch": _of(t, lc.EarlyStopping).stopped_epoch,
                                  "global_step": t.global_step}, steps=4),
    Companion("LearningRateMonitor", lambda root: [lc.LearningRateMonitor(logging_interval="step")],
              {"logger": "csv", "log_every_n_steps": 1}, lambda t, m, root: {"lrs": _of(t, lc.LearningRateMonitor).lrs}),
    Companion("StochasticWeightAveraging", lambda root: [lc.StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1,
                                                                                      annealing_epochs=1)],
              EPOCHS, applies=_automatic, steps=6),
    Companion("EMAWeightAveraging", lambda root: [lc.EMAWeightAveraging(decay=0.5)]),
    Companion("GradientAccumulationScheduler", lambda root: [lc.GradientAccumulationScheduler(scheduling={1: 2})],
              {"max_epochs": 2, "limit_train_batches": 4}, applies=_automatic, steps=6),
    Companion("BackboneFinetuning", lambda root: [lc.BackboneFinetuning(unfreeze_backbone_at_epoch=1,
                                                                        backbone_initial_ratio_lr=0.1, verbose=False)],
              {"max_epochs": 2, "limit_train_batches": 2}, applies=_backbone, steps=4),
    Companion("BatchSizeFinder", lambda root: [lc.BatchSizeFinder(init_val=4, max_trials=1, steps_per_trial=1)],
              observe=lambda t, m, root: {"batch_size": m.batch_size}),
    Companion("LearningRateFinder", lambda root: [lc.LearningRateFinder(min_lr=1e-4, max_lr=1e-1,
                                                                        num_training_steps=5, attr_name="lr")],
              observe=lambda t, m, root: {"lr": m.lr}),
    Companion("Timer", lambda root: [lc.Timer(duration="00:00:10:00")]),
]
COMPANIONS_BY_NAME = {c.name: c for c in COMPANIONS}

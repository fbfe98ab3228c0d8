"""Child process of ``tests/callbacks/test_adapters_io.py``: one LoRA run by the ``Adapters`` callback, alone.

    python tests/callbacks/_adapters_child.py SPEC_JSON

``SPEC_JSON``: ``strategy`` (``"auto"`` or ``"offload"``), ``precision``, ``steps`` (``max_steps``), ``save`` (a
checkpoint path written at the end, or null), ``resume`` (a ``ckpt_path``, or null), ``out`` (where the module's
final ``state_dict`` is written). The adapters have no dropout: Lightning keeps no RNG state in its checkpoints.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L
import torch

from lightning_lowmem import Adapters
from lightning_lowmem.strategies.offload import OffloadStrategy
from tests.callbacks.test_adapters import LitLM
from tests.helpers.models import random_batch


class Keyed(LitLM):
    """The batch of step ``i`` is drawn from a generator seeded with ``i``.

    NOTE: Lightning restarts a loader without a ``state_dict`` from the epoch's first batch when it resumes mid-epoch
    (Lightning's behaviour for every run, not what is measured here).
    """

    def training_step(self, batch, batch_idx):
        return super().training_step(random_batch(2, 16, seed=self.trainer.global_step), batch_idx)


def main(spec: dict) -> None:
    module = Keyed(None)
    strategy = OffloadStrategy() if spec["strategy"] == "offload" else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=spec["precision"],
                        max_steps=spec["steps"], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False,
                        callbacks=[Adapters(spec.get("kind", "lora"), r=4, alpha=8, dropout=0.0)])
    trainer.fit(module, ckpt_path=spec["resume"])
    if spec["save"]:
        trainer.save_checkpoint(spec["save"])
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, spec["out"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

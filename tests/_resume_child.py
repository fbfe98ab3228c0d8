"""Child process of ``tests/test_resume_across_processes.py``: one training run, straight or resumed, alone.

    python tests/_resume_child.py SPEC_JSON

``SPEC_JSON`` is a JSON object:

- ``strategy``: a registered name (``"auto"`` for plain Lightning), ``strategy_args``: arguments for the registered
  class (optional), ``precision``: the Trainer's flag;
- ``steps``: ``max_steps``; ``accumulation``: ``null``, ``{"trainer": k}`` (``accumulate_grad_batches=k``) or
  ``{"effective": E, "micro": m, "tokens": bool}`` (``AccumulationScheduler``, ``"tokens"``: token normalisation);
- ``save_at``: batch indices (0-based, counted over the whole run) after which ``trainer.save_checkpoint``
  writes ``ckpt_dir/batch=N.ckpt``, from ``on_train_batch_end`` as ``ModelCheckpoint`` does; an index inside
  an accumulation window is a mid-window checkpoint (a time-based ``ModelCheckpoint``, a validation that does
  not fall on a window edge, a SLURM requeue);
- ``save_every``: Lightning's ``ModelCheckpoint(every_n_train_steps=...)`` writes ``ckpt_dir/step=N.ckpt`` (N: the
  global step), in the straight run and in the resumed one alike, as a resumed run configured the same does;
- ``resume``: a checkpoint path for ``fit(ckpt_path=...)``, or ``null``;
- ``model``: ``"gpt2"`` (the default) or ``"llama"`` (a tiny LLaMA from a config); ``adapters``: ``null``, or the
  arguments of ``Adapters("lora", ...)`` (a LoRA fine-tune of the frozen model);
- ``out``: where to write the final state: every parameter's fp32 value (the host master for ``lowmem_offload``,
  DeepSpeed's fp32 partition gathered for ZeRO, taken at ``on_train_end`` while the strategy is set up), the
  module's parameters (after ``fit``; gathered at ``on_train_end`` for ZeRO) and its buffers.

Sample ``i`` is drawn from a generator seeded with ``i``, and a resumed run's loader starts after the samples the
checkpoint had processed: Lightning restarts a loader that has no ``state_dict`` from the epoch's first batch when it
resumes mid-epoch (it warns), which is Lightning's behaviour for every strategy, not what these tests measure. The model has no dropout
(Lightning does not put the RNG state in its checkpoints; plain Lightning's resume draws other masks).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_lowmem  # NOTE: registers the strategy names
from lightning_lowmem.demo.module import CausalLMModule

CONFIG = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
          "attn_pdrop": 0.0}
LLAMA = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 32}
SEQ = 16
SAMPLES = 64  # one epoch is longer than every run: a resume is always mid-epoch


class KeyedData(torch.utils.data.Dataset):
    """Sample ``i`` drawn from its own seed: the same data whatever the batch size (the scheduler sets it)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, 256, (SEQ,), generator=g)
        # NOTE: a varying number of padded tokens per sequence, so "tokens" and "samples" normalisation differ
        mask = (torch.arange(SEQ) < torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g)).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Module(CausalLMModule):
    """The demo LM with a step-wise LR warm-up, a batch size the scheduler can set, and data keyed by sample."""

    def __init__(self, batch_size: int = 2, loss_reduction: str = "mean", model: str = "gpt2") -> None:
        super().__init__(model_type=model, config=CONFIG if model == "gpt2" else LLAMA, learning_rate=1e-2,
                         warmup_steps=3, loss_reduction=loss_reduction)
        self.batch_size = batch_size

    def train_dataloader(self):
        # NOTE: Lightning restarts a loader without state from the epoch's first sample on a mid-epoch resume (it
        # warns); this one starts after the batches the checkpoint had processed (the loops are restored before
        # the loader is built), as a resumable loader's `load_state_dict` would
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed * self.batch_size
        return torch.utils.data.DataLoader(torch.utils.data.Subset(KeyedData(), range(done, SAMPLES)),
                                           batch_size=self.batch_size)


class SaveAt(L.Callback):
    def __init__(self, directory: str, batches: list[int]) -> None:
        self.directory, self.batches = directory, set(batches)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx in self.batches:
            trainer.save_checkpoint(os.path.join(self.directory, f"batch={batch_idx}.ckpt"))


class Capture(L.Callback):
    """The final fp32 weights (the optimizer's masters) at the end of training, while the strategy is set up."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        zero = type(strategy).__name__ == "ZeroStrategy"
        if zero:
            import deepspeed
            from deepspeed.utils import safe_get_full_fp32_param
        # NOTE: lowmem_offload's view shows the masters, and a frozen weight without one as its value (a streamed
        # block's is its host copy: the parameter itself holds a placeholder between uses)
        view = getattr(strategy, "masters_view", None)
        with view() if view is not None else contextlib.nullcontext():
            for name, p in pl_module.named_parameters():
                if zero:
                    self.state[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().clone()
                    # NOTE: ZeRO-3 partitions the module's own weights after fit: gathered here
                    with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                        self.state[f"module/{name}"] = p.detach().clone()
                else:
                    self.state[f"fp32/{name}"] = p.detach().float().clone()
        for i, group in enumerate(trainer.optimizers[0].param_groups):
            self.state[f"lr/{i}"] = torch.tensor(group["lr"], dtype=torch.float64)


def main() -> None:
    spec = json.loads(sys.argv[1])
    accumulation = spec.get("accumulation") or {}
    capture = Capture()
    callbacks: list[L.Callback] = [capture]
    kwargs = {}
    tokens = bool(accumulation.get("tokens"))
    if "effective" in accumulation:
        callbacks.insert(0, lightning_lowmem.AccumulationScheduler(
            accumulation["effective"], accumulation["micro"], loss_normalization="tokens" if tokens else "samples"))
    elif "trainer" in accumulation:
        kwargs["accumulate_grad_batches"] = accumulation["trainer"]
    if spec.get("save_at"):
        callbacks.append(SaveAt(spec["ckpt_dir"], spec["save_at"]))
    if spec.get("save_every"):  # NOTE: Lightning's own callback (no user hook that sees the masters): `step=N.ckpt`
        callbacks.append(ModelCheckpoint(spec["ckpt_dir"], filename="step={step}", every_n_train_steps=spec["save_every"],
                                         save_top_k=-1, auto_insert_metric_name=False))
    if spec.get("adapters"):
        callbacks.insert(0, lightning_lowmem.Adapters("lora", **spec["adapters"]))
    # NOTE: a different initialisation when resuming: everything must come from the checkpoint
    L.seed_everything(1 if spec.get("resume") else 0, verbose=False)
    module = Module(loss_reduction="sum" if tokens else "mean", model=spec.get("model", "gpt2"))
    strategy = spec["strategy"]
    if spec.get("strategy_args"):
        from lightning_lowmem._registry import STRATEGIES

        where, name, _, preset = STRATEGIES[strategy]
        strategy = getattr(importlib.import_module(where), name)(**preset, **spec["strategy_args"])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=spec["precision"], max_steps=spec["steps"],
        logger=False, enable_checkpointing=bool(spec.get("save_every")), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
        # NOTE: Lightning gives a training loader under DeepSpeed a shuffling DistributedSampler seeded with the
        # global seed, which the resumed run draws differently: one process has nothing to shard
        use_distributed_sampler=False, **kwargs,
    )
    trainer.fit(module, ckpt_path=spec.get("resume"))
    state = capture.state
    if not any(k.startswith("module/") for k in state):  # NOTE: what the user's module holds after fit
        state.update({f"module/{k}": v.detach().clone() for k, v in module.named_parameters()})
    state.update({f"buffer/{k}": v.detach().clone() for k, v in module.named_buffers()})
    state["global_step"] = torch.tensor(trainer.global_step)
    torch.save(state, spec["out"])
    print(json.dumps({"global_step": trainer.global_step}), flush=True)


if __name__ == "__main__":
    main()

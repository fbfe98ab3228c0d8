"""The conformance corpus: every module the sweep trains, by name, with its kind and what the flags need to know.

``MODULES[name].build()`` returns a fresh LightningModule with weights drawn from a seeded global RNG, so two builds
start equal. ``kind`` groups modules for the fast slice (one module per kind); ``tags`` say what a flag depends on:
``causal_lm`` (``ChunkedLMLoss`` applies), ``manual`` (manual optimization), ``optimizer:NAME`` (the module's own
optimizer), ``backbone`` (a ``backbone`` attribute: ``BackboneFinetuning``), ``compiled``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import torch

from tests.conformance import corpus_hf, corpus_kinds, corpus_libs, corpus_lightning, corpus_nets


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    kind: str
    factory: Callable[[], L.LightningModule]
    tags: frozenset[str]
    note: str = ""

    def build(self, seed: int = 0) -> L.LightningModule:
        """A fresh module, its weights drawn after ``torch.manual_seed(seed)``."""
        torch.manual_seed(seed)
        return self.factory()

    @property
    def optimizer(self) -> str:
        return next((t.split(":", 1)[1] for t in self.tags if t.startswith("optimizer:")), "adamw")


def _hf(family: corpus_hf.Family) -> ModuleSpec:
    tags = {f"optimizer:{family.optimizer}", "hf"}
    if family.kind == "causal_lm":
        tags.add("causal_lm")
    return ModuleSpec(family.name, family.kind, functools.partial(corpus_hf.HFModule, family), frozenset(tags),
                      family.note or f"transformers {family.model_type}")


def _net(name: str, kind: str, cls: type, *tags: str, optimizer: str | None = None) -> ModuleSpec:
    optimizer = optimizer or getattr(cls, "OPTIMIZER", "adamw")
    doc = (cls.__doc__ or "").strip().splitlines()[0]
    return ModuleSpec(name, kind, cls, frozenset({*tags, f"optimizer:{optimizer}"}), doc)


_NETS = [
    _net("cnn_bn", "cnn", corpus_nets.ConvBatchNorm, "backbone"),
    _net("cnn_gn", "cnn", corpus_nets.ConvGroupNorm),
    _net("mlp", "mlp", corpus_nets.MLP),
    _net("rnn", "rnn", corpus_nets.ElmanRNN),
    _net("lstm_packed", "rnn", corpus_nets.PackedLSTM),
    _net("gru_lm", "rnn", corpus_nets.GRULanguageModel),
    _net("frozen_backbone", "frozen_backbone", corpus_nets.FrozenBackbone, "backbone"),
    _net("configure_model", "configure_model", corpus_nets.BuiltInConfigureModel),
    _net("compiled_submodule", "compiled", corpus_nets.CompiledSubmodule, "compiled"),
    _net("outputs_dict", "outputs", corpus_nets.DictOutputs),
    _net("outputs_tuple", "outputs", corpus_nets.TupleOutputs),
    _net("outputs_dataclass", "outputs", corpus_nets.DataclassOutputs),
    _net("manual_3_optimizers", "manual_opt", corpus_lightning.ManualOptimization, "manual", optimizer="sgd+adam+adamw"),
    _net("torchmetrics", "torchmetrics", corpus_lightning.WithTorchmetrics),
    _net("sync_dist_logging", "sync_dist", corpus_lightning.SyncDistLogging),
    _net("clipping_override", "clipping", corpus_lightning.ClippingOverride),
    _net("peft_lora_llama", "peft", corpus_lightning.PeftLoRA, "causal_lm", "hf", "peft"),
    _net("peft_dora_bert", "peft", corpus_lightning.PeftDoRA, "hf", "peft"),
    _net("conv1d_audio", "conv1d", corpus_kinds.Conv1dAudio),
    _net("embedding_bag_recsys", "embedding_bag", corpus_kinds.EmbeddingBagRecommender),
    _net("tied_transformer_lm", "weight_tying", corpus_kinds.TiedTransformerLM),
    _net("instance_norm_stats", "running_stats", corpus_kinds.InstanceNormStats),
    _net("mlp_mixer", "mlp_mixer", corpus_kinds.MLPMixer),
    _net("scatter_gnn", "gnn", corpus_kinds.ScatterGNN),
    _net("shared_reentrant", "weight_sharing", corpus_kinds.SharedReentrantBlock),
    _net("parametrized_blocks", "parametrized", corpus_kinds.ParametrizedBlocks),
    _net("float64_head", "float64", corpus_kinds.Float64Head),
    _net("ema_teacher", "self_distillation", corpus_kinds.EMATeacher),
    # published libraries' model classes, where the `corpus` extra installed them
    *(_net(name, kind, cls) for name, (kind, cls) in corpus_libs.available().items()),
]

MODULES: dict[str, ModuleSpec] = {m.name: m for m in [*_NETS, *map(_hf, corpus_hf.FAMILIES)]}

#: the modules every Lightning callback is run on, beside every flag
CALLBACK_HOSTS = ("cnn_bn", "hf_gpt2")

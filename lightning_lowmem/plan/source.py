"""What the planner plans for: a model shape, a LightningModule (with its data) or a LightningCLI YAML, and how a
recipe is dry-run on it (:class:`Source`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.callbacks.adapters.callback import Adapters
from lightning_lowmem.callbacks.lean_optimizer import LeanOptimizer
from lightning_lowmem.core.reproducible import init_arguments
from lightning_lowmem.plan.cost import ModelShape
from lightning_lowmem.predict.configs import causal_lm_factory, causal_lm_init_args, resolve_config
from lightning_lowmem.predict.depth import find_blocks
from lightning_lowmem.predict.dry_run import dry_run
from lightning_lowmem.predict.estimate import is_module, module_class
from lightning_lowmem.predict.result import MemoryEstimate
from lightning_lowmem.predict.run_config import load_run_config
from lightning_lowmem.predict.run_spec import RunSpec


def effective_batch(callbacks: Sequence[Any], loader_batch: Any, accumulate_grad_batches: int) -> int | None:
    """Samples per optimizer step of a run: its ``AccumulationScheduler``'s effective batch, else the loader's batch
    times ``accumulate_grad_batches`` (None when the loader does not say)."""
    scheduler = next((c for c in callbacks if isinstance(c, AccumulationScheduler)), None)
    if scheduler is not None:
        return scheduler.effective_batch_size
    return loader_batch * accumulate_grad_batches if isinstance(loader_batch, int) else None


class _Identity:
    """A cache key part that is equal only for the same object, and keeps it alive (its id cannot be reused)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


@dataclass
class Source:
    """What is planned for: a model shape, a module (with data) or a YAML, and how to dry-run a recipe on it."""

    key: Any
    shape: ModelShape
    batch_size: int | None
    causal_lm: bool
    can_split: bool
    module: Any
    data: Any
    tokens: dict[str, int]
    notes: list[str]
    yaml_parts: dict[str, Any] = field(default_factory=dict)
    loader_batch: int | None = None
    scheduler: dict[str, Any] = field(default_factory=dict)
    #: a YAML's own callbacks that fix what the run trains (its ``Adapters``, ``LeanOptimizer``): every candidate keeps them
    fixed_callbacks: list[Any] = field(default_factory=list)
    #: a YAML's device (from its ``trainer.accelerator``) and why; None: not said
    target: str | None = None
    target_source: str = ""

    def estimate(self, run: RunSpec, target: str) -> MemoryEstimate:
        return dry_run(self.module, self.data, run=run, target=target, **self.tokens)

    @classmethod
    def of(cls, model: Any, batch_size: int | None, seq_len: int | None, data: Any, problems: list[str]
           ) -> Source | None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                problems.append(f"Passed `{name}={value!r}`; expected a positive integer.")
        if isinstance(model, (str, Path)) and str(model).endswith((".yaml", ".yml")):
            try:
                module, data, run = load_run_config(model)
            except (ValueError, FileNotFoundError) as err:
                problems.append(str(err))
                return None
            scheduler = next((c for c in run.callbacks if isinstance(c, AccumulationScheduler)), None)
            if batch_size is None:
                batch_size = effective_batch(run.callbacks, getattr(data, "batch_size", None),
                                             run.accumulate_grad_batches)
            source = cls._of_module(module, data, batch_size, seq_len, key=("yaml", str(Path(model).resolve())),
                                    problems=problems)
            if source is not None:
                source.yaml_parts = {"base_yaml": model}
                source.target, source.target_source = run.target, f"the YAML's {run.target_source}"
                # NOTE: what the run trains and with which optimizer (its maths) stays; the plan's techniques go around it
                source.fixed_callbacks = [c for c in run.callbacks if isinstance(c, (Adapters, LeanOptimizer))]
                if scheduler is not None:  # its maths (loss normalisation) stays; the plan sets the batch sizes
                    source.scheduler = {k: v for k, v in init_arguments(scheduler).items()
                                        if k not in ("effective_batch_size", "micro_batch_size", "memory_budget",
                                                     "measure")}
            return source
        try:
            named = None if is_module(model) else module_class(model)
        except ValueError as err:
            problems.append(str(err))
            return None
        if is_module(model) or named is not None:
            module = model if is_module(model) else named
            # NOTE: keyed by identity (the objects are kept alive by the key, so an id is never reused for another)
            source = cls._of_module(module, data, batch_size, seq_len, key=("module", _Identity(model),
                                                                            _Identity(data)), problems=problems)
            if source is not None:
                source.yaml_parts = {k: v for k, v in (("model", _class_yaml(module)), ("data", _class_yaml(data)))
                                     if v is not None}
            return source

        try:
            config = resolve_config(model)
        except (ValueError, FileNotFoundError, TypeError) as err:
            problems.append(str(err))
            return None
        if batch_size is None or seq_len is None:
            problems.append(f"Passed the model shape {model!r} without `batch_size` and `seq_len`.")
            return None
        try:
            factory = causal_lm_factory(config)
        except ValueError as err:
            problems.append(str(err))
            return None
        yaml_parts = {
            "model": {"class_path": "lightning_lowmem.demo.module.CausalLMModule",
                      "init_args": causal_lm_init_args(config)},
            "data": {"class_path": "lightning_lowmem.demo.data.StdlibTextDataModule",
                     "init_args": {"seq_len": seq_len, "batch_size": batch_size}},
        }
        num_params = sum(p.numel() for p in {id(p): p for p in factory().parameters()}.values())
        return cls(("shape", config.to_json_string()), ModelShape.of(num_params, config, seq_len), batch_size, True,
                   True, factory, None, {"batch_size": batch_size, "seq_len": seq_len}, [], yaml_parts)

    @classmethod
    def _of_module(cls, module: Any, data: Any, batch_size: int | None, seq_len: int | None, *, key: Any,
                   problems: list[str]) -> Source | None:
        is_factory = callable(module) and not isinstance(module, torch.nn.Module)
        with torch.device("meta"):
            probe = module() if is_factory else module
        # NOTE: an AccumulationScheduler sets the micro-batch through a `batch_size` attribute of the data module, or
        # of the module when it makes its own loader; a DataLoader given to `fit` keeps its batch
        if isinstance(data, L.LightningDataModule):
            holder = data if hasattr(data, "batch_size") else None
        else:
            holder = probe if data is None and hasattr(probe, "batch_size") else None
        data_batch = getattr(holder if holder is not None else data, "batch_size", None)
        if batch_size is None:
            batch_size = data_batch if isinstance(data_batch, int) else None
        notes = []
        if holder is None:
            notes.append("no `batch_size` attribute on the data module (or on the module making its own loader): "
                         "micro-batches not considered")
        config = getattr(getattr(probe, "model", probe), "config", None)
        found = find_blocks(probe)
        num_params = sum(p.numel() for p in {id(p): p for p in probe.parameters()}.values())
        causal_lm = config is not None and hasattr(getattr(probe, "model", None), "get_output_embeddings")
        shape = ModelShape.of(num_params, config, seq_len or getattr(data, "seq_len", None),
                              len(found[2]) if found else None)

        loader = data_batch if isinstance(data_batch, int) and data_batch != batch_size else None
        return cls(key, shape, batch_size, causal_lm, holder is not None and batch_size is not None, module, data, {},
                   notes, loader_batch=loader)


def _class_yaml(obj: Any) -> dict[str, Any] | None:
    """``{"class_path": ...}`` (with the ``init_args`` it saved, where it did) of a module or data class or object, as a
    written YAML names it; None for what has no importable class path (a lambda, a DataLoader, a class defined in a
    function or in ``__main__``)."""
    cls = obj if isinstance(obj, type) else type(obj)
    if obj is None or not issubclass(cls, (L.LightningModule, L.LightningDataModule)) or "<" in cls.__qualname__ \
            or cls.__module__ == "__main__":
        return None
    out: dict[str, Any] = {"class_path": f"{cls.__module__}.{cls.__qualname__}"}
    saved = {} if isinstance(obj, type) else dict(getattr(obj, "hparams", {}) or {})
    if saved:
        out["init_args"] = saved
    return out


__all__ = ["Source", "effective_batch"]

"""A chosen recipe as something to run: LightningCLI YAML for ``lowmem fit``, and Python ``Trainer`` arguments."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from lightning_lowmem._registry import STRATEGIES, builds
from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.callbacks.chunked_lm_loss.callback import ChunkedLMLoss
from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer
from lightning_lowmem.callbacks.optimizer_in_backward import OptimizerInBackward
from lightning_lowmem.core.atomic import atomic_write_text
from lightning_lowmem.core.reproducible import init_arguments
from lightning_lowmem.predict.run_spec import RunSpec

#: the names of the suite's technique callbacks, which a plan replaces in a YAML (its ``class_path``, short or full)
TECHNIQUES = tuple(cls.__name__ for cls in (ActivationCheckpointing, ActivationOffload, AccumulationScheduler,
                                            LowBitOptimizer, OptimizerInBackward, ChunkedLMLoss))


def _changed_arguments(obj: Any) -> dict[str, Any]:
    """The constructor arguments of a suite object that differ from their defaults, by name."""
    params = inspect.signature(type(obj)).parameters
    return {k: v for k, v in init_arguments(obj).items()
            if k not in params or params[k].default is inspect.Parameter.empty or params[k].default != v}


def _strategy_yaml(strategy: Any) -> Any:
    if isinstance(strategy, str):
        return strategy
    changed = _changed_arguments(strategy)
    for name, (_, _, _, preset) in STRATEGIES.items():  # a registered name says it shortest
        if builds(name, type(strategy)) and preset == changed:
            return name
    return {"class_path": f"{type(strategy).__module__}.{type(strategy).__name__}", "init_args": changed}


def trainer_yaml(run: RunSpec) -> dict[str, Any]:
    """The ``trainer:`` keys of a run (strategy, precision, technique callbacks)."""
    return {"strategy": _strategy_yaml(run.strategy), "precision": run.precision,
            "callbacks": [{"class_path": type(c).__name__, **({"init_args": a} if (a := _changed_arguments(c)) else {})}
                          for c in run.callbacks]}


def trainer_arguments(run: RunSpec) -> str:
    """``L.Trainer(...)`` with the run's strategy, precision and callbacks, as Python source."""

    def call(obj: Any) -> str:
        return f"{type(obj).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in _changed_arguments(obj).items()) + ")"

    strategy = _strategy_yaml(run.strategy)
    parts = [f"strategy={strategy!r}" if isinstance(strategy, str) else f"strategy={call(run.strategy)}",
             f"precision={run.precision!r}"]
    if run.callbacks:
        parts.append("callbacks=[" + ", ".join(call(c) for c in run.callbacks) + "]")
    return "L.Trainer(" + ", ".join(parts) + ")"


def write_yaml(path: str | Path, run: RunSpec, *, header: str, base_yaml: str | Path | None = None,
               model: dict[str, Any] | None = None, data: dict[str, Any] | None = None) -> Path:
    """Write a YAML ``lowmem fit --config`` runs: ``base_yaml`` with its techniques replaced by the run's, or a
    new file with ``model`` and ``data`` (``class_path``/``init_args`` dicts). Written atomically."""
    import yaml

    config: dict[str, Any] = (yaml.safe_load(Path(base_yaml).read_text()) or {}) if base_yaml is not None else {}
    trainer = config["trainer"] = config.get("trainer") or {}
    kept = [c for c in (trainer.get("callbacks") or [])
            if not (isinstance(c, dict) and str(c.get("class_path", "")).rsplit(".", 1)[-1] in TECHNIQUES)]
    planned = trainer_yaml(run)
    trainer.update(strategy=planned["strategy"], precision=planned["precision"],
                   callbacks=planned["callbacks"] + kept)
    if any(isinstance(c, AccumulationScheduler) for c in run.callbacks):
        trainer.pop("accumulate_grad_batches", None)
    trainer.setdefault("max_steps", 100)
    config.update({key: part for key, part in (("model", model), ("data", data)) if part is not None})
    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(config, sort_keys=False)
    path = Path(path)
    atomic_write_text(path, text)
    return path


__all__ = ["TECHNIQUES", "trainer_arguments", "trainer_yaml", "write_yaml"]

"""Model shapes by name: the shipped shapes, ``config.json`` files, model types and ``transformers`` config objects."""

from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem.demo.module import CausalLMModule, causal_lm_types

SHAPES_DIR = Path(__file__).resolve().parent / "shapes"


def shipped_shapes() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def resolve_config(model: Any, overrides: dict[str, Any] | None = None) -> Any:
    """A ``transformers`` config from a shipped shape name, a config.json path (or its directory), a model
    type (``"llama"``), a ``transformers`` config class name (``"GPT2Config"``), a dict or a config object.

    Raises:
        ValueError / FileNotFoundError: naming what was given and what is accepted (an override key the
            config does not have is refused with the nearest names).
    """
    import transformers
    from transformers import AutoConfig, PretrainedConfig

    overrides = dict(overrides or {})
    if isinstance(model, PretrainedConfig):
        cls_ = model.__class__
        return _with_overrides(model, overrides, lambda o: cls_.from_dict({**model.to_diff_dict(), **o}))
    if isinstance(model, dict):
        fields = {k: v for k, v in model.items() if not k.startswith("_")}
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"Passed a config dict without `model_type` (keys: {sorted(fields)[:8]}...).")
        return _with_overrides(AutoConfig.for_model(model_type, **fields), overrides,
                               lambda o: AutoConfig.for_model(model_type, **{**fields, **o}))
    if not isinstance(model, (str, Path)):
        raise TypeError(f"Passed a model of type {type(model).__name__}; expected a config, a path or a name.")
    name = str(model)
    if name in shipped_shapes():
        return resolve_config(json.loads((SHAPES_DIR / f"{name}.json").read_text()), overrides)
    path = Path(name).expanduser()
    if path.suffix == ".json" or path.exists() or "/" in name:
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"Passed `--model {name}`: no such config file ({file}).")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"Passed `--model {name}`: {file} is not valid JSON ({err}).") from err
        return resolve_config(data, overrides)
    cls = getattr(transformers, name.rsplit(".", 1)[-1], None)
    if isinstance(cls, type) and issubclass(cls, PretrainedConfig) and cls is not PretrainedConfig:
        return _with_overrides(cls(), overrides, lambda o: cls(**o))
    try:
        return _with_overrides(AutoConfig.for_model(name), overrides, lambda o: AutoConfig.for_model(name, **o))
    except ValueError as err:
        if "Unrecognized model" not in str(err) and "model_type" not in str(err):
            raise
        raise ValueError(
            f"Passed `model={name!r}`, which is not a shipped shape ({', '.join(shipped_shapes())}), a config.json "
            "path, a transformers config class (e.g. 'GPT2Config') or a model type (e.g. 'llama')."
        ) from None


def _with_overrides(config: Any, overrides: dict[str, Any], rebuild: Any) -> Any:
    """Check ``overrides`` against ``config``, then ``rebuild(overrides)``.

    NOTE: rebuilt, not set on the built config: fields derived in a config's ``__init__`` (LLaMA's ``head_dim``
    from ``hidden_size``) would keep their old values.
    """
    if not overrides:
        return config
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    problems = []
    for key, value in overrides.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            problems.append(f"`{key}` is not a field of {type(config).__name__}"
                            + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
            continue
        current = getattr(config, key, None)
        if isinstance(current, bool) != isinstance(value, bool) or (
            isinstance(current, (int, float)) and not isinstance(value, (int, float))
        ):
            problems.append(f"`{key}={value!r}` has the wrong type: {type(config).__name__}.{key} is "
                            f"{type(current).__name__} (now {current!r})")
    if problems:
        raise ValueError("Passed config overrides that do not apply: " + "; ".join(problems) + ".")
    return rebuild(overrides)


def causal_lm_init_args(config: Any) -> dict[str, Any]:
    """The demo ``CausalLMModule``'s arguments over ``config``: what a YAML's ``model: init_args:`` says."""
    if config.model_type not in causal_lm_types():
        raise ValueError(
            f"architecture `{config.model_type}` has no causal-LM head in transformers, so the demo training step "
            "(next-token cross-entropy) cannot run it; pass your own LightningModule to `estimate_memory`/`dry_run`"
        )
    fields = {k: v for k, v in config.to_diff_dict().items()
              if k not in ("model_type", "transformers_version", "architectures", "_name_or_path")}
    fields["vocab_size"] = config.vocab_size  # NOTE: the demo module defaults to its 258-token byte vocabulary
    return {"model_type": config.model_type, "config": fields}


def causal_lm_factory(config: Any) -> Any:
    """A zero-argument callable giving the demo ``CausalLMModule`` over ``config``, built on the meta device.

    NOTE: built once per config (the last one is kept): a table of estimates (``lowmem estimate --model``) or a plan
    runs a dozen dry runs of the same model, and building GPT-2 XL's 48 blocks takes seconds. A dry run copies it.
    """
    init_args = causal_lm_init_args(config)
    return functools.partial(_built_on_meta, init_args["model_type"], json.dumps(init_args["config"], sort_keys=True))


@functools.lru_cache(maxsize=1)
def _built_on_meta(model_type: str, config_json: str) -> CausalLMModule:
    with torch.device("meta"):
        return CausalLMModule(model_type=model_type, config=json.loads(config_json))


def max_positions(config: Any) -> int | None:
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


__all__ = ["SHAPES_DIR", "causal_lm_factory", "causal_lm_init_args", "max_positions", "resolve_config", "shipped_shapes"]

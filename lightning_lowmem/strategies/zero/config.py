"""DeepSpeed config building for ``ZeroStrategy``: the preset (:func:`reference_config`) <- the Trainer's flags
(:func:`trainer_settings`) <- the user's JSON (:func:`merge`); :func:`conflicts` decides where the JSON contradicts the
Trainer (docs/techniques/zero.md).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Literal

OffloadDevice = Literal["cpu", "nvme"]

# fp16 dynamic loss scaling of the reference JSON (loss_scale 0 = dynamic; Hugging Face's DeepSpeed docs' values)
FP16_REFERENCE: dict[str, Any] = {"loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                                  "hysteresis": 2, "min_loss_scale": 1}
_HALF_PRECISIONS = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


def load_user_config(config: str | os.PathLike | dict[str, Any] | None) -> dict[str, Any]:
    """A DeepSpeed config from a dict or a JSON file path (``{}`` for None)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"Passed `config={str(config)!r}`, which is not a file. Give a DeepSpeed JSON file or a dict.")
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"Passed `config={str(config)!r}`, which is not valid JSON: {err}") from err
        if not isinstance(loaded, dict):
            raise ValueError(  # noqa: TRY004  (a file's content, not the argument's type)
                f"Passed `config={str(config)!r}`; its JSON must be an object, got {type(loaded).__name__}.")
        return loaded
    raise TypeError(f"Passed `config` of type {type(config).__name__}; expected a dict, a JSON file path or None.")


def reference_config(
    *, stage: int, offload_optimizer: bool, offload_parameters: bool, offload_device: OffloadDevice,
    nvme_path: str | None, pin_memory: bool, overlap_comm: bool, contiguous_gradients: bool,
    reduce_bucket_size: int | Literal["auto"], allgather_bucket_size: int, sub_group_size: int,
    gather_16bit_weights_on_model_save: bool, zero_force_ds_cpu_optimizer: bool,
) -> dict[str, Any]:
    """The preset's DeepSpeed config: the reference ZeRO-2 and ZeRO-3 offload JSON settings."""
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": overlap_comm,
        "contiguous_gradients": contiguous_gradients,
        "reduce_bucket_size": reduce_bucket_size,
    }
    if stage in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=allgather_bucket_size, reduce_scatter=True)
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
            sub_group_size=sub_group_size,
            stage3_max_live_parameters=int(1e9),
            stage3_max_reuse_distance=int(1e9),
            stage3_gather_16bit_weights_on_model_save=gather_16bit_weights_on_model_save,
        )
    nvme = {"nvme_path": nvme_path} if offload_device == "nvme" else {}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": offload_device, "pin_memory": pin_memory, **nvme}
    if offload_parameters:
        zero["offload_param"] = {"device": offload_device, "pin_memory": pin_memory, **nvme}
    return {
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": zero_force_ds_cpu_optimizer,
        "steps_per_print": 2**31 - 1,  # NOTE: DeepSpeed's own step logging; Lightning logs
        "wall_clock_breakdown": False,
    }


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base`` (dicts merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def trainer_settings(*, accumulate_grad_batches: int, gradient_clip_val: float | None, precision: str,
                     micro_batch_size: int, fp16: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the Trainer's flags mean in DeepSpeed's config."""
    cfg: dict[str, Any] = {
        "gradient_accumulation_steps": int(accumulate_grad_batches),
        "gradient_clipping": float(gradient_clip_val or 0.0),
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
    }
    half = _HALF_PRECISIONS.get(precision)
    if half == "fp16":
        cfg["fp16"] = {"enabled": True, **FP16_REFERENCE, **(fp16 or {})}
    elif half == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def enabled(section: Any) -> bool:
    """Whether a DeepSpeed config section (``fp16``, ``bf16``) is enabled (``true`` or ``"true"``)."""
    if not isinstance(section, dict):
        return False
    value = section.get("enabled", False)
    return value is True or (isinstance(value, str) and value.lower() == "true")


def conflicts(trainer_cfg: dict[str, Any], user_cfg: dict[str, Any], precision: str) -> tuple[list[str], list[str]]:
    """Contradictions between the Trainer's settings and the user's JSON: ``(errors, warnings)``."""
    errors: list[str] = []
    warnings: list[str] = []
    gas = user_cfg.get("gradient_accumulation_steps")
    if gas not in (None, "auto") and int(gas) != trainer_cfg["gradient_accumulation_steps"]:
        errors.append(
            f"the DeepSpeed config sets `gradient_accumulation_steps={gas}` but "
            f"`Trainer(accumulate_grad_batches={trainer_cfg['gradient_accumulation_steps']})`: Lightning divides the "
            "loss and counts optimizer steps with the Trainer's value, so it must win. Set "
            "`Trainer(accumulate_grad_batches=...)` and remove the key from the JSON"
        )
    for key in ("fp16", "bf16"):
        section = user_cfg.get(key)
        if isinstance(section, dict) and "enabled" in section and enabled(section) != (key in trainer_cfg):
            want = "enabled" if enabled(user_cfg[key]) else "disabled"
            errors.append(
                f"the DeepSpeed config has `{key}` {want} but `Trainer(precision={precision!r})`: Lightning casts the "
                f"inputs from its precision flag, so the Trainer must win. Set `Trainer(precision="
                f"{'16-mixed' if key == 'fp16' else 'bf16-mixed'})` (or '32-true') and drop `{key}.enabled` from the JSON "
                "(other fp16 keys such as `initial_scale_power` may stay)"
            )
    clip = user_cfg.get("gradient_clipping")
    if clip not in (None, "auto") and trainer_cfg["gradient_clipping"] and float(clip) != trainer_cfg["gradient_clipping"]:
        warnings.append(
            f"the DeepSpeed config sets `gradient_clipping={clip}` and `Trainer(gradient_clip_val="
            f"{trainer_cfg['gradient_clipping']})`; the JSON wins (DeepSpeed alone clips)"
        )
    mbs = user_cfg.get("train_micro_batch_size_per_gpu")
    if mbs not in (None, "auto") and int(mbs) != trainer_cfg["train_micro_batch_size_per_gpu"]:
        warnings.append(
            f"the DeepSpeed config sets `train_micro_batch_size_per_gpu={mbs}` but the train loader's batch size is "
            f"{trainer_cfg['train_micro_batch_size_per_gpu']}; the JSON wins (DeepSpeed uses it only for its "
            "batch-size bookkeeping and throughput logs; the loader decides what is computed)"
        )
    return errors, warnings


def resolve_auto(cfg: dict[str, Any], hidden_size: int | None, world_size: int) -> None:
    """Replace ``"auto"`` values in place, as Hugging Face's integration does, from the model's hidden size."""
    zero = cfg.get("zero_optimization", {})
    sizes = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    } if hidden_size else {}
    # NOTE: DeepSpeed's own defaults where the model does not say its hidden size.
    fallback = {"reduce_bucket_size": int(5e8), "stage3_prefetch_bucket_size": int(5e7), "stage3_param_persistence_threshold": int(1e5)}
    for key, default in fallback.items():
        if zero.get(key) == "auto":
            zero[key] = sizes.get(key, default)
    if cfg.get("gradient_clipping") == "auto":
        cfg["gradient_clipping"] = 0.0
    if cfg.get("train_batch_size") == "auto":
        cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world_size
    if cfg.get("train_micro_batch_size_per_gpu") == "auto":
        cfg.pop("train_micro_batch_size_per_gpu")


def hidden_size_of(module: Any) -> int | None:
    """The hidden size of the first Hugging Face config found on ``module`` or its children."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        if isinstance(size, int):
            return size
    return None


def check_nvme_path(nvme_path: str | os.PathLike | None) -> str:
    """The NVMe offload directory, or a ValueError saying what is wrong with it."""
    if nvme_path is None:
        raise ValueError(
            "NVMe offload needs a directory: pass `ZeroStrategy(..., offload_device='nvme', nvme_path='/local_nvme')` "
            "(in YAML: `init_args: {nvme_path: ...}`), or set the `LOWMEM_NVME_PATH` environment variable to use "
            "the `lowmem_zero3_nvme` name."
        )
    path = Path(nvme_path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"Passed `nvme_path={str(nvme_path)!r}`, which is not an existing directory. Create it on a fast local "
            "NVMe drive (`mkdir -p ...`) or pass another one."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"Passed `nvme_path={str(nvme_path)!r}`, which this process (uid {os.getuid()}) cannot write to. "
            "Pass a directory you own, or fix its permissions."
        )
    return str(path)


_SIZES = {"reduce_bucket_size": "elements reduced per bucket", "allgather_bucket_size": "elements gathered per bucket",
          "sub_group_size": "elements per optimizer sub-group (stage 3)"}
# `zero_optimization` keys that are counts (`"auto"` where HF allows it); 0 is meaningful but for the bucket sizes
_CONFIG_SIZES = ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "stage3_prefetch_bucket_size",
                 "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance")
_POSITIVE = {"reduce_bucket_size", "allgather_bucket_size"}
_AUTO = {"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"}


def _size(value: Any, least: int = 1) -> int | None:
    """``value`` as an element count ``>= least`` (an int, or a float such as ``5e8`` with no fraction), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and value >= least else None


def size_arguments(stage: Any, sizes: dict[str, Any], defaults: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """Check ``ZeroStrategy``'s bucket/sub-group arguments (DeepSpeed would at ``fit``): ``(wrong types, bad values,
    settings ignored)``."""
    wrong, bad, ignored = [], [], []
    for name, value in sizes.items():
        if value is None and name == "reduce_bucket_size":
            continue
        if _size(value) is None:
            kind = isinstance(value, (int, float)) and not isinstance(value, bool)
            (bad if kind else wrong).append(
                f"Passed `{name}={value!r}`; expected a positive number of {_SIZES[name]} (an int such as "
                f"{int(defaults[name] or 2e8)})."
                + (" 0 would put every parameter in a sub-group of its own (a slow optimizer step)."
                   if name == "sub_group_size" and value == 0 else "")
            )
        elif value != defaults[name]:
            if name == "sub_group_size" and stage in (1, 2):
                ignored.append(f"`sub_group_size={value!r}` is used by ZeRO stage 3 only; with `stage={stage}` it is "
                               "ignored. Remove it, or use stage=3.")
            if name == "allgather_bucket_size" and stage == 3:
                ignored.append(f"`allgather_bucket_size={value!r}` is used by ZeRO stages 1 and 2 only (stage 3 gathers "
                               "by `stage3_prefetch_bucket_size`, in `config=`); it is ignored. Remove it.")
    return wrong, bad, ignored


def config_problems(user: dict[str, Any]) -> list[str]:
    """What is wrong with the ``zero_optimization`` section of a user's DeepSpeed config (stage, sizes)."""
    zero = user.get("zero_optimization")
    if zero is None:
        return []
    if not isinstance(zero, dict):
        return [f"`config['zero_optimization']` is a {type(zero).__name__}; expected a mapping of ZeRO settings."]
    problems = []
    stage = zero.get("stage")
    if "stage" in zero and not (isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3):
        problems.append(f"`config['zero_optimization']['stage']={stage!r}`; expected 0, 1, 2 or 3 (an int). Or leave it "
                        "out: `ZeroStrategy(stage=...)` sets it.")
    for key in _CONFIG_SIZES:
        least = 1 if key in _POSITIVE else 0
        if key in zero and not (zero[key] == "auto" and key in _AUTO) and _size(zero[key], least) is None:
            problems.append(f"`config['zero_optimization'][{key!r}]={zero[key]!r}`; expected "
                            + ("a positive int" if least else "an int >= 0") + (" or 'auto'" if key in _AUTO else "") + ".")
    return problems

"""Predicted peak memory for any combination of the suite's techniques, and ``lowmem estimate``.

:func:`estimate_memory` answers "will this model fit my card, and with which flags?" before any
training. The figure comes from a *trace*: a :func:`~lightning_lowmem.memory.dry_run.dry_run` of the
model's real training step on fake tensors, with the techniques applied in the trace. Closed forms
(:mod:`lightning_lowmem.memory.analytic`) are printed beside it as a sanity bound, and used in its
place only when the model cannot be traced (the result says why). ZeRO partitioning is the one
technique derived in closed form from the traced breakdown (DeepSpeed's partitioning of model
states is exact arithmetic; its bucket buffers are not modelled).

Example::

    from lightning_lowmem import estimate_memory

    est = estimate_memory("gpt2-xl", batch_size=4, seq_len=1024, precision="bf16-true", offload=True,
                          checkpointing="all", optimizer="adamw8bit")
    est.peak_device, est.peak_host, est.binding_phase    # bytes, bytes, "backward"
    est.to_dict()                                          # JSON-able: phases x roles x categories

Command line::

    lowmem estimate --model gpt2-xl --batch-size 4 --seq-len 1024 --budget 12GB
    lowmem estimate --model path/to/config.json --batch-size 8 --seq-len 512 --budget "6 GiB"
    lowmem estimate --model llama --set num_hidden_layers=8 --set hidden_size=1024 --batch-size 2 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_lowmem.memory.categories import CATEGORIES, MemoryBreakdown

PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")
CHECKPOINTING = ("all", "every_n", "sqrt", "selective", None)
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
ZERO_STAGES = (0, 2, 3)
SHAPES_DIR = Path(__file__).resolve().parent / "shapes"

Precision = Literal["32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed"]


def validate_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"Passed `{name}={value!r}`; expected one of {', '.join(repr(c) for c in choices)}.")


@dataclass
class Correction:
    """A CPU-trace-vs-GPU difference applied to the prediction.

    ``applied_in_trace``: the GPU behaviour was traced (the kernel choice was emulated on CPU);
    otherwise ``bytes`` were added. ``calibrated`` stays False until a GPU run confirms it.
    """

    name: str
    bytes: int
    applied_in_trace: bool
    detail: str
    calibrated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "applied_in_trace": self.applied_in_trace,
                "calibrated": self.calibrated, "detail": self.detail}


@dataclass
class MemoryEstimate:
    """Predicted peak bytes per phase (forward, backward, optimizer), role (device, host) and category.

    ``phases[name].device`` is the device-role breakdown at that phase's device peak, ``.host`` the
    host-role one at its host peak. ``method`` is ``"dry_run"`` (traced) or ``"analytic"`` (closed
    form; ``fallback_reason`` says why the trace was not used).
    """

    phases: dict[str, MemoryBreakdown]
    method: Literal["dry_run", "analytic"]
    target: str = "cpu"
    corrections: list[Correction] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    num_params: int | None = None
    techniques: dict[str, Any] = field(default_factory=dict)
    fallback_reason: str | None = None
    analytic_bound: dict[str, int] | None = None

    def peak(self, role: Literal["device", "host"] = "device") -> int:
        return max((bd.total(role) for bd in self.phases.values()), default=0)

    @property
    def peak_device(self) -> int:
        return self.peak("device")

    @property
    def peak_host(self) -> int:
        return self.peak("host")

    @property
    def binding_phase(self) -> str:
        """The phase whose device peak is the step's peak (the one a technique must shrink to help)."""
        return max(self.phases, key=lambda p: self.phases[p].total("device"))

    def fits(self, budget_bytes: int) -> bool:
        return self.peak_device <= budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_device": self.peak_device,
            "peak_host": self.peak_host,
            "binding_phase": self.binding_phase,
            "method": self.method,
            "target": self.target,
            "num_params": self.num_params,
            "techniques": self.techniques,
            "phases": {name: bd.to_dict() for name, bd in self.phases.items()},
            "corrections": [c.to_dict() for c in self.corrections],
            "notes": list(self.notes),
            "fallback_reason": self.fallback_reason,
            "analytic_bound": self.analytic_bound,
            "wall_s": round(self.wall_s, 3),
        }


# --- sizes ---------------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``"12 GiB"`` -> 12 * 2**30, ``"12GB"`` -> 12e9, ``"12e9"`` -> 12e9, ``"1.5 TB"``; ints pass through.

    Raises:
        ValueError: not a positive number with an optional unit B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            hint = " ('G' alone is ambiguous: write GB for 10^9 or GiB for 2^30)" if match and match.group(2) else ""
            raise ValueError(
                f"Passed a memory size {text!r} that does not parse{hint}; expected a number with an optional unit, "
                "e.g. '12GB' (12e9 bytes), '12 GiB' (12 * 2^30), '12e9' or '6144MiB'."
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    nbytes = value * _UNITS[unit]
    if not math.isfinite(nbytes) or nbytes <= 0:
        raise ValueError(f"Passed a memory size {text!r}; it must be positive.")
    return int(nbytes)


def fmt_gib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


# --- model configs ----------------------------------------------------------------------------------------
def shipped_shapes() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def resolve_config(model: Any, overrides: dict[str, Any] | None = None) -> Any:
    """A ``transformers`` config from a shipped shape name, a config.json path (or its directory), a model
    type (``"llama"``), a ``transformers`` config class name (``"GPT2Config"``), a dict or a config object.

    Raises:
        ValueError / FileNotFoundError: naming what was given and what is accepted.
    """
    import transformers
    from transformers import AutoConfig, PretrainedConfig

    overrides = dict(overrides or {})
    if isinstance(model, PretrainedConfig):
        config = model.__class__.from_dict({**model.to_dict(), **overrides})
        return config
    if isinstance(model, dict):
        fields = {k: v for k, v in model.items() if not k.startswith("_")}
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"Passed a config dict without `model_type` (keys: {sorted(fields)[:8]}...).")
        return AutoConfig.for_model(model_type, **{**fields, **overrides})
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
        return cls(**overrides)
    try:
        return AutoConfig.for_model(name, **overrides)
    except ValueError:
        raise ValueError(
            f"Passed `model={name!r}`, which is not a shipped shape ({', '.join(shipped_shapes())}), a config.json "
            "path, a transformers config class (e.g. 'GPT2Config') or a model type (e.g. 'llama')."
        ) from None


def _module_factory(config: Any) -> Any:
    from lightning_lowmem.demo.module import CausalLMModule, causal_lm_types

    if config.model_type not in causal_lm_types():
        raise ValueError(
            f"architecture `{config.model_type}` has no causal-LM head in transformers, so the demo training step "
            "(next-token cross-entropy) cannot run it; pass your own LightningModule to `estimate_memory`/`dry_run`"
        )
    fields = {k: v for k, v in config.to_diff_dict().items()
              if k not in ("model_type", "transformers_version", "architectures", "_name_or_path")}
    fields["vocab_size"] = config.vocab_size  # NOTE: the demo module defaults to its 258-token byte vocabulary
    return lambda: CausalLMModule(model_type=config.model_type, config=fields)


def _optimizer_factory(name: str | None) -> Any:
    import torch

    if name in (None, "adamw"):
        return None  # the module's own configure_optimizers (AdamW)
    if name == "adamw8bit":
        from lightning_lowmem._compat import require

        bnb = require("bitsandbytes", "`optimizer='adamw8bit'`")
        return lambda params: bnb.optim.AdamW8bit(params, lr=1e-4)
    return lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9)


# --- the estimate ----------------------------------------------------------------------------------------------
def estimate_memory(
    model_or_config: Any,
    batch_size: int,
    seq_len: int,
    *,
    precision: Precision = "32-true",
    offload: bool = False,
    checkpointing: Literal["all", "every_n", "sqrt", "selective"] | None = None,
    checkpointing_every_n: int = 2,
    activation_offload: bool = False,
    micro_batch_size: int | None = None,
    optimizer: Literal["adamw", "adamw8bit", "sgd"] | None = None,
    optimizer_in_backward: bool = False,
    zero_stage: Literal[0, 2, 3] = 0,
    world_size: int = 1,
    target: Literal["cpu", "cuda"] = "cuda",
    method: Literal["dry_run", "analytic"] = "dry_run",
    extrapolate: bool | None = None,
) -> MemoryEstimate:
    """Predict peak memory per phase, role and category for one combination of techniques.

    Args:
        model_or_config: a LightningModule (or a callable building one: its own ``training_step`` and
            ``configure_optimizers`` are traced), or a config: a shipped shape name (``gpt2``, ``gpt2-medium``,
            ``gpt2-large``, ``gpt2-xl``, ``opt-1.3b``, ``llama-7b``), a ``config.json`` path, a model type, a dict
            or a ``transformers`` config (traced with the demo ``CausalLMModule``'s causal-LM step).
        batch_size, seq_len: the (effective) batch and its sequence length.
        precision: Lightning's precision string.
        offload: ``strategy="lowmem_offload"``: half-precision compute weights on the device, fp32 masters,
            gradients and optimizer on the host.
        checkpointing: ``ActivationCheckpointing(policy=...)``: ``"all"``, ``"every_n"``, ``"sqrt"``, ``"selective"``.
        activation_offload: ``ActivationOffload``: saved activations held on the host between forward and backward.
        micro_batch_size: accumulation: the step runs ``ceil(batch_size / micro_batch_size)`` micro-batches.
        optimizer: ``"adamw"`` (default), ``"adamw8bit"`` (bitsandbytes), ``"sgd"`` (momentum 0.9). For a
            LightningModule, None keeps its own ``configure_optimizers``.
        optimizer_in_backward: ``OptimizerInBackward``: step each parameter when its gradient is ready.
        zero_stage, world_size: DeepSpeed ZeRO 2/3 over ``world_size`` ranks (model states partitioned
            in closed form over the traced activations; with ``offload=True``, the optimizer on the host).
        target: ``"cuda"`` applies the listed CPU-vs-GPU corrections; ``"cpu"`` predicts a CPU run as traced.
        method: ``"analytic"`` skips the trace (closed form only; 40-71 % low on HF models).
        extrapolate: see :func:`~lightning_lowmem.memory.dry_run.dry_run`.

    Raises:
        ValueError / TypeError: a bad argument, named with the accepted values.
    """
    validate_choice("precision", precision, PRECISIONS)
    validate_choice("checkpointing", checkpointing, CHECKPOINTING)
    validate_choice("optimizer", optimizer, (*OPTIMIZERS, None))
    validate_choice("zero_stage", zero_stage, ZERO_STAGES)
    validate_choice("target", target, ("cpu", "cuda"))
    validate_choice("method", method, ("dry_run", "analytic"))
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Passed `{name}={value!r}`; expected a positive integer.")
    micro = batch_size if micro_batch_size is None else micro_batch_size
    if not isinstance(micro, int) or not 1 <= micro <= batch_size:
        raise ValueError(
            f"Passed `micro_batch_size={micro_batch_size!r}`; expected an integer in 1..batch_size={batch_size}."
        )
    if zero_stage and optimizer_in_backward:
        raise ValueError("Passed `zero_stage` and `optimizer_in_backward=True`; DeepSpeed runs its own optimizer step.")
    techniques = {"precision": precision, "offload": offload, "checkpointing": checkpointing,
                  "activation_offload": activation_offload, "micro_batch_size": micro,
                  "accumulate_grad_batches": math.ceil(batch_size / micro), "optimizer": optimizer or "adamw",
                  "optimizer_in_backward": optimizer_in_backward, "zero_stage": zero_stage, "world_size": world_size}
    if checkpointing == "every_n":
        techniques["checkpointing_every_n"] = checkpointing_every_n

    import lightning as L

    is_module = isinstance(model_or_config, L.LightningModule) or (
        callable(model_or_config) and not isinstance(model_or_config, (str, Path, dict))
        and not hasattr(model_or_config, "model_type")
    )
    config = None if is_module else resolve_config(model_or_config)
    bound, num_params = _analytic(config, micro, seq_len, precision, optimizer or "adamw", checkpointing,
                                  checkpointing_every_n, flash=True if target == "cuda" else None,
                                  offload=offload and not zero_stage)
    # NOTE: ZeRO keeps half-precision compute weights (and bf16/fp16 activations) whatever the mixed setting
    trace_precision = precision
    if zero_stage:
        trace_precision = {"bf16-mixed": "bf16-true", "16-mixed": "16-true"}.get(precision, precision)
    fallback = None
    est = None
    if method == "dry_run":
        from lightning_lowmem.memory.dry_run import DryRunUnsupportedError, dry_run

        try:
            factory = model_or_config if is_module else _module_factory(config)
        except ValueError as err:
            factory, fallback = None, str(err)
        if factory is not None:
            try:
                est = dry_run(
                    factory, batch_size=micro, seq_len=seq_len, precision=trace_precision,
                    checkpointing=checkpointing, checkpointing_every_n=checkpointing_every_n,
                    activation_offload=activation_offload, offload=offload and not zero_stage,
                    optimizer_in_backward=optimizer_in_backward,
                    accumulate_grad_batches=techniques["accumulate_grad_batches"],
                    optimizer=None if zero_stage else _optimizer_factory(optimizer),
                    target=target, extrapolate=extrapolate,
                )
            except DryRunUnsupportedError as err:
                fallback = str(err)
    if est is None:
        if bound is None:
            raise ValueError(f"Cannot estimate this model: {fallback or 'no trace and no transformer config'}.")
        est = MemoryEstimate(phases=bound, method="analytic", target=target, num_params=num_params,
                             fallback_reason=fallback,
                             notes=["closed form (analytic.py): a lower bound, 40-71 % below measured HF peaks"])
    if zero_stage:
        gathered = None
        if config is not None:
            from lightning_lowmem.memory.analytic import transformer_shape

            try:
                shape = transformer_shape(config)
                gathered = max((shape.num_params - shape.vocab * shape.hidden) // shape.num_layers,
                               shape.vocab * shape.hidden)
            except ValueError:
                gathered = None
        _apply_zero(est, zero_stage, world_size, offload, optimizer or "adamw", trace_precision, gathered)
    est.techniques = techniques
    if bound is not None:
        est.analytic_bound = {phase: bd.total("device") for phase, bd in bound.items()}
        est.analytic_bound["peak"] = max(est.analytic_bound.values())
    if est.num_params is None:
        est.num_params = num_params
    return est


def _analytic(config: Any, micro: int, seq_len: int, precision: str, optimizer: str, checkpointing: str | None,
              every_n: int, flash: bool | None = None, offload: bool = False) -> tuple[dict[str, MemoryBreakdown] | None, int | None]:
    """The closed-form bound, with exact parameter counts from a meta model when the architecture builds."""
    if config is None:
        return None, None
    from lightning_lowmem.memory.analytic import analytic_phases

    num_params = largest = None
    try:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        unique = {id(p): p for p in meta.parameters()}.values()
        num_params = sum(p.numel() for p in unique)
        largest = max(p.numel() for p in unique)
    except Exception:  # noqa: BLE001  NOTE: any architecture transformers cannot build: closed-form counts
        pass
    try:
        phases = analytic_phases(config, micro, seq_len, precision=precision, optimizer=optimizer,
                                 checkpointing=checkpointing, checkpointing_every_n=every_n,
                                 num_params=num_params, largest_param=largest, flash_attention=flash,
                                 offload=offload)
    except ValueError:
        return None, num_params
    return phases, num_params or None


def _apply_zero(est: MemoryEstimate, stage: int, world_size: int, offload: bool, optimizer: str,
                precision: str, gathered_params: int | None) -> None:
    """Replace the traced model states by DeepSpeed's partitioned ones (``ZeroStrategy`` presets).

    Per rank, P parameters, N ranks, h = 2 B (half precision) or 4 B (fp32): weights hP (stage 3: hP/N),
    gradients hP/N, optimizer (fp32 masters 4P when h = 2, plus AdamW 8P / 8-bit ~2P / SGD 4P) over N. With
    ``offload``: ``offload_optimizer`` (state, its step and fp32 gradients on the host; device gradients leave as
    they are reduced) and, for stage 3, ``offload_parameters`` (the device holds the gathered parameters of the
    module in use and the next one, ``2 x gathered_params``).
    """
    from lightning_lowmem.memory.analytic import optimizer_state_bytes_per_param

    P, N = est.num_params or 0, world_size
    h = 4 if precision == "32-true" else 2
    state = (4 * P if h == 2 else 0) + int(optimizer_state_bytes_per_param(optimizer, 4, P))
    weights = h * P if stage == 2 else h * P // N
    if stage == 3 and offload:
        weights = 2 * h * gathered_params if gathered_params else 0
    grads = h * P // N
    for phase, bd in est.phases.items():
        dev = bd.device
        has_grads = dev["gradients"] > 0
        dev["weights"] = weights
        dev["gradients"] = 0 if offload else (grads if has_grads else 0)
        dev["optimizer_state"] = 0 if offload else state // N
        if phase == "optimizer" and offload:
            dev["other"] = 0
        bd.host = dict.fromkeys(CATEGORIES, 0)
        if offload:
            bd.host["optimizer_state"] = state // N
            bd.host["gradients"] = 4 * P // N
            if stage == 3:
                bd.host["weights"] = h * P // N
    est.notes.append(
        f"ZeRO-{stage} over {N} rank(s): model states from DeepSpeed's partitioning in closed form "
        f"({precision} compute weights{', fp32 masters in the optimizer' if h == 2 else ''}"
        f"{'; optimizer and (stage 3) parameters offloaded' if offload else ''}); reduce/all-gather buckets "
        "not modelled"
    )


# --- the command line --------------------------------------------------------------------------------------------
COMBINATIONS: list[tuple[str, dict[str, Any]]] = [
    ("fp32 AdamW (baseline)", {}),
    ("bf16-mixed", {"precision": "bf16-mixed"}),
    ("bf16-true", {"precision": "bf16-true"}),
    ("bf16-true + ckpt(all)", {"precision": "bf16-true", "checkpointing": "all"}),
    ("bf16-true + ckpt(all) + 8-bit AdamW", {"precision": "bf16-true", "checkpointing": "all",
                                             "optimizer": "adamw8bit"}),
    ("offload + ckpt(all)", {"precision": "bf16-true", "offload": True, "checkpointing": "all"}),
    ("offload + ckpt(all) + 8-bit AdamW", {"precision": "bf16-true", "offload": True, "checkpointing": "all",
                                           "optimizer": "adamw8bit"}),
    ("offload + ckpt(all) + act. offload", {"precision": "bf16-true", "offload": True, "checkpointing": "all",
                                            "activation_offload": True}),
    ("bf16-true + ckpt(all) + opt-in-bwd", {"precision": "bf16-true", "checkpointing": "all",
                                            "optimizer_in_backward": True}),
    ("ZeRO-2 + ckpt(all)", {"precision": "bf16-mixed", "zero_stage": 2, "checkpointing": "all"}),
    ("ZeRO-3 + offload + ckpt(all)", {"precision": "bf16-mixed", "zero_stage": 3, "offload": True,
                                      "checkpointing": "all"}),
]


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"Passed `--set {item}`; expected KEY=VALUE, e.g. `--set n_layer=6`.")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``lowmem estimate``: predicted device and host peaks of the suite's technique combinations."""
    parser = argparse.ArgumentParser(prog="lowmem estimate", description=main.__doc__)
    parser.add_argument("--model", required=True,
                        help=f"shipped shape ({', '.join(shipped_shapes())}), config.json path, model type or "
                        "config class")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="accumulation micro-batch (default: the batch size)")
    parser.add_argument("--budget", default=None, help="device memory, e.g. 12GB, '12 GiB', 12e9")
    parser.add_argument("--target", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--only", action="append", default=None, help="run only combinations whose name contains this")
    parser.add_argument("--analytic", action="store_true", help="closed form only (fast, 40-71%% low on HF models)")
    parser.add_argument("--json", default=None, help="also write every estimate to this JSON file")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        budget = parse_bytes(args.budget) if args.budget is not None else None
        config = resolve_config(args.model, _parse_set(args.set))
        for name, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
            if value < 1:
                raise ValueError(f"Passed `{name} {value}`; expected a positive integer.")
    except (ValueError, FileNotFoundError, TypeError) as err:
        parser.exit(2, f"lowmem estimate: error: {err}\n")
    combos = [(n, kw) for n, kw in COMBINATIONS if not args.only or any(o.lower() in n.lower() for o in args.only)]
    rows, payload = [], []
    for name, kw in combos:
        try:
            est = estimate_memory(config, args.batch_size, args.seq_len, micro_batch_size=args.micro_batch_size,
                                  target=args.target, world_size=args.world_size,
                                  method="analytic" if args.analytic else "dry_run", **kw)
        except ModuleNotFoundError as err:  # an optional extra (bitsandbytes) missing: say so, keep going
            rows.append((name, "-", "-", "-", "-", f"skipped: {err}"))
            continue
        fits = "-" if budget is None else ("yes" if est.fits(budget) else "no")
        rows.append((name, fmt_gib(est.peak_device), fmt_gib(est.peak_host), est.binding_phase, fits,
                     est.method + (f" ({est.fallback_reason})" if est.fallback_reason else "")))
        payload.append({"combination": name, **est.to_dict()})
    fits_header = "fits" + (f" {args.budget}" if budget else "")
    header = ("combination", "device peak", "host peak", "binds", fits_header, "method")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"{args.model}: batch {args.batch_size}, seq {args.seq_len}, target {args.target}"
          + (f", budget {args.budget} = {budget:,} B" if budget else ""))
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    if args.target == "cuda":
        print("GPU corrections (uncalibrated, no GPU run yet): 1-byte dropout masks, flash SDPA, foreach AdamW "
              "traced; +512 MiB CUDA context; allocator fragmentation not modelled.")
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


__all__ = ["MemoryEstimate", "Correction", "estimate_memory", "parse_bytes", "resolve_config", "main"]

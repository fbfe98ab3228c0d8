"""``lowmem estimate``: predicted device and host peaks, from the dry run, before any training.

    lowmem estimate --config configs/demo.yaml --budget 6GB          # exactly the run `lowmem fit` would do
    lowmem estimate --model gpt2-xl --batch-size 4 --seq-len 1024 --budget 12GB   # the suite's combinations

More examples in docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_lowmem.core.units import fmt_size, parse_bytes

_EPILOG = (
    "--config predicts the run a LightningCLI YAML describes (model, data, strategy, precision, callbacks, "
    "accumulation: what `lowmem fit --config` runs). --model predicts the suite's technique combinations for a "
    "model shape with the demo causal-LM step."
)


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def glue_values(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``--flag -5GB`` as ``--flag=-5GB``, so that a negative size reaches our check instead of argparse's "expected one
    argument" (argparse takes a value starting with ``-`` for an option unless it looks like a plain number)."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in flags and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


_DATA_ARG = "--data.init_args."


def split_data_args(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """``argv`` without its ``--data.init_args.KEY VALUE`` (or ``=VALUE``) pairs, as LightningCLI spells them, and
    those as a dict (a value read as JSON where it parses, else kept as a string)."""
    rest: list[str] = []
    found: dict[str, Any] = {}
    args = iter(argv)
    for arg in args:
        if not arg.startswith(_DATA_ARG):
            rest.append(arg)
            continue
        key, sep, raw = arg[len(_DATA_ARG):].partition("=")
        if not sep and (raw := next(args, None)) is None:
            raise ValueError(f"Passed `{arg}` without a value; e.g. `{_DATA_ARG}batch_size 4`")
        found[key] = _json_or_text(raw)
    return rest, found


def build_data(class_path: str, data_args: str | None, init_args: dict[str, Any]) -> Any:
    """The LightningDataModule ``class_path`` names, built with ``--data-args`` JSON and ``--data.init_args.*``.

    Raises:
        ValueError: naming what was given (no such class, not a LightningDataModule, arguments it refuses).
    """
    import importlib

    import lightning as L

    args: dict[str, Any] = {}
    if data_args:
        try:
            args = json.loads(data_args)
        except json.JSONDecodeError as err:
            raise ValueError(f"Passed `--data-args {data_args}`, which is not JSON ({err}); e.g. "
                             "`--data-args '{\"batch_size\": 4}'`") from None
        if not isinstance(args, dict):
            raise ValueError(f"Passed `--data-args {data_args}`; expected a JSON object of init arguments")
    args.update(init_args)
    module_name, _, attr = class_path.rpartition(".")
    cls = None
    if module_name:
        try:
            cls = getattr(importlib.import_module(module_name), attr, None)
        except ImportError as err:
            raise ValueError(f"Passed `--data {class_path}`: cannot import {module_name!r} ({err})") from None
    if not (isinstance(cls, type) and issubclass(cls, L.LightningDataModule)):
        raise ValueError(  # noqa: TRY004  (a name that names no data module: a wrong value, as a typo in a name)
            f"Passed `--data {class_path}`, which does not name a LightningDataModule class; give its "
                         "class path, e.g. `--data my_project.data.MyDataModule`")
    try:
        return cls(**args)
    except TypeError as err:
        raise ValueError(f"Passed `--data {class_path}` with init arguments {args}: {cls.__name__}() refused them "
                         f"({err})") from None


def size_problem(flag: str, value: str) -> tuple[int | None, str | None]:
    """``(bytes, None)`` for a memory size given to ``flag``, or ``(None, why not)`` naming it and an example."""
    try:
        size = parse_bytes(value, f"`{flag}`")
    except ValueError as err:
        text = str(value).strip()
        try:  # NOTE: "-5GB" is a negative size, "-" or "-lots" do not parse at all
            size = -parse_bytes(text[1:], f"`{flag}`") if text.startswith("-") else 0
        except ValueError:
            size = 0
        if size == 0:
            return None, str(err)
    if size <= 0:
        return None, f"Passed `{flag} {value}`; a memory size must be positive, e.g. `{flag} 12GB`"
    return size, None


def output_problems(args: argparse.Namespace, flags: Sequence[str]) -> list[str]:
    """What is wrong with the files ``--FLAG`` would write: a directory, or one in a directory that does not exist."""
    problems = []
    for flag in flags:
        value = getattr(args, flag)
        if value and Path(value).is_dir():
            problems.append(f"Passed `--{flag} {value}`, which is a directory; give a file name in it")
        elif value and not Path(value).parent.is_dir():
            parent = Path(value).parent
            problems.append(f"Passed `--{flag} {value}`, but the directory {str(parent)!r} does not exist; create it "
                            f"(`mkdir -p {parent}`) or give a path in an existing one")
    return problems


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowmem estimate", description=__doc__.split("\n")[0], epilog=_EPILOG)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="a LightningCLI YAML: the run `lowmem fit --config` would do")
    what.add_argument("--model", help="a shipped shape (gpt2 ... gpt2-xl, llama-7b, ...), config.json path, model type "
                      "or config class")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    add_data_arguments(parser)
    parser.add_argument("--batch-size", type=int, help="with --model: the (effective) batch size")
    parser.add_argument("--seq-len", type=int, help="with --model: the sequence length")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="with --model: accumulation micro-batch (default: the batch size)")
    parser.add_argument("--budget", default=None, help="device memory, e.g. 12GB, '12 GiB', 12e9")
    parser.add_argument("--target", choices=("cuda", "cpu"), default=None,
                        help="the device predicted (default: with --config the YAML's trainer.accelerator, `auto` "
                        "meaning CUDA where this machine has it, else the CPU; with --model cuda)")
    parser.add_argument("--world-size", type=int, default=1, help="with --model: processes (ZeRO partitioning)")
    parser.add_argument("--adapters", default=None, metavar="KIND", help="with --model: every combination trains "
                        "LoRA ('lora') or DoRA ('dora') adapters on a frozen base (the Adapters callback; rows show "
                        "weights, gradients, optimizer state and activations at the binding phase)")
    parser.add_argument("--adapter-r", type=int, default=None, help="with --adapters: the adapters' rank (default 16)")
    parser.add_argument("--quantize-base", default=None, metavar="QUANT", help="with --adapters: the frozen base in "
                        "4-bit ('nf4', 'fp4') or 8-bit ('int8') bitsandbytes layers (QLoRA)")
    parser.add_argument("--optimizer", default=None, metavar="KIND", help="with --model: every combination steps "
                        "this optimizer instead of the module's AdamW: 'adamw8bit' (LowBitOptimizer, bitsandbytes), "
                        "or a LeanOptimizer at its defaults: 'galore', 'apollo', 'apollo_mini', 'adam_mini', "
                        "'adamw4bit', 'torchao_adamw8bit' (its own code runs in the dry run); the combinations with an "
                        "optimizer of their own are left out")
    parser.add_argument("--only", action="append", default=None, help="with --model: combinations whose name has this")
    parser.add_argument("--analytic", action="store_true", help="closed form only (fast; 21%% low to 6%% high on the benchmarked HF models)")
    parser.add_argument("--full-trace", action="store_true", help="trace every block (no extrapolation)")
    parser.add_argument("--json", default=None, help="also write every estimate to this JSON file")
    return parser


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", help="with --model CLASS_PATH of a LightningModule: the LightningDataModule that feeds "
                        "it (a class path); its arguments as `--data.init_args.KEY VALUE` (repeatable) or --data-args")
    parser.add_argument("--data-args", help="the --data class's init arguments as a JSON object, e.g. "
                        "'{\"batch_size\": 4}'")


def data_problems(args: argparse.Namespace, init_args: dict[str, Any], module_class: Any) -> tuple[Any, list[str]]:
    """``(the data module or None, problems)`` of ``--data``, ``--data-args`` and ``--data.init_args.*``."""
    if args.data is None:
        given = ["--data-args"] if args.data_args else []
        given += [f"{_DATA_ARG}{k}" for k in init_args]
        return None, [f"Passed `{'`, `'.join(given)}` without `--data CLASS_PATH`"] if given else []
    if args.config:
        return None, ["`--data` is for --model; with --config the YAML's `data:` section names the data"]
    problems = []
    if module_class is None:
        problems.append(f"`--data` feeds a LightningModule: pass its class path as --model (given {args.model!r}, "
                        "which is a model shape: it trains on `--batch-size` x `--seq-len` tokens)")
    try:
        return build_data(args.data, args.data_args, init_args), problems
    except ValueError as err:
        return None, [*problems, str(err)]


def _check(args: argparse.Namespace, init_args: dict[str, Any]
           ) -> tuple[int | None, list[tuple[str, dict[str, Any]]], Any, Any]:
    """Every problem with the arguments at once, before anything is traced."""
    from lightning_lowmem.predict.estimate import COMBINATIONS, module_class

    try:
        cls = module_class(args.model, "--model ") if args.model else None
    except ValueError as err:  # NOTE: a class path that does not import: said, not taken for a model shape
        raise ValueError("\n- ".join(["the arguments do not describe an estimate:", str(err)])) from None
    data, problems = data_problems(args, init_args, cls)
    budget = None
    if args.budget is not None:
        budget, problem = size_problem("--budget", args.budget)
        problems += [problem] if problem else []
    problems += output_problems(args, ("json",))
    combos: list[tuple[str, dict[str, Any]]] = []
    config = None
    if args.config:
        for flag in ("batch_size", "seq_len", "micro_batch_size", "only"):
            if getattr(args, flag):
                problems.append(f"`--{flag.replace('_', '-')}` is for --model; with --config the YAML describes the run")
        if args.set:
            problems.append("`--set` is for --model; with --config edit the YAML")
        if args.adapters or args.adapter_r is not None or args.quantize_base:
            problems.append("`--adapters`/`--adapter-r`/`--quantize-base` are for --model; with --config add "
                            "`class_path: Adapters` to the YAML's trainer.callbacks")
        if args.optimizer:
            problems.append("`--optimizer` is for --model; with --config add `class_path: LeanOptimizer` (or "
                            "LowBitOptimizer) to the YAML's trainer.callbacks")
    else:
        for flag in ("batch_size", "seq_len"):
            value = getattr(args, flag)
            if (value is None and cls is None) or (value is not None and value < 1):
                problems.append(f"Passed `--{flag.replace('_', '-')} {value}`; --model needs a positive integer")
        if args.micro_batch_size is not None and args.batch_size and (args.micro_batch_size < 1
                                                                     or args.batch_size % args.micro_batch_size):
            problems.append(f"Passed `--micro-batch-size {args.micro_batch_size}`; it must divide `--batch-size "
                            f"{args.batch_size}` (AccumulationScheduler steps on whole micro-batches)")
        if args.world_size < 1:
            problems.append(f"Passed `--world-size {args.world_size}`; expected a positive integer")
        problems += [*adapter_problems(args), *optimizer_problems(args)]
        combos = [(n, kw) for n, kw in COMBINATIONS if not args.only or any(o.lower() in n.lower() for o in args.only)]
        if args.optimizer:  # NOTE: one optimizer for every row: the rows that choose their own are another question
            combos = [(n, kw) for n, kw in combos if "optimizer" not in kw]
        if not combos:
            problems.append(f"Passed `--only {' '.join(args.only)}`, which matches no combination; the names are: "
                            + "; ".join(n for n, _ in COMBINATIONS))
        config = cls  # a LightningModule class path: its own step (and data, unless sized)
        if config is None:
            try:
                config = _model_config(args)
            except (ValueError, FileNotFoundError, TypeError) as err:
                problems.append(str(err))
    if problems:
        raise ValueError("\n- ".join(["the arguments do not describe an estimate:", *problems]))
    return budget, combos, config, data


def adapter_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with ``--adapters``, ``--adapter-r`` and ``--quantize-base`` (named as given), all at once."""
    from lightning_lowmem.callbacks.adapters.callback import KINDS
    from lightning_lowmem.callbacks.adapters.quantize_base import QUANT_TYPES
    from lightning_lowmem.core.optional import require

    problems = []
    if args.adapters is None:
        given = [f"`--{f.replace('_', '-')} {getattr(args, f)}`" for f in ("adapter_r", "quantize_base")
                 if getattr(args, f) is not None]
        if given:
            problems.append(f"Passed {' and '.join(given)} without `--adapters`; add `--adapters lora` (or dora) to "
                            "estimate an adapter run, or leave them out for a full fine-tune")
        return problems
    call = f"`--adapters {args.adapters}`"
    if args.adapters not in KINDS:
        problems.append(f"Passed {call}; expected one of {', '.join(KINDS)}")
    if args.adapter_r is not None and args.adapter_r < 1:
        problems.append(f"Passed `--adapter-r {args.adapter_r}`; expected an integer >= 1 (the adapters' rank)")
    if args.quantize_base is not None and args.quantize_base not in QUANT_TYPES:
        problems.append(f"Passed `--quantize-base {args.quantize_base}`; expected one of {', '.join(QUANT_TYPES)} "
                        "(or leave it out: the base keeps its dtype)")
    if getattr(args, "analytic", False):
        problems.append(f"Passed {call} with `--analytic`: the closed form does not model adapters; drop --analytic")
    for package, needed in (("peft", True), ("bitsandbytes", args.quantize_base is not None)):
        try:
            if needed:
                require(package, call + (f" `--quantize-base {args.quantize_base}`" if package == "bitsandbytes" else ""))
        except ModuleNotFoundError as err:
            problems.append(str(err))
    return problems


def optimizer_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with ``--optimizer`` (named as given): an unknown kind, ``--analytic``, a missing extra."""
    from lightning_lowmem.predict.estimate import OPTIMIZERS, lean_extra_problem

    if args.optimizer is None:
        return []
    call = f"`--optimizer {args.optimizer}`"
    if args.optimizer not in OPTIMIZERS:
        return [f"Passed {call}; expected one of {', '.join(OPTIMIZERS)}"]
    problems = []
    if getattr(args, "analytic", False) and args.optimizer not in ("adamw", "adamw8bit"):
        problems.append(f"Passed {call} with `--analytic`: the closed form does not model lean optimizers; drop "
                        "--analytic")
    return [*problems, missing] if (missing := lean_extra_problem(args.optimizer, call)) else problems


def adapter_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``estimate_memory``'s adapter shorthands from the parsed ``--adapters``, ``--adapter-r``, ``--quantize-base``."""
    if args.adapters is None:
        return {}
    return {"adapters": args.adapters, "adapter_r": args.adapter_r, "quantize_base": args.quantize_base}


def _model_config(args: argparse.Namespace) -> Any:
    from lightning_lowmem.predict.configs import max_positions, resolve_config

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"Passed `--set {item}`; expected KEY=VALUE, e.g. `--set n_layer=6`.")
        overrides[key] = _json_or_text(raw)
    config = resolve_config(args.model, overrides)
    layers = next((getattr(config, n) for n in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(getattr(config, n, None), int)), None)
    if layers is not None and layers < 1:
        raise ValueError(f"The model {args.model!r} has {layers} layers; give it at least one (`--set n_layer=...`).")
    positions = max_positions(config)
    if positions and args.seq_len and args.seq_len > positions and getattr(config, "model_type", "") in ("gpt2", "opt"):
        raise ValueError(f"Passed `--seq-len {args.seq_len}`, beyond the {positions} learned positions of {args.model!r}; "
                         f"use at most {positions}, or `--set n_positions={args.seq_len}`.")
    return config


class _Rows:
    """A table printed row by row, as each row is computed (fixed widths; the last column as long as it is)."""

    def __init__(self, header: tuple[str, ...], widths: list[int]) -> None:
        self.widths = [max(w, len(h)) for w, h in zip(widths, header)]
        self.print(*header)
        self.print(*("-" * w for w in self.widths), "-" * len(header[-1]))

    def print(self, *cells: str) -> None:
        fixed = "  ".join(str(c).ljust(w) for c, w in zip(cells, self.widths))
        print(f"{fixed}  {cells[-1]}".rstrip(), flush=True)


def _row_failure(estimate_memory: Any, config: Any, args: argparse.Namespace, data: Any, method: str,
                 extrapolate: bool | None, kw: dict[str, Any], budget: int | None) -> Any:
    """One row's estimate, or why it has none: a missing extra, a refusal of the real run, no trace possible."""
    from lightning_lowmem.predict.fake import DryRunUnsupportedError

    try:
        return estimate_memory(config, args.batch_size, args.seq_len, data=data, micro_batch_size=args.micro_batch_size,
                               target=args.target, world_size=args.world_size, method=method, extrapolate=extrapolate,
                               skip_above=budget, **kw, **adapter_flags(args),
                               **({"optimizer": args.optimizer} if args.optimizer else {}))
    except ModuleNotFoundError as err:  # an optional extra (bitsandbytes) missing: say so, keep going
        return f"skipped: {err}"
    except ValueError as err:  # the real run refuses this combination for this model: its own reason
        return "refused: " + " ".join(str(err).split())
    except DryRunUnsupportedError as err:  # no trace and no closed form (an adapter run): say why
        return "not predicted: " + " ".join(str(err).split())
    except RuntimeError as err:  # NOTE: a row that fails must not take the table with it: its error, the rest goes on
        return f"failed: {type(err).__name__}: " + " ".join(str(err).split())[:300]


def main(argv: Sequence[str] | None = None) -> int:
    """``lowmem estimate``: predicted device and host peaks of a run (``--config``) or of the suite's combinations."""
    parser = _parser()
    try:
        rest, init_args = split_data_args(sys.argv[1:] if argv is None else argv)
    except ValueError as err:
        parser.exit(2, f"lowmem estimate: error: {err}\n")
    args = parser.parse_args(glue_values(rest, ("--budget",)))
    from lightning_lowmem.core.accounting import CATEGORIES  # NOTE: after parsing: `--help` imports no torch
    from lightning_lowmem.predict.estimate import estimate_memory

    try:
        budget, combos, config, data = _check(args, init_args)
    except ValueError as err:
        parser.exit(2, f"lowmem estimate: error: {err}\n")
    method = "analytic" if args.analytic else "dry_run"
    extrapolate = False if args.full_trace else None
    payload: list[dict[str, Any]] = []
    given = "" if budget is None else f"{args.budget} ({fmt_size(budget)})"  # NOTE: as given, and in the table's unit
    fits_header = f"fits {given}".rstrip()
    # NOTE: the budget in bytes and in the tables' GiB, naming the unit it was given in (a GPU's "12 GB" is 12 GiB)
    unit = "" if budget is None else (f"; budget {args.budget} = {budget:,} B = {fmt_size(budget)} (GB = 10^9 B, "
                                      "GiB = 2^30 B: the sizes below are GiB; a GPU sold as 12 GB holds 12 GiB: give "
                                      "it as 12GiB)")
    target = args.target or "cuda"
    if args.config:
        t0 = time.perf_counter()
        est = estimate_memory(args.config, target=args.target, method=method, extrapolate=extrapolate)
        target = est.target
        rows = [(phase, fmt_size(bd.total("device")), *(fmt_size(bd.device[c]) for c in CATEGORIES),
                 fmt_size(bd.total("host"))) for phase, bd in est.phases.items()]
        source = "--target" if args.target else est.target_source
        print(f"{args.config}: target {est.target} (from {source}; `--target` overrides); {est.run}{unit}")
        header = ("phase", "device peak", *CATEGORIES, "host peak")
        table = _Rows(header, [max(len(str(r[i])) for r in rows) for i in range(len(header) - 1)])
        for row in rows:
            table.print(*row)
        verdict = "" if budget is None else f"; {'fits' if est.fits(budget) else 'does NOT fit'} {given}"
        disk = f", disk {fmt_size(est.peak_disk)}" if est.peak_disk else ""
        print(f"device peak {fmt_size(est.peak_device)} ({est.binding_phase}), host peak {fmt_size(est.peak_host)}"
              f"{disk}{verdict}; {est.method}, {time.perf_counter() - t0:.1f} s")
        for note in est.notes:
            print(f"  note: {note}")
        payload.append({"config": args.config, **est.to_dict()})
    else:
        # NOTE: with adapters the rows break the device peak down (weights: the frozen base at its stored size and
        # the adapters; gradients and optimizer state: the adapters'), at the phase the peak binds in
        cats = CATEGORIES if args.adapters else ()
        adapters = "" if not args.adapters else (
            f", adapters {args.adapters} r={args.adapter_r or 16}"
            + (f" on a {args.quantize_base} base" if args.quantize_base else "") + " (device bytes by category at the "
            "binding phase)")
        optimizer = f", optimizer {args.optimizer}" if args.optimizer else ""
        print(f"{args.model}: target {target} (from {'--target' if args.target else 'the default for --model'}), "
              f"batch {args.batch_size}, seq {args.seq_len}{adapters}{optimizer}{unit}", flush=True)
        # NOTE: each row is printed as it comes (a row's dry run takes seconds): fixed widths, the method last
        table = _Rows(("combination", "device peak", "host peak", "binds", fits_header, *cats, "time", "method"),
                      [max(len(n) for n, _ in combos), 11, 11, 9, len(fits_header), *(11,) * len(cats), 7])
        for name, kw in combos:
            t0 = time.perf_counter()
            est = _row_failure(estimate_memory, config, args, data, method, extrapolate, kw, budget)
            if isinstance(est, str):
                table.print(name, *("-",) * (4 + len(cats)), "-", est)
                continue
            fits = "-" if budget is None else ("yes" if est.fits(budget) else "no")
            binding = est.phases[est.binding_phase].device
            table.print(name, fmt_size(est.peak_device), fmt_size(est.peak_host), est.binding_phase, fits,
                        *(fmt_size(binding[c]) for c in cats), f"{time.perf_counter() - t0:.1f} s",
                        est.method + (f" ({est.fallback_reason})" if est.fallback_reason else ""))
            payload.append({"combination": name, **est.to_dict()})
    if target == "cuda":
        print("GPU corrections (uncalibrated, no GPU run yet): 1-byte dropout masks, foreach AdamW; +512 MiB CUDA "
              "context; attention with dropout at CPU's math kernel (high); allocator fragmentation not modelled.")
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


__all__ = ["adapter_flags", "adapter_problems", "add_data_arguments", "build_data", "data_problems", "main",
           "optimizer_problems", "split_data_args"]

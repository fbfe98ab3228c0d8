"""``lowmem plan``: the fastest recipe of the suite that fits your GPU, as a YAML ``lowmem fit`` runs.

    lowmem plan --config run.yaml --device-memory 12GB --host-memory 64GB --write plan.yaml
    lowmem plan --model llama-7b --batch-size 1 --seq-len 2048 --host-budget 64GB --disk-dir /nvme --disk-budget 2TB
    lowmem fit --config plan.yaml

More examples in docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

_EPILOG = (
    "Every candidate (strategy, precision, checkpointing, activation offload, chunked loss, micro-batch for the same "
    "effective batch, optimizer in backward, ZeRO offload presets; adapters and other optimizers where allowed; the "
    "disk tier with --disk-dir) is priced by a cost model, then "
    "predicted by the dry run (the real Trainer.fit on fake tensors), fastest first, until one fits. Hardware "
    "profiles: rtx2060-6gb, rtx3060-12gb, rtx4090-24gb, a100-40gb, a100-80gb, h100-80gb, 'measure' (this "
    "machine), or a YAML file (`base: <profile>` and the fields to change)."
)


def _parser() -> argparse.ArgumentParser:
    from lightning_lowmem.cli.estimate import add_data_arguments

    parser = argparse.ArgumentParser(prog="lowmem plan", description=__doc__.split("\n")[0], epilog=_EPILOG)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="a LightningCLI YAML (its model and data; its techniques are replaced)")
    what.add_argument("--model", help="a shipped shape (gpt2 ... gpt2-xl, llama-7b, ...), config.json path or type, or "
                      "the class path of your LightningModule (with --data, or its own train_dataloader)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    add_data_arguments(parser)
    parser.add_argument("--batch-size", type=int, help="the effective batch (--model; --config: the data's)")
    parser.add_argument("--seq-len", type=int, help="with --model: the sequence length")
    parser.add_argument("--device-memory", help="device budget, e.g. 12GB (default: the hardware profile's memory)")
    parser.add_argument("--host-memory", help="host budget, e.g. 64GB (default: not checked)")
    parser.add_argument("--host-budget", help="the same as --host-memory")
    parser.add_argument("--disk-dir", help="a directory on a local disk for the disk tier (the fp32 masters and "
                        "optimizer state in files, stepped in backward): its recipes are considered, after every "
                        "recipe in RAM (slower); the plan creates no file there")
    parser.add_argument("--disk-budget", help="with --disk-dir: the disk tier's budget, e.g. 2TB (default: not "
                        "checked; the strategy checks the free space when it starts)")
    parser.add_argument("--hardware", help="a profile name, 'measure', or a YAML file (default: 'measure' for a CPU "
                        "target, else rtx3060-12gb rates)")
    parser.add_argument("--pure-half", action="store_true", help="also consider half weights without fp32 masters")
    parser.add_argument("--adapters", default="none", metavar="KINDS", help="the trainings you allow, comma-separated, in "
                        "order of preference: 'none' (the full fine-tune, the default), 'lora', 'dora' (the Adapters "
                        "callback on a frozen base); the next is planned only when none of the one before fits; the "
                        "plan never switches to adapters unless listed")
    parser.add_argument("--quantize-base", default="none", metavar="QUANTS", help="with --adapters: the frozen bases "
                        "allowed, comma-separated: 'none' (its dtype, the default), 'nf4', 'fp4', 'int8' (bitsandbytes)")
    parser.add_argument("--adapter-r", type=int, default=16, help="with --adapters: the adapters' rank (default 16)")
    parser.add_argument("--optimizers", default="adamw", metavar="KINDS", help="the optimizers you allow, "
                        "comma-separated, in order of preference: 'adamw' (the module's own, the default), 'adamw8bit' "
                        "(LowBitOptimizer), LeanOptimizer kinds 'galore', 'apollo', 'apollo_mini', 'adam_mini', "
                        "'adamw4bit', 'torchao_adamw8bit'; the next is planned only when none of the one before fits; "
                        "the plan never changes the optimizer unless listed")
    parser.add_argument("--target", choices=("cuda", "cpu"), default=None,
                        help="the device planned for, as `lowmem estimate`'s (default: with --config the YAML's "
                        "trainer.accelerator, `auto` meaning CUDA where this machine has it, else the CPU; with --model "
                        "cuda); a CPU target is priced at this machine's measured rates unless --hardware says otherwise")
    parser.add_argument("--write", help="write the chosen recipe as a YAML `lowmem fit --config` runs")
    parser.add_argument("--json", help="also write the plan as JSON")
    return parser


def _check(args: argparse.Namespace) -> list[str]:
    from lightning_lowmem.cli.estimate import output_problems, size_problem
    from lightning_lowmem.plan.recipes import disk_problems

    problems = output_problems(args, ("write", "json"))
    if args.host_memory is not None and args.host_budget is not None:
        problems.append(f"Passed `--host-memory {args.host_memory}` and `--host-budget {args.host_budget}`; they are "
                        "the same budget: pass one")
    for flag in ("device_memory", "host_memory", "host_budget", "disk_budget"):
        value = getattr(args, flag)
        problem = None if value is None else size_problem(f"--{flag.replace('_', '-')}", value)[1]
        problems += [problem] if problem else []
    disk_problems(args.disk_dir, args.disk_budget, problems, cli=True)
    for flag in ("batch_size", "seq_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            problems.append(f"Passed `--{flag.replace('_', '-')} {value}`; expected a positive integer")
    if args.config and (args.set or args.seq_len):
        problems.append("`--set`/`--seq-len` are for --model; with --config the YAML describes the model and data")
    if args.device_memory is None and args.hardware is None and args.target != "cpu":
        problems.append("give `--device-memory` (e.g. 12GB) or `--hardware` (a profile with its memory)")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """``lowmem plan``: rank the suite's recipes for a run and a budget; write the fastest that fits."""
    parser = _parser()
    from lightning_lowmem.cli.estimate import _model_config, data_problems, glue_values, split_data_args

    try:
        rest, init_args = split_data_args(sys.argv[1:] if argv is None else argv)
    except ValueError as err:
        parser.exit(2, f"lowmem plan: error: {err}\n")
    args = parser.parse_args(glue_values(rest, ("--device-memory", "--host-memory", "--host-budget", "--disk-budget")))
    from lightning_lowmem.plan.recipes import adapter_variants, optimizer_choices
    from lightning_lowmem.plan.search import NoRecipeFitsError, plan
    from lightning_lowmem.predict.estimate import module_class as _module_class

    problems = _check(args)
    adapters, quantize_base = args.adapters.split(","), args.quantize_base.split(",")
    adapter_variants(adapters, quantize_base, args.adapter_r, (), problems, cli=True)  # NOTE: the flags', up front
    optimizers = args.optimizers.split(",")
    optimizer_choices(optimizers, (), problems, cli=True)
    model = args.config
    module_class = None
    try:
        module_class = _module_class(args.model, "--model ") if args.model else None
    except ValueError as err:  # NOTE: a class path that does not import: said, not taken for a model shape
        parser.exit(2, f"lowmem plan: error: {err}\n")
    data, data_issues = data_problems(args, init_args, module_class)
    problems += data_issues
    if module_class is not None:
        model = module_class  # your LightningModule, built on the meta device, on --data or its own dataloader
    elif args.model:
        try:
            model = _model_config(args)
        except (ValueError, FileNotFoundError, TypeError) as err:
            problems.append(str(err))
    if problems:
        parser.exit(2, "lowmem plan: error: " + "\n- ".join(["the arguments do not describe a plan:", *problems]) + "\n")
    try:
        result = plan(model, args.batch_size, args.seq_len, device_memory=args.device_memory,
                      host_memory=args.host_memory or args.host_budget, hardware=args.hardware,
                      pure_half=args.pure_half,
                      target=args.target, data=data, adapters=adapters, quantize_base=quantize_base,
                      adapter_r=args.adapter_r, optimizers=optimizers, disk_dir=args.disk_dir,
                      disk_budget=args.disk_budget,
                      progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    except NoRecipeFitsError as err:
        parser.exit(1, f"lowmem plan: {err}\n")
    except ValueError as err:
        parser.exit(2, f"lowmem plan: error: {err}\n")
    what = args.config or (f"{args.model} on {args.data}" if data is not None else
                           f"{args.model}: batch {args.batch_size}, seq {args.seq_len}")
    if data is not None:  # NOTE: as given: a written YAML builds the same data module
        result.yaml_parts["data"] = {"class_path": args.data,
                                     "init_args": {**json.loads(args.data_args or "{}"), **init_args}}
    print(f"{what}; {result.hardware.name}; {'; '.join(result.notes)}; {result.wall_s:.1f} s")
    print(result.table())
    print(result.summary())
    print(f"Python: {result.trainer_arguments()}")
    if args.write:
        command = "lowmem plan " + " ".join(sys.argv[1:] if argv is None else argv)
        path = result.write_yaml(args.write, command)
        print(f"wrote {path}: run it with `lowmem fit --config {path}`")
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    return 0


__all__ = ["main"]

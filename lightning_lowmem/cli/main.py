"""The ``lowmem`` command: Lightning's LightningCLI with the ``lowmem_*`` names registered (docs/cli.md).

Modules in the current directory are importable after every installed one. Bad input ends with one
``lowmem: error: ...`` line; ``LOWMEM_TRACEBACK=1`` shows the full traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

from lightning_lowmem.cli.commands import CALLBACKS, LOOPS, SUBCOMMANDS, TOOLS

# NOTE: the imports inside the functions below are deliberate: `lowmem --help` (and each tool's `--help`) must
# answer without importing Lightning or torch (seconds), so what needs them is imported when it is used.


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "bad input": shown as one line, not a traceback."""
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_lowmem.core.disk_full import DiskFullError
    from lightning_lowmem.core.host_memory import HostMemoryError
    from lightning_lowmem.core.ops_build import StaleBuildLockError
    from lightning_lowmem.core.preflight import LaunchError
    from lightning_lowmem.strategies.offload.strategy import NonFiniteGradientError

    return (ValueError, TypeError, FileNotFoundError, IsADirectoryError, ModuleNotFoundError, MisconfigurationException,
            HostMemoryError, NonFiniteGradientError, DiskFullError, StaleBuildLockError, LaunchError,
            ArgumentError)  # jsonargparse's, raised instead of printing the usage text (see `cli.errors`)


def print_help() -> None:
    width = max(map(len, SUBCOMMANDS))
    print("usage: lowmem {" + ",".join(SUBCOMMANDS) + "} ...\n")
    print("lightning_lowmem: train models larger than the GPU's memory with Lightning flags.\n")
    for name, what in SUBCOMMANDS.items():
        print(f"  {name.ljust(width)}  {what}")
    print("\n`lowmem SUBCOMMAND --help` describes one. Set LOWMEM_TRACEBACK=1 to see full tracebacks.")


def print_loop_help(subcommand: str) -> None:
    """``lowmem fit --help``: what a user of the suite needs, without importing Lightning or torch (LightningCLI's
    own 500+ lines, which take seconds to build, stay one flag away: ``--help-all``)."""
    from lightning_lowmem._registry import STRATEGIES

    print(f"usage: lowmem {subcommand} --config run.yaml [--config more.yaml] [--SECTION.KEY VALUE ...]\n")
    what = {"fit": "Train", "validate": "Run the validation loop", "test": "Run the test loop",
            "predict": "Run the predict loop"}[subcommand]
    print(f"{what} with Lightning's LightningCLI. A YAML file names the model, the data and the Trainer's arguments "
          "and callbacks (configs/demo.yaml is one); any key can be overridden on the command line.\n")
    options = [
        ("-c, --config FILE", "a YAML file (repeatable; later files and flags override earlier ones)"),
        ("--print_config", "print the resolved configuration (after every override) and exit"),
        ("--trainer.strategy NAME", "a lowmem_* name below, or Lightning's (auto, ddp, deepspeed_stage_2, ...)"),
        ("--trainer.precision P", "32-true, bf16-true, 16-true, bf16-mixed, 16-mixed"),
        ("--trainer.accelerator A", "auto (CUDA where present), cpu, gpu"),
        ("--trainer.max_steps N", "optimizer steps to train for"),
        ("--trainer.callbacks+=NAME", "add a callback by its short name (then --trainer.callbacks.KEY VALUE)"),
        ("--model CLASS_PATH", "your LightningModule (--model.init_args.KEY VALUE for its arguments)"),
        ("--data CLASS_PATH", "your LightningDataModule (--data.init_args.KEY VALUE)"),
        ("--ckpt_path PATH", "resume from a checkpoint (`last` for the latest)"),
    ]
    width = max(len(flag) for flag, _ in options)
    print("Main options:")
    for flag, what in options:
        print(f"  {flag.ljust(width)}  {what}")
    width = max(map(len, [*STRATEGIES, *CALLBACKS]))
    print("\nStrategies of lightning_lowmem (`strategy: NAME` under `trainer:`):")
    for name, entry in STRATEGIES.items():
        print(f"  {name.ljust(width)}  {entry[2]}")
    print("\nCallbacks of lightning_lowmem (`- class_path: NAME` with `init_args:` under `trainer: callbacks:`):")
    for name, what in CALLBACKS.items():
        print(f"  {name.ljust(width)}  {what}")
    print(f"\n`lowmem {subcommand} --help-all` lists every option (the Trainer's, your model's and data's: LightningCLI's "
          "full help). `lowmem estimate --config run.yaml` predicts the run's peak memory first.")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print_help()
        return 0
    if args[0] in LOOPS and any(a in ("-h", "--help") for a in args[1:]):
        print_loop_help(args[0])
        return 0
    if args[0] in LOOPS and "--help-all" in args[1:]:
        args = [("--help" if a == "--help-all" else a) for a in args]
        argv = args
    # NOTE: the working directory LAST on sys.path (`class_path: my_module.MyModel` imports, but a local `yaml.py`
    # never replaces the real one); `python -P` / PYTHONSAFEPATH is respected
    if not sys.flags.safe_path and not any(entry in ("", ".", os.getcwd()) for entry in sys.path):
        sys.path.append(os.getcwd())
    try:
        if args[0] in TOOLS:
            module, function = TOOLS[args[0]]
            return int(getattr(importlib.import_module(module), function)(args[1:]) or 0)
        from lightning_lowmem.cli import errors as _cli_errors
        from lightning_lowmem.predict.lightning_cli import LowMemCLI

        _cli_errors.check_config_files(args)
        with warnings.catch_warnings():
            # NOTE: `--help-all` is handed on as `--help` through `args=`, which LightningCLI warns about whenever
            # sys.argv holds arguments too (they are the same command line here)
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
            LowMemCLI(args=argv)
    except Exception as err:
        if not isinstance(err, _user_errors()) or os.environ.get("LOWMEM_TRACEBACK"):
            raise
        from lightning_lowmem.cli import errors as _cli_errors  # NOTE: imports Lightning: only on an error

        # NOTE: the innermost bad-input error behind `err` (jsonargparse wraps a constructor's error in its own)
        causes = [e for e in _cli_errors._chain(err) if isinstance(e, _user_errors())]
        line = _cli_errors.one_line(err, args, causes[-1] if causes else err)
        print(f"lowmem: error: {line}\n(set LOWMEM_TRACEBACK=1 to see the full traceback)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

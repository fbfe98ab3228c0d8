"""A run described by a LightningCLI YAML (what ``lowmem fit --config`` reads), loaded for a dry run."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator

from lightning_lowmem._internals import lightning as lightning_internals

# NOTE: the parser `lowmem fit` runs, so the YAML means here what it means there
from lightning_lowmem.predict.lightning_cli import LowMemCLI
from lightning_lowmem.predict.run_spec import RunSpec


def load_run_config(path: str | os.PathLike) -> tuple[Any, Any, RunSpec]:
    """The module (built on the meta device: no weights allocated), the data module and the run of a YAML.

    The YAML is parsed exactly as ``lowmem fit --config`` parses it (same parser, short names, checks), and
    the Trainer it describes is built but never run; :meth:`RunSpec.from_trainer` reads the run from it.

    Raises:
        ValueError / FileNotFoundError: the file is missing or does not describe a run.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Passed the run config {str(path)!r}: no such file.")

    class RunConfig(LowMemCLI):
        def instantiate_classes(self) -> None:
            # NOTE: as LightningCLI.instantiate_classes, with the classes built on the meta device: a model too large
            # for this machine is described without allocating it. The Trainer is built outside (it is never run).
            with torch.device("meta"):
                self.config_init = self.parser.instantiate_classes(self.config)
            self.datamodule = lightning_internals.cli_get(self, self.config_init, "data")
            self.model = lightning_internals.cli_get(self, self.config_init, "model")
            lightning_internals.cli_add_configure_optimizers(self, self.subcommand)
            trainer_config = lightning_internals.cli_get(self, self.config_init, "trainer", default={})
            self.target, self.target_source = run_target(trainer_config.get("accelerator", "auto"))
            overrides: dict[str, Any] = {}
            if self.target == "cuda" and not torch.cuda.is_available():
                # NOTE: a GPU run described on a machine without one (the laptop asking "will it fit my card?"):
                # the Trainer is only read for its strategy, precision and callbacks, so it is built for the CPU
                overrides = {"accelerator": "cpu", "devices": 1}
            self.trainer = self.instantiate_trainer(**overrides)

    quiet = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:  # NOTE: the Trainer is only described here ("GPU available: ..." would be about nothing)
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            # NOTE: LightningCLI warns that `args=` is meant for Python use whenever sys.argv is not empty: it is
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
            cli = RunConfig(run=False, args=["--config", str(path)], save_config_callback=None)
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    run = RunSpec.from_trainer(cli.trainer)
    run.target, run.target_source = cli.target, cli.target_source
    return cli.model, cli.datamodule, run


def run_target(accelerator: Any) -> tuple[str, str]:
    """``("cuda" | "cpu", why)``: the device a run with ``trainer.accelerator=accelerator`` trains on.

    ``auto`` (Lightning's default) is CUDA when this machine has it, else the CPU, as the Trainer decides.
    """
    if isinstance(accelerator, Accelerator):
        name = type(accelerator).__name__
        return ("cpu" if isinstance(accelerator, CPUAccelerator) else "cuda"), f"trainer.accelerator: {name}"
    name = str(accelerator or "auto").lower()
    if name == "auto":
        found = "cuda" if torch.cuda.is_available() else "cpu"
        return found, f"trainer.accelerator: auto, {'a CUDA device' if found == 'cuda' else 'no CUDA device'} here"
    return ("cpu" if name == "cpu" else "cuda"), f"trainer.accelerator: {name}"


__all__ = ["load_run_config", "run_target"]

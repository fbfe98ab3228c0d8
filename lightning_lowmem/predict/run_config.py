"""A run described by a LightningCLI YAML (what ``lowmem fit --config`` reads), loaded for a dry run."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch

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
            self.trainer = self.instantiate_trainer()

    quiet = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:  # NOTE: the Trainer is only described here ("GPU available: ..." would be about nothing)
        lg.setLevel(logging.WARNING)
    try:
        cli = _load(RunConfig, path)
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    return cli.model, cli.datamodule, RunSpec.from_trainer(cli.trainer)


def _load(cls: Any, path: str | os.PathLike) -> Any:
    with warnings.catch_warnings():
        # NOTE: LightningCLI warns that `args=` is meant for Python use whenever sys.argv is not empty: it is
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
        return cls(run=False, args=["--config", str(path)], save_config_callback=None)


__all__ = ["load_run_config"]

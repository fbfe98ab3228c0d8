"""What remains of the side steps: helpers for code that simulates a run beside the user's (no trial steps run).

- :func:`forked_rng`: the CPU generator (and the CUDA device's), Python's ``random`` and NumPy's global generator
  are put back afterwards, so a simulation's draws leave the run's random streams as they were.
- :func:`silenced_log`: ``self.log``/``self.log_dict`` do nothing (a dry run's fake copy logs nothing).
- :func:`quiet_warnings`: Python warnings ignored and Lightning's loggers at ``ERROR``, for a run whose warnings
  would be about a simulation (the dry run), not the user's run.

NOTE: the module goes once its last users (``plan.auto``, ``predict.fake``) stop using it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from lightning_lowmem.core.hooks import swapped

_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_lowmem")


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def silenced_log(target: Any) -> contextlib.AbstractContextManager[None]:
    """``target.log`` and ``target.log_dict`` do nothing inside (a LightningModule instance, or the class itself)."""
    return swapped(target, log=_no_log, log_dict=_no_log)


@contextlib.contextmanager
def forked_rng(device: torch.device | None = None) -> Iterator[None]:
    """The CPU RNG, ``device``'s when it is a CUDA device, Python's ``random`` and NumPy's global one, put back on exit.

    ``device=None``: the current CUDA device when CUDA is initialized, else the CPU generator only; CUDA is never
    initialized by this. NumPy's generator only when NumPy is imported.
    """
    if device is None:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    else:
        devices = [device] if device.type == "cuda" else []
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        # NOTE: device_type given: torch's default asks the current accelerator, and `devices=[]` forks the CPU only
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Python warnings ignored, and Lightning's (and this package's) loggers at ``ERROR``, inside.

    NOTE: for a run that only simulates the user's (the dry run): its warnings and info lines would describe the
    simulation. Never around a real step: the user's own warnings would be lost.
    """
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


__all__ = ["forked_rng", "quiet_warnings", "silenced_log"]

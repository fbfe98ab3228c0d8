"""Running (part of) a user's ``training_step`` outside Lightning's loop: :func:`side_step` (private helper).

Several techniques run the module's step themselves: ``ActivationCheckpointing`` measures what one forward saves
(``callbacks.activation_checkpointing.probe``), ``AccumulationScheduler(micro_batch_size="auto")`` times trial steps (``callbacks.accumulation.micro_batch_search``), the
out-of-memory splitter re-runs chunks of a batch (``callbacks.accumulation.oom_split``), the dry run fits a fake copy
(``memory.fake``). Each piece of what such a step needs lives here once:

- :func:`forked_rng`: the CPU generator (and the CUDA device's), Python's ``random`` and NumPy's global generator
  are put back afterwards, so a side step's dropout draws (or a ``random.random()`` augmentation in the step) leave
  the run's random streams, and with them the trained weights, as they were.
- :func:`~lightning_lowmem.core.kept_state.kept_state`: every buffer (``BatchNorm`` statistics and
  ``num_batches_tracked``), every ``torchmetrics`` metric's state, and the public attributes the step rebinds
  (``self.seen += n``) are put back, so the step leaves no trace in the module.
- :func:`silenced_log`: ``self.log``/``self.log_dict`` do nothing. Outside a loop hook Lightning refuses them, and
  inside one a value logged by a side step would count twice in the epoch means.
- the mark: :func:`stands_aside` is true while a side step runs on the module (or the module is detached from any
  Trainer). A callback that wraps ``training_step`` to change the real step (``AccumulationScheduler``'s window
  weighing, the OOM splitter's chunking) reads it and returns the step untouched.
- :func:`quiet_warnings`: Python warnings ignored and Lightning's loggers at ``ERROR``, for a run whose warnings
  would be about a simulation (the dry run), not the user's run.

:func:`side_step` is the first four together, what a probe or a trial step needs.
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
from torch.utils.weak import WeakIdKeyDictionary

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core.hooks import swapped
from lightning_lowmem.core.kept_state import kept_state

#: side steps running per module (nested ones count). NOTE: weak, so a module (or a copy of it) carries no state of
#: ours; keyed by identity, so a module whose class defines `__eq__` (and so no `__hash__`) works too
_RUNNING = WeakIdKeyDictionary()
_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_lowmem")


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def silenced_log(target: Any) -> contextlib.AbstractContextManager[None]:
    """``target.log`` and ``target.log_dict`` do nothing inside (a LightningModule instance, or the class itself)."""
    return swapped(target, log=_no_log, log_dict=_no_log)


@contextlib.contextmanager
def forked_rng(device: torch.device | None = None) -> Iterator[None]:
    """The CPU RNG, ``device``'s when it is a CUDA device, Python's ``random`` and NumPy's global one, put back on exit.

    ``device=None``: the current CUDA device when CUDA is initialized (a step that ran there has drawn from it),
    else the CPU generator only; CUDA is never initialized by this. NumPy's generator only when NumPy is imported.
    The generators ``lightning.seed_everything`` seeds, all of them.
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
def marked(pl_module: Any) -> Iterator[None]:
    """:func:`stands_aside` is true for ``pl_module`` inside (nested marks count)."""
    _RUNNING[pl_module] = _RUNNING.get(pl_module, 0) + 1
    try:
        yield
    finally:
        left = _RUNNING.get(pl_module, 1) - 1
        if left:
            _RUNNING[pl_module] = left
        else:
            _RUNNING.pop(pl_module, None)


def stands_aside(pl_module: Any) -> bool:
    """Whether a callback that wraps ``pl_module.training_step`` must pass the step through untouched.

    True inside :func:`side_step` (or :func:`marked`), and for a module detached from any Trainer (a step called by
    hand, or a copy of the module: a dry run's), where there is no loop whose step the wrapper could change.
    """
    return _RUNNING.get(pl_module, 0) > 0 or lightning_internals.attached_trainer(pl_module) is None


@contextlib.contextmanager
def side_step(pl_module: Any, device: torch.device | None = None) -> Iterator[None]:
    """Run ``pl_module``'s ``training_step`` (or part of it) outside the loop, leaving no trace in the run.

    Inside: the RNG is forked (:func:`forked_rng` with ``device``), ``self.log``/``self.log_dict`` do nothing
    (:func:`silenced_log`), and callbacks that wrap ``training_step`` stand aside (:func:`stands_aside`). All three
    are put back on exit, after an error too, and so is the module's state
    (:func:`~lightning_lowmem.core.kept_state.kept_state`: buffers, ``torchmetrics`` metric states, rebound
    public attributes); nested side steps are allowed. The optimizers are the caller's to put back.

    Example:
        >>> import lightning as L
        >>> module = L.LightningModule()
        >>> with side_step(module):
        ...     module.log("loss", 1.0)  # refused outside a loop; here it does nothing
        ...     stands_aside(module)
        True
        >>> "log" in vars(module)
        False
    """
    # NOTE: the module's state outermost: `silenced_log`'s swap of `log` is undone before it compares attributes
    with kept_state(pl_module), forked_rng(device), silenced_log(pl_module), marked(pl_module):
        yield


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


__all__ = ["forked_rng", "marked", "quiet_warnings", "side_step", "silenced_log", "stands_aside"]

"""Re-pointing LR schedulers at an optimizer that replaced the one they were built on.

Used wherever an optimizer is swapped after ``configure_optimizers`` (``LowBitOptimizer``'s 8-bit optimizer,
``ZeroStrategy``'s ``DeepSpeedCPUAdam``): the new optimizer holds the same param-group dicts' contents, so a
scheduler only has to be told which object to write the learning rates into.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch


def repoint_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point ``scheduler``, and every scheduler it chains, from ``old`` to ``new``.

    ``SequentialLR`` and ``ChainedScheduler`` hold their own ``optimizer`` and inner schedulers (``_schedulers``)
    that each hold one too; all of them are re-pointed, recursively. A scheduler built on another optimizer is left
    alone. Any object with an ``optimizer`` attribute is handled (``ReduceLROnPlateau`` included).

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> old = torch.optim.SGD(model.parameters(), lr=1.0)
        >>> warm = torch.optim.lr_scheduler.LinearLR(old, start_factor=0.5, total_iters=2)
        >>> sched = torch.optim.lr_scheduler.SequentialLR(old, [warm, torch.optim.lr_scheduler.ConstantLR(old)], [2])
        >>> new = torch.optim.SGD(old.param_groups, lr=1.0)
        >>> repoint_scheduler(sched, old, new)
        >>> sched.optimizer is new and all(s.optimizer is new for s in sched._schedulers)
        True
    """
    for child in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
        repoint_scheduler(child, old, new)
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            _track_step_called(new)


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` the way ``LRScheduler.__init__`` does (torch's own wrapper is a local function).

    NOTE: torch schedulers wrap ``optimizer.step`` at construction to warn when ``scheduler.step()`` runs before
    ``optimizer.step()``; without the same wrapper on the new optimizer every re-pointed scheduler would warn
    "optimizer.step() has been overridden" at its first step.
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    opt_ref = weakref.ref(optimizer)
    func = optimizer.step.__func__  # type: ignore[attr-defined]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]

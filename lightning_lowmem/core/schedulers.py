"""Re-pointing LR schedulers at an optimizer that replaced the one they were built on (``LowBitOptimizer``,
``ZeroStrategy``'s ``DeepSpeedCPUAdam``): the new one holds the same param groups' contents."""

from __future__ import annotations

from typing import Any

import torch

from lightning_lowmem._internals import torch as torch_internals


def repoint_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point ``scheduler``, and every scheduler it chains, from ``old`` to ``new``.

    The inner schedulers of ``SequentialLR``/``ChainedScheduler`` too; one built on another optimizer is left alone.
    Any object with an ``optimizer`` attribute is handled (``ReduceLROnPlateau`` included).

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
    for child in torch_internals.chained_schedulers(scheduler):  # SequentialLR, ChainedScheduler
        repoint_scheduler(child, old, new)
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            torch_internals.track_step_called(new)

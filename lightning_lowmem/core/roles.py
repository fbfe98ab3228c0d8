"""Roles a technique declares, so that code in another part of the package recognises it by type, never by name.

The strategies and the callbacks never import each other: one asks ``isinstance(obj, Role)`` for a role defined here,
which the other's class inherits (a subclass or a renamed class keeps it; a look-alike never has it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TypeVar

from lightning_lowmem._internals import lightning as lightning_internals

T = TypeVar("T")


class HostMastersStrategy:
    """A strategy whose optimizers step fp32 master weights on the host, not the module's parameters
    (``OffloadStrategy``, ``strategy="lowmem_offload"``).

    ``OptimizerInBackward`` refuses it; ``LowBitOptimizer`` finds the module's parameters through :meth:`master_of`;
    ``MasterHalfPrecision`` runs the gradient hooks inside :meth:`masters_view`.
    """

    def master_of(self, p_host: object) -> object | None:
        """The module parameter that ``p_host`` is the master of (None if it is not a master)."""
        raise NotImplementedError

    def masters_view(self, *, grads: bool = False, write_back: bool = False) -> AbstractContextManager:
        """Inside, the module's own parameters show the fp32 masters (``grads``: with their gradients)."""
        raise NotImplementedError


def module_param_of(module: object, p: T) -> T:
    """The module parameter that ``p`` (a parameter an optimizer steps) stands for: the one it is the master of when
    ``module`` (a LightningModule) is fitted by a :class:`HostMastersStrategy`, else ``p`` itself."""
    strategy = getattr(lightning_internals.attached_trainer(module), "strategy", None)
    master_of = strategy.master_of(p) if isinstance(strategy, HostMastersStrategy) else None
    return p if master_of is None else master_of  # type: ignore[return-value]


class LowBitOptimizerSwap:
    """A callback that replaces the configured optimizer by a bitsandbytes 8-bit one at fit start
    (``LowBitOptimizer``).

    A strategy sizing the host RAM of the optimizer state before the swap counts the 8-bit state instead.
    """

    #: the bitsandbytes optimizer swapped in (``"adamw8bit"``, ``"paged_adamw8bit"``, ...)
    kind: str
    #: tensors with fewer values keep 32-bit state
    min_8bit_size: int
    #: embeddings keep 32-bit state
    stable_embedding: bool


class LeanOptimizerSwap:
    """A callback that replaces the configured optimizer at fit start by one whose state it sizes itself
    (``LeanOptimizer``: GaLore, APOLLO, Adam-mini, torchao's 4-/8-bit AdamW).

    A strategy sizing the host RAM of the optimizer state before the swap asks it (:meth:`expected_state_bytes`).
    """

    def expected_state_bytes(self, optimizer: object, module: object) -> int:
        """Bytes of the state the optimizer replacing ``optimizer`` (over ``module``'s parameters) will keep for
        fp32 masters."""
        raise NotImplementedError


__all__ = ["HostMastersStrategy", "LeanOptimizerSwap", "LowBitOptimizerSwap", "module_param_of"]

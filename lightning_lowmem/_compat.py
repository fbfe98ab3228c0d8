"""Optional dependencies and the `lightning` vs `pytorch_lightning` boundary."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

# package import name -> extra of lightning-lowmem that installs it
_EXTRAS = {"deepspeed": "deepspeed", "bitsandbytes": "bnb", "liger_kernel": "kernels", "cut_cross_entropy": "kernels"}


def package_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# package -> (logger, message start) of an import-time notice about a feature lightning_lowmem never uses
_IMPORT_NOTICES = {
    # NOTE: bitsandbytes >= 0.49 logs on every import on AVX512-bf16 CPUs that its optional 4-bit CPU matmul
    # kernel (the `kernels` package) is missing; the 8-bit optimizers we import it for do not use that kernel.
    "bitsandbytes": ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
}


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def _import_quietly(name: str) -> ModuleType:
    """Import ``name``, dropping its known import-time notice (only that message, only during this import)."""
    if name in sys.modules or name not in _IMPORT_NOTICES:
        return importlib.import_module(name)
    logger_name, start = _IMPORT_NOTICES[name]
    logger, drop = logging.getLogger(logger_name), _DropMessage(start)
    logger.addFilter(drop)
    try:
        return importlib.import_module(name)
    finally:
        logger.removeFilter(drop)


def require(name: str, feature: str) -> ModuleType:
    """Import an optional dependency, or say which extra installs it.

    Raises:
        ModuleNotFoundError: naming ``feature``, the missing package and the ``pip install`` line.
    """
    try:
        return _import_quietly(name)
    except ImportError as err:
        extra = _EXTRAS.get(name, name)
        raise ModuleNotFoundError(
            f"{feature} needs the `{name}` package, which is not installed ({err}). "
            f"Install it with `pip install 'lightning-lowmem[{extra}]'`."
        ) from err


def check_lightning_object(obj: Any, what: str) -> None:
    """Refuse objects of the standalone ``pytorch_lightning`` package with a message that says what to do.

    lightning_lowmem targets the unified ``lightning`` package; the two packages keep separate class
    hierarchies and registries, so their objects cannot be mixed.
    """
    module = type(obj).__module__ or ""
    if module == "pytorch_lightning" or module.startswith("pytorch_lightning."):
        raise TypeError(
            f"Passed a `{type(obj).__module__}.{type(obj).__qualname__}` as {what}; lightning_lowmem works with the "
            "unified `lightning` package only. Replace `import pytorch_lightning as pl` with "
            "`import lightning.pytorch as pl` (or `import lightning as L` and use `L.Trainer`, "
            "`L.LightningModule`, `L.Callback`)."
        )


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a nested batch, module input or output, in order.

    Walks what Lightning's ``apply_to_collection`` walks to move a batch to its device: mappings (dicts, Hugging
    Face ``BatchEncoding`` and ``ModelOutput``), lists, tuples, namedtuples and dataclasses. A batch Lightning
    could move is a batch whose tensors are all found here.

    Example:
        >>> from collections import UserDict
        >>> batch = UserDict(input_ids=torch.zeros(2, 3), extra=[(torch.ones(1), "text")])
        >>> [tuple(t.shape) for t in tensors_in(batch)]
        [(2, 3), (1,)]
    """
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    # NOTE: apply_to_collection rebuilds the collection around what `keep` returns; only `found` is used.
    apply_to_collection(value, torch.Tensor, keep)
    return found


class Reproducible:
    """Remembers its constructor arguments, so that an unused copy can be made: :meth:`fresh`.

    A dry run (``lightning_lowmem.dry_run``, ``MemoryReport``'s prediction) runs a technique's own
    object on fake tensors; it must get one that no Trainer has touched yet, built as the user built theirs.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__new__(cls)
        # NOTE: unpickling calls `cls.__new__(cls)` without arguments, then restores `__dict__` (with these)
        obj._init_args = (args, kwargs)
        return obj

    def fresh(self, **changes: Any) -> Any:
        """A new object built with this one's constructor arguments (nested reproducible objects fresh too),
        with ``changes`` to them by name."""
        args, kwargs = getattr(self, "_init_args", ((), {}))
        if changes:
            args, kwargs = (), {**init_arguments(self), **changes}
        return type(self)(*(fresh(a) for a in args), **{k: fresh(v) for k, v in kwargs.items()})

    def resolved(self) -> Any:
        """:meth:`fresh`, with what this object decided at run time (an automatic choice) fixed; None when it
        decided to do nothing."""
        return self.fresh()


def init_arguments(obj: Any) -> dict[str, Any]:
    """The constructor arguments a :class:`Reproducible` object was built with, by name (positional ones named)."""
    args, kwargs = getattr(obj, "_init_args", ((), {}))
    names = list(inspect.signature(type(obj).__init__).parameters)[1 : len(args) + 1]
    return {**dict(zip(names, args)), **kwargs}


def fresh(obj: Any) -> Any:
    """``obj.fresh()`` for a :class:`Reproducible` object; any other value is returned as it is."""
    return obj.fresh() if isinstance(obj, Reproducible) else obj


def run_after_configure_model(pl_module: Any, apply: Callable[[], None]) -> None:
    """Make ``pl_module.configure_model`` run ``apply`` after itself (undo with :func:`restore_configure_model`).

    NOTE: Lightning calls ``configure_model`` after the callbacks' ``setup``: a model built there exists only
    after it, so a technique that rewrites the model applies itself there.
    """
    original = pl_module.configure_model

    @functools.wraps(original)
    def configure_model() -> None:
        original()
        apply()

    pl_module.configure_model = configure_model


def restore_configure_model(pl_module: Any) -> None:
    """Drop the wrapper(s) :func:`run_after_configure_model` set on the instance."""
    pl_module.__dict__.pop("configure_model", None)


def training_step_args(step: Any, batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """The positional arguments Lightning's loop gives ``step`` (a ``training_step``): ``batch``, and ``batch_idx``
    only when the signature takes it (``training_step(self, batch)`` is allowed).

    NOTE: the same rule as Lightning's ``_build_kwargs`` (decorators unwrapped through ``__wrapped__``), so code
    that runs a module's step itself (trials, probes) calls it as the Trainer would.
    """
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    return (batch, batch_idx) if is_param_in_hook_signature(step, "batch_idx", min_args=2) else (batch,)


_MISSING = object()


@contextlib.contextmanager
def swapped(target: Any, **attributes: Any) -> Iterator[None]:
    """Set ``attributes`` in ``target``'s own ``__dict__`` (an instance, a class or a module); put back what was there.

    NOTE: restores the target's own previous entry rather than deleting ours, so nested swaps (a probe inside the
    OOM splitter's capture, a side step inside a side step) each get back what they found.
    """
    own = vars(target)
    previous = {name: own.get(name, _MISSING) for name in attributes}
    for name, value in attributes.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(target, name)
            else:
                setattr(target, name, value)

"""Optional dependencies: import one, or say which extra of lightning-lowmem installs it."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from types import ModuleType

# package import name -> extra of lightning-lowmem that installs it
_EXTRAS = {"deepspeed": "deepspeed", "bitsandbytes": "bnb", "liger_kernel": "kernels", "cut_cross_entropy": "kernels",
           "galore_torch": "galore", "apollo_torch": "apollo", "adam_mini": "adam-mini", "torchao": "torchao"}


def package_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# package -> (logger, message start) of an import-time notice about a feature lightning_lowmem never uses
_IMPORT_NOTICES = {
    # NOTE: bitsandbytes >= 0.49 logs on every import on AVX512-bf16 CPUs that its optional 4-bit CPU matmul
    # kernel (the `kernels` package) is missing; the 8-bit optimizers we import it for do not use that kernel.
    "bitsandbytes": ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
}


def _import_quietly(name: str) -> ModuleType:
    """Import ``name``, dropping its known import-time notice (only that message, only during this import)."""
    if name in sys.modules or name not in _IMPORT_NOTICES:
        return importlib.import_module(name)
    logger_name, start = _IMPORT_NOTICES[name]
    logger = logging.getLogger(logger_name)

    def drop(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(start)

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


def loaded_class(module: str, name: str) -> type | None:
    """Class ``name`` of ``module`` when that module is imported already, else None; never imports it.

    NOTE: an object of an optional package's class exists only once its module is imported, so ``isinstance`` against
    this needs no import (never a class-name string: a subclass or a look-alike would be judged by its name).
    """
    loaded = sys.modules.get(module)
    cls = getattr(loaded, name, None) if loaded is not None else None
    return cls if isinstance(cls, type) else None


def instance_of(obj: object, classes: tuple[tuple[str, str], ...]) -> bool:
    """Whether ``obj`` is an instance of one of ``classes`` (``(module, name)`` pairs, see :func:`loaded_class`)."""
    return any(cls is not None and isinstance(obj, cls) for cls in (loaded_class(m, n) for m, n in classes))

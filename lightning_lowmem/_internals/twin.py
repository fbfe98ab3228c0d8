"""``lightning_lowmem.pl``: this package for the standalone ``pytorch_lightning`` package (docs/lightning-packages.md).

Module ``lightning_lowmem.pl.X`` is the file of ``lightning_lowmem.X`` compiled (:mod:`.twin_source`) with its imports,
and the module paths its strings name, rewritten (:data:`_RENAMES`). The modules of :data:`SHARED` are one copy for
both. NOTE: not imported by ``import lightning_lowmem``: the registry's finder imports it on first use of the build.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from typing import Any

PREFIX = "lightning_lowmem.pl"
#: the Lightning package -> the build of this package that works with it
BUILDS = {"lightning": "lightning_lowmem", "pytorch_lightning": PREFIX}
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the lightning_lowmem package's folder
#: served to both builds as they are: the import machinery and the name registry (they hold no Lightning class)
SHARED = frozenset({"lightning_lowmem._registry", "lightning_lowmem._internals.twin",
                    "lightning_lowmem._internals.twin_source"})
#: old module prefix -> new one, the first that matches wins (``lightning`` after its subpackages)
_RENAMES = (
    ("lightning.pytorch", "pytorch_lightning"),
    ("lightning.fabric", "lightning_fabric"),
    ("lightning", "pytorch_lightning"),
    ("lightning_lowmem", PREFIX),
)


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def twin_name(name: str) -> str:
    """The name module ``name`` has in the ``pytorch_lightning`` build (unchanged for one of neither package)."""
    if name in SHARED or _under(name, PREFIX):
        return name
    return next((new + name[len(old) :] for old, new in _RENAMES if _under(name, old)), name)


def real_name(name: str) -> str:
    """The module of this package that ``name`` (a module of either build) is compiled from."""
    return "lightning_lowmem" + name[len(PREFIX) :] if _under(name, PREFIX) else name


def package_of(obj: Any) -> str | None:
    """``"lightning"`` or ``"pytorch_lightning"``: the package whose Trainer, LightningModule, Callback,
    LightningDataModule or Strategy ``obj`` is (None for neither). Checks only packages already imported."""
    for package, module in (("lightning", "lightning.pytorch"), ("pytorch_lightning", "pytorch_lightning")):
        pl, strategies = sys.modules.get(module), sys.modules.get(module + ".strategies")
        if pl is None or strategies is None:
            continue
        if isinstance(obj, (pl.Trainer, pl.LightningModule, pl.Callback, pl.LightningDataModule, strategies.Strategy)):
            return package
    return None


def package_for(module_name: str) -> str:
    """The Lightning package the build holding module ``module_name`` (its ``__name__``) works with."""
    return "pytorch_lightning" if _under(module_name, PREFIX) else "lightning"


def find_spec(fullname: str) -> Any:
    """The spec of ``lightning_lowmem.pl[.X]`` for :mod:`lightning_lowmem._registry`'s finder: the rewritten file of
    ``lightning_lowmem[.X]`` (None for no such file)."""
    if not _under(fullname, PREFIX) or real_name(fullname) in SHARED:
        return None
    parts = fullname.split(".")[2:]
    if not all(part.isidentifier() for part in parts):  # NOTE: a name is never a path out of the package
        return None
    base = os.path.join(_ROOT, *parts)
    package = os.path.isfile(os.path.join(base, "__init__.py"))
    origin = os.path.join(base, "__init__.py") if package else base + ".py"
    if not os.path.isfile(origin):
        return None
    from lightning_lowmem._internals.twin_source import Loader

    spec = importlib.machinery.ModuleSpec(fullname, Loader(origin), origin=origin, is_package=package)
    spec.has_location = True
    if package:
        spec.submodule_search_locations = [base]
    return spec

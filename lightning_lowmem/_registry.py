"""The ``lowmem_*`` strategy names, registered with the ``StrategyRegistry`` of both Lightning packages on import.

Each name's factory imports its strategy module only when a Trainer asks for it; when Lightning is not imported
yet, a one-shot import hook registers the names the moment it is. ``lightning_lowmem.pl`` (:mod:`._internals.twin`)
gives a ``pytorch_lightning.Trainer`` the same names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

# name -> (module, class, description, preset keyword arguments)
_OFFLOAD = ("lightning_lowmem.strategies.offload.strategy", "OffloadStrategy")
_ZERO = ("lightning_lowmem.strategies.zero.strategy", "ZeroStrategy")
STRATEGIES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "lowmem_offload": (*_OFFLOAD, ("CPU-master half precision: compute weights on the accelerator, fp32 masters, "
                       "gradients and optimizer on the host"), {}),
    "lowmem_offload_params": (*_OFFLOAD, ("lowmem_offload with the repeated blocks' compute weights on the host too, "
                              "streamed to the device block by block"), {"offload_params": True}),
    "lowmem_offload_disk": (*_OFFLOAD, ("lowmem_offload with the fp32 masters and the optimizer state in files on "
                            "a local disk (the Trainer's `default_root_dir`), each stepped as its gradient lands"),
                            {"optimizer_in_backward": True, "disk": True}),
    "lowmem_auto": ("lightning_lowmem.plan.auto", "AutoStrategy", ("the fastest recipe of the suite that fits the "
                    "device, planned at fit start from dry runs (`lowmem plan`)"), {}),
    "lowmem_zero2": (*_ZERO, "DeepSpeed ZeRO stage 2 (optimizer state and gradients sharded), also on CPU",
                     {"stage": 2}),
    "lowmem_zero2_offload": (*_ZERO, ("DeepSpeed ZeRO stage 2 with the optimizer state and step on the CPU "
                             "(DeepSpeedCPUAdam)"), {"stage": 2, "offload_optimizer": True}),
    "lowmem_zero3": (*_ZERO, "DeepSpeed ZeRO stage 3 (parameters sharded as well), also on CPU", {"stage": 3}),
    "lowmem_zero3_offload": (*_ZERO, "DeepSpeed ZeRO stage 3 with optimizer state and parameters offloaded to the CPU",
                             {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    "lowmem_zero3_nvme": (*_ZERO, ("DeepSpeed ZeRO stage 3 with optimizer state and parameters offloaded to NVMe "
                          "(`nvme_path=` or the LOWMEM_NVME_PATH variable)"),
                          {"stage": 3, "offload_optimizer": True, "offload_parameters": True,
                           "offload_device": "nvme"}),
}


def _factory(module: str, cls: str) -> Callable[..., Any]:
    def build(**kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), cls)(**kwargs)

    build.__qualname__ = build.__name__ = f"{cls}"
    build.__doc__ = f"Builds `{module}.{cls}` (imported on first use)."
    return build


def builds(name: str, cls: type) -> bool:
    """Whether the registered name ``name`` builds exactly ``cls``, of either build (False for a name not ours).

    NOTE: compared by module and name, as the table holds them: importing the entry's module would import every
    strategy (and the planner) on first use.
    """
    from lightning_lowmem._internals.twin import real_name

    entry = STRATEGIES.get(name)
    return entry is not None and (entry[0], entry[1]) == (real_name(cls.__module__), cls.__qualname__)


#: this package built for the standalone ``pytorch_lightning`` package (:mod:`._internals.twin`, its ``PREFIX``)
PL_BUILD = "lightning_lowmem.pl"
#: each Lightning package's strategies module -> the build of this package whose classes the names build for it
_PACKAGES = {"lightning.pytorch.strategies": "lightning_lowmem", "pytorch_lightning.strategies": PL_BUILD}


def register_strategies() -> None:
    """Register every ``lowmem_*`` name with both Lightning packages, now or as soon as each is imported. Idempotent.

    NOTE: never imports Lightning itself (seconds of start-up): a one-shot import hook registers them later.
    """
    for registry_module, build in _PACKAGES.items():
        module = sys.modules.get(registry_module)
        if module is None:
            after_import(registry_module, register_strategies)
            continue
        for name, (path, cls, description, init_params) in STRATEGIES.items():
            path = build + path.removeprefix("lightning_lowmem")
            module.StrategyRegistry.register(
                name, _factory(path, cls), description=description, override=True, **init_params
            )


def serve_pytorch_lightning_build() -> None:
    """Make ``lightning_lowmem.pl`` importable (idempotent; imports nothing until it is imported)."""
    if not any(isinstance(finder, _BuildFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BuildFinder())


class _BuildFinder(importlib.abc.MetaPathFinder):
    """Finds ``lightning_lowmem.pl[.X]`` with :func:`._internals.twin.find_spec` (imported then); nothing else.

    NOTE: first on ``sys.meta_path``: the path finder would find a submodule's real file and execute it unrewritten.
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != PL_BUILD and not fullname.startswith(PL_BUILD + "."):
            return None
        from lightning_lowmem._internals.twin import find_spec

        return find_spec(fullname)


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` right after module ``name`` is first executed (once; nothing if already pending)."""
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of one module to run a callback after the module is executed."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding this finder again
        # NOTE: the first of the other meta-path finders, not `PathFinder` alone: editable installs and zipapps put
        # their own finder there, and a module only they find would be imported without the callback
        finders = (f.find_spec for f in list(sys.meta_path) if getattr(f, "find_spec", None) is not None)
        spec = next((s for s in (find(fullname, path, target) for find in finders) if s is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callback = spec.loader, self.callback

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                spec.loader = module.__loader__ = loader  # NOTE: the module keeps its real loader (reload, source)
                loader.exec_module(module)
                callback()

            def __getattr__(self, name: str) -> Any:
                return getattr(loader, name)

        spec.loader = _Loader()
        return spec

import importlib
import importlib.abc
import importlib.util
import inspect
import pkgutil
import subprocess
import sys

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_lowmem
from lightning_lowmem._registry import STRATEGIES, register_strategies


def test_every_name_registered():
    for name in STRATEGIES:
        assert name in StrategyRegistry.available_strategies()


def test_registration_idempotent():
    register_strategies()
    register_strategies()
    importlib.reload(lightning_lowmem)
    assert "lowmem_offload" in StrategyRegistry.available_strategies()


def test_import_does_not_import_optional_extras():
    code = "import sys, lightning_lowmem; print('deepspeed' in sys.modules, 'bitsandbytes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_unknown_public_name():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lightning_lowmem.Nope  # noqa: B018


def test_object_of_the_other_lightning_package_refused_naming_the_build():
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning as pl
    from lightning_lowmem.pl.core.hooks import check_lightning_object as check_pl_object

    from lightning_lowmem.core.hooks import check_lightning_object

    with pytest.raises(TypeError, match=r"import the same class from `lightning_lowmem.pl`"):
        check_lightning_object(pl.LightningModule(), "the model")
    with pytest.raises(TypeError, match=r"import the same class from `lightning_lowmem`: `from lightning_lowmem imp"):
        check_pl_object(L.LightningModule(), "the model")
    check_lightning_object(L.LightningModule(), "the model")
    check_pl_object(pl.LightningModule(), "the model")
    check_lightning_object(object(), "the model")  # NOTE: of neither package (a stand-in): not ours to judge


def test_zero_module_import_forms():
    from lightning_lowmem.zero import consolidate

    assert lightning_lowmem.zero.consolidate is consolidate


@pytest.mark.parametrize(
    "imports",
    ["import pytorch_lightning as pl, lightning_lowmem", "import lightning_lowmem, pytorch_lightning as pl"],
    ids=["pytorch_lightning-first", "lightning_lowmem-first"],
)
def test_pytorch_lightning_trainer_resolves_every_name_whatever_the_import_order(imports):
    pytest.importorskip("pytorch_lightning")
    code = (
        f"{imports}\n"
        "import inspect, sys, pytorch_lightning.strategies as s\n"
        "from lightning_lowmem._registry import STRATEGIES\n"
        "assert type(s.__loader__).__name__ == 'SourceFileLoader' and inspect.getsource(s)  # real loader kept\n"
        "assert set(STRATEGIES) <= set(s.StrategyRegistry.available_strategies())\n"
        "from lightning_lowmem.pl import ActivationCheckpointing, AccumulationScheduler\n"
        "t = pl.Trainer(strategy='lowmem_offload', accelerator='cpu', logger=False,\n"
        "               callbacks=[ActivationCheckpointing(), AccumulationScheduler()])\n"
        "assert isinstance(t.strategy, s.Strategy), type(t.strategy).__mro__\n"
        "print(type(t.strategy).__module__, any(m.split('.')[0] == 'lightning' for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-1500:]
    # NOTE: built by lightning_lowmem.pl, without importing any module of the unified package
    assert out.stdout.split()[-2:] == ["lightning_lowmem.pl.strategies.offload.strategy", "False"]


def test_pytorch_lightning_module_to_lightning_trainer_is_named():
    """Lightning itself refuses it before any code of ours runs, naming the fix (one import style)."""
    pytest.importorskip("pytorch_lightning")
    code = (
        "import lightning_lowmem, lightning as L\n"
        "from pytorch_lightning.demos.boring_classes import BoringModel\n"
        "L.Trainer(strategy='lowmem_offload', accelerator='cpu', logger=False).fit(BoringModel())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode != 0
    assert "You passed a `pytorch_lightning` object (BoringModel) to a `lightning.pytorch` Trainer" in out.stderr
    assert "invalid strategy name" not in out.stderr


def _overrides_without_decorator() -> list[str]:
    """Every method of a package class that overrides a base class's (Lightning's, torch's, ours) without `@override`."""
    from lightning_lowmem.core.optional import _EXTRAS

    missing = []
    for info in pkgutil.walk_packages(lightning_lowmem.__path__, "lightning_lowmem."):
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as err:
            if err.name in _EXTRAS:  # NOTE: a module of an optional extra that is not installed
                continue
            raise
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            for attr, value in vars(cls).items():
                if attr.startswith("__"):
                    continue
                fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
                fn = fn.fget if isinstance(fn, property) else fn
                # NOTE: a nested class is no method (torch.autograd.Function's metaclass adds `_backward_cls`)
                if isinstance(fn, type) or not callable(fn):
                    continue
                # NOTE: torch's `Optimizer.__init__` wraps the class's `step` at its first instance (`hooked`)
                if getattr(fn, "hooked", False) and fn.__wrapped__.__qualname__.split(".")[0] != cls.__name__:
                    continue
                overrides = any(attr in vars(base) for base in cls.__mro__[1:] if base is not object)
                if overrides and not (getattr(fn, "__override__", False) or getattr(value, "__override__", False)):
                    missing.append(f"{module.__name__}.{cls.__qualname__}.{attr}")
    return missing


def test_every_overriding_method_is_marked_override():
    missing = _overrides_without_decorator()
    assert not missing, "Mark these with `@override` (typing_extensions):\n" + "\n".join(missing)


class _MemoryFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder of one module that ``PathFinder`` cannot find (as editable installs and zipapps have)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.name else None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.EXECUTED = True


def test_after_import_runs_for_a_module_another_meta_path_finder_finds():
    from lightning_lowmem._registry import after_import

    name = "lowmem_test_meta_path_module"
    finder = _MemoryFinder(name)
    sys.meta_path.append(finder)  # NOTE: after PathFinder, where setuptools' editable finders go
    calls = []
    try:
        after_import(name, lambda: calls.append(sys.modules[name].EXECUTED))
        module = importlib.import_module(name)
        assert calls == [True] and module.__loader__ is finder
        assert not any(getattr(f, "name", None) == name for f in sys.meta_path if f is not finder)  # one shot
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop(name, None)


# what a function may import lazily outside cli/ (docs/design.md): optional extras and libraries costly to import
_LAZY = {"deepspeed", "bitsandbytes", "peft", "torchao", "galore_torch", "apollo_torch", "adam_mini", "liger_kernel",
         "cut_cross_entropy", "matplotlib", "safetensors", "transformers", "yaml", "psutil",
         # NOTE: Unix-only; torch's compiler, C++ builder and checkpointing (a second each to import); torch.distributed's
         # wrappers (not on every build); our modules that import DeepSpeed as they load
         "resource", "torch._dynamo", "torch.utils.cpp_extension", "torch.utils.checkpoint", "torch.distributed",
         "lightning_lowmem.strategies.zero.checkpoint_engine", "lightning_lowmem.strategies.zero.optim"}
# modules whose own imports are lazy by design: the import hooks (they must not import Lightning or the package early)
_LAZY_MODULES = {"lightning_lowmem/_registry.py", "lightning_lowmem/_internals/twin.py"}


def test_function_level_imports_are_the_documented_ones():
    import ast
    from pathlib import Path

    root = Path(lightning_lowmem.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel.startswith("lightning_lowmem/cli/") or rel in _LAZY_MODULES:
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) \
                        else [a.name for a in node.names]
                    found += [f"{rel}:{node.lineno} {name}" for name in names
                              if not any(name == lazy or name.startswith(lazy + ".") for lazy in _LAZY)]
    assert not found, "import these at the module top, or say in docs/design.md why they are lazy:\n" + "\n".join(found)


def test_no_import_circle_inside_the_offload_strategy():
    """Issue 44: `strategies/offload/` imports form no circle, imports under `TYPE_CHECKING` included."""
    import ast
    from pathlib import Path

    folder = Path(lightning_lowmem.__file__).parent / "strategies" / "offload"
    pkg = "lightning_lowmem.strategies.offload"
    names = {f"{pkg}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name in names:
        deps = set()
        for node in ast.walk(ast.parse((folder / f"{name.rsplit('.', 1)[1]}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = (deps & names) - {name}

    def circle(start: str, path: list[str]) -> list[str] | None:
        for nxt in graph[path[-1]]:
            if nxt == start:
                return [*path, nxt]
            if nxt not in path and (found := circle(start, [*path, nxt])):
                return found
        return None

    circles = [c for name in sorted(names) if (c := circle(name, [name]))]
    assert not circles, circles

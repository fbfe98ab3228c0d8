"""``lightning_lowmem/_internals/``: every private Lightning, torch, DeepSpeed and Python name the package uses exists
in the installed versions (an upgrade that removes one fails here, by name), and no other module uses one."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_lowmem._internals import bitsandbytes as bitsandbytes_internals
from lightning_lowmem._internals import deepspeed as deepspeed_internals
from lightning_lowmem._internals import frames as frames_internals
from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem._internals import torch as torch_internals

PACKAGE = Path(__file__).parents[1] / "lightning_lowmem"


def _resolve(dotted: str) -> object:
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)  # AttributeError names the missing symbol
        return obj
    raise ImportError(dotted)


def _class(dotted: str) -> type:
    cls = _resolve(dotted)
    assert isinstance(cls, type), dotted
    return cls


@pytest.mark.parametrize("dotted", [*torch_internals.PRIVATE_SYMBOLS, *lightning_internals.PRIVATE_SYMBOLS,
                                    *frames_internals.PRIVATE_SYMBOLS])
def test_private_symbol_exists(dotted):
    _resolve(dotted)


@pytest.mark.parametrize("dotted", bitsandbytes_internals.PRIVATE_SYMBOLS)
def test_bitsandbytes_private_symbol_exists(dotted):
    pytest.importorskip("bitsandbytes")
    _resolve(dotted)


def _instances() -> dict[str, object]:
    """An object of each class whose private attributes the package reads."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import FSDPStrategy

    weight = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([weight], lr=0.1)
    const = torch.optim.lr_scheduler.ConstantLR(opt)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    return {
        "torch.Tensor": torch.zeros(1),
        "torch.UntypedStorage": torch.zeros(1).untyped_storage(),
        "torch.nn.Module": torch.nn.Linear(1, 1),
        "torch.optim.lr_scheduler.SequentialLR": torch.optim.lr_scheduler.SequentialLR(opt, [const], milestones=[]),
        "torch.optim.lr_scheduler.ChainedScheduler": torch.optim.lr_scheduler.ChainedScheduler([const]),
        "torch._ops.OpOverload": torch.ops.aten.add.Tensor,
        "torch._dynamo.eval_frame.OptimizedModule": torch.compile(torch.nn.Linear(1, 1)),
        "lightning.pytorch.LightningModule": BoringModel(),
        "lightning.pytorch.Trainer": trainer,
        "lightning.pytorch.loops.fit_loop._FitLoop": trainer.fit_loop,
        "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector":
            trainer._accelerator_connector,
        "lightning.pytorch.strategies.FSDPStrategy": FSDPStrategy(),
    }


def test_private_instance_attributes_exist():
    instances = _instances()
    table = {**torch_internals.INSTANCE_ATTRIBUTES, **lightning_internals.INSTANCE_ATTRIBUTES}
    missing = []
    for path, names in table.items():
        obj = instances[path]  # KeyError: a new entry needs an instance above
        assert isinstance(obj, _class(path)), path
        missing += [f"{path}.{name}" for name in names if not hasattr(obj, name)]
    assert not missing, f"private attributes gone from the installed versions: {missing}"


def test_overridden_and_inherited_private_members_exist():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    missing = [f"{path}.{name}" for path, names in lightning_internals.OVERRIDDEN.items() for name in names
               if not callable(getattr(_class(path), name, None))]
    # NOTE: the inherited ones are set by the base class's constructor: checked on an instance
    instances = {"lightning.pytorch.strategies.Strategy": SingleDeviceStrategy(device="cpu")}
    missing += [f"{path}.{name}" for path, names in lightning_internals.INHERITED.items() for name in names
                if not hasattr(instances[path], name)]
    assert not missing, f"private members gone from the installed Lightning: {missing}"


def test_deepspeed_private_symbols_exist():
    pytest.importorskip("deepspeed")
    for dotted in deepspeed_internals.PRIVATE_SYMBOLS:
        _resolve(dotted)
    for path, method, attribute in deepspeed_internals.SOURCE_ATTRIBUTES:
        source = inspect.getsource(getattr(_class(path), method))
        assert f"{attribute} =" in source or f"{attribute}=" in source, f"{path}.{method} no longer sets {attribute}"
    for path, text in deepspeed_internals.SOURCE_LINES:
        assert text in inspect.getsource(_class(path)), f"{path} no longer holds {text!r}"


def test_hook_tables_hold_every_hook_table():
    """``hook_tables`` finds the tables by their names' ending: each hook table a module has today is among them."""
    module = torch.nn.Linear(2, 2)
    tables = [id(t) for t in torch_internals.hook_tables(module)]
    names = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
             "_load_state_dict_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
    assert all(id(getattr(module, name)) in tables for name in names)


def test_forget_fake_output_lets_swap_tensors_move_a_fake_parameter():
    """The canary of pytorch#148977: torch's memo of a fake op's output holds a weak reference, which makes the
    ``swap_tensors`` that ``module.to()`` runs on a fake parameter refuse it; dropping the entry lets the swap run."""
    import weakref

    with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):  # NOTE: a cache hit makes no memo entry
        mode = torch_internals.FakeTensorMode()
    with mode:
        p = torch.nn.Parameter(torch.empty(2, 3))
        q = torch.nn.Parameter(torch.empty(2, 3))
    assert weakref.getweakrefcount(p) == 1  # fails once torch drops the memo entry itself: the workaround can go
    with pytest.raises(RuntimeError, match="weakref"):
        torch.utils.swap_tensors(p, q)
    torch_internals.forget_fake_output(p)
    torch_internals.forget_fake_output(q)
    torch_internals.forget_fake_output(torch.zeros(1))  # a real tensor: nothing to drop
    torch.utils.swap_tensors(p, q)
    assert weakref.getweakrefcount(p) == 0


def test_checkpoint_region_is_torch_checkpoint_in_two_halves():
    """``checkpoint_region`` around a call recomputes it in backward with the same gradients as
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and plain autograd (dropout: the RNG is kept)."""
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Tanh())
    x = torch.randn(3, 4)
    calls = []

    def run(how: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer.zero_grad()

        def fn(t: torch.Tensor) -> torch.Tensor:
            calls.append(how)
            return layer(t)

        if how == "region":
            region = torch_internals.checkpoint_region(fn, noop_context_fn, x)
            next(region)
            out = fn(x)
            next(region, None)
        else:
            out = checkpoint(fn, x, use_reentrant=False) if how == "checkpoint" else fn(x)
        out.square().sum().backward()
        return [p.grad.clone() for p in layer.parameters()]

    plain, ours, theirs = run("plain"), run("region"), run("checkpoint")
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(plain, ours, theirs))
    assert calls.count("region") == 2  # forward, then the recompute in backward


#: the libraries whose private names only ``_internals/`` may use
_FOREIGN = {"torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "deepspeed", "peft",
            "transformers", "bitsandbytes", "torchao", "torchmetrics", "sys", "jsonargparse", "safetensors", "numpy"}
#: the public API of namedtuples (underscored so as not to clash with field names)
_NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _own_names(trees: list[ast.AST]) -> set[str]:
    """The private names the package defines itself: functions, classes, attributes and keys it assigns, arguments,
    keywords, loop variables."""
    out: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.arg) or isinstance(node, ast.keyword) and node.arg:
                out.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                out.add(node.asname)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.comprehension)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in (sub for target in targets for sub in ast.walk(target)):
                    if isinstance(t, ast.Attribute):
                        out.add(t.attr)
                    elif isinstance(t, ast.Name):
                        out.add(t.id)
                    elif isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant):
                        out.add(str(t.slice.value))  # `obj.__dict__["_name"] = ...`
    return {n for n in out if _private(n)}


def private_uses(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    """Every use of another library's private name in ``tree``: a private module or name imported from one, a private
    attribute of an object reached from one (``torch._foreach_norm``, ``aten = torch.ops.aten; aten._unique``), and a
    private attribute, ``getattr`` name or mapping key the package does not define itself (``x._version``)."""
    aliases: dict[str, str] = {}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _FOREIGN:
                    aliases[(a.asname or a.name).split(".")[0]] = a.name
                    if any(_private(part) for part in a.name.split(".")):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] in _FOREIGN:
            if any(_private(part) for part in node.module.split(".")):
                found.append((node.lineno, f"from {node.module} import ..."))
            for a in node.names:
                aliases[a.asname or a.name] = node.module
                if _private(a.name):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):  # NOTE: aliases of foreign objects (`_aten = torch.ops.aten`), at any level
        if isinstance(node, ast.Assign) and _root(node.value) in aliases:
            aliases.update((t.id, "") for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in _NAMEDTUPLE:
            if _root(node) in aliases or node.attr not in own:
                found.append((node.lineno, f".{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in own):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and isinstance(node.slice.value, str) and _private(node.slice.value) and node.slice.value not in own):
            found.append((node.lineno, f"[{node.slice.value!r}]"))
    return sorted(set(found))


def _package_trees() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_outside_internals_uses_a_private_api():
    trees = _package_trees()
    own = _own_names(list(trees.values()))
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}" for path, tree in trees.items()
             if "_internals" not in path.parts for line, what in private_uses(tree, own)]
    assert not found, "use (or add) a function of lightning_lowmem/_internals/ instead:\n" + "\n".join(found)


@pytest.mark.parametrize(("code", "what"), [
    ("key = t.untyped_storage()._cdata", "._cdata"),
    ("from torch._subclasses.fake_tensor import FakeTensor", "from torch._subclasses.fake_tensor import ..."),
    ("from torch.nn.modules.batchnorm import _BatchNorm", "from torch.nn.modules.batchnorm import _BatchNorm"),
    ("import torch\nn = torch._foreach_norm(ts)", "._foreach_norm"),
    ("import torch\n_aten = torch.ops.aten\nop = _aten._grouped_mm.default\ndef _grouped_mm(): ...", "._grouped_mm"),
    ("skip = trainer.fit_loop._skip_backward", "._skip_backward"),
    ("name = getattr(module, '_current_fx_name', None)", "getattr(..., '_current_fx_name')"),
])
def test_the_scan_sees_a_private_use(code, what):
    """Each kind of private use the scan must see (a name the package defines itself too included, where it is
    reached from a foreign object); and a private name the package defines is its own."""
    tree = ast.parse(code)
    assert what in [w for _, w in private_uses(tree, _own_names([tree]))]


def test_the_scan_leaves_the_package_own_names_and_public_apis_alone():
    code = "import torch\nclass A:\n    def __init__(self):\n        self._x = 1\n    def f(self, other):\n"
    code += "        return other._x, torch.utils.checkpoint.checkpoint, point._replace(x=1)"
    tree = ast.parse(code)
    assert private_uses(tree, _own_names([tree])) == []

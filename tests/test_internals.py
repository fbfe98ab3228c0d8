"""``lightning_lowmem/_internals/``: every private Lightning, torch, DeepSpeed and Python name the package uses exists
in the installed versions (an upgrade that removes one fails here, by name), and no other module uses one."""

from __future__ import annotations

import importlib
import inspect
import re
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


#: a private torch/Lightning/DeepSpeed/PEFT module or name, or one of the private attributes the package reads
_PRIVATE = re.compile(r"""(?x)
  (?<![\w.])torch\._[A-Za-z]
| ^\s*(?:from|import)\s+(?:torch|lightning|deepspeed|peft)(?:\.\w+)*\._\w
| ^\s*from\s+(?:torch|lightning|deepspeed|peft)(?:\.\w+)*\s+import\s+[^(]*\b_[A-Za-z]
| \bsys\._getframe
| \.(?:_cdata|_current_fx_name|_accelerator_connector|_data_source|_forward_hooks\w*|_version|_schema
     |_execution_engine|_activation_checkpointing_kwargs|_setup_model|_opt_called)\b
""")


def test_hook_tables_hold_every_hook_table():
    """``hook_tables`` finds the tables by their names' ending: each hook table a module has today is among them."""
    module = torch.nn.Linear(2, 2)
    tables = [id(t) for t in torch_internals.hook_tables(module)]
    names = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
             "_load_state_dict_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
    assert all(id(getattr(module, name)) in tables for name in names)


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


def test_no_module_outside_internals_uses_a_private_api():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_internals" in path.parts:
            continue
        in_string = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.count('"""') % 2:
                in_string = not in_string
                continue
            code = line.split("#")[0]
            if not in_string and _PRIVATE.search(code):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert not found, "use (or add) a function of lightning_lowmem/_internals/ instead:\n" + "\n".join(found)


def test_the_scan_sees_a_private_use():
    assert _PRIVATE.search("    key = t.untyped_storage()._cdata")
    assert _PRIVATE.search("from torch._subclasses.fake_tensor import FakeTensor")
    assert _PRIVATE.search("from torch.nn.modules.batchnorm import _BatchNorm")
    assert _PRIVATE.search("        return torch._foreach_norm(tensors)")
    assert not _PRIVATE.search("from torch.utils.checkpoint import checkpoint")

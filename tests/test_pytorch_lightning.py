"""Both Lightning packages: ``lightning_lowmem.pl`` (this package built for the standalone ``pytorch_lightning``) trains a
``pytorch_lightning.Trainer`` exactly as ``lightning_lowmem`` trains a ``lightning`` one.

- the build: every module of the package compiles for it; its classes come from the same files and subclass
  ``pytorch_lightning``'s; the ``lowmem_*`` names build them; nothing of the unified package is imported;
- numerics: one small module, written once for either package, through each package's own Trainer with the same
  flags (``ActivationCheckpointing``, ``AccumulationScheduler``, ``lowmem_offload`` at 32-true): equal weights and
  buffers, and each against the plain run of its package;
- a library that builds ``pytorch_lightning.Trainer(**trainer_kwargs)`` itself: neuralforecast's NHITS through its own
  ``NeuralForecast.fit``/``predict`` (the ``corpus`` extra), against its plain run;
- mixing the builds is refused before the first step, naming the build to import.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_lowmem
from lightning_lowmem._internals import twin, twin_source
from lightning_lowmem._registry import PL_BUILD, STRATEGIES

pl = pytest.importorskip("pytorch_lightning")
import lightning_lowmem.pl as lowmem_pl  # (after the skip: needs pytorch_lightning)

_PACKAGE = Path(lightning_lowmem.__file__).parent


def test_every_module_compiles_for_pytorch_lightning():
    """The rewrite accepts every file (an `import lightning.x` without `as` would be refused, naming the line)."""
    for path in sorted(_PACKAGE.rglob("*.py")):
        twin_source.Loader(str(path)).source_to_code(path.read_bytes(), str(path))


def test_rewrite_changes_imports_and_module_paths_only():
    source = ("import lightning as L\nimport lightning_lowmem\nfrom lightning.fabric.utilities import x\n"
              "A = ('lightning.pytorch.strategies', 'lightning_lowmem.zero', 'lightning.', f'lightning_lowmem.{1}',\n"
              "     'not lightning.pytorch', 'torch.nn')\n")
    text = ast.unparse(twin_source.Rewrite("x.py").visit(ast.parse(source)))
    assert "import pytorch_lightning as L" in text
    assert "import lightning_lowmem.pl as lightning_lowmem" in text
    assert "from lightning_fabric.utilities import x" in text
    assert "('pytorch_lightning.strategies', 'lightning_lowmem.pl.zero', 'lightning.', f'lightning_lowmem.{1}', " \
           "'not lightning.pytorch', 'torch.nn')" in text


def test_import_lightning_dot_module_without_alias_is_refused():
    with pytest.raises(ImportError, match=r"x.py:1: `import lightning.pytorch` cannot be rewritten"):
        twin_source.Loader("x.py").source_to_code(b"import lightning.pytorch\n", "x.py")


def test_the_build_is_the_same_source_subclassing_pytorch_lightning():
    for name in ("OffloadStrategy", "ActivationCheckpointing", "AccumulationScheduler", "ZeroStrategy"):
        try:
            ours, theirs = getattr(lightning_lowmem, name), getattr(lowmem_pl, name)
        except ModuleNotFoundError:  # NOTE: ZeroStrategy without the deepspeed extra
            continue
        assert theirs is not ours and inspect.getsourcefile(theirs) == inspect.getsourcefile(ours)
        assert theirs.__module__ == twin.twin_name(ours.__module__)
        base = pl.Callback if name not in ("OffloadStrategy", "ZeroStrategy") else pl.strategies.Strategy
        assert issubclass(theirs, base) and not issubclass(ours, base)
    assert lowmem_pl.pl is lowmem_pl and sorted(lowmem_pl.__all__) == sorted(lightning_lowmem.__all__)
    # NOTE: the import machinery and the name table are one copy for both builds
    assert importlib.import_module("lightning_lowmem.pl.core.hooks").package_of is twin.package_of


def test_private_lightning_names_exist_in_pytorch_lightning():
    """The canaries of tests/test_internals.py, for the build's own list (rewritten to pytorch_lightning's names)."""
    from tests.test_internals import _class, _resolve

    internals = importlib.import_module("lightning_lowmem.pl._internals.lightning")
    names = [*internals.PRIVATE_SYMBOLS, *internals.INSTANCE_ATTRIBUTES, *internals.OVERRIDDEN, *internals.INHERITED]
    assert all(name.startswith(("pytorch_lightning.", "lightning_fabric.")) for name in names)
    for dotted in internals.PRIVATE_SYMBOLS:
        _resolve(dotted)
    missing = [f"{path}.{name}" for path, names in internals.OVERRIDDEN.items() for name in names
               if not callable(getattr(_class(path), name, None))]
    strategy = pl.strategies.SingleDeviceStrategy(device="cpu")
    missing += [f"{path}.{name}" for path, names in internals.INHERITED.items() for name in names
                if not hasattr(strategy, name)]
    assert not missing


def test_the_finder_serves_only_package_files():
    for name in ("lightning_lowmem.pl.nope", "lightning_lowmem.pl._registry", "lightning_lowmem.pl.a/../b"):
        assert twin.find_spec(name) is None


def test_every_name_builds_the_pytorch_lightning_build():
    assert PL_BUILD == twin.PREFIX
    for name, (module, cls, _, _) in STRATEGIES.items():
        entry = pl.strategies.StrategyRegistry[name]
        assert entry["strategy"].__doc__ == f"Builds `{twin.twin_name(module)}.{cls}` (imported on first use)."
        assert entry["init_params"] == L.pytorch.strategies.StrategyRegistry[name]["init_params"]
    trainer = pl.Trainer(strategy="lowmem_offload_params", accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, lowmem_pl.OffloadStrategy) and trainer.strategy.offload_params


# --- numerics: one module, either package --------------------------------------------------------------------------
def _module_class(base: type) -> type:
    """The same small module for either package: 3 repeated blocks (checkpointable), each with a BatchNorm (buffers)
    before its Linear (a bias right before a BatchNorm gets a gradient of rounding noise only)."""

    class Net(base):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 16), nn.GELU()) for _ in range(3))
            self.head = nn.Linear(16, 1)

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            for block in self.blocks:
                x = x + block(x)
            return F.mse_loss(self.head(x), y)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)),
                              batch_size=8)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Net


def _fit(package: Any, flags: dict[str, Any]) -> dict[str, Tensor]:
    package.seed_everything(0, verbose=False)
    module = _module_class(package.LightningModule)()
    trainer = package.Trainer(
        max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **flags)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


#: flag -> (its Trainer arguments from a build, plain Lightning's arguments for the same maths, exactly equal to them)
_FLAGS: dict[str, tuple[Callable[[Any], dict[str, Any]], dict[str, Any], bool]] = {
    "ActivationCheckpointing": (lambda build: {"callbacks": [build.ActivationCheckpointing()]}, {}, True),
    # NOTE: a weighted sum rescaled, against Lightning's mean of means: close, not equal
    "AccumulationScheduler": (
        lambda build: {"callbacks": [build.AccumulationScheduler(effective_batch_size=16, micro_batch_size=8)]},
        {"accumulate_grad_batches": 2}, False),
    # NOTE: the host optimizer (a fused AdamW on the fp32 masters): the same maths in another order
    "lowmem_offload@32-true": (lambda build: {"strategy": "lowmem_offload"}, {}, False),
    "OffloadStrategy(host_optimizer='as_is')": (
        lambda build: {"strategy": build.OffloadStrategy(host_optimizer="as_is")}, {}, True),
}


@pytest.mark.integration
@pytest.mark.parametrize("flag", sorted(_FLAGS))
def test_pytorch_lightning_trainer_trains_as_the_lightning_one(flag):
    flags, reference, exact = _FLAGS[flag]
    got_pl, got_l = _fit(pl, flags(lowmem_pl)), _fit(L, flags(lightning_lowmem))
    assert got_pl.keys() == got_l.keys()
    differ = [k for k in got_l if not torch.equal(got_pl[k], got_l[k])]
    assert not differ, f"the two packages' runs of {flag} differ: {differ}"
    want = _fit(pl, reference)
    if exact:
        assert all(torch.equal(got_pl[k], want[k]) for k in want)
    else:
        assert all(torch.allclose(got_pl[k].double(), want[k].double(), rtol=1e-5, atol=1e-6) for k in want)


@pytest.mark.parametrize("where", ["callbacks", "strategy"])
def test_mixing_the_builds_is_refused_before_the_first_step(where):
    module = _module_class(pl.LightningModule)()
    if where == "callbacks":
        trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[lightning_lowmem.ActivationCheckpointing()])
        with pytest.raises(TypeError, match=r"import the same class from `lightning_lowmem.pl`"):
            trainer.fit(module)
        assert trainer.global_step == 0
    else:  # NOTE: pytorch_lightning's own check, before any code of ours runs (documented in docs/lightning-packages.md)
        with pytest.raises(ValueError, match="invalid strategy name"):
            pl.Trainer(strategy=lightning_lowmem.OffloadStrategy(), accelerator="cpu", logger=False)


# --- a library that builds its own pytorch_lightning.Trainer -------------------------------------------------------
def _neuralforecast(**trainer_kwargs: Any) -> tuple[dict[str, Tensor], Any]:
    """neuralforecast's NHITS through its own entry point (``NeuralForecast.fit`` builds ``pl.Trainer(**trainer_kwargs)``
    from the model's keyword arguments; ``predict`` builds another from the same), on two synthetic series.

    NOTE: the forecast is None with a strategy object: ``predict`` reuses it in a second Trainer, which
    pytorch_lightning refuses for any strategy object used once ("... set through both ..."), plain ones alike.
    """
    import numpy as np
    import pandas as pd
    from neuralforecast import NeuralForecast
    from neuralforecast.models import NHITS

    rng = np.random.default_rng(0)
    days = pd.date_range("2020-01-01", periods=48, freq="D")
    df = pd.concat([pd.DataFrame({"unique_id": uid, "ds": days, "y": np.sin(np.arange(48) / 3.0 + i)
                                  + 0.1 * rng.standard_normal(48)}) for i, uid in enumerate("ab")])
    model = NHITS(h=4, input_size=12, max_steps=4, batch_size=2, windows_batch_size=8, random_seed=1,
                  accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                  **trainer_kwargs)
    nf = NeuralForecast(models=[model], freq="D")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nf.fit(df=df)
        forecast = None if isinstance(trainer_kwargs.get("strategy"), pl.strategies.Strategy) else nf.predict()
    return {k: v.detach().clone() for k, v in nf.models[0].state_dict().items()}, forecast


@pytest.mark.integration
@pytest.mark.slow
def test_neuralforecast_trainer_kwargs_reach_the_suite():
    pytest.importorskip("neuralforecast")
    want, want_forecast = _neuralforecast()
    got, forecast = _neuralforecast(callbacks=[lowmem_pl.ActivationCheckpointing()])
    assert all(torch.equal(got[k], want[k]) for k in want) and forecast.equals(want_forecast)
    got, _ = _neuralforecast(strategy=lowmem_pl.OffloadStrategy(host_optimizer="as_is"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    got, forecast = _neuralforecast(strategy="lowmem_offload")  # NOTE: the host optimizer: the same maths, fused
    assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6) for k in want)
    assert np.allclose(forecast["NHITS"], want_forecast["NHITS"], rtol=1e-5, atol=1e-6)

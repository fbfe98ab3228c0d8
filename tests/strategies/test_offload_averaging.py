"""Lightning's weight averaging (``StochasticWeightAveraging``, ``WeightAveraging`` with an EMA) under ``lowmem_offload``.

Under ``32-true`` and ``*-mixed`` the compute weights are fp32 copies of the masters, so the callbacks average them as
plain Lightning averages its parameters, and what they write back (SWA in place, the EMA through ``.data`` at the end
of fit) reaches the masters. Compared, through a real ``Trainer.fit`` on a module with BatchNorm (SWA recomputes its
statistics in an extra epoch, the EMA averages them as buffers): ``torch.equal`` with plain Lightning at the same
precision, for the module after fit (weights and buffers), ``last.ckpt`` and the validation losses (the EMA validates
on the average). Under ``offload_params`` (streamed weights are placeholders between uses) they are refused.
"""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.helpers.foreign import FOREIGN_MODULES, make

pytestmark = pytest.mark.integration
EPOCHS = 3


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.lin(x)))


class Net(L.LightningModule):
    """Written as for plain Lightning: SGD with momentum, BatchNorm, a validation loss."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 1)
        self.val_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(nn.functional.mse_loss(self(x).float(), y).detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return _loader(seed=0)

    def val_dataloader(self):
        return _loader(seed=1, n=16)


def _loader(seed: int, n: int = 32) -> DataLoader:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x, torch.sin(x[:, :1]) * 2), batch_size=8)


def _swa() -> StochasticWeightAveraging:
    return StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1)


def _ema() -> WeightAveraging:
    return WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.9))


AVERAGING = {"swa": _swa, "ema": _ema}


def _fit(kind: str, strategy, precision: str, tmp_path):
    L.seed_everything(0, verbose=False)
    module = Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_epochs=EPOCHS, limit_val_batches=1,
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[AVERAGING[kind](), ModelCheckpoint(dirpath=tmp_path, save_last=True)],
    )  # fmt: skip
    trainer.fit(module)
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    final = {k: v.detach().clone() for k, v in module.state_dict().items()}
    trainer.validate(module, verbose=False)  # the EMA swaps its average in for validation, and back
    _assert_equal(module.state_dict(), final, "module after validate")
    return final, last, [float(v) for v in module.val_losses]


_PLAIN: dict[tuple[str, str], tuple] = {}


def _plain(kind: str, precision: str, tmp_path_factory):
    if (kind, precision) not in _PLAIN:
        _PLAIN[kind, precision] = _fit(kind, "auto", precision, tmp_path_factory.mktemp("plain"))
    return _PLAIN[kind, precision]


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key} differs by {(got[key] - value).abs().max()}"


def _strategy(stream: bool) -> OffloadStrategy:
    return OffloadStrategy(host_optimizer="as_is", offload_params=stream)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_averaging_equals_plain_lightning(kind, precision, tmp_path, tmp_path_factory):
    final, last, val = _fit(kind, _strategy(False), precision, tmp_path)
    want_final, want_last, want_val = _plain(kind, precision, tmp_path_factory)
    _assert_equal(final, want_final, "module after fit")
    _assert_equal(last["state_dict"], want_last["state_dict"], "last.ckpt state_dict")
    if kind == "ema":  # the callback saves the average as `state_dict` and the trained weights beside it
        _assert_equal(last["current_model_state"], want_last["current_model_state"], "last.ckpt current_model_state")
    assert val == want_val and len(val) >= EPOCHS


@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_averaging_is_refused_with_offload_params(kind, tmp_path):
    with pytest.raises(ValueError, match=r"averages the module's parameters.*placeholders.*offload_params=False"):
        _fit(kind, _strategy(True), "32-true", tmp_path)


@pytest.mark.parametrize("name", list(FOREIGN_MODULES))
def test_ema_on_the_foreign_modules_equals_plain_lightning(name):
    """Lightning's EMA on the six modules written as Lightning's examples write them (tests/helpers/foreign.py)."""

    def fit(strategy) -> dict[str, torch.Tensor]:
        module = make(name)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_steps=3, limit_val_batches=1, num_sanity_val_steps=0,
            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            callbacks=[_ema()],
        )  # fmt: skip
        L.seed_everything(1, verbose=False)  # dropout masks and the GAN's noise
        trainer.fit(module)
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    if name == "transformer_lm":
        # its position table is a buffer built on first use: the average made at setup has none, and torch's
        # AveragedModel cannot copy it, under plain Lightning as here
        for strategy in ("auto", OffloadStrategy(host_optimizer="as_is")):
            with pytest.raises(RuntimeError, match=r"size of tensor a \(0\) must match the size of tensor b"):
                fit(strategy)
        return
    _assert_equal(fit(OffloadStrategy(host_optimizer="as_is")), fit("auto"), name)


class OwnEMA(Callback):
    """A user's own weight averaging, written for the fp32 module, using the strategy's public ``masters_view``."""

    def __init__(self) -> None:
        self.average: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        view = trainer.strategy.masters_view() if isinstance(trainer.strategy, OffloadStrategy) else contextlib.nullcontext()
        with view:
            current = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        if self.average is None:
            self.average = current
        else:
            self.average = {n: 0.9 * self.average[n] + 0.1 * current[n] for n in current}


@pytest.mark.parametrize("stream", [False, True], ids=["offload", "offload_params"])
def test_masters_view_serves_a_users_own_averaging(stream):
    averages = []
    for strategy in ("auto", _strategy(stream)):
        L.seed_everything(0, verbose=False)
        callback = OwnEMA()
        trainer = L.Trainer(
            accelerator="cpu", strategy=strategy, precision="bf16-mixed", max_steps=3, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
            callbacks=[callback],
        )  # fmt: skip
        trainer.fit(Net())
        averages.append(callback.average)
    _assert_equal(averages[1], averages[0], "the user's average")


def _fit_swa_from(strategy, tmp_path, ckpt_path=None) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    module = Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=EPOCHS, limit_val_batches=1, num_sanity_val_steps=0,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[_swa(), ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)],
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_swa_resumed_mid_average_equals_plain_lightning(tmp_path):
    """A checkpoint taken after the first averaged epoch (SWA's average, its count and scheduler are callback state) and
    resumed by a new Trainer and module: the same weights and BatchNorm statistics as the run that was not stopped, as
    plain Lightning's; from our checkpoint and from plain Lightning's (one file format)."""
    want = _fit_swa_from("auto", tmp_path / "plain")
    plain_ckpt = next((tmp_path / "plain").glob("epoch=1-*.ckpt"))
    _assert_equal(_fit_swa_from("auto", tmp_path / "plain_resumed", plain_ckpt), want, "plain Lightning resumed")
    _assert_equal(_fit_swa_from(_strategy(False), tmp_path / "ours"), want, "lowmem_offload")
    ours_ckpt = next((tmp_path / "ours").glob("epoch=1-*.ckpt"))
    _assert_equal(_fit_swa_from(_strategy(False), tmp_path / "resumed", ours_ckpt), want, "lowmem_offload resumed")
    _assert_equal(_fit_swa_from(_strategy(False), tmp_path / "cross", plain_ckpt), want, "resumed from plain's file")

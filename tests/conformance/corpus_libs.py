"""Modules of the corpus built from published libraries' own model classes (the ``corpus`` extra), on synthetic data.

neuralforecast's NHITS (MLP stacks with pooling and interpolation), PatchTST (a transformer over patches) and LSTM (a
recurrent encoder, an MLP decoder), each the library's class built with its own defaults beside a few small sizes,
called as the library calls it (``model(windows_batch)``) and trained on MAE (the library's default loss). The library's classes are
``pytorch_lightning.LightningModule`` s: here each is the network of a ``lightning`` module, so the corpus sweeps them
with the rest; the library's own entry point through a ``pytorch_lightning.Trainer`` (``lightning_lowmem.pl``) is
``tests/test_pytorch_lightning.py``'s. :func:`available` lists the modules whose library is installed.

NOTE: not TFT: its attention keeps a causal mask of ``-inf`` as a buffer, which ``compare.py`` judges as a trained
value gone non-finite (``differs`` on every flag, plain Lightning's run holding the same mask).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import Tensor, nn

from tests.conformance.corpus_nets import SAMPLES, Base

INPUT, HORIZON = 16, 4


class _NeuralForecast(Base):
    """A neuralforecast model (``_build``) on windows of noisy sines: ``INPUT`` steps in, ``HORIZON`` out, MAE, Adam
    (the library's default optimizer)."""

    OPTIMIZER = "adam"

    def __init__(self) -> None:
        super().__init__()
        self.net = self._build()

    def _build(self) -> nn.Module:
        raise NotImplementedError

    def _make_data(self, g: torch.Generator) -> list[Any]:
        steps = torch.arange(INPUT + HORIZON, dtype=torch.float32)
        phase = torch.rand(SAMPLES, 1, generator=g) * 6.0
        series = torch.sin(steps / 3.0 + phase) + 0.1 * torch.randn(SAMPLES, INPUT + HORIZON, generator=g)
        return list(zip(series[:, :INPUT], series[:, INPUT:]))

    def forward(self, x: Tensor) -> Tensor:
        windows = {"insample_y": x[..., None], "insample_mask": torch.ones_like(x)[..., None], "futr_exog": None,
                   "hist_exog": None, "stat_exog": None}
        return self.net(windows)[..., 0]

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        return (self(x) - y).abs().mean()


class NeuralForecastNHITS(_NeuralForecast):
    """neuralforecast's ``NHITS`` (three MLP stacks, 16 wide, max-pooled inputs, interpolated forecasts)."""

    def _build(self) -> nn.Module:
        from neuralforecast.models import NHITS

        return NHITS(h=HORIZON, input_size=INPUT, mlp_units=[[16, 16]] * 3, n_pool_kernel_size=[2, 2, 1],
                     n_freq_downsample=[2, 1, 1])


class NeuralForecastPatchTST(_NeuralForecast):
    """neuralforecast's ``PatchTST`` (a transformer encoder over patches of 4 steps, 16 wide, 2 heads).

    Patching, learned positional encodings, batch-norm'd attention blocks and a flatten head, as the library builds it.
    """

    def _build(self) -> nn.Module:
        from neuralforecast.models import PatchTST

        return PatchTST(h=HORIZON, input_size=INPUT, hidden_size=16, n_heads=2, patch_len=4, stride=4,
                        linear_hidden_size=16)


class NeuralForecastLSTM(_NeuralForecast):
    """neuralforecast's ``LSTM`` (a 2-layer LSTM encoder, 16 wide, and an MLP decoder per horizon step)."""

    def _build(self) -> nn.Module:
        from neuralforecast.models import LSTM

        return LSTM(h=HORIZON, input_size=INPUT, encoder_hidden_size=16, decoder_hidden_size=16)


#: corpus name -> (kind, class, the library it needs)
MODULES = {
    "neuralforecast_nhits": ("forecasting", NeuralForecastNHITS, "neuralforecast"),
    "neuralforecast_patchtst": ("forecasting", NeuralForecastPatchTST, "neuralforecast"),
    "neuralforecast_lstm": ("forecasting", NeuralForecastLSTM, "neuralforecast"),
}


def available() -> dict[str, tuple[str, type]]:
    """The modules whose library is installed (the ``corpus`` extra): name -> (kind, class)."""
    return {name: (kind, cls) for name, (kind, cls, lib) in MODULES.items() if importlib.util.find_spec(lib)}

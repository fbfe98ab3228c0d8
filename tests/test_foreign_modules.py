"""Every strategy and callback on six LightningModules written as Lightning's own examples write them.

The modules (``tests/helpers/foreign.py``) are not adapted to lightning_lowmem in any way. Each case runs
``fit`` (3 optimizer steps), ``validate``, ``test`` and ``predict`` (the GAN example has no validation or test
step) and compares with plain Lightning where the maths is the same:

- ``torch.equal`` of the weights after fit and of the predictions: ``lowmem_offload`` with ``32-true`` and with
  ``bf16-mixed`` (``host_optimizer="as_is"``: the module's optimizer as configured), ``ActivationCheckpointing``,
  ``ActivationOffload``, ``OptimizerInBackward``, ``MemoryReport``;
  (the GAN's discriminator, called on real and fake images, has its half weights' contributions summed in fp32 as
  under plain mixed precision);
- ``AccumulationScheduler`` (2 micro-batches of 8) against Lightning's ``accumulate_grad_batches=2``: the same
  mean, computed as a weighted sum then rescaled: ``rtol=1e-5, atol=1e-7``;
- ``bf16-true`` and ``LowBitOptimizer`` change the arithmetic (half weights; 8-bit moments): they must train
  (finite loss, weights moved) and run every stage, nothing more is claimed here.

Combinations refused by design are asserted with their message.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.callbacks.optimizer_in_backward import OptimizerInBackward
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.helpers.foreign import FOREIGN_MODULES, STAGES, make
from tests.helpers.runif import RunIf

pytestmark = pytest.mark.integration

MODULES = list(FOREIGN_MODULES)
STEPS = 3


class _Losses(Callback):
    """The loss of every training batch (automatic optimization) and whether it stayed finite."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if isinstance(outputs, dict) and "loss" in outputs:
            self.losses.append(float(outputs["loss"]))


def _run(name: str, *, strategy: Any = "auto", precision: str = "32-true", callbacks: tuple = (), **trainer_kwargs):
    """fit, then every other stage the module has; returns (weights after fit, predictions, losses, trainer)."""
    module = make(name)
    losses = _Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=STEPS,
        limit_val_batches=1, limit_test_batches=1, limit_predict_batches=2, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*copy.deepcopy(list(callbacks)), losses], **trainer_kwargs,
    )  # fmt: skip
    L.seed_everything(1, verbose=False)  # dropout masks and the GAN's noise
    trainer.fit(module)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if "validate" in STAGES[name]:
        trainer.validate(module, verbose=False)
        trainer.test(module, verbose=False)
    predictions = trainer.predict(module)
    assert predictions and all(isinstance(p, torch.Tensor) for p in predictions)
    assert all(v.dtype == torch.float32 for v in weights.values() if v.is_floating_point()), "weights given back fp32"
    return weights, predictions, losses.losses, trainer


@functools.cache
def _plain(name: str, precision: str = "32-true", accumulate: int = 1):
    return _run(name, precision=precision, accumulate_grad_batches=accumulate)


def _assert_same(got, want, **tolerance) -> None:
    (w_got, p_got), (w_want, p_want) = got[:2], want[:2]
    assert w_got.keys() == w_want.keys()
    for key in w_want:
        if tolerance:
            torch.testing.assert_close(w_got[key], w_want[key], **tolerance, msg=lambda m, key=key: f"{key}: {m}")
        else:
            assert torch.equal(w_got[key], w_want[key]), key
    for a, b in zip(p_got, p_want):
        if not tolerance:
            assert torch.equal(a, b)
        elif a.is_floating_point():
            torch.testing.assert_close(a, b, **tolerance)


def _assert_trained(result, name: str) -> None:
    weights, _, losses, _ = result
    before = make(name).state_dict()
    assert any(not torch.equal(weights[k], before[k].float()) for k in before if before[k].is_floating_point())
    assert all(math.isfinite(x) for x in losses)


# --- lowmem_offload -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_offload_matches_plain_lightning(name, precision):
    """fp32 weights, or autocast with half copies of exactly the weights autocast casts: plain Lightning's maths."""
    got = _run(name, strategy=OffloadStrategy(host_optimizer="as_is"), precision=precision)
    _assert_same(got, _plain(name, precision))


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("precision", ["bf16-true", "16-mixed"])
def test_offload_half_precisions_train_every_module(name, precision):
    """The registered name and default host optimizer; "16-mixed" is bf16-mixed on the CPU, as in Lightning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*AMP with fp16 is not supported on CPU.*")
        result = _run(name, strategy="lowmem_offload", precision=precision)
    _assert_trained(result, name)


# --- callbacks ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODULES)
def test_activation_checkpointing_matches_plain(name):
    if name == "gan":
        with pytest.raises(ValueError, match=r"a manual-optimization step cannot step its optimizers.*blocks=\['generator', 'discriminator'\]"):
            _run(name, callbacks=(ActivationCheckpointing(),))
        callback = ActivationCheckpointing(blocks=["generator", "discriminator"])
    else:
        callback = ActivationCheckpointing()
    got = _run(name, callbacks=(callback,))
    _assert_same(got, _plain(name))
    cb = next(c for c in got[3].callbacks if isinstance(c, ActivationCheckpointing))
    assert cb.wrapped, "something is checkpointed in every one of these modules"


@pytest.mark.parametrize("name", MODULES)
def test_activation_offload_matches_plain(name):
    _assert_same(_run(name, callbacks=(ActivationOffload(min_bytes=0),)), _plain(name))


@pytest.mark.parametrize("name", MODULES)
def test_accumulation_scheduler_matches_lightning_accumulation(name):
    callback = AccumulationScheduler(effective_batch_size=16, micro_batch_size=8)
    if name == "gan":
        with pytest.raises(ValueError, match="manual optimization is not supported"):
            _run(name, callbacks=(callback,))
        return
    _assert_same(_run(name, callbacks=(callback,)), _plain(name, accumulate=2), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["plain_tensor", "autoencoder"])
def test_accumulation_scheduler_auto_micro_batch(name):
    """The dry runs measure each module as Lightning runs it (`plain_tensor`'s `training_step` takes no `batch_idx`)."""
    from lightning_lowmem import dry_run_peak

    callback = AccumulationScheduler(effective_batch_size=16, micro_batch_size="auto", memory_budget="64MiB",
                                     measure=dry_run_peak)
    result = _run(name, callbacks=(callback,))
    _assert_trained(result, name)
    assert next(c for c in result[3].callbacks if isinstance(c, AccumulationScheduler)).choice.micro_batch_size >= 1


@pytest.mark.parametrize("name", MODULES)
def test_optimizer_in_backward_matches_plain(name):
    if name == "gan":
        with pytest.raises(ValueError, match="manual optimization"):
            _run(name, callbacks=(OptimizerInBackward(),))
        return
    _assert_same(_run(name, callbacks=(OptimizerInBackward(),)), _plain(name))


@pytest.mark.parametrize("name", MODULES)
def test_memory_report_measures_without_changing_training(name, tmp_path):
    from lightning_lowmem.report.memory_report import MemoryReport

    report = MemoryReport(every_n_steps=1, predict=False, plot=False, save_dir=tmp_path)
    _assert_same(_run(name, callbacks=(report,)), _plain(name))


@pytest.mark.bnb
@RunIf(bitsandbytes=True)
@pytest.mark.parametrize("name", MODULES)
def test_low_bit_optimizer_trains_adam_modules_and_names_what_sgd_lacks(name):
    from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer

    if name in ("classifier", "plain_tensor"):  # SGD: bitsandbytes has no 8-bit SGD to swap in
        with pytest.raises(ValueError, match=r"cannot replace `torch\.optim\.sgd\.SGD`: it has no 8-bit equivalent"):
            _run(name, callbacks=(LowBitOptimizer(),))
        return
    result = _run(name, callbacks=(LowBitOptimizer(),))
    _assert_trained(result, name)
    assert {type(o).__module__.split(".")[0] for o in result[3].optimizers} == {"bitsandbytes"}


# --- DeepSpeed ------------------------------------------------------------------------------------------------------


@pytest.mark.deepspeed
@RunIf(deepspeed=True)
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("strategy", ["lowmem_zero2", "lowmem_zero3"])
def test_zero_presets_train_every_single_optimizer_module(name, strategy):
    if name == "gan":  # Lightning's DeepSpeedStrategy: one optimizer per engine
        with pytest.raises(Exception, match="DeepSpeed currently only supports single optimizer"):
            _run(name, strategy=strategy)
        return
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    if strategy == "lowmem_zero3":  # the weights come back into the module for the check
        strategy = ZeroStrategy(stage=3, gather_on_fit_end=True)
    _assert_trained(_run(name, strategy=strategy), name)

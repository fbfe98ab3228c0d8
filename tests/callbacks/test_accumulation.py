"""AccumulationScheduler alone: input checks, the window bookkeeping, the Trainer conflicts it reports."""

from __future__ import annotations

import logging
import random
import re
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.callbacks.accumulation.scheduler import (
    AccumulationScheduler,
    Choice,
    _divisibility_message,
    lightning_accumulation,
)
from tests.helpers.runif import RunIf

TRAINER = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "max_steps": 2,
}


class Regression(L.LightningModule):
    """A linear model with a ``batch_size`` attribute its loader uses (mean squared error per micro-batch)."""

    def __init__(self, batch_size: int = 1, batch_norm: bool = False, returns: str = "tensor") -> None:
        super().__init__()
        self.batch_size, self.returns = batch_size, returns
        self.net = torch.nn.Sequential(torch.nn.BatchNorm1d(4) if batch_norm else torch.nn.Identity(), torch.nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        return loss if self.returns == "tensor" else {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, generator=g)), self.batch_size)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"effective_batch_size": 0}, "`effective_batch_size=0` must be a positive int"),
        ({"micro_batch_size": "max"}, "`micro_batch_size='max'` must be a positive int or 'auto'"),
        ({"loss_normalization": "mean"}, "`loss_normalization='mean'`; expected 'samples' or 'tokens'"),
        ({"schedule_interval": "batch"}, "`schedule_interval='batch'`; expected 'step' or 'epoch'"),
        ({"schedule": {-1: 8}}, "`schedule` entry -1: 8"),
        ({"memory_budget": -5}, "`memory_budget=-5`"),
        ({"effective_batch_size": 60, "micro_batch_size": 8}, "nearest valid effective batch sizes are 56 or 64"),
        ({"micro_batch_size": 8, "schedule": {10: 20}}, "`effective_batch_size` 20 is not a multiple"),
    ],
)
def test_constructor_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        AccumulationScheduler(**kwargs)


def test_constructor_reports_every_problem_at_once():
    with pytest.raises(ValueError) as err:
        AccumulationScheduler(effective_batch_size=-1, loss_normalization="x", schedule_interval="y")
    assert all(s in str(err.value) for s in ("effective_batch_size=-1", "loss_normalization='x'", "schedule_interval='y'"))


def test_divisibility_message_says_the_nearest_valid_values():
    msg = _divisibility_message(60, 8, 1)
    assert "56 or 64" in msg and "keep 60 with micro-batch 6 or 10" in msg
    msg = _divisibility_message(64, 8, 3)  # 64 is not divisible by 3 processes: only the effective batch can move
    assert "8 x world size 3 = 24" in msg and "48 or 72" in msg and "keep" not in msg


def test_effective_batch_schedule():
    by_step = AccumulationScheduler(16, 8, schedule={100: 32, 200: 64})
    assert [by_step.effective_batch_at(s, 0) for s in (0, 99, 100, 199, 200, 10**6)] == [16, 16, 32, 32, 64, 64]
    by_epoch = AccumulationScheduler(16, 8, schedule={0: 8, 2: 64}, schedule_interval="epoch")
    assert [by_epoch.effective_batch_at(999, e) for e in (0, 1, 2, 5)] == [8, 8, 64, 64]


def _simulate(windows_per_epoch: list[list[int]]) -> None:
    """Drive ``lightning_accumulation`` with Lightning's own rules (zero when ``batch_idx % N == 0``, step when
    ``ready % N == 0`` or at the epoch's last batch) and check zero/step happen exactly at the window edges."""
    for windows in windows_per_epoch:
        n_batches = sum(windows)
        batch_idx = 0
        for size in windows:
            for pos in range(size):
                ready, first, last = batch_idx + 1, pos == 0, pos == size - 1
                epoch_end = ready == n_batches
                n, zero_here = lightning_accumulation(batch_idx, ready, first, last, epoch_end, size)
                lightning_zeroes = batch_idx % n == 0
                lightning_steps = ready % n == 0 or epoch_end
                assert (lightning_zeroes or zero_here) == first, (windows, batch_idx)
                assert not (lightning_zeroes and zero_here)
                assert lightning_steps == last, (windows, batch_idx)
                if (batch_idx % size == 0) == first and (ready % size == 0 or epoch_end) == last:
                    assert n == size  # aligned windows keep the real accumulation in the Trainer
                batch_idx += 1


def test_lightning_accumulation_gives_every_window_its_edges():
    _simulate([[8, 8, 8], [3, 8, 8, 5], [1, 2, 4, 8], [1, 1, 7], [5]])
    rng = random.Random(0)
    for _ in range(200):
        _simulate([[rng.randint(1, 9) for _ in range(rng.randint(1, 6))]])


def test_trainer_accumulate_grad_batches_conflict_says_what_to_remove():
    trainer = L.Trainer(accumulate_grad_batches=4, callbacks=[AccumulationScheduler(16, 4)], **TRAINER)
    with pytest.raises(ValueError, match="`accumulate_grad_batches=4`: remove it from the Trainer"):
        trainer.fit(Regression())


def test_setup_reports_every_conflict_at_once():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    callbacks = [AccumulationScheduler(16, "auto"), GradientAccumulationScheduler({0: 2})]
    trainer = L.Trainer(accumulate_grad_batches=2, callbacks=callbacks, **TRAINER)
    with pytest.raises(ValueError) as err:
        trainer.fit(Regression())
    for text in ("remove it from the Trainer", "remove the `GradientAccumulationScheduler`", "needs `memory_budget`"):
        assert text in str(err.value)


def test_sets_the_loader_batch_size_and_the_trainer_accumulation():
    module = Regression(batch_size=1)
    callback = AccumulationScheduler(16, 4)
    trainer = L.Trainer(callbacks=[callback], **TRAINER)
    trainer.fit(module)
    assert module.batch_size == 4 and trainer.accumulate_grad_batches == 4
    assert callback.last_window.samples == 16 and callback.last_window.micro_batches == 4
    assert trainer.global_step == 2
    assert "training_step" not in module.__dict__  # the wrapper is gone after fit


def test_loader_that_cannot_be_set_must_match_the_micro_batch():
    class Fixed(Regression):
        def __init__(self):
            super().__init__()
            del self.batch_size  # no attribute for the callback to set

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64)), batch_size=2)

    trainer = L.Trainer(callbacks=[AccumulationScheduler(16, 4)], **TRAINER)
    with pytest.raises(ValueError, match="needs micro-batches of 4, but neither .* the train loader gives batches of 2"):
        trainer.fit(Fixed())


def test_batch_size_only_in_hparams_with_a_fixed_loader_is_refused():
    """``lightning_setattr`` sets ``hparams.batch_size`` when only the hyper-parameters have one; a loader that does
    not read it would give another micro-batch, and each step the wrong effective batch."""

    class HparamsOnly(Regression):
        def __init__(self, batch_size: int = 8):
            super().__init__()
            del self.batch_size
            self.save_hyperparameters()

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64)), batch_size=2)  # ignores the hparam

    module = HparamsOnly()
    trainer = L.Trainer(callbacks=[AccumulationScheduler(16, 4)], **TRAINER)
    with pytest.raises(ValueError, match=r"set `batch_size=4` .* the train loader gives batches of 2, so each optimizer "
                                         r"step would hold 2/4 .*`self.hparams.batch_size`"):
        trainer.fit(module)
    assert module.hparams.batch_size == 4  # what the callback set, unread by the loader


def test_tokens_normalization_needs_the_token_count():
    trainer = L.Trainer(callbacks=[AccumulationScheduler(16, 4, loss_normalization="tokens")], **TRAINER)
    with pytest.raises(TypeError, match=r"must return `\{'loss': sum_of_token_losses, 'num_tokens': n\}`"):
        trainer.fit(Regression(returns="dict"))


def test_micro_batch_of_one_not_fitting_says_what_to_switch_on():
    trainer = L.Trainer(callbacks=[AccumulationScheduler(16, "auto", memory_budget=64)], **TRAINER)
    with pytest.raises(RuntimeError, match=r"a micro-batch of 1 peaks at \d+ B, over the budget of 64 B\.") as err:
        trainer.fit(Regression())
    assert "ActivationCheckpointing" in str(err.value) and "lowmem_offload" in str(err.value)


def test_auto_micro_batch_line_reads_in_human_units(caplog):
    trainer = L.Trainer(callbacks=[AccumulationScheduler(16, "auto", memory_budget="1MiB")], **TRAINER)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(Regression())
    [line] = [r.getMessage() for r in caplog.records if "(auto: peak" in r.getMessage()]
    assert re.search(r"\(auto: peak [0-9.]+ (B|KiB) within budget 1.00 MiB\)$", line), line


def test_batch_norm_warns_once():
    callback = AccumulationScheduler(16, 4)
    module = Regression(batch_size=4, batch_norm=True)
    with pytest.warns(UserWarning, match="BatchNorm1d layers; they normalise over each micro-batch"):
        callback._warn_batch_norm(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback._warn_batch_norm(module)


@pytest.mark.deepspeed
@RunIf(deepspeed=True)
def test_deepspeed_refuses_what_the_engine_cannot_do():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(stage=2), logger=False)
    callback = AccumulationScheduler(16, "auto", schedule={5: 32}, loss_normalization="tokens", memory_budget=1 << 30)
    with pytest.raises(ValueError) as err:
        callback.setup(trainer, Regression(), "fit")
    for text in ("'tokens'` is not available with DeepSpeed", "a `schedule` is not available", "pass an int"):
        assert text in str(err.value)


def test_state_dict_keeps_the_chosen_micro_batch_on_resume():
    callback = AccumulationScheduler(64, "auto", memory_budget=1 << 30)
    callback._micro, callback._n_ref = 8, torch.tensor(123.0, dtype=torch.float64)
    resumed = AccumulationScheduler(64, "auto", memory_budget=1 << 30)
    resumed.load_state_dict(callback.state_dict())
    assert resumed._micro == 8 and float(resumed._n_ref) == 123.0


def test_memory_budget_with_a_fixed_micro_batch_warns():
    with pytest.warns(UserWarning, match=r"`memory_budget=1073741824` is used only .* `micro_batch_size=4` it is ignored"):
        AccumulationScheduler(16, 4, memory_budget="1GiB")
    auto = AccumulationScheduler(16, "auto", memory_budget="1GiB")
    auto.choice = Choice(16, 4, 4, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copy fixed at the chosen micro-batch (dry runs) drops the budget, silently
        assert auto.resolved().micro_batch_size == 4


class _BarSeen(L.Callback):
    """The train bar's (position, total, description) at the end of every epoch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, str]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar):
            t = bar.train_progress_bar
            self.seen.append((t.n, t.total, t.desc.rstrip(": ")))
        else:
            [t] = [t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id]
            self.seen.append((int(t.completed), t.total, t.description.strip()))


@pytest.mark.parametrize("bar_class", [TQDMProgressBar, RichProgressBar])
@pytest.mark.parametrize("limit", [{"max_steps": 3}, {"max_epochs": 2}], ids=["max_steps", "max_epochs"])
def test_progress_bar_counts_optimizer_steps_as_plain_lightning_at_the_effective_batch(bar_class, limit):
    """Micro-batches of 4 for an effective batch of 16: the bar reads what plain Lightning's reads with batches of 16
    for the same optimizer steps ("3/3", not "12/3"), and never "Epoch 0/-2"."""
    seen = {}
    for name, callbacks, batch_size in (("plain", [], 16), ("scheduler", [AccumulationScheduler(16, 4)], 1)):
        bar, recorder = bar_class(), _BarSeen()
        trainer = L.Trainer(**{**TRAINER, "enable_progress_bar": True, "max_steps": -1, **limit},
                            callbacks=[*callbacks, recorder, bar])
        trainer.fit(Regression(batch_size=batch_size))
        assert type(trainer.progress_bar_callback) is bar_class  # given back as it was
        seen[name] = recorder.seen
    rich = bar_class is RichProgressBar
    expected = [(3, 3, "Epoch 0")] if "max_steps" in limit else [(4, 4, "Epoch 0/1" if rich else "Epoch 0"),
                                                                 (4, 4, "Epoch 1/1" if rich else "Epoch 1")]
    assert seen["scheduler"] == expected
    if bar_class is TQDMProgressBar or "max_epochs" in limit:
        assert seen["plain"] == seen["scheduler"]
    else:  # plain Lightning's RichProgressBar writes max_epochs - 1 even when max_steps bounds the run
        assert seen["plain"] == [(3, 3, "Epoch 0/-2")]

"""What runs before or beside the first step leaves no trace in the module: buffers, metric states, counters, RNG.

``ActivationCheckpointing(policy="budget")`` measures a forward on a fake copy; ``AccumulationScheduler(
micro_batch_size="auto")`` measures on dry runs (fake copies). Neither runs the user's ``training_step`` on the
module. The first module here is what users write: convolutions with ``BatchNorm`` (running statistics and
``num_batches_tracked`` are buffers updated in forward), a torchmetrics accuracy updated in ``training_step`` and
logged per epoch, a sample counter attribute, a random flip drawn from Python's ``random``, Adam with a warm-up LR
schedule. Each run is compared with plain Lightning at the same micro-batch and effective batch: every weight and
buffer by ``torch.equal``, the metric's state after every batch, the logged epoch value, the counter, the LR
schedule. Then a causal LM with dropout (a draw from the run's RNG would change every later mask) and a
self-distillation module whose step moves its EMA teacher in place.
"""

from __future__ import annotations

import copy
import random
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.demo.module import CausalLMModule
from tests.callbacks.test_accumulation_integration import ListData, fit_kwargs, padded_samples
from tests.helpers.activation_modules import LitConvBN, assert_same_state, fit_state

pytestmark = pytest.mark.integration


class LitConvBNMetric(LitConvBN):
    """``LitConvBN`` with a loader of ``self.batch_size``, an accuracy metric, a counter and a random flip."""

    def __init__(self, blocks: int = 2, batch_size: int = 8) -> None:
        super().__init__(2, blocks)
        self.batch_size = batch_size
        self.accuracy = MulticlassAccuracy(num_classes=4, average="micro")
        self.samples_seen = 0

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*self._tensors()), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if random.random() < 0.5:  # an augmentation drawn from Python's generator
            x = x.flip(-1)
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        self.accuracy(logits, y)
        self.log("train_acc", self.accuracy, on_step=False, on_epoch=True)
        self.samples_seen += len(y)
        return torch.nn.functional.cross_entropy(logits, y)


class Recorder(L.Callback):
    """The metric's state and the counter after every training batch, and the value logged for the epoch."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.states.append({k: v.clone() for k, v in pl_module.accuracy.metric_state.items()})
        self.counts.append(pl_module.samples_seen)


def _fit(callbacks: list[L.Callback], blocks: int = 2, batch_size: int = 8, steps: int = 2, **trainer_kwargs: Any):
    recorder = Recorder()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*BatchNorm2d layers.*")
        state, trainer = fit_state(
            lambda: LitConvBNMetric(blocks, batch_size), [*callbacks, recorder], steps=steps, **trainer_kwargs
        )
    return state, recorder, trainer


def _assert_same_run(got: tuple, want: tuple) -> None:
    """Every difference at once: weights and buffers, the metric after each batch, the counter, the logged value."""
    (state, recorder, trainer), (ref_state, ref_recorder, ref_trainer) = got, want
    problems = []
    try:
        assert_same_state(state, ref_state)
    except AssertionError as err:
        problems.append(str(err))
    for i, (a, b) in enumerate(zip(recorder.states, ref_recorder.states)):
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            problems.append(f"metric state after batch {i}: {a} != {b}")
    if len(recorder.states) != len(ref_recorder.states):
        problems.append(f"{len(recorder.states)} batches, plain Lightning {len(ref_recorder.states)}")
    if recorder.counts != ref_recorder.counts:
        problems.append(f"samples_seen {recorder.counts} != {ref_recorder.counts}")
    lrs = [(s.last_epoch, s.get_last_lr()) for t in (trainer, ref_trainer) for s in [t.lr_scheduler_configs[0].scheduler]]
    if lrs[0] != lrs[1]:
        problems.append(f"LR schedule (steps, LR) {lrs[0]} != {lrs[1]}")
    logged, ref_logged = trainer.callback_metrics["train_acc"], ref_trainer.callback_metrics["train_acc"]
    if not torch.equal(logged, ref_logged):
        problems.append(f"logged train_acc {logged} != {ref_logged}")
    assert not problems, "\n".join(problems)


def test_a_dry_run_measured_micro_batch_leaves_buffers_metrics_and_counters_as_plain_lightning():
    """``micro_batch_size="auto"`` measured by dry runs (fake copies): nothing runs on the module before the first
    step, so BatchNorm, the accuracy, the counter, the RNG and the LR schedule are plain Lightning's at the choice."""
    from tests.callbacks.test_accumulation_integration import dry_run_peak

    asked: list[int] = []

    def measure(trainer: L.Trainer, pl_module: Any, micro: int) -> int:
        asked.append(micro)
        return dry_run_peak(trainer, pl_module, micro)

    auto = AccumulationScheduler(16, "auto", memory_budget=10**12, measure=measure)
    got = _fit([auto])
    assert auto.choice.micro_batch_size == 16 and asked == [1, 4, 8, 16]  # the dry runs ran at several sizes
    _assert_same_run(got, _fit([], batch_size=16))


@pytest.mark.parametrize("blocks", [2, 0], ids=["repeated-blocks", "measured-submodules"])
def test_checkpointing_probe_leaves_buffers_metrics_and_counters_as_plain_lightning(blocks):
    """The budget probe runs ``training_step`` (twice for a model without repeated blocks) on the first batch."""
    probe = ActivationCheckpointing(policy="budget", budget=10**12)
    got = _fit([probe], blocks=blocks)
    assert probe.measured
    _assert_same_run(got, _fit([], blocks=blocks))


def test_the_runs_above_train_and_count():
    """Guards the tests above: the weights move, the metric and the counter count what the steps saw."""
    _, recorder, trainer = _fit([], steps=2)
    untouched = fit_state(lambda: LitConvBNMetric(2, 8), steps=0)[0]
    assert any(not torch.equal(v, untouched[k]) for k, v in trainer.lightning_module.state_dict().items())
    assert recorder.counts == [8, 16]
    assert [int(s["tp"] + s["fn"]) for s in recorder.states] == [8, 16]


# --- a causal LM with dropout, a self-distillation teacher --------------------------------------------------------
# dropout on: a probe that drew from the run's RNG would change every later mask, and so the weights
CONFIG = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 16,
          "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}


def _fit_lm(callbacks: list[Any], steps: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = CausalLMModule(config=CONFIG, loss_reduction="sum", learning_rate=1e-3)
    L.seed_everything(7, verbose=False)
    trainer = L.Trainer(max_steps=steps, callbacks=callbacks, **fit_kwargs())
    trainer.fit(module, ListData(padded_samples(4 * steps)))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name


def test_a_probe_leaves_the_scheduler_window_and_the_weights_as_without_it():
    """The budget probe measures the first batch inside the scheduler's first window: the scheduler must not count
    it (a count of 3 micro-batches would scale the first step's gradients)."""
    scheduler = {"effective_batch_size": 4, "micro_batch_size": 2, "loss_normalization": "tokens"}
    reference = _fit_lm([AccumulationScheduler(**scheduler)])
    probe = ActivationCheckpointing(policy="budget", budget=10**12)
    counted = AccumulationScheduler(**scheduler)
    weights = _fit_lm([counted, probe])
    assert probe.measured and len(probe.measured["blocks"]) == CONFIG["n_layer"]  # the probe ran
    assert counted.last_window.micro_batches == 2
    _assert_equal(weights, reference)


def _fit_ema_teacher(callbacks: list[Any]) -> dict[str, torch.Tensor]:
    from tests.conformance.corpus_kinds import EMATeacher

    torch.manual_seed(0)
    module = EMATeacher()
    trainer = L.Trainer(max_steps=3, callbacks=callbacks, limit_val_batches=0, **fit_kwargs())
    trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("policy", ["all", "budget"])
def test_a_probe_puts_back_a_teacher_that_training_step_moves_in_place(policy):
    """A self-distillation step moves its frozen EMA teacher toward the student in place (``torch.no_grad``): the
    probe must not move it too (a probe that ran ``training_step`` on the module moved it one more EMA step)."""
    reference = _fit_ema_teacher([])
    probe = ActivationCheckpointing(policy="budget", budget=10**12) if policy == "budget" else ActivationCheckpointing()
    _assert_equal(_fit_ema_teacher([probe]), reference)


def test_the_fits_above_train():
    """Guards the probe tests above: two steps move the weights (runs that trained nothing would pass them)."""
    torch.manual_seed(0)
    untouched = copy.deepcopy(CausalLMModule(config=CONFIG, loss_reduction="sum", learning_rate=1e-3).state_dict())
    trained = _fit_lm([AccumulationScheduler(4, 2, loss_normalization="tokens")])
    assert any(not torch.equal(untouched[k], trained[k]) for k in untouched)

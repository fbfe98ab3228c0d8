"""AccumulationScheduler alone: input checks, the window bookkeeping, the Trainer conflicts it reports, and its
seams: plain Lightning's accumulation bit for bit, nothing of another object replaced, graph batches counted by the
loader (issue 47)."""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import warnings
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_lowmem.callbacks.accumulation.counts import count_samples
from lightning_lowmem.callbacks.accumulation.scheduler import (
    AccumulationScheduler,
    Choice,
    _divisibility_message,
    lightning_accumulation,
)
from lightning_lowmem.callbacks.accumulation.window import Window
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
    with pytest.raises(TypeError, match=r"counts each micro-batch's tokens before its forward .* the batch is a list.*"
                                        r"must return `\{'loss': sum_of_token_losses, 'num_tokens': n\}`"):
        trainer.fit(Regression(returns="dict"))
    # counted by the user's function, but `training_step` does not say how many tokens its loss summed
    count = AccumulationScheduler(16, 4, loss_normalization="tokens", count_tokens=lambda batch: 4)
    with pytest.raises(TypeError, match=r"must return `\{'loss': sum_of_token_losses, 'num_tokens': n\}`"):
        L.Trainer(callbacks=[count], **TRAINER).fit(Regression(returns="dict"))


class TokenLM(Regression):
    """A token-sum loss over ``x``'s 4 features, with labels -100 where ``x < 0``: ``num_tokens`` counts the rest."""

    def __init__(self, shifted: bool = True) -> None:
        super().__init__(batch_size=4)
        self.shifted = shifted

    def training_step(self, batch, batch_idx):
        x = batch["labels"].float()
        kept = batch["labels"][..., 1:] != -100 if self.shifted else batch["labels"] != -100
        losses = (self.net(batch["x"]).squeeze(-1)[:, None] - x) ** 2
        losses = losses[..., 1:] if self.shifted else losses
        return {"loss": (losses * kept).sum(), "num_tokens": kept.sum()}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        labels = torch.randint(-1, 3, (64, 4), generator=g).masked_fill_(torch.rand(64, 4, generator=g) < 0.3, -100)
        return DataLoader([{"x": torch.randn(4, generator=g), "labels": labels[i]} for i in range(64)], self.batch_size)


@pytest.mark.parametrize(("accelerator", "precision"), [
    ("cpu", "32-true"), pytest.param("cuda", "16-mixed", marks=RunIf(min_cuda_gpus=1))])
def test_tokens_counted_from_the_batch_are_checked_against_what_training_step_returned(accelerator, precision):
    """CUDA, 16-mixed: the counts on the device, the weight's hook on the loss GradScaler scaled."""
    scheduler = AccumulationScheduler(8, 4, loss_normalization="tokens")
    L.Trainer(callbacks=[scheduler], **{**TRAINER, "accelerator": accelerator, "precision": precision}).fit(TokenLM())
    assert scheduler.last_window.tokens is not None and scheduler.last_window.samples == 8
    # a loss over every label, unshifted: the default count (next-token labels) is not what it sums over
    with pytest.raises(ValueError, match=r"normalised by \d+ tokens, counted from the batch .* returned `num_tokens="
                                         r"\d+`\. Pass `count_tokens="):
        L.Trainer(callbacks=[AccumulationScheduler(8, 4, loss_normalization="tokens")], **TRAINER).fit(TokenLM(False))
    count = AccumulationScheduler(8, 4, loss_normalization="tokens", count_tokens=lambda b: (b["labels"] != -100).sum())
    L.Trainer(callbacks=[count], **TRAINER).fit(TokenLM(False))


def _peaks(per_sample: int, asked: list[int] | None = None):
    """A ``measure`` whose peak grows with the micro-batch (``per_sample`` bytes each), recording what it was asked."""

    def measure(trainer: L.Trainer, pl_module: L.LightningModule, micro: int) -> int:
        assert trainer.global_step == 0 and pl_module.trainer is trainer
        if asked is not None:
            asked.append(micro)
        return 1000 + per_sample * micro

    return measure


def test_micro_batch_of_one_not_fitting_says_what_to_switch_on():
    trainer = L.Trainer(callbacks=[AccumulationScheduler(16, "auto", memory_budget=64, measure=_peaks(10))], **TRAINER)
    with pytest.raises(RuntimeError, match=r"a micro-batch of 1 peaks at 1010 B, over the budget of 64 B\.") as err:
        trainer.fit(Regression())
    assert "ActivationCheckpointing" in str(err.value) and "lowmem_offload" in str(err.value)


def test_auto_picks_the_largest_divisor_the_measure_fits_by_binary_search(caplog):
    asked: list[int] = []
    module = Regression()
    callback = AccumulationScheduler(16, "auto", memory_budget=1000 + 10 * 5, measure=_peaks(10, asked))
    trainer = L.Trainer(callbacks=[callback], **TRAINER)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(module)
    assert asked == [1, 4, 8]  # divisors 1, 2, 4, 8, 16: 1 fits, then a binary search
    assert (callback.choice.micro_batch_size, callback.choice.accumulation) == (4, 4) and module.batch_size == 4
    assert callback.choice.peaks == {1: 1010, 4: 1040, 8: 1080}
    [line] = [r.getMessage() for r in caplog.records if "(auto: peak" in r.getMessage()]
    assert re.search(r"\(auto: peak 1.02 KiB within budget 1.03 KiB\)$", line), line
    resolved = callback.resolved()  # the dry runs' copy: the micro-batch it chose, nothing to measure
    assert (resolved.micro_batch_size, resolved.measure, resolved.memory_budget) == (4, None, None)


def test_auto_without_a_measure_is_refused_with_the_fix():
    trainer = L.Trainer(callbacks=[AccumulationScheduler(16, "auto", memory_budget="1MiB")], **TRAINER)
    with pytest.raises(ValueError, match=r"`micro_batch_size='auto'` needs `measure` .* runs no trial step .*`lowmem plan`"):
        trainer.fit(Regression())


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


def test_state_dict_keeps_the_chosen_micro_batch_and_the_token_reference_on_resume():
    callback = AccumulationScheduler(64, "auto", loss_normalization="tokens", memory_budget=1 << 30, measure=_peaks(1))
    callback.choice = Choice(64, 8, 8, 1)
    callback._micro, callback.window.reference = 8, torch.tensor(123.0, dtype=torch.float64)
    resumed = AccumulationScheduler(64, "auto", loss_normalization="tokens", memory_budget=1 << 30, measure=_peaks(1))
    resumed.load_state_dict(callback.state_dict())
    assert resumed.state_dict() == {"micro_batch_size": 8, "n_ref": 123.0}


def test_memory_budget_with_a_fixed_micro_batch_warns():
    with pytest.warns(UserWarning, match=r"with `micro_batch_size=4` they are ignored \(`memory_budget=1073741824`\)"):
        AccumulationScheduler(16, 4, memory_budget="1GiB")
    auto = AccumulationScheduler(16, "auto", memory_budget="1GiB", measure=_peaks(1))
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
def test_progress_bar_is_lightnings_own_and_reads_as_its_accumulate_grad_batches(bar_class):
    """The bar counts micro-batches, exactly as with ``Trainer(accumulate_grad_batches=4)`` (documented)."""
    seen = {}
    for name, callbacks, kwargs in (("plain", [], {"accumulate_grad_batches": 4}),
                                    ("scheduler", [AccumulationScheduler(16, 4)], {})):
        bar, recorder = bar_class(), _BarSeen()
        trainer = L.Trainer(**{**TRAINER, "enable_progress_bar": True, "max_steps": -1, "max_epochs": 2, **kwargs},
                            callbacks=[*callbacks, recorder, bar])
        trainer.fit(Regression(batch_size=4))
        assert type(trainer.progress_bar_callback) is bar_class
        seen[name] = recorder.seen
    assert seen["scheduler"] == seen["plain"] and seen["plain"][0][:2] == (16, 16)


# --- seams, not patches -----------------------------------------------------------------------------------------


class Steps(L.Callback):
    """Every parameter and buffer after each optimizer step."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if len(self.states) < trainer.global_step:
            self.states.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=RunIf(min_cuda_gpus=1))])
@pytest.mark.parametrize("batch_norm", [False, True])
def test_equal_micro_batches_train_bit_for_bit_as_plain_accumulate_grad_batches(batch_norm, accelerator):
    """Full windows of equal micro-batches: nothing is multiplied (both weights exactly 1), weights and buffers
    ``torch.equal`` to ``Trainer(accumulate_grad_batches=4)`` after every step; nothing of another object replaced."""
    runs = {}
    for name, callbacks, kwargs in (("plain", [], {"accumulate_grad_batches": 4}),
                                    ("scheduler", [AccumulationScheduler(16, 4)], {})):
        torch.manual_seed(0)
        module, steps = Regression(batch_size=4, batch_norm=batch_norm), Steps()
        trainer = L.Trainer(callbacks=[*callbacks, steps], **{**TRAINER, "max_steps": 5, "accelerator": accelerator,
                                                              **kwargs})
        methods = (dict(vars(module)), dict(vars(trainer.strategy)))
        trainer.fit(module)
        assert "training_step" not in vars(module) and not {"training_step", "backward"} & set(vars(trainer.strategy))
        assert set(methods[0]) <= set(vars(module))  # nothing removed or swapped in by the scheduler
        runs[name] = steps.states
    assert len(runs["plain"]) == len(runs["scheduler"]) == 5
    for got, want in zip(runs["scheduler"], runs["plain"]):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


class ReadsGradients(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


def test_a_callback_reading_gradients_before_it_is_refused_and_the_order_kept():
    callbacks = [ReadsGradients(), AccumulationScheduler(16, 4)]
    trainer = L.Trainer(callbacks=callbacks, **TRAINER)
    with pytest.raises(ValueError, match=r"list it before `ReadsGradients` in `callbacks`: it normalises the window's "
                                         r"gradients in `on_before_optimizer_step`"):
        trainer.fit(Regression())
    assert trainer.callbacks[:2] == callbacks  # not reordered
    L.Trainer(callbacks=callbacks[::-1], **TRAINER).fit(Regression())


@dataclasses.dataclass
class GraphBatch:
    """A graph batch as chemprop's ``TrainingBatch``: node features first (16 atoms), then 4 molecules' targets."""

    nodes: torch.Tensor  # (atoms, features)
    graph_of_node: torch.Tensor  # (atoms,): which molecule each atom belongs to
    y: torch.Tensor  # (molecules,)


class Molecules(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.atoms = [torch.randn(int(torch.randint(2, 7, (1,), generator=g)), 4, generator=g) for _ in range(n)]
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.atoms[i], self.y[i]


def collate_graphs(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> GraphBatch:
    nodes = torch.cat([a for a, _ in samples])
    index = torch.cat([torch.full((len(a),), i) for i, (a, _) in enumerate(samples)])
    return GraphBatch(nodes, index, torch.stack([y for _, y in samples]))


class GraphRegression(Regression):
    """Mean-pooled node features per molecule, mean squared error per molecule (issue 47: chemprop's batches)."""

    def __init__(self, n: int = 22, batch_size: int = 4) -> None:
        super().__init__(batch_size=batch_size)
        self.n = n

    def training_step(self, batch: GraphBatch, batch_idx):
        pooled = torch.zeros(len(batch.y), 4).index_reduce_(0, batch.graph_of_node, batch.nodes, "mean", include_self=False)
        return torch.nn.functional.mse_loss(self.net(pooled).squeeze(-1), batch.y)

    def train_dataloader(self):
        return DataLoader(Molecules(self.n), batch_size=self.batch_size, collate_fn=collate_graphs)


def test_a_graph_batch_is_counted_by_what_the_loader_says():
    """Issue 47: the first tensor of a graph batch is its atoms (16 for 4 molecules); the loader says 4 samples, and
    the last batch of 22 molecules in fours holds 2. The run is plain Lightning's accumulation of the same batches
    except the short last window, averaged over the 6 molecules it held."""
    module = GraphRegression()
    batch = next(iter(module.train_dataloader()))
    loader = module.train_dataloader()
    assert len(batch.nodes) != 4 and count_samples(loader, batch, 0) == 4 and count_samples(loader, batch, 5) == 2
    states = {}
    for name, callbacks, kwargs in (("plain", [], {"accumulate_grad_batches": 2}),
                                    ("scheduler", [AccumulationScheduler(8, 4)], {})):
        torch.manual_seed(0)
        module, steps = GraphRegression(), Steps()
        L.Trainer(callbacks=[*callbacks, steps], **{**TRAINER, "max_steps": -1, "max_epochs": 1, **kwargs}).fit(module)
        states[name] = steps.states
    assert len(states["plain"]) == len(states["scheduler"]) == 3
    for got, want in zip(states["scheduler"][:2], states["plain"][:2]):
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(states["scheduler"][2]["net.1.weight"], states["plain"][2]["net.1.weight"])  # 4 + 2: mean of 6


def test_a_loader_that_names_no_batch_size_is_warned_about_not_refused():
    class PreBatched(GraphRegression):
        def train_dataloader(self):
            return DataLoader([collate_graphs([Molecules(4)[i] for i in range(4)])] * 4, batch_size=None)

    with pytest.warns(UserWarning, match=r"cannot tell the train loader's batch size: it names none .* first tensor has "
                                         r"\d+ rows, which need not be its samples"):
        L.Trainer(callbacks=[AccumulationScheduler(8, 4)], **TRAINER).fit(PreBatched())


def test_oom_split_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"`on_oom='split'` was removed: Lightning has no hook around a failing "
                                         r"`training_step`.*`OnExceptionCheckpoint`"):
        AccumulationScheduler(16, 8, on_oom="split")
    with pytest.raises(ValueError, match=r"`on_oom='retry'`; expected 'raise' or None"):
        AccumulationScheduler(16, 8, on_oom="retry")


# --- the window -------------------------------------------------------------------------------------------------


def _window_steps(window: Window, counts: list[int], save_after: int | None = None) -> tuple[list, Any, dict | None]:
    """Place, weigh and step ``counts`` (token counts, one window of 3 micro-batches); the state after ``save_after``."""
    weights, saved = [], None
    for i, c in enumerate(counts):
        window.advance(3, i, i + 1, False, (2, torch.tensor(float(c), dtype=torch.float64)))
        weights.append(window.weigh(3, window.size, lambda t: t))
        if i == save_after:
            saved = window.state_dict()
    return weights, window.step_factor(1, lambda t: t, "cpu"), saved


def test_the_token_weights_are_powers_of_two_exact_in_half_precision():
    """The tokens' reference is the power of two nearest the mean count (300 -> 256): ``h`` is exact in bf16, so the
    step's factor divides out exactly what the gradients took."""
    weights, factor, _ = _window_steps(Window(tokens=True), [300, 200, 250])
    assert [float(h) for h in weights] == [1 / 256] * 3 and float(weights[0].to(torch.bfloat16)) == 1 / 256
    assert float(factor) == 256 * 3 / 750


def test_a_window_saved_mid_way_continues_as_the_uninterrupted_one():
    straight = _window_steps(Window(tokens=True), [300, 200, 250])
    first = Window(tokens=True)
    _, _, saved = _window_steps(first, [300, 200], save_after=1)
    resumed = Window(tokens=True)
    resumed.load_state_dict(saved)
    resumed.advance(3, 2, 3, False, (2, torch.tensor(250.0, dtype=torch.float64)))
    h = resumed.weigh(3, resumed.size, lambda t: t)
    assert float(h) == float(straight[0][2]) and float(resumed.step_factor(1, lambda t: t, "cpu")) == float(straight[1])
    assert resumed.stats.samples == 6 and resumed.stats.micro_batches == 3 and int(resumed.stats.tokens) == 750


def test_a_checkpoint_inside_a_window_under_deepspeed_or_ddp_warns():
    """Where the window's gradients cannot be written (DeepSpeed's own buffers, other processes' parts), say so."""
    callback = AccumulationScheduler(4, 2)
    callback.window.advance(2, 0, 1, False, (2, 2))  # one of the window's two micro-batches
    progress = SimpleNamespace(ready=1, processed=1)  # between two batches, as in `on_train_batch_end`
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=progress)))
    for engine, world, match in ((True, 1, "DeepSpeed keeps the window's gradients"), (False, 2, "each process")):
        callback._engine = engine
        checkpoint = {"callbacks": {callback.state_key: {}}}
        with pytest.warns(UserWarning, match=match):
            callback.on_save_checkpoint(SimpleNamespace(world_size=world, fit_loop=loop), None, checkpoint)
        assert checkpoint["callbacks"][callback.state_key] == {}

"""AccumulationScheduler through ``Trainer.fit``: gradients equal a plain float64 reference of one big batch."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_lowmem import dry_run_peak
from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler
from lightning_lowmem.demo.module import IGNORE_INDEX, CausalLMModule
from tests.helpers.models import GPT2_TINY
from tests.helpers.runif import RunIf

pytestmark = pytest.mark.integration

PAD = 257
SEQ = 16
# no dropout: the reference must see the same function; small, since float64 matmuls are slow on CPU
CONFIG = {
    **GPT2_TINY, "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": SEQ,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}


def padded_samples(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences of 2..SEQ tokens, padded to SEQ (labels -100 on padding): micro-batches hold different
    numbers of tokens, which is what makes a per-micro-batch mean differ from the mean over the window."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, SEQ + 1, (1,), generator=g))
        ids = torch.full((SEQ,), PAD, dtype=torch.long)
        ids[:length] = torch.randint(0, 256, (length,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        labels = ids.clone()
        labels[length:] = IGNORE_INDEX
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class ListData(L.LightningDataModule):
    """Samples in a fixed order (no shuffling), so each optimizer step's window is a known slice."""

    def __init__(self, samples: list[dict[str, torch.Tensor]], batch_size: int = 1) -> None:
        super().__init__()
        self.samples, self.batch_size = samples, batch_size

    def train_dataloader(self) -> DataLoader:
        # NOTE: under DDP each process takes every world_size-th sample (Lightning's own sampler would shuffle)
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        return DataLoader(self.samples[rank::world], batch_size=self.batch_size, shuffle=False, collate_fn=collate)


def per_sample_loss(module: CausalLMModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's mean token loss (a per-sample quantity, for the "samples" normalisation)."""
    logits = module(batch["input_ids"], batch["attention_mask"])[:, :-1]
    labels = batch["labels"][:, 1:]
    losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return losses.sum(1) / (labels != IGNORE_INDEX).sum(1).clamp(min=1)


class SampleMeanLM(CausalLMModule):
    """Returns the mean over its micro-batch of per-sample losses."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        return per_sample_loss(self, batch).mean()


def make_module(mode: str) -> CausalLMModule:
    torch.manual_seed(0)
    if mode == "tokens":
        return CausalLMModule(config=CONFIG, loss_reduction="sum", learning_rate=1e-3)
    return SampleMeanLM(config=CONFIG, learning_rate=1e-3)


def window_loss(module: CausalLMModule, batch: dict[str, torch.Tensor], mode: str) -> torch.Tensor:
    """The loss of one big batch: mean over all its tokens, or over all its samples."""
    if mode == "tokens":
        loss_sum, n = module.loss_sum_and_tokens(batch)
        return loss_sum / n
    return per_sample_loss(module, batch).mean()


def reference_run(
    module0: CausalLMModule, windows: list[list[dict[str, torch.Tensor]]], mode: str
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Plain PyTorch, float64: one batch per optimizer step. Returns the gradients of each step and the final weights."""
    ref = copy.deepcopy(module0).double()
    optimizer = ref.configure_optimizers()
    grads = []
    for window in windows:
        optimizer.zero_grad()
        window_loss(ref, collate(window), mode).backward()
        grads.append({n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})
        optimizer.step()
    return grads, {n: p.detach().clone() for n, p in ref.named_parameters()}


class GradCapture(L.Callback):
    """Copies the gradients the optimizer is about to step with (after AccumulationScheduler has scaled them)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.batch_sizes: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch_sizes.append(batch["input_ids"].size(0))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def assert_close_rel(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = 1e-6) -> None:
    """Relative error of each tensor in norm: ``|a - e| / |e| <= rtol`` (float64 on both sides)."""
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        a, e = actual[name].double(), want.double()
        err = (a - e).norm() / e.norm().clamp(min=1e-30)
        assert err <= rtol, f"{name}: relative error {err:.3e} > {rtol}"


def fit_kwargs(**overrides: Any) -> dict[str, Any]:
    return {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **overrides,
    }


def _fit(mode: str, samples: list, max_steps: int, max_epochs: int | None = None, **callback_kwargs: Any):
    module = make_module(mode)
    module0 = copy.deepcopy(module)
    capture = GradCapture()
    callback = AccumulationScheduler(loss_normalization=mode, **callback_kwargs)
    trainer = L.Trainer(
        precision="64-true", max_steps=max_steps, max_epochs=max_epochs, callbacks=[callback, capture], **fit_kwargs()
    )
    trainer.fit(module, ListData(samples))
    return module0, module, capture, callback, trainer


@pytest.mark.parametrize("mode", ["tokens", "samples"])
def test_eight_micro_batches_of_eight_equal_one_batch_of_64(mode):
    samples = padded_samples(128)
    module0, module, capture, callback, trainer = _fit(mode, samples, 2, effective_batch_size=64, micro_batch_size=8)

    assert capture.batch_sizes == [8] * 16  # the callback set the loader's batch size
    assert callback.choice.accumulation == 8
    ref_grads, ref_weights = reference_run(module0, [samples[:64], samples[64:]], mode)
    assert len(capture.grads) == 2
    for got, want in zip(capture.grads, ref_grads):
        assert_close_rel(got, want)
    assert_close_rel({n: p.detach() for n, p in module.named_parameters()}, ref_weights)
    assert trainer.global_step == 2


def test_schedule_change_mid_epoch_at_an_unaligned_batch(mode="tokens"):
    # 24 = 3 micro-batches, then 64 = 8 micro-batches from optimizer step 1: the second window starts at batch 3,
    # not a multiple of 8, where Lightning's own `batch_idx % N` bookkeeping would zero and step at the wrong batches.
    samples = padded_samples(24 + 64 + 8)
    module0, module, capture, callback, _ = _fit(
        mode, samples, 2, effective_batch_size=24, micro_batch_size=8, schedule={1: 64}
    )
    assert capture.batch_sizes == [8] * 11
    ref_grads, ref_weights = reference_run(module0, [samples[:24], samples[24:88]], mode)
    for got, want in zip(capture.grads, ref_grads, strict=True):
        assert_close_rel(got, want)
    assert_close_rel({n: p.detach() for n, p in module.named_parameters()}, ref_weights)
    assert callback.last_window.samples == 64 and callback.last_window.micro_batches == 8


@pytest.mark.parametrize("mode", ["tokens", "samples"])
def test_short_last_window_of_an_epoch_is_the_mean_of_what_it_held(mode):
    # 100 samples, windows of 64: the epoch's second step holds 36 samples in micro-batches 8, 8, 8, 8, 4.
    # Lightning would divide that window by 8 micro-batches (#19987); the reference is the mean over the 36.
    samples = padded_samples(100)
    module0, module, capture, callback, _ = _fit(mode, samples, 2, effective_batch_size=64, micro_batch_size=8)
    assert capture.batch_sizes == [8] * 12 + [4]
    ref_grads, ref_weights = reference_run(module0, [samples[:64], samples[64:]], mode)
    for got, want in zip(capture.grads, ref_grads, strict=True):
        assert_close_rel(got, want)
    assert_close_rel({n: p.detach() for n, p in module.named_parameters()}, ref_weights)
    assert callback.last_window.samples == 36 and callback.last_window.micro_batches == 5


def test_epoch_schedule_warm_up():
    # epoch 0: effective 16 (two steps of 2 micro-batches); epoch 1: effective 32 (one step of 4 micro-batches)
    samples = padded_samples(32)
    module0, module, capture, _, trainer = _fit(
        "tokens", samples, -1, max_epochs=2, effective_batch_size=16, micro_batch_size=8, schedule={1: 32},
        schedule_interval="epoch",
    )
    assert trainer.global_step == 3
    ref_grads, ref_weights = reference_run(module0, [samples[:16], samples[16:], samples], "tokens")
    for got, want in zip(capture.grads, ref_grads, strict=True):
        assert_close_rel(got, want)
    assert_close_rel({n: p.detach() for n, p in module.named_parameters()}, ref_weights)


def test_auto_picks_the_largest_micro_batch_whose_measured_peak_fits_the_budget():
    """With a dry run for ``measure``: the largest micro-batch within the budget wins, and the run trains exactly as
    with that micro-batch from the start (nothing ran on the module before the first step)."""
    samples = padded_samples(128)
    module = make_module("tokens")
    module0 = copy.deepcopy(module)
    capture = GradCapture()
    callback = AccumulationScheduler(64, "auto", loss_normalization="tokens", memory_budget="8MiB", measure=dry_run_peak)
    trainer = L.Trainer(precision="64-true", max_steps=1, callbacks=[callback, capture], **fit_kwargs())
    data = ListData(samples)
    trainer.fit(module, data)

    choice, budget = callback.choice, 8 * 2**20
    assert choice.accumulation > 1 and data.batch_size == choice.micro_batch_size
    assert capture.batch_sizes == [choice.micro_batch_size] * choice.accumulation
    assert choice.peaks[choice.micro_batch_size] <= budget
    assert all(p > budget for m, p in choice.peaks.items() if m > choice.micro_batch_size)  # the next one tried did not
    ref_grads, ref_weights = reference_run(module0, [samples[:64]], "tokens")
    assert_close_rel(capture.grads[0], ref_grads[0])
    assert_close_rel({n: p.detach() for n, p in module.named_parameters()}, ref_weights)


class SavingGradCapture(GradCapture):
    """GradCapture that hands its gradients back from rank 0 of a spawned DDP run through a file."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            weights = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            torch.save({"grads": self.grads, "weights": weights, "batch_sizes": self.batch_sizes}, self.path)


@pytest.mark.distributed
def test_ddp_two_processes_token_mean_over_both(tmp_path):
    # 2 processes x micro-batch 4 x accumulation 4 = 32: each process sees every other sample, with its own token
    # count; the step must get the mean over all 32 samples' tokens (counts all-reduced, DDP's average undone).
    samples = padded_samples(64)
    module = make_module("tokens")
    module0 = copy.deepcopy(module)
    path = str(tmp_path / "rank0.pt")
    callback = AccumulationScheduler(32, 4, loss_normalization="tokens")
    trainer = L.Trainer(
        precision="64-true", max_steps=2, callbacks=[callback, SavingGradCapture(path)],
        **fit_kwargs(strategy="ddp_spawn", devices=2, use_distributed_sampler=False),
    )
    trainer.fit(module, ListData(samples))
    got = torch.load(path)
    assert got["batch_sizes"] == [4] * 8
    ref_grads, ref_weights = reference_run(module0, [samples[:32], samples[32:]], "tokens")
    for grads, want in zip(got["grads"], ref_grads, strict=True):
        assert_close_rel(grads, want)
    assert_close_rel(got["weights"], ref_weights)


class MasterGradCapture(GradCapture):
    """Under ``lowmem_offload`` the optimizer steps the host masters: copy their gradients."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in trainer.strategy.masters.items() if p.grad is not None})


def test_lowmem_offload_scales_the_host_master_gradients():
    samples = padded_samples(100)
    module = make_module("tokens")
    module0 = copy.deepcopy(module)
    capture = MasterGradCapture()
    callback = AccumulationScheduler(64, 8, loss_normalization="tokens")
    trainer = L.Trainer(strategy="lowmem_offload", max_steps=2, callbacks=[callback, capture], **fit_kwargs())
    trainer.fit(module, ListData(samples))
    ref_grads, _ = reference_run(module0, [samples[:64], samples[64:]], "tokens")
    assert len(capture.grads) == 2
    for got, want in zip(capture.grads, ref_grads):
        # the strategy computes in float32 (no float64 path): float32 rounding against the float64 reference
        assert_close_rel(got, want, rtol=2e-6)


def test_memory_report_prediction_runs_with_the_scheduler(tmp_path):
    """The scheduler's training_step wrapper stands aside for a detached module (MemoryReport's dry run)."""
    import json

    from lightning_lowmem import AccumulationScheduler, MemoryReport
    from tests.helpers.models import random_batch, tiny_lm_module

    module = tiny_lm_module(loss_reduction="sum")
    report = MemoryReport(every_n_steps=1, plot=False, save_dir=tmp_path)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[AccumulationScheduler(effective_batch_size=4, micro_batch_size=2, loss_normalization="tokens"), report],
    )
    trainer.fit(module, torch.utils.data.DataLoader([random_batch(2, 16, seed=i) for i in range(8)], batch_size=None))
    predicted = json.loads((tmp_path / "memory_report.json").read_text())["predicted"]
    assert "error" not in predicted, predicted
    assert predicted["peak_device"] > 0


class ReturnedLoss(L.Callback):
    """Put *before* the scheduler in `callbacks`: what a user's loss callback sees in `outputs["loss"]`."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(outputs["loss"].detach().clone())


class RecordingLM(CausalLMModule):
    """Keeps the loss each `training_step` returns (for tokens: the sum of its token losses)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.returned.append((out["loss"] if isinstance(out, dict) else out).detach().clone())
        return out


@pytest.mark.parametrize(
    ("strategy", "mode"),
    [("auto", "tokens"), ("auto", "samples"), ("lowmem_offload", "tokens"),
     pytest.param("lowmem_zero2", "samples", marks=[pytest.mark.deepspeed, RunIf(deepspeed=True)])],
)
def test_callbacks_see_what_plain_lightning_accumulation_hands_them(strategy, mode):
    """`outputs["loss"]` is Lightning's own: the returned loss divided by `accumulate_grad_batches` (4 here), on every
    strategy; the normalisation acts on the gradients only (a hook on the loss and a factor before the step)."""
    torch.manual_seed(0)
    module = RecordingLM(config=CONFIG, loss_reduction="sum" if mode == "tokens" else "mean", learning_rate=1e-3)
    module.returned = []
    seen = ReturnedLoss()
    trainer = L.Trainer(
        strategy=strategy, max_steps=2, **fit_kwargs(use_distributed_sampler=False),
        callbacks=[seen, AccumulationScheduler(effective_batch_size=8, micro_batch_size=2, loss_normalization=mode)],
    )
    trainer.fit(module, ListData(padded_samples(16)))
    assert len(seen.seen) == len(module.returned) == 8
    for got, returned in zip(seen.seen, module.returned):
        assert torch.equal(got, returned / 4)

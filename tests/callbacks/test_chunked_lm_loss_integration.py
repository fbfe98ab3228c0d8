"""ChunkedLMLoss through ``Trainer.fit``: parity with the model's own loss, alone and with the suite's techniques."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_lowmem.callbacks.chunked_lm_loss.callback import ChunkedLMLoss, is_chunked
from lightning_lowmem.demo.module import CausalLMModule
from tests.helpers.models import GPT2_TINY, random_batch, tiny_gpt2, tiny_llama
from tests.helpers.runif import RunIf

pytestmark = pytest.mark.integration

SEQ = 24


class LabelsLM(L.LightningModule):
    """A user's module: ``training_step`` calls ``model(input_ids=..., labels=...)`` and reads ``.loss``.

    With ``tokens=True`` it returns ``{"loss": sum, "num_tokens": n}`` for ``AccumulationScheduler``: Hugging Face's
    own ``num_items_in_batch=1`` makes ``.loss`` the sum, with or without the callback.
    NOTE: SGD, not Adam, for parity: Adam divides by sqrt(v), which turns rounding noise in gradients that are zero
    in exact arithmetic (GPT-2's key bias) into steps of size lr, hiding the comparison.
    """

    def __init__(self, arch: str = "gpt2", tokens: bool = False, optimizer: str = "sgd", lr: float = 0.5) -> None:
        super().__init__()
        self.model = tiny_gpt2() if arch == "gpt2" else tiny_llama()
        self.tokens, self.optimizer, self.lr = tokens, optimizer, lr
        self.batch_size = 2
        self.val_logits_seen: list[bool] = []
        self.train_logits_seen: list[bool] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        out = self.model(**inputs, num_items_in_batch=1) if self.tokens else self.model(**inputs)
        self.train_logits_seen.append(out.logits is not None)
        if self.tokens:
            return {"loss": out.loss, "num_tokens": (batch["labels"][:, 1:] != -100).sum()}
        self.log("train_loss", out.loss.detach(), batch_size=batch["input_ids"].size(0))
        return out.loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self.model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")})
        self.val_logits_seen.append(out.logits is not None)
        self.log("val_loss", out.loss, batch_size=batch["input_ids"].size(0))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _padded(n: int, batch_size: int = 2) -> list[dict[str, torch.Tensor]]:
    """Batches with right padding of varying length (masked, ignored) and an ignored prompt."""
    out = []
    for i in range(n):
        b = random_batch(batch_size, SEQ, seed=i)
        pad = 3 + 2 * i % 7
        b["attention_mask"][-1, -pad:] = 0
        b["labels"][-1, -pad:] = -100
        b["labels"][0, : i % 4] = -100
        out.append(b)
    return out


def _trainer(callbacks: list[Callback], max_steps: int = 3, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=callbacks, **kwargs,
    )


def _fit(module: L.LightningModule, callbacks: list[Callback], n_batches: int = 3, **kwargs: Any) -> L.Trainer:
    L.seed_everything(7, verbose=False)
    trainer = _trainer(callbacks, **kwargs)
    val = DataLoader(_padded(1), batch_size=None) if kwargs.get("limit_val_batches") else None
    trainer.fit(module, DataLoader(_padded(n_batches), batch_size=None, shuffle=False), val)
    return trainer


def _weights(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    masters = getattr(trainer.strategy, "masters", None)  # lowmem_offload: the fp32 host masters
    if masters:
        return {n: p.detach().float().clone() for n, p in masters.items()}
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _assert_updates_close(got: dict, want: dict, start: dict, rtol: float) -> None:
    """Each tensor's update (after - before) matches the reference update within ``rtol`` of its largest entry.

    Plus 4 fp32 ulps of the weight itself: an update is read as the difference of two weights (LayerNorm's ~1.0).
    """
    assert got.keys() == want.keys()
    moved = 0
    for name, w in want.items():
        du, dw = got[name] - start[name], w - start[name]
        scale = dw.abs().max()
        moved += bool(scale > 0)
        ulps = 4 * torch.finfo(torch.float32).eps * w.abs().max()
        assert (du - dw).abs().max() <= rtol * scale + ulps, f"{name}: {(du - dw).abs().max()} vs {scale}"
    assert moved > 0


def _compare(make: Any, callbacks: Any, rtol: float, recompute: bool = True,
             **kwargs: Any) -> tuple[L.Trainer, L.LightningModule]:
    """Fit the same seeded module with and without ChunkedLMLoss (other callbacks alike); compare the updates."""
    torch.manual_seed(0)
    module = make()
    plain = copy.deepcopy(module)
    start = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    chunked = ChunkedLMLoss(chunk_tokens=7, backend="auto", recompute=recompute)
    trainer = _fit(module, [*callbacks(), chunked], **kwargs)
    reference = _fit(plain, callbacks(), **kwargs)
    assert chunked.wrapped == [] and not is_chunked(module.model)  # teardown gave the forward back
    if isinstance(module, LabelsLM):  # every training step of the chunked run went through the chunked loss
        assert module.train_logits_seen and not any(module.train_logits_seen) and all(plain.train_logits_seen)
    got, want = _weights(trainer, module), _weights(reference, plain)
    start = {n: start[n] for n in want} if set(want) <= set(start) else {n: start[n.removeprefix("_forward_module.")] for n in want}
    _assert_updates_close(got, want, start, rtol)
    return trainer, module


# NOTE: fp32 tolerance on the update after 3 SGD steps: the gradients differ by summation order (<= 1.1e-6 of the
# largest entry, tests/callbacks/test_chunked_lm_loss.py), the weights by that times lr, compounded over steps.
FP32_RTOL = 1e-4


@pytest.mark.parametrize(("arch", "recompute"), [("gpt2", True), ("llama", True), ("gpt2", False)])
def test_fit_matches_the_models_own_loss(arch, recompute):
    trainer, module = _compare(lambda: LabelsLM(arch), list, FP32_RTOL, recompute=recompute, val_check_interval=2,
                               limit_val_batches=1)
    assert module.val_logits_seen and all(module.val_logits_seen)  # validation ran the model untouched
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


def test_fit_with_accumulation_scheduler_is_token_exact():
    from lightning_lowmem.callbacks.accumulation.scheduler import AccumulationScheduler

    def callbacks() -> list[Callback]:
        return [AccumulationScheduler(effective_batch_size=4, micro_batch_size=2, loss_normalization="tokens")]

    trainer, _ = _compare(lambda: LabelsLM(tokens=True), callbacks, FP32_RTOL, n_batches=6, max_steps=3)
    scheduler = next(c for c in trainer.callbacks if type(c).__name__ == "AccumulationScheduler")
    want = sum(int((b["labels"][:, 1:] != -100).sum()) for b in _padded(6)[4:6])
    assert int(scheduler.last_window.tokens) == want  # the last window's token count, from our num_tokens


def test_fit_with_activation_checkpointing():
    from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing

    _compare(LabelsLM, lambda: [ActivationCheckpointing(policy="all")], FP32_RTOL)


def test_fit_with_activation_offload():
    from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload

    _compare(LabelsLM, lambda: [ActivationOffload(min_bytes=1024)], FP32_RTOL)


@pytest.mark.parametrize("recompute", [True, False])
def test_fit_with_lowmem_offload_bf16_true(recompute):
    # NOTE: bf16 compute: both runs round the same logits to bf16 before the fp32 softmax, but the weight's gradient
    # is accumulated over chunks in bf16 (one rounding per chunk, 2^-8 relative each) and the matmuls block
    # differently, so updates agree to bf16 precision, not fp32.
    _compare(LabelsLM, list, 5e-2, recompute=recompute, strategy="lowmem_offload", precision="bf16-true")


@pytest.mark.bnb
@RunIf(bitsandbytes=True)
def test_fit_with_low_bit_optimizer():
    from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer

    # NOTE: AdamW8bit with a small lr and a 32-bit-state threshold below every tensor: the quantized states of both
    # runs see gradients equal to fp32 rounding; tolerance on the update as for Adam's sign-like steps.
    trainer, _ = _compare(lambda: LabelsLM(optimizer="adamw", lr=1e-3), lambda: [LowBitOptimizer(min_8bit_size=0)],
                               5e-2)
    assert type(trainer.optimizers[0]).__name__ == "AdamW8bit"


def test_demo_causal_lm_module_uses_the_chunked_loss():
    """``CausalLMModule`` asks a wrapped model for ``labels=`` (no logits) and matches its own logits loss."""

    class SGDModule(CausalLMModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.02)  # summed loss: gradients ~ tokens x a mean's

    calls: list[bool] = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            calls.append(is_chunked(pl_module.model))

    config = {**GPT2_TINY, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    _compare(lambda: SGDModule(config=config, loss_reduction="sum"), lambda: [Spy()], FP32_RTOL)
    assert calls[:3] == [True] * 3 and calls[3:] == [False] * 3


@pytest.mark.deepspeed
@RunIf(deepspeed=True)
def test_deepspeed_stage_3_is_refused():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    # NOTE: the check reads the strategy's class and config only; no engine is built
    trainer = SimpleNamespace(strategy=DeepSpeedStrategy(stage=3))
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        ChunkedLMLoss().setup(trainer, LabelsLM(), "fit")  # type: ignore[arg-type]

"""OptimizerInBackward: refused configurations, and bit-identical training through Trainer.fit on an HF GPT-2."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_lowmem.callbacks.optimizer_in_backward import OptimizerInBackward
from lightning_lowmem.demo.module import CausalLMModule
from tests.helpers.models import GPT2_TINY, random_batch
from tests.helpers.runif import RunIf

NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
STEPS = 3


def make_optimizer(module: torch.nn.Module, kind: str) -> tuple[torch.optim.Optimizer, Any]:
    """Two param groups and a warm-up schedule, so per-group hyper-parameters and the LR schedule both matter."""
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "sgd":
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    elif kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=2e-3, betas=(0.9, 0.95))
    else:
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(groups, lr=2e-3, betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))


class LM(CausalLMModule):
    def __init__(self, kind: str = "adamw", reentrant: bool = False) -> None:
        super().__init__(model_type="gpt2", config={**GPT2_TINY, **NO_DROPOUT})
        self.kind = kind
        if reentrant:  # NOTE: each block under reentrant checkpointing: its own inner backward calls the hooks
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})

    def configure_optimizers(self):
        opt, sched = make_optimizer(self, self.kind)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def batches() -> list[dict[str, torch.Tensor]]:
    return [random_batch(batch_size=2, seq_len=32, seed=i) for i in range(STEPS)]


class Watch(Callback):
    """Gradients as the optimizer sees them at each (per-parameter) step, and the weights after each training step."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        self.max_live_grads = 0

    def on_fit_start(self, trainer, pl_module):
        names = {id(p): n for n, p in pl_module.named_parameters()}
        optimizer = trainer.optimizers[0]

        def pre_step(opt, args, kwargs):
            live = {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None}
            self.max_live_grads = max(self.max_live_grads, len(live))
            self.grads[-1].update(live)

        optimizer.register_step_pre_hook(pre_step)

    def on_train_batch_start(self, *args):
        self.grads.append({})

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.weights.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def fit(kind: str, callbacks: list, reentrant: bool = False, **kwargs) -> tuple[LM, L.Trainer]:
    torch.manual_seed(0)
    module = LM(kind, reentrant)
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_steps=STEPS, callbacks=callbacks, **kwargs,
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches(), batch_size=None))
    return module, trainer


def reference(kind: str, clip_value: float | None = None, reentrant: bool = False):
    """The plain PyTorch loop: forward, backward, (clip), step, zero_grad; gradients and weights per step."""
    torch.manual_seed(0)
    module = copy.deepcopy(LM(kind, reentrant))
    opt, sched = make_optimizer(module, kind)
    grads, weights = [], []
    for batch in batches():
        loss_sum, n = module.loss_sum_and_tokens(batch)
        (loss_sum / n).backward()
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(module.parameters(), clip_value)
        grads.append({name: p.grad.clone() for name, p in module.named_parameters()})
        opt.step()
        opt.zero_grad()
        sched.step()
        weights.append({name: p.detach().clone() for name, p in module.named_parameters()})
    return grads, weights


@pytest.mark.integration
@pytest.mark.parametrize(("kind", "clip_value", "reentrant"), [("sgd", None, False), ("adamw", None, False),
                                                              ("adamw", 0.01, False), ("adamw", None, True)])
def test_bit_identical_to_the_normal_step(kind, clip_value, reentrant):
    """Step by step against plain PyTorch: every gradient the optimizer sees and every weight, with torch.equal.

    clip_value=0.01 clips a good share of this model's gradients, so value clipping in the hook is exercised.
    """
    watch = Watch()
    kwargs = {"gradient_clip_val": clip_value, "gradient_clip_algorithm": "value"} if clip_value else {}
    _, trainer = fit(kind, [OptimizerInBackward(), watch], reentrant, **kwargs)
    ref_grads, ref_weights = reference(kind, clip_value, reentrant)

    assert trainer.global_step == STEPS
    assert trainer.gradient_clip_val == clip_value  # lifted during fit (clipping moved into the hook), put back
    assert watch.max_live_grads == 1  # the gradients never all exist at once: one parameter's at a time
    for step in range(STEPS):
        assert watch.grads[step].keys() == ref_grads[step].keys()
        for name, g in ref_grads[step].items():
            assert torch.equal(watch.grads[step][name], g), (step, name)
        for name, w in ref_weights[step].items():
            assert torch.equal(watch.weights[step][name], w), (step, name)
    if clip_value:
        assert any(g.abs().max() == clip_value for g in ref_grads[0].values())


def test_a_weight_whose_gradient_arrives_twice_in_one_backward_is_refused():
    """One block applied three times under reentrant checkpointing: each segment's inner backward hands over part of
    its gradient, and the next segment's recompute would read the weight stepped at the first part (before: trained
    silently otherwise, |diff|/|update| 1.07 in the conformance sweep)."""
    from tests.conformance.corpus_kinds import SharedReentrantBlock

    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, max_steps=2, limit_val_batches=0, callbacks=[OptimizerInBackward()])
    with pytest.raises(ValueError, match=r"`block\.[01]\.(weight|bias)` arrived twice in one backward.*"
                                         r"use_reentrant=False.*remove the callback"):
        trainer.fit(SharedReentrantBlock())


@pytest.mark.integration
@pytest.mark.bnb
@RunIf(bitsandbytes=True)
def test_combines_with_low_bit_optimizer():
    """The LowBitOptimizer swap happens in on_fit_start too; the hook steps whichever optimizer is current."""
    from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer

    ref_module, _ = fit("adamw8bit", [])  # the user configured bnb AdamW8bit, normal step
    module, trainer = fit("adamw", [LowBitOptimizer(kind="adamw8bit"), OptimizerInBackward()])
    assert type(trainer.optimizers[0]).__name__ == "AdamW8bit"
    assert any(s["state1"].dtype == torch.uint8 for s in trainer.optimizers[0].state.values())
    for (name, a), b in zip(ref_module.named_parameters(), module.parameters()):
        assert torch.equal(a, b), name


class OverridingLM(LM):
    def optimizer_step(self, *args, **kwargs):
        return super().optimizer_step(*args, **kwargs)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=1,
        callbacks=[OptimizerInBackward()], **kwargs,
    )


def test_refused_configurations_are_reported_together():
    trainer = _trainer(accumulate_grad_batches=2, gradient_clip_val=1.0)
    with pytest.raises(ValueError) as err:
        trainer.fit(OverridingLM(), train_dataloaders=DataLoader(batches(), batch_size=None))
    message = str(err.value)
    for expected in (
        "`accumulate_grad_batches=2`",
        "`gradient_clip_val=1.0` with clipping by norm",
        "`OverridingLM.optimizer_step` is overridden",
    ):
        assert expected in message, message


def test_manual_optimization_is_refused():
    module = LM()
    module.automatic_optimization = False
    with pytest.raises(ValueError, match="manual optimization"):
        _trainer().fit(module, train_dataloaders=DataLoader(batches(), batch_size=None))


def test_ddp_is_refused_with_the_reason():
    from lightning.pytorch.strategies import DDPStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), logger=False, max_steps=1)
    problems = OptimizerInBackward.conflicts(trainer, LM())
    assert len(problems) == 1 and "unreduced gradients" in problems[0]

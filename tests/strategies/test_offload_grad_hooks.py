"""The gradient hooks of a LightningModule under ``lowmem_offload``: what user code there reads and clips.

Plain Lightning's ``on_after_backward``, ``on_before_optimizer_step`` and ``configure_gradient_clipping`` see the
module's parameters with their ``.grad``. Under ``lowmem_offload`` the gradients the optimizer steps are the host
masters': while these hooks run, the module's parameters show the fp32 masters and their gradients, so a user's
``clip_grad_value_(self.frontend.parameters(), ...)`` clips what is stepped, Lightning's ``grad_norm`` logs it, and a
gradient the hook replaces (or drops) is the one stepped. Compared through ``Trainer.fit`` (2 micro-batches per step,
4 steps): ``torch.equal`` with plain Lightning at ``32-true`` and ``bf16-mixed`` (``host_optimizer="as_is"``); at
``bf16-true`` with ``lowmem_offload`` clipping the same masters from a callback through ``trainer.strategy.masters``
(plain Lightning's ``bf16-true`` has no fp32 masters: other maths).
"""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

pytestmark = pytest.mark.integration
STEPS = 4


class Clipped(L.LightningModule):
    """A user's own clipping (a value clip on the front end, then Lightning's), gradient hooks that read ``p.grad``."""

    def __init__(self, own_clip: bool = True, drop_head_bias: bool = False) -> None:
        super().__init__()
        self.frontend = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 1)
        self.own_clip, self.drop_head_bias = own_clip, drop_head_bias
        self.norms: list[dict[str, float]] = []
        self.after_backward: list[torch.Tensor] = []

    def forward(self, x):
        x = self.frontend(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y.float())

    def on_after_backward(self):
        self.after_backward.append(self.frontend[0].weight.grad.clone())

    def on_before_optimizer_step(self, optimizer):
        self.norms.append({k: float(v) for k, v in grad_norm(self, norm_type=2).items()})
        if self.drop_head_bias:
            self.head.bias.grad = None  # this parameter must not step

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.own_clip:
            torch.nn.utils.clip_grad_value_(self.frontend.parameters(), 0.01)
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, torch.sin(x[:, :1]) * 3), batch_size=8)


class ClipMastersByValue(Callback):
    """The front end's value clip done on the masters, through the strategy's public ``masters``."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        masters = trainer.strategy.masters
        torch.nn.utils.clip_grad_value_([masters[n] for n in ("frontend.0.weight", "frontend.0.bias")], 0.01)


def _fit(strategy, precision: str, callbacks=(), **module_kwargs):
    L.seed_everything(0, verbose=False)
    module = Clipped(**module_kwargs)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=STEPS, accumulate_grad_batches=2,
        gradient_clip_val=0.5, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=list(callbacks),
    )  # fmt: skip
    trainer.fit(module)
    return module, {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} differs by {(got[key] - value).abs().max()}"


@pytest.mark.parametrize("stream", [False, True], ids=["offload", "offload_params"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_user_clipping_and_gradient_hooks_equal_plain_lightning(precision, stream):
    plain, want = _fit("auto", precision)
    ours, got = _fit(OffloadStrategy(host_optimizer="as_is", offload_params=stream), precision)
    _assert_equal(got, want)
    assert ours.norms == plain.norms and len(ours.norms) == STEPS  # grad_norm logs the masters' gradients
    assert len(ours.after_backward) == 2 * STEPS
    for a, b in zip(ours.after_backward, plain.after_backward):  # accumulated so far: a partial sum, then the sum
        assert torch.equal(a, b)
    assert all(p.grad is None for p in ours.parameters())  # outside the hooks the module holds no gradient


def test_user_clipping_on_the_deferred_cuda_transfers(transfer_mode):
    """The same through the CUDA transfer logic (pinned staging, side stream) with its copies deferred on the CPU."""
    _, want = _fit("auto", "32-true")
    _, got = _fit(OffloadStrategy(host_optimizer="as_is"), "32-true")
    _assert_equal(got, want)


def test_a_gradient_the_hook_drops_is_not_stepped():
    _, want = _fit("auto", "32-true", drop_head_bias=True)
    _, got = _fit(OffloadStrategy(host_optimizer="as_is"), "32-true", drop_head_bias=True)
    _assert_equal(got, want)
    L.seed_everything(0, verbose=False)
    assert torch.equal(got["head.bias"], Clipped().head.bias.detach())


@pytest.mark.parametrize("stream", [False, True], ids=["offload", "offload_params"])
def test_bf16_true_user_clipping_clips_the_masters(stream):
    strategy = OffloadStrategy(host_optimizer="as_is", offload_params=stream)
    ours, got = _fit(strategy, "bf16-true")
    reference = OffloadStrategy(host_optimizer="as_is", offload_params=stream)
    _, want = _fit(reference, "bf16-true", callbacks=[ClipMastersByValue()], own_clip=False)
    _assert_equal(got, want)
    _, unclipped = _fit(OffloadStrategy(host_optimizer="as_is"), "bf16-true", own_clip=False)
    assert not torch.equal(got["frontend.0.weight"], unclipped["frontend.0.weight"])  # the value clip did act
    assert all(ab.dtype == torch.float32 for ab in ours.after_backward)  # the fp32 master gradients


class ValidationSeesGradients(Callback):
    def __init__(self) -> None:
        self.none: list[bool] = []

    def on_validation_epoch_start(self, trainer, pl_module):
        # NOTE: from the strategy's `on_validation_start` on (callbacks' `on_validation_start` run before it)
        if isinstance(trainer.strategy, OffloadStrategy):
            self.none.append(all(m.grad is None for m in trainer.strategy.masters.values()))
        else:
            self.none.append(all(p.grad is None for p in pl_module.parameters()))


def test_validation_releases_the_master_gradients_as_plain_lightning_does():
    """Lightning's `on_validation_model_zero_grad` frees the gradients after a step, before validating."""
    seen = {}
    for name, strategy in (("plain", "auto"), ("ours", "lowmem_offload")):
        module = Clipped()
        module.val_dataloader = module.train_dataloader
        module.validation_step = lambda batch, batch_idx: None
        callback = ValidationSeesGradients()
        trainer = L.Trainer(
            accelerator="cpu", strategy=strategy, max_steps=STEPS, val_check_interval=2, limit_val_batches=1,
            num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, callbacks=[callback],
        )  # fmt: skip
        trainer.fit(module)
        seen[name] = callback.none
    assert seen["ours"] == seen["plain"] == [True] * len(seen["plain"]) and seen["plain"]


def test_optimizer_in_backward_refuses_a_clipping_override_and_warns_about_gradient_hooks():
    trainer = L.Trainer(
        accelerator="cpu", strategy=OffloadStrategy(optimizer_in_backward=True), max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    warns = pytest.warns(UserWarning, match=r"`Clipped.on_after_backward` and `Clipped.on_before_optimizer_step` will see")
    with warns, pytest.raises(ValueError, match=r"before `Clipped.configure_gradient_clipping` runs.*optimizer_in_backward=False"):
        trainer.fit(Clipped())


_AFTER_STEP = ("on_train_batch_start", "on_before_zero_grad", "on_train_batch_end", "on_train_epoch_end")


class GradSpy(Callback):
    """What ``p.grad`` shows in the hooks between a step and the next ``zero_grad`` (a gradient-norm logger's hooks)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, torch.Tensor | None]]] = []

    def _look(self, hook: str, pl_module) -> None:
        with _view(pl_module):
            self.seen.append((hook, {n: None if p.grad is None else p.grad.clone() for n, p in pl_module.named_parameters()}))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._look("on_train_batch_start", pl_module)

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self._look("on_before_zero_grad", pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._look("on_train_batch_end", pl_module)

    def on_train_epoch_end(self, trainer, pl_module):
        self._look("on_train_epoch_end", pl_module)


def _view(pl_module):
    """Where the gradients are: the module's parameters under plain Lightning, the masters' view under ``lowmem_offload``
    (outside the gradient hooks the module's parameters hold the compute weights and no gradient)."""
    strategy = pl_module.trainer.strategy
    return strategy.masters_view(grads=True) if isinstance(strategy, OffloadStrategy) else contextlib.nullcontext()


class LogsGradNorms(Clipped):
    """The module's own ``on_train_batch_end`` logging gradient norms, through the view under ``lowmem_offload``."""

    def __init__(self) -> None:
        super().__init__(own_clip=False)
        self.batch_end_norms: list[dict[str, float]] = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with _view(self):
            self.batch_end_norms.append({k: float(v) for k, v in grad_norm(self, norm_type=2).items()})


@pytest.mark.parametrize("stream", [False, True], ids=["offload", "offload_params"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_view_shows_the_last_gradients_after_the_step_as_plain_lightning(precision, stream):
    """In ``on_train_batch_end``, ``on_train_epoch_end``, the next ``on_train_batch_start`` and ``on_before_zero_grad``
    the masters' view shows the last step's gradients (or, between micro-batches, those accumulated so far), as plain
    Lightning's parameters do."""
    seen = {}
    for name, strategy in (("plain", "auto"), ("ours", OffloadStrategy(host_optimizer="as_is", offload_params=stream))):
        spy = GradSpy()
        L.seed_everything(0, verbose=False)
        module = LogsGradNorms()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_epochs=2, limit_train_batches=4,
            accumulate_grad_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, callbacks=[spy],
        )  # fmt: skip
        trainer.fit(module)
        seen[name] = (spy.seen, module.batch_end_norms, {k: v.clone() for k, v in module.state_dict().items()})
    (want, want_norms, want_state), (got, got_norms, got_state) = seen["plain"], seen["ours"]
    assert [hook for hook, _ in got] == [hook for hook, _ in want] and {hook for hook, _ in want} == set(_AFTER_STEP)
    for i, ((hook, grads), (_, plain)) in enumerate(zip(got, want)):
        assert grads.keys() == plain.keys()
        for key, g in plain.items():
            assert (grads[key] is None) == (g is None), f"call {i} ({hook}): {key}.grad is {grads[key]}, plain {g}"
            assert g is None or torch.equal(grads[key], g), f"call {i} ({hook}): {key}.grad differs"
    assert any(g is not None for _, grads in want for g in grads.values())  # the hooks do see gradients
    assert got_norms == want_norms and len(want_norms) == 8 and all(want_norms)
    _assert_equal(got_state, want_state)
    assert all(p.grad is None for p in trainer.lightning_module.parameters())  # outside the hooks: none

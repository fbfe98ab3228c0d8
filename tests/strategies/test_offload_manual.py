"""Manual optimization (``automatic_optimization = False``) under ``lowmem_offload``, against plain Lightning.

Between ``self.manual_backward(loss)`` and ``opt.step()`` plain Lightning's parameters hold their gradients, and code in
``training_step`` reads, clips and changes them. Under ``lowmem_offload`` the gradients the optimizer steps are the fp32
host masters': from each ``manual_backward`` to the step (or the next forward, backward, or the end of
``training_step``) the module's parameters show the masters and their gradients (strategies/offload/manual_grads.py).
Compared through ``Trainer.fit`` over several steps, weights and BatchNorm buffers, ``torch.equal`` with plain Lightning
at ``32-true`` and ``bf16-mixed`` (``host_optimizer="as_is"``), and at ``16-mixed`` with plain Lightning's
``GradScaler`` (gradients loss-scaled until the step there as here): torch's clipping on all or some parameters,
``self.clip_gradients``, gradients logged and changed, gradient accumulation over ``manual_backward`` calls,
``zero_grad`` (``set_to_none`` or not, the optimizer's or the module's), a GAN with two optimizers and
``toggle_optimizer``, a WGAN's critic clamped after its step, an LR scheduler stepped by hand. ``bf16-true`` (plain
Lightning has no fp32 masters there): against clipping the masters explicitly. A gradient kept past the step keeps its
values, as plain Lightning's; a backward of the user's own is refused at the step.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem import MasterHalfPrecision
from lightning_lowmem.strategies.offload.masters import HostMasters
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.helpers.streams import assert_copies_were_deferred

pytestmark = pytest.mark.integration
BATCHES = 8  # batches of 8 samples: 4 optimizer steps when stepping every 2 batches


def _loader() -> DataLoader:
    x = torch.randn(8 * BATCHES, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, torch.sin(x[:, :1]) * 3), batch_size=8)


class Manual(L.LightningModule):
    """Manual optimization as plain Lightning's docs write it, with a BatchNorm (buffers) and repeated blocks (streamed).

    ``clip``: ``"norm"``/``"value"`` (torch's on all parameters), ``"subset"`` (torch's on the front end), ``"lightning"``
    (``self.clip_gradients``) or None; ``every``: step every that many batches (gradients accumulate over
    ``manual_backward`` calls); ``zero``: ``"none"``/``"zeros"`` (``opt.zero_grad(set_to_none=...)``) or ``"module"``
    (``self.zero_grad()``); ``inspect``: every step logs the gradient norm, halves the head's weight gradient and drops
    the head's bias gradient; ``halves``: ``training_step`` runs forward and ``manual_backward`` on each half of the
    batch in turn (the second forward comes between a backward and the step). Every step steps an LR scheduler by hand.
    """

    def __init__(
        self, clip: str | None = "norm", every: int = 2, zero: str = "none", inspect: bool = True, halves: bool = False
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.frontend = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 1)
        self.clip, self.every, self.zero, self.inspect, self.halves = clip, every, zero, inspect, halves
        self.norms: list[float] = []
        self.lrs: list[float] = []

    def forward(self, x):
        x = self.frontend(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        opt, scheduler = self.optimizers(), self.lr_schedulers()
        x, y = batch
        for xs, ys in zip(x.chunk(2), y.chunk(2)) if self.halves else [(x, y)]:
            self.manual_backward(nn.functional.mse_loss(self(xs).float(), ys) / self.every / (1 + self.halves))
        if (batch_idx + 1) % self.every:
            return  # accumulate: the next manual_backward adds to these gradients
        if self.inspect:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            self.norms.append(float(norm))
            self.log("grad_norm", norm)
        if self.clip == "norm":
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.2)
        elif self.clip == "value":
            torch.nn.utils.clip_grad_value_(self.parameters(), 0.02)
        elif self.clip == "subset":
            torch.nn.utils.clip_grad_norm_(self.frontend.parameters(), 0.05)
        elif self.clip == "lightning":
            self.clip_gradients(opt, gradient_clip_val=0.2, gradient_clip_algorithm="norm")
        elif self.clip == "masters":  # the reference of `bf16-true` below: the masters, through the strategy
            torch.nn.utils.clip_grad_norm_(list(self.trainer.strategy.masters.values()), 0.2)
        if self.inspect:
            self.head.weight.grad.mul_(0.5)
            self.head.bias.grad = None  # this parameter does not step in this batch
        opt.step()
        scheduler.step()
        self.lrs.append(opt.param_groups[0]["lr"])
        if self.zero == "module":
            self.zero_grad()
        else:
            opt.zero_grad(set_to_none=self.zero == "none")

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    def train_dataloader(self):
        return _loader()


def _fit(strategy, precision: str = "32-true", plugins=(), module_cls=Manual, **module_kwargs):
    L.seed_everything(0, verbose=False)
    module = module_cls(**module_kwargs)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=None if plugins else precision, plugins=list(plugins),
        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    L.seed_everything(1, verbose=False)  # the GAN's noise
    trainer.fit(module)
    return module, {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} differs by {(got[key].float() - value.float()).abs().max()}"


def _ours(stream: bool = False) -> OffloadStrategy:
    return OffloadStrategy(host_optimizer="as_is", offload_params=stream)


CASES = [  # (clip, every, zero, inspect)
    ("norm", 2, "none", True),
    ("norm", 2, "none", False),  # torch's clipping alone (it used to find no gradient and clip nothing, silently)
    ("value", 2, "none", True),
    ("subset", 2, "zeros", True),
    ("lightning", 1, "none", True),
    ("norm", 1, "module", True),
]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize(("clip", "every", "zero", "inspect"), CASES)
def test_manual_optimization_equals_plain_lightning(clip, every, zero, inspect, precision):
    kwargs = {"clip": clip, "every": every, "zero": zero, "inspect": inspect}
    plain, want = _fit("auto", precision, **kwargs)
    ours, got = _fit(_ours(), precision, **kwargs)
    _assert_equal(got, want)
    assert ours.norms == plain.norms and len(ours.norms) == (BATCHES // every if inspect else 0)  # what the code read
    assert ours.lrs == plain.lrs
    if clip in ("norm", "lightning") and inspect:
        assert max(plain.norms) > 0.2  # the clip acted
    assert all(p.grad is None for p in ours.parameters())  # outside the window the module holds no gradient
    assert not any("zero_grad" in vars(m) for m in ours.modules())  # the modules' own zero_grad again after fit


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("halves", [False, True])
def test_manual_optimization_with_streamed_blocks_equals_plain_lightning(precision, halves):
    """``lowmem_offload_params``: the view replaces the streamed blocks' placeholders, and the next forward (in a later
    batch, or in this one between a backward and the step) closes it before the blocks are fetched."""
    plain, want = _fit("auto", precision, halves=halves)
    ours, got = _fit(_ours(stream=True), precision, halves=halves)
    _assert_equal(got, want)
    assert ours.norms == plain.norms


@pytest.mark.parametrize("stream", [False, True], ids=["offload", "offload_params"])
def test_bf16_true_manual_clipping_clips_the_fp32_masters(stream):
    """Plain Lightning's ``bf16-true`` has no fp32 masters (other maths): the reference clips the masters explicitly."""
    _, want = _fit(_ours(stream), "bf16-true", clip="masters", inspect=False)
    _, got = _fit(_ours(stream), "bf16-true", clip="norm", inspect=False)
    _assert_equal(got, want)
    _, unclipped = _fit(_ours(stream), "bf16-true", clip=None, inspect=False)
    assert not torch.equal(got["frontend.0.weight"], unclipped["frontend.0.weight"])  # the clip acted


@pytest.mark.parametrize("module", ["Manual", "WGAN"])
def test_manual_optimization_on_the_deferred_cuda_transfers(transfer_mode, module):
    """The CUDA transfer logic with its copies deferred: the gradients read after `manual_backward` are all there, and
    the stepped weights (the critic's clamped ones) reach the device before the next forward."""
    module_cls = {"Manual": Manual, "WGAN": WGAN}[module]
    plain, want = _fit("auto", module_cls=module_cls)
    ours, got = _fit(_ours(), module_cls=module_cls)
    _assert_equal(got, want)
    assert ours.norms == plain.norms
    assert_copies_were_deferred(transfer_mode)


def test_fp16_mixed_shows_the_loss_scaled_gradients_as_plain_lightnings_grad_scaler():
    """Plain Lightning's ``16-mixed`` leaves the gradients scaled until ``opt.step()`` (its ``GradScaler`` unscales
    there): the clipping in ``training_step`` sees them scaled, here too. The first steps overflow and are skipped."""
    plain_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    plain, want = _fit("auto", plugins=[plain_plugin], clip="lightning", every=1)
    ours, got = _fit(_ours(), plugins=[MasterHalfPrecision("16-mixed")], clip="lightning", every=1)
    _assert_equal(got, want)
    assert ours.norms == plain.norms and min(plain.norms) > 1000  # scaled (the loss scale starts at 2**16)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])  # repeated blocks: streamed
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        for layer in self.layers:
            x = nn.functional.leaky_relu(layer(x), 0.2)
        return self.out(x)


class GAN(L.LightningModule):
    """Lightning's GAN pattern: two optimizers, ``toggle_optimizer``, one step each per batch; the discriminator's
    gradients clipped and its norm logged between its backward and step; the generator's zeroed by the module."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 8))
        self.discriminator = Discriminator()
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        bce = nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(opt_g)
        self.manual_backward(bce(self.discriminator(self.generator(z)).float(), ones))
        opt_g.step()
        self.generator.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = (bce(self.discriminator(real).float(), ones) + bce(self.discriminator(fake).float(), zeros)) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.discriminator.parameters(), 0.1)))
        opt_d.step()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-2), torch.optim.SGD(self.discriminator.parameters(), lr=0.1)]

    def train_dataloader(self):
        return _loader()


@pytest.mark.parametrize("stream", [False, True], ids=["offload", "offload_params"])
def test_gan_with_two_optimizers_equals_plain_lightning(stream):
    plain, want = _fit("auto", module_cls=GAN)
    ours, got = _fit(_ours(stream), module_cls=GAN)
    _assert_equal(got, want)
    assert ours.norms == plain.norms and max(plain.norms) > 0.1


class KeepsGradients(Manual):
    """Averages each gradient with the previous step's, kept by reference (or a ``detach()`` view of it)."""

    def __init__(self, keep: str) -> None:
        super().__init__(clip=None, every=1)
        self.keep = keep
        self.previous: list[torch.Tensor] | None = None

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x).float(), y))
        params = [p for p in self.parameters() if p.grad is not None]
        if self.previous is not None:
            for p, g in zip(params, self.previous):
                p.grad.add_(g, alpha=0.5)
        self.previous = [p.grad if self.keep == "ref" else p.grad.detach() for p in params]
        opt.step()
        opt.zero_grad()  # set_to_none: plain Lightning's next backward makes new gradients; the kept ones stay


@pytest.mark.parametrize("keep", ["ref", "detach"])
def test_a_gradient_kept_past_the_step_keeps_its_values(keep):
    plain, want = _fit("auto", module_cls=KeepsGradients, keep=keep)
    ours, got = _fit(_ours(), module_cls=KeepsGradients, keep=keep)
    _assert_equal(got, want)
    for a, b in zip(ours.previous, plain.previous):  # the last step's gradients, as the code kept them
        assert torch.equal(a, b)


class OwnBackward(Manual):
    def training_step(self, batch, batch_idx):
        x, y = batch
        nn.functional.mse_loss(self(x), y).backward()
        self.optimizers().step()


def test_a_backward_lightning_does_not_run_is_refused_before_the_step():
    module = OwnBackward()
    before = {k: v.detach().clone() for k, v in module.named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu", strategy=_ours(), max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"backward ran outside `self.manual_backward`.*Call `self.manual_backward"):
        trainer.fit(module)
    _assert_equal(dict(module.named_parameters()), before)  # nothing stepped


class WGAN(GAN):
    """WGAN's critic: its weights clamped after each of its steps (``p.data.clamp_``), its gradient norm read after the
    step (plain Lightning's gradients stay until ``zero_grad``)."""

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4)

        self.toggle_optimizer(opt_d)
        self.manual_backward(self.discriminator(self.generator(z).detach()).mean() - self.discriminator(real).mean())
        opt_d.step()
        self.norms.append(float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in self.discriminator.parameters()]))))
        for p in self.discriminator.parameters():
            p.data.clamp_(-0.05, 0.05)
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        self.manual_backward(-self.discriminator(self.generator(z)).mean())
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)


@pytest.mark.parametrize("stream", [False, True], ids=["offload", "offload_params"])
def test_wgan_weights_written_after_the_step_are_trained_as_plain_lightning(stream):
    plain, want = _fit("auto", module_cls=WGAN)
    ours, got = _fit(_ours(stream), module_cls=WGAN)
    _assert_equal(got, want)
    assert ours.norms == plain.norms
    assert all(bool((v.abs() <= torch.tensor(0.05)).all()) for k, v in got.items() if k.startswith("discriminator"))
    L.seed_everything(0, verbose=False)
    assert any(float(p.abs().max()) > 0.05 for p in WGAN().discriminator.parameters())  # the clamp acted


class GradientChange(Callback):
    """How much the gradients changed since the last step, from the gradients kept by reference (automatic loop)."""

    def __init__(self) -> None:
        self.previous: list[torch.Tensor] | None = None
        self.changes: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters()]
        if self.previous is not None:
            self.changes.append(float(sum(torch.linalg.vector_norm(g - q) for g, q in zip(grads, self.previous))))
        self.previous = grads


class Automatic(Manual):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)


def test_a_callback_comparing_with_the_kept_gradients_of_the_last_step_sees_them():
    changes = []
    for strategy in ("auto", _ours()):
        callback = GradientChange()
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu", strategy=strategy, max_steps=4, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, callbacks=[callback],
        )  # fmt: skip
        trainer.fit(Automatic())
        changes.append(callback.changes)
    assert changes[1] == changes[0] and len(changes[0]) == 3 and min(changes[0]) > 0


def test_the_host_gradient_buffers_are_reused_unless_code_kept_one():
    """No allocation per step in the common case; a new buffer only where code holds the old one (or a view of it)."""
    masters = HostMasters()
    masters.build(nn.Linear(2, 2), loading=False, precision=None, grad_buffers=True)
    buffer = id(masters.grad_host[0])  # NOTE: an id: holding the tensor would be keeping it
    for _ in range(3):
        masters.p_host[0].grad = None  # the optimizer's zero_grad()
        masters.fold(0, torch.ones(2, 2))
        assert id(masters.p_host[0].grad) == buffer
    for keep in (lambda g: g, lambda g: g.detach(), lambda g: g[0]):
        kept = keep(masters.p_host[0].grad)
        masters.p_host[0].grad = None
        masters.fold(0, torch.full((2, 2), 2.0))
        assert id(masters.p_host[0].grad) != buffer and bool((kept == 1.0).all())  # the kept one: the old values
        buffer = id(masters.p_host[0].grad)
        masters.p_host[0].grad = None
        masters.fold(0, torch.ones(2, 2))  # ready for the next round: ones, in the buffer just made
        assert id(masters.p_host[0].grad) == buffer
        del kept

"""Frozen parameters under ``lowmem_offload``: no fp32 host master, no gradient buffer, no optimizer state.

A frozen weight never changes, so where its compute weight is its whole value (``*-true``, and under ``*-mixed`` the
weights kept fp32 on the device) it has no master; a weight ``*-mixed`` stores in bf16 keeps its fp32 master (plain
mixed precision keeps that value). Before, every frozen base weight of a LoRA fine-tune had an fp32 host master
(LLaMA-7B: 14 GiB of host RAM for 40 M trained parameters). Checked through ``Trainer.fit`` against plain Lightning,
every weight and buffer.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem import Adapters
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from tests.helpers.runif import RunIf

pytestmark = pytest.mark.integration


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)  # NOTE: frozen, its running statistics (buffers) still update in training
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.block(torch.tanh(self.norm(self.inp(x))))))


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)  # NOTE: the frozen base too, as PEFT's examples do

    def train_dataloader(self):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, torch.sin(x[:, :1]) * 3), batch_size=8)


class Seen(Callback):
    """What the strategy holds on the host during training."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        strategy = trainer.strategy
        if isinstance(strategy, OffloadStrategy):
            self.masters = sorted(strategy.masters)
            self.grad_buffers = sum(g is not None for g in strategy._masters.grad_host)
            self.state = {n for n, p in strategy.masters.items()
                          for opt in strategy.optimizers if p in opt.state}


def _fit(strategy, precision: str, *callbacks) -> tuple[dict[str, torch.Tensor], Lit]:
    L.seed_everything(0, verbose=False)
    module = Lit()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=3, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[Adapters("lora", r=4, alpha=8, dropout=0.0, target_modules=["inp", "block"]), *callbacks],
    )  # fmt: skip
    trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, module


def _trainable(module: nn.Module) -> list[str]:
    return sorted(n.removeprefix("model.") for n, p in module.named_parameters() if p.requires_grad)


@RunIf(peft=True)
def test_lora_fp32_frozen_base_has_no_master_and_trains_as_plain_lightning():
    want, _ = _fit("auto", "32-true")
    seen = Seen()
    got, module = _fit(OffloadStrategy(host_optimizer="as_is"), "32-true", seen)
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []  # weights AND buffers, bit for bit
    trainable = [f"model.{n}" for n in _trainable(module)]
    assert trainable and all("lora_" in n for n in trainable)
    assert seen.masters == trainable  # NOTE: failed before: every frozen base weight had an fp32 master
    assert seen.grad_buffers == len(trainable)
    assert seen.state == set(trainable)


@RunIf(peft=True)
def test_lora_bf16_true_frozen_base_is_held_in_bf16_only():
    want, _ = _fit("auto", "bf16-true")
    seen = Seen()
    got, module = _fit(OffloadStrategy(host_optimizer="as_is"), "bf16-true", seen)
    assert seen.masters == [f"model.{n}" for n in _trainable(module)]
    # the frozen base is the bf16 weights plain bf16-true trains with (the adapters step fp32 masters here)
    weights = {f"model.{n}" for n, _ in module.model.named_parameters()}
    # NOTE: weights only: the adapters step fp32 masters here and bf16 weights there, so the BatchNorm statistics
    # of later steps differ by their rounding (parity of weights and buffers: the 32-true and bf16-mixed tests)
    frozen = [k for k in want if "lora_" not in k and k in weights]
    assert frozen
    for key in frozen:  # NOTE: failed before: the frozen weights came back as their fp32 masters
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


@RunIf(peft=True)
def test_bf16_mixed_frozen_weights_have_no_master_and_train_as_plain_lightning():
    want, _ = _fit("auto", "bf16-mixed")
    seen = Seen()
    got, module = _fit(OffloadStrategy(host_optimizer="as_is"), "bf16-mixed", seen)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    # the compute weights are fp32 on the device (autocast casts per op): a frozen one holds its whole value
    assert seen.masters == [f"model.{n}" for n in _trainable(module)]


class UnfreezeAt(Callback):
    """The user's own unfreezing (what the refusal of ``BackboneFinetuning`` names): the backbone frozen before
    ``configure_optimizers``, unfrozen at epoch 1 with a param group of its own; kept across a resume."""

    def __init__(self) -> None:
        self.unfrozen = False

    def setup(self, trainer, pl_module, stage):
        pl_module.backbone.requires_grad_(False)

    def _unfreeze(self, trainer, pl_module):
        pl_module.backbone.requires_grad_(True)
        trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters())})
        self.unfrozen = True

    def on_fit_start(self, trainer, pl_module):
        if self.unfrozen:  # NOTE: resumed after the unfreeze: the checkpoint's optimizer state has its group
            self._unfreeze(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1 and not self.unfrozen:
            self._unfreeze(trainer, pl_module)

    def state_dict(self):
        return {"unfrozen": self.unfrozen}

    def load_state_dict(self, state):
        self.unfrozen = state["unfrozen"]


class Unfreeze(Lit):
    """The input layer as the backbone; the optimizer holds the trainable parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = self.model.inp

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _backbone(precision: str, strategy) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    class AtUnfreeze(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            self.before = {n: p.detach().clone() for n, p in pl_module.backbone.named_parameters()}

        def on_train_epoch_end(self, trainer, pl_module):
            if isinstance(trainer.strategy, OffloadStrategy) and trainer.current_epoch == 1:
                self.masters = {n: trainer.strategy.masters.get(f"model.inp.{n}") for n in ("weight", "bias")}

    L.seed_everything(0, verbose=False)
    module = Unfreeze()
    seen = AtUnfreeze()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_epochs=2, limit_train_batches=2,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[UnfreezeAt(), seen],
    )  # fmt: skip
    trainer.fit(module)
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}, seen


def test_unfrozen_later_gets_its_master_from_the_exact_bf16_weight(monkeypatch):
    """bf16-true: the backbone, frozen at setup, is held in bf16 only; unfrozen at epoch 1 its master is that bf16
    value, exactly (plain bf16-true has rounded the weights before the cast away too), and it trains from there."""
    from lightning_lowmem.strategies.offload.masters import HostMasters

    made = []
    original = HostMasters.master_unfrozen

    def spy(self, value_of):
        new = original(self, value_of)
        made.extend((self.names[i], self.p_host[i].detach().clone(), self.p_device[i].detach().clone()) for i in new)
        return new

    monkeypatch.setattr(HostMasters, "master_unfrozen", spy)
    got, seen = _backbone("bf16-true", OffloadStrategy(host_optimizer="as_is"))
    assert sorted(n for n, _, _ in made) == ["model.inp.bias", "model.inp.weight"]
    for name, master, compute in made:
        assert compute.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(master, compute.float()), name
    assert all(m is not None for m in seen.masters.values())
    assert not torch.equal(got["model.inp.weight"], seen.before["weight"].float())  # it trained after the unfreeze


@RunIf(peft=True)
def test_host_bytes_needed_counts_masters_of_the_trainable_parameters_only():
    """The host check and the estimate count what the strategy allocates (failed before: 4 B for every parameter)."""
    module = Lit()
    Adapters("lora", r=4, alpha=8, dropout=0.0, target_modules=["inp", "block"]).apply(module)
    need = OffloadStrategy().host_bytes_needed(module, [])
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in module.parameters())
    assert need["masters"] == 4 * trainable and need["gradient_buffers"] == 4 * trainable


class MastersAtStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.masters = {n: p.detach().clone() for n, p in trainer.strategy.masters.items()}


def _unfreeze_run(tmp_path, max_epochs: int, ckpt_path=None, save: bool = False) -> MastersAtStart:
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(0, verbose=False)
    seen = MastersAtStart()
    callbacks = [UnfreezeAt(), seen]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=OffloadStrategy(host_optimizer="as_is"), precision="bf16-true",
        max_epochs=max_epochs, limit_train_batches=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=save, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(Unfreeze(), ckpt_path=ckpt_path)
    return seen


def test_resumed_after_an_unfreeze_keeps_the_checkpoint_fp32_masters(tmp_path):
    """bf16-true: a checkpoint saved after the backbone was unfrozen holds its fp32 masters; resumed, the backbone is
    frozen again at setup and keeps its checkpoint value as a master, not the bf16 rounding of it (which would
    make the resumed run differ from the uninterrupted one)."""
    _unfreeze_run(tmp_path, 2, save=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    assert saved["model.inp.weight"].dtype == torch.float32  # a master: trained after the unfreeze
    seen = _unfreeze_run(tmp_path, 3, ckpt_path=tmp_path / "last.ckpt")
    for name in ("model.inp.weight", "model.inp.bias"):
        assert name in seen.masters and torch.equal(seen.masters[name], saved[name]), name


@RunIf(peft=True)
def test_dry_run_pinned_staging_counts_the_parameters_with_a_master():
    """The dry run's CUDA staging correction is what the strategy stages: the adapters' masters, not the frozen base
    (failed before: every parameter of the model was counted, 13.6 GiB for LLaMA-7B)."""
    from lightning_lowmem import estimate_memory
    from lightning_lowmem.demo.module import CausalLMModule
    from lightning_lowmem.strategies.offload.transfer import pinned_staging_bytes

    config = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 258}
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
    est = estimate_memory({"model_type": "llama", **config}, 1, 16, precision="bf16-true", target="cuda",
                          strategy="lowmem_offload", callbacks=[Adapters("lora", **lora)])
    staging = next(c.bytes for c in est.corrections if c.name == "pinned_staging")
    module = CausalLMModule(model_type="llama", config=config)
    Adapters("lora", **lora).apply(module)
    trainable = [p.numel() for p in module.parameters() if p.requires_grad]
    assert staging == pinned_staging_bytes([(n, torch.bfloat16) for n in trainable])


class FrozenInput(Lit):
    def __init__(self) -> None:
        super().__init__()
        self.model.inp.requires_grad_(False)  # NOTE: still in configure_optimizers' group (self.parameters())


def test_a_frozen_weight_in_the_group_keeps_the_fused_host_kernel_in_the_run_and_its_dry_run(tmp_path):
    """A frozen weight kept without a master stays in its optimizer's group in the compute dtype (bf16 here). It never
    has a gradient, so no kernel steps it: the host step is torch's fused kernel all the same, in the run and in its
    dry run. Before, the choice depended on when the module was cast: fused in the run (the weight still fp32 when the
    groups were re-pointed), the for-loop in the dry run (already bf16), whose temporaries put the predicted step
    peak above the measured one (Whisper's frozen sinusoidal positions: +10 %)."""
    from lightning_lowmem import MemoryReport
    from tests.memory.test_dry_run import _assert_predicted_equals_measured

    class Fused(Callback):
        def on_train_batch_end(self, trainer, *args):
            self.fused = len(trainer.strategy._kernel._saved)

    L.seed_everything(0, verbose=False)
    report, fused = MemoryReport(every_n_steps=1, plot=False, save_dir=tmp_path), Fused()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="lowmem_offload", precision="bf16-true", max_steps=3, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[report, fused],
    )  # fmt: skip
    trainer.fit(FrozenInput())
    assert fused.fused == 1
    _assert_predicted_equals_measured(report)

"""Resuming another model's or optimizer's checkpoint (lowmem_offload), and settings that used to be ignored silently."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lowmem.demo.module import CausalLMModule
from tests.helpers.models import random_batch


class Module(CausalLMModule):
    def __init__(self, opt: str = "adamw", n_embd: int = 32) -> None:
        super().__init__(config={"n_layer": 1, "n_embd": n_embd, "n_head": 2, "n_positions": 32})
        self.opt = opt

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(module, steps, ckpt_path=None, save=None):
    full = random_batch(8, 16, seed=1)
    data = [{k: v[i] for k, v in full.items()} for i in range(8)]
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="lowmem_offload", precision="bf16-true", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpts")
    for opt in ("sgd", "adamw"):
        _fit(Module(opt), 1, save=directory / f"{opt}.ckpt")
    return directory


@pytest.mark.integration
@pytest.mark.parametrize(("written", "resumed", "match"), [
    ("sgd", "adamw", (r"written by SGD with momentum \(per-parameter \['momentum_buffer'\]\), but `configure_optimizers` "
                     r"now returns an `AdamW` \(it keeps \['exp_avg', 'exp_avg_sq', 'step'\]\)")),
    # NOTE: torch's SGD loads Adam's state without a word and steps with a fresh momentum
    ("adamw", "sgd", (r"written by Adam/AdamW \(per-parameter \['exp_avg', 'exp_avg_sq', 'step'\]\), but "
                     r"`configure_optimizers` now returns a `SGD` \(it keeps \['momentum_buffer'\]\)")),
])
def test_another_optimizers_state_is_named_with_the_file(checkpoints, written, resumed, match):
    path = checkpoints / f"{written}.ckpt"
    with pytest.raises(ValueError, match=rf"Cannot resume from `ckpt_path='{path}'`: its optimizer state was {match}.*"
                                         r"Resume with the optimizer that wrote it, or keep only its weights"):
        _fit(Module(resumed), 2, ckpt_path=str(path))


@pytest.mark.integration
def test_another_model_shape_names_the_file_the_tensors_and_the_hyperparameters(checkpoints):
    path = checkpoints / "adamw.ckpt"
    with pytest.raises(ValueError, match=rf"Cannot resume from `ckpt_path='{path}'`: it was written by a model of "
                                         r"another shape \(\d+ tensor\(s\) differ: `model.transformer.wte.weight` is "
                                         r"\[258, 32\] there, \[258, 64\] here.*hyper-parameters differ from this "
                                         r"model's: .*n_embd: 32 there, 64 here"):
        _fit(Module("adamw", n_embd=64), 2, ckpt_path=str(path))


def test_the_same_optimizer_resumes(checkpoints):
    _fit(Module("adamw"), 2, ckpt_path=str(checkpoints / "adamw.ckpt"))


def test_negative_size_in_a_model_config():
    with pytest.raises(ValueError, match=r"Passed `config` with `n_layer: -1`, `n_head: -2`: layer counts and sizes "
                                         r"must be positive"):
        CausalLMModule(config={"n_layer": -1, "n_embd": 32, "n_head": -2})
    with pytest.raises(ValueError, match=r"Could not build the `gpt2` model from `config=.*`embed_dim` must be "
                                         r"divisible by num_heads"):
        CausalLMModule(config={"n_layer": 1, "n_embd": 32, "n_head": 3})


def test_device_budget_without_auto_offload_params_warns():
    from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

    with pytest.warns(UserWarning, match=r"`device_budget='1GB'` is used only with `offload_params='auto'`.*with "
                                         r"`offload_params=True` it is ignored"):
        OffloadStrategy(offload_params=True, device_budget="1GB")


def test_loss_scaler_settings_under_bf16_warn():
    from lightning_lowmem import MasterHalfPrecision

    with pytest.warns(UserWarning, match=r"`init_scale=4096` set the fp16 loss scaler; `precision='bf16-true'` has "
                                         r"none .* they are ignored"):
        MasterHalfPrecision("bf16-true", init_scale=2**12)
    assert MasterHalfPrecision("16-mixed", init_scale=2**12).scaler.scale == 4096

"""lowmem_zero*: nothing silent (skipped steps, ignored settings), bad settings refused in the constructor, clear
resume errors."""

from __future__ import annotations

import shutil

import lightning as L
import pytest
import torch

from tests.helpers.runif import RunIf

pytestmark = [
    pytest.mark.deepspeed,
    RunIf(deepspeed=True),
    pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.*:FutureWarning"),
]


def _trainer(strategy, **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False, enable_checkpointing=False, **kwargs)


def _loader(n=8):
    from tests.helpers.models import random_batch

    full = random_batch(n, 16, seed=1)
    return torch.utils.data.DataLoader([{k: v[i] for k, v in full.items()} for i in range(n)], batch_size=2)


def _module(inf_at_step=None, n_layer=1, n_embd=32):
    from lightning_lowmem.demo.module import CausalLMModule

    class Module(CausalLMModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.trainer.global_step == inf_at_step else loss

    return Module(config={"n_layer": n_layer, "n_embd": n_embd, "n_head": 2, "n_positions": 32, "resid_pdrop": 0.0,
                          "embd_pdrop": 0.0, "attn_pdrop": 0.0})


class Masters(L.Callback):
    def __init__(self):
        self.after_step: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from deepspeed.utils import safe_get_full_fp32_param

        self.after_step.append({n: safe_get_full_fp32_param(p).clone() for n, p in pl_module.named_parameters()})


# --- skipped steps ---------------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_skipped_step_is_logged_and_warned(precision):
    masters = Masters()
    trainer = _trainer("lowmem_zero2", precision=precision, max_steps=3, callbacks=[masters])
    with pytest.warns(RuntimeWarning, match=r"DeepSpeed skipped the optimizer step at global step 1: the gradients "
                                            r"held inf/nan.*`lowmem/skipped_steps`"):
        trainer.fit(_module(inf_at_step=1), _loader())
    assert trainer.strategy.deepspeed_engine.skipped_steps == 1
    assert trainer.callback_metrics["lowmem/skipped_steps"] == 1.0
    first, skipped, last = masters.after_step
    assert all(torch.equal(first[n], skipped[n]) for n in first)  # the step was skipped: masters unchanged
    assert all(torch.isfinite(t).all() and not torch.equal(t, skipped[n]) for n, t in last.items())


@pytest.mark.integration
def test_no_skip_no_warning(recwarn):
    trainer = _trainer("lowmem_zero2", max_steps=2)
    trainer.fit(_module(), _loader())
    assert trainer.callback_metrics["lowmem/skipped_steps"] == 0.0
    assert not [w for w in recwarn if "skipped the optimizer step" in str(w.message)]


# --- resuming from another stage's checkpoint -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zero2_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zero2") / "last.ckpt"
    trainer = _trainer("lowmem_zero2", max_steps=1)
    trainer.fit(_module(), _loader())
    trainer.save_checkpoint(directory)
    return directory


@pytest.mark.integration
def test_zero3_resuming_a_zero2_directory_names_the_stages(zero2_checkpoint, tmp_path):
    ckpt = tmp_path / "last.ckpt"
    shutil.copytree(zero2_checkpoint, ckpt)
    with pytest.raises(ValueError, match=r"written by ZeRO-1/2 .* this strategy runs ZeRO-3.*`lowmem_zero2` / "
                                         r"`lowmem_zero2_offload`.*lowmem consolidate"):
        _trainer("lowmem_zero3", max_steps=2).fit(_module(), _loader(), ckpt_path=str(ckpt))


@pytest.mark.integration
def test_resuming_another_model_shape_or_optimizer_names_the_file(zero2_checkpoint, tmp_path):
    from lightning_lowmem.demo.module import CausalLMModule

    class SGDModule(CausalLMModule):
        def configure_optimizers(self):  # the same parameter groups as the AdamW of the module
            groups = [{k: v for k, v in g.items() if k == "params"} for g in super().configure_optimizers().param_groups]
            return torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    bigger = _module(n_embd=64)
    with pytest.raises(ValueError, match=r"Cannot resume from `ckpt_path='.*last.ckpt'`: it was written by a model of "
                                         r"another shape \(\d+ tensor\(s\) differ: `model.transformer.wte.weight` is "
                                         r"\[258, 32\] there, \[258, 64\] here"):
        _trainer("lowmem_zero2", max_steps=2).fit(bigger, _loader(), ckpt_path=str(zero2_checkpoint))
    sgd = tmp_path / "sgd.ckpt"
    trainer = _trainer("lowmem_zero2", max_steps=1)
    trainer.fit(SGDModule(config=_module().hparams.config), _loader())
    trainer.save_checkpoint(sgd)
    with pytest.raises(ValueError, match=r"its optimizer state was written by another kind of optimizer, but "
                                         r"`configure_optimizers` now returns an `AdamW` \(KeyError: 'step'\).*"
                                         r"lowmem consolidate"):
        _trainer("lowmem_zero2", max_steps=2).fit(_module(), _loader(), ckpt_path=str(sgd))


# --- settings: checked in the constructor, none ignored silently ----------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"config": {"zero_optimization": {"stage": "x"}}}, ValueError,
         r"`config\['zero_optimization'\]\['stage'\]='x'`; expected 0, 1, 2 or 3"),
        ({"config": {"zero_optimization": {"reduce_bucket_size": "huge"}}}, ValueError,
         r"\['reduce_bucket_size'\]='huge'`; expected a positive int or 'auto'"),
        ({"reduce_bucket_size": -1}, ValueError, r"`reduce_bucket_size=-1`; expected a positive number of elements"),
        ({"allgather_bucket_size": 0}, ValueError, r"`allgather_bucket_size=0`; expected a positive number"),
        ({"sub_group_size": 0}, ValueError, r"`sub_group_size=0`.*every parameter in a sub-group of its own"),
        ({"reduce_bucket_size": "big", "sub_group_size": -2}, TypeError,
         r"`reduce_bucket_size='big'`.*`sub_group_size=-2`"),
    ],
)
def test_bad_sizes_and_stage_are_refused_in_the_constructor(kwargs, error, match):
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    with pytest.raises(error, match=match):
        ZeroStrategy(**kwargs)


def test_settings_another_stage_ignores_warn():
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    with pytest.warns(UserWarning, match=r"`sub_group_size=500000000.0` is used by ZeRO stage 3 only; with `stage=2`"):
        ZeroStrategy(stage=2, sub_group_size=5e8)
    with pytest.warns(UserWarning, match=r"`allgather_bucket_size=10000000` is used by ZeRO stages 1 and 2 only"):
        ZeroStrategy(stage=3, allgather_bucket_size=10**7)
    strategy = ZeroStrategy(stage=3, sub_group_size=5e8, reduce_bucket_size=5e8)  # floats such as 5e8 are counts
    assert strategy.config["zero_optimization"]["sub_group_size"] == 500_000_000


# --- consolidate ------------------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_consolidate_strip_prefix_matching_nothing_and_a_missing_directory(zero2_checkpoint, tmp_path):
    from lightning_lowmem.zero import consolidate

    with pytest.raises(ValueError, match=r"`strip_prefix='modle.'`, but no key of the checkpoint starts with it "
                                         r"\(they start with 'model.'\)"):
        consolidate(zero2_checkpoint, tmp_path / "model.pt", strip_prefix="modle.")
    assert not (tmp_path / "model.pt").exists()
    missing = tmp_path / "no" / "such"
    with pytest.raises(ValueError, match=r"the directory '.*no/such' does not exist; create it \(`mkdir -p "):
        consolidate(zero2_checkpoint, missing / "model.pt")
    assert not (tmp_path / "no").exists()  # as `lowmem plan --write`: nothing created
    assert "transformer.wte.weight" in consolidate(zero2_checkpoint, tmp_path / "model.pt", strip_prefix="model.")

"""ZeroStrategy without a fit: presets, config layering, bad input, the optimizer swap, consolidate's errors."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_lowmem
from lightning_lowmem.strategies.zero import config as zc
from tests.helpers.runif import RunIf

pytestmark = [pytest.mark.deepspeed, RunIf(deepspeed=True)]


@pytest.mark.parametrize(
    ("name", "stage", "optimizer_offload", "param_offload"),
    [
        ("lowmem_zero2", 2, False, False),
        ("lowmem_zero2_offload", 2, True, False),
        ("lowmem_zero3", 3, False, False),
        ("lowmem_zero3_offload", 3, True, True),
    ],
)
def test_presets_carry_the_reference_settings(name, stage, optimizer_offload, param_offload):
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, ZeroStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == stage and zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert ("offload_optimizer" in zero) == optimizer_offload
    assert ("offload_param" in zero) == param_offload
    for key in ("offload_optimizer", "offload_param"):
        if key in zero:
            assert zero[key] == {"device": "cpu", "pin_memory": True}
    if stage == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
        assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == int(1e9)
        assert zero["reduce_bucket_size"] == "auto"  # resolved from the model's hidden size in setup
    else:
        assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == int(2e8)


def test_trainer_settings_layering_and_fp16_reference():
    preset = zc.reference_config(
        stage=2, offload_optimizer=False, offload_parameters=False, offload_device="cpu", nvme_path=None,
        pin_memory=True, overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=int(2e8),
        allgather_bucket_size=int(2e8), sub_group_size=int(1e9), gather_16bit_weights_on_model_save=True,
        zero_force_ds_cpu_optimizer=True,
    )  # fmt: skip
    trainer = zc.trainer_settings(accumulate_grad_batches=4, gradient_clip_val=1.0, precision="16-mixed", micro_batch_size=8)
    assert trainer["fp16"] == {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                               "hysteresis": 2, "min_loss_scale": 1}  # fmt: skip
    user = {"zero_optimization": {"reduce_bucket_size": 5}, "fp16": {"initial_scale_power": 12}}
    merged = zc.merge(zc.merge(preset, trainer), user)
    assert merged["zero_optimization"]["reduce_bucket_size"] == 5  # the JSON wins ...
    assert merged["zero_optimization"]["overlap_comm"] is True  # ... and only where it speaks
    assert merged["fp16"]["initial_scale_power"] == 12 and merged["fp16"]["enabled"] is True
    assert merged["gradient_accumulation_steps"] == 4 and merged["gradient_clipping"] == 1.0
    assert zc.conflicts(trainer, user, "16-mixed") == ([], [])
    bf16 = zc.trainer_settings(accumulate_grad_batches=1, gradient_clip_val=None, precision="bf16-mixed", micro_batch_size=1)
    assert bf16["bf16"] == {"enabled": True} and "fp16" not in bf16 and bf16["gradient_clipping"] == 0.0


def test_conflicts_say_which_wins():
    trainer = zc.trainer_settings(accumulate_grad_batches=2, gradient_clip_val=1.0, precision="32-true", micro_batch_size=4)
    user = {"gradient_accumulation_steps": 8, "fp16": {"enabled": True}, "gradient_clipping": 0.3,
            "train_micro_batch_size_per_gpu": 16}  # fmt: skip
    errors, warns = zc.conflicts(trainer, user, "32-true")
    assert len(errors) == 2 and len(warns) == 2
    assert "gradient_accumulation_steps=8" in errors[0] and "accumulate_grad_batches=2" in errors[0] and "must win" in errors[0]
    assert "`fp16` enabled" in errors[1] and "precision='32-true'" in errors[1]
    assert "gradient_clipping=0.3" in warns[0] and "the JSON wins" in warns[0]
    assert "train_micro_batch_size_per_gpu=16" in warns[1] and "the JSON wins" in warns[1]


def test_resolve_auto_from_hidden_size():
    cfg = {"zero_optimization": {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"},
           "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "train_batch_size": "auto"}  # fmt: skip
    zc.resolve_auto(cfg, hidden_size=64, world_size=2)
    assert cfg["zero_optimization"] == {"reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 3686,
                                        "stage3_param_persistence_threshold": 640}  # fmt: skip
    assert cfg["train_batch_size"] == 12


def test_user_json_file_is_merged_over_the_preset(tmp_path):
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"overlap_comm": false}, "steps_per_print": 10}')
    strategy = ZeroStrategy(stage=3, config=str(path))
    assert strategy.config["zero_optimization"]["overlap_comm"] is False
    assert strategy.config["zero_optimization"]["contiguous_gradients"] is True
    assert strategy.config["steps_per_print"] == 10
    with pytest.raises(FileNotFoundError, match="not a file"):
        ZeroStrategy(config=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        ZeroStrategy(config=str(tmp_path / "bad.json"))


def test_bad_arguments_are_reported_together():
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    with pytest.raises(ValueError) as err:
        ZeroStrategy(stage=4, offload_parameters=True, offload_device="disk", overlap=True)
    message = str(err.value)
    assert "stage=4" in message and "offload_device='disk'" in message and "['overlap']" in message
    assert "parameter offload needs stage 3" in message


def test_nvme_path_is_checked(tmp_path, monkeypatch):
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    monkeypatch.delenv("LOWMEM_NVME_PATH", raising=False)
    with pytest.raises(ValueError, match="LOWMEM_NVME_PATH"):
        StrategyRegistry.get("lowmem_zero3_nvme")
    with pytest.raises(ValueError, match="not an existing directory"):
        ZeroStrategy(stage=3, offload_optimizer=True, offload_device="nvme", nvme_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="offload_device='nvme'` with `stage=2`; DeepSpeed swaps to NVMe only at stage 3"):
        ZeroStrategy(stage=2, offload_optimizer=True, offload_device="nvme", nvme_path=str(tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not an existing directory"):
        ZeroStrategy(stage=3, offload_optimizer=True, offload_device="nvme", nvme_path=str(tmp_path / "file"))
    monkeypatch.setenv("LOWMEM_NVME_PATH", str(tmp_path))
    strategy = StrategyRegistry.get("lowmem_zero3_nvme")
    zero = strategy.config["zero_optimization"]
    assert zero["offload_param"] == zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": str(tmp_path)}
    assert strategy.remote_device == "nvme"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to any directory")
def test_nvme_path_not_writable(tmp_path):
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot write"):
        ZeroStrategy(stage=3, offload_optimizer=True, offload_device="nvme", nvme_path=str(locked))


def test_missing_deepspeed_names_the_extra(monkeypatch):
    from lightning_lowmem.strategies.zero import strategy as zero

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ModuleNotFoundError, match=r"lightning-lowmem\[deepspeed\]"):
        zero.ZeroStrategy(stage=2)
    with pytest.raises(ModuleNotFoundError, match=r"lightning-lowmem\[deepspeed\]"):
        zero.consolidate("x", "y")


def _params():
    return [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]


def test_adamw_becomes_cpu_adam_with_the_same_groups_and_one_step_matches():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from lightning_lowmem.strategies.zero.optim import to_cpu_optimizer

    w, b = _params()
    groups = [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0, "lr": 3e-3}]
    torch_opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.8, 0.9), eps=1e-6)
    cpu_opt, message = to_cpu_optimizer(torch_opt, {})
    assert isinstance(cpu_opt, DeepSpeedCPUAdam) and cpu_opt.adam_w_mode
    assert "adamw_mode=True" in message and "lr=0.003" in message
    for got, want in zip(cpu_opt.param_groups, torch_opt.param_groups):
        assert got["params"] == want["params"]
        assert (got["lr"], tuple(got["betas"]), got["eps"], got["weight_decay"]) == (want["lr"], want["betas"], want["eps"], want["weight_decay"])

    # one step of each from the same start: DeepSpeedCPUAdam's C++ kernel rounds differently (tolerance 1e-6)
    w2, b2 = (torch.nn.Parameter(p.detach().clone()) for p in (w, b))
    ref = torch.optim.AdamW([{"params": [w2], "weight_decay": 0.1}, {"params": [b2], "weight_decay": 0.0, "lr": 3e-3}],
                            lr=1e-3, betas=(0.8, 0.9), eps=1e-6)  # fmt: skip
    for p, q in ((w, w2), (b, b2)):
        p.grad = torch.full_like(p, 0.5)
        q.grad = p.grad.clone()
    cpu_opt.step()
    ref.step()
    torch.testing.assert_close(w, w2, atol=1e-6, rtol=0)
    torch.testing.assert_close(b, b2, atol=1e-6, rtol=0)


def test_adam_keeps_l2_mode_and_unsupported_optimizers_are_refused():
    from lightning_lowmem.strategies.zero.optim import to_cpu_optimizer

    cpu_opt, _ = to_cpu_optimizer(torch.optim.Adam(_params(), lr=1e-3, weight_decay=0.1), {})
    assert not cpu_opt.adam_w_mode
    assert to_cpu_optimizer(cpu_opt, {})[0] is cpu_opt  # already a DeepSpeed CPU optimizer
    sgd = torch.optim.SGD(_params(), lr=0.1)
    with pytest.raises(ValueError, match=r"torch\.optim\.sgd\.SGD.*lowmem_zero2.*zero_force_ds_cpu_optimizer"):
        to_cpu_optimizer(sgd, {})
    assert to_cpu_optimizer(sgd, {"zero_force_ds_cpu_optimizer": False})[0] is sgd
    with pytest.raises(ValueError, match="`amsgrad=True`"):
        to_cpu_optimizer(torch.optim.AdamW(_params(), amsgrad=True), {})


def test_scheduler_follows_the_swapped_optimizer():
    from lightning_lowmem.core.schedulers import repoint_scheduler
    from lightning_lowmem.strategies.zero.optim import to_cpu_optimizer

    torch_opt = torch.optim.AdamW(_params(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda step: 0.5 ** step)
    cpu_opt, _ = to_cpu_optimizer(torch_opt, {})
    repoint_scheduler(scheduler, torch_opt, cpu_opt)
    for p in cpu_opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        cpu_opt.step()
        scheduler.step()
    assert cpu_opt.param_groups[0]["lr"] == 0.5


def test_consolidate_refuses_a_non_checkpoint(tmp_path):

    with pytest.raises(ValueError, match="not a DeepSpeed checkpoint directory: it has no `latest` file"):
        lightning_lowmem.zero.consolidate(tmp_path, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_gather_on_fit_end_is_for_stage_3_only():
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    with pytest.raises(ValueError, match=r"`gather_on_fit_end=True` with `stage=2`; only stage 3 partitions"):
        ZeroStrategy(stage=2, gather_on_fit_end=True)
    with pytest.raises(TypeError, match=r"`gather_on_fit_end='yes'`; expected True or False"):
        ZeroStrategy(stage=3, gather_on_fit_end="yes")
    assert ZeroStrategy(stage=3, gather_on_fit_end=True).gather_on_fit_end is True


@pytest.mark.parametrize("name", ["lowmem_zero2", "lowmem_zero3"])
def test_a_0d_parameter_is_refused_before_deepspeed_starts(name):
    """neuralforecast's PatchTST holds a trainable 0-d attention `scale`: DeepSpeed's byte view of the flat buffer
    crashed on it ("self.dim() cannot be 0 to view Float as Byte"; found by the conformance sweep)."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Scaled(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return super().forward(x) * self.scale

    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"0-dimensional parameters \(`scale`.*torch.tensor\(\[value\]\)"):
        trainer.fit(Scaled())

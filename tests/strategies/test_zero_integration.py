"""The ``lowmem_zero*`` presets through a real ``Trainer.fit`` on the CPU accelerator (gloo), against plain PyTorch.

The first fit of an offload preset builds DeepSpeed's ``cpu_adam`` C++ op (~100 s on 2 cores, once per
machine, cached in ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch

from lightning_lowmem.demo.module import CausalLMModule
from tests.helpers.models import GPT2_TINY, random_batch
from tests.helpers.runif import RunIf

pytestmark = [
    pytest.mark.integration,
    pytest.mark.deepspeed,
    RunIf(deepspeed=True),
    # NOTE: DeepSpeed 0.19 calls torch's deprecated `reduce_scatter_tensor` on every step
    pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.*:FutureWarning"),
]

NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
BATCH, SEQ = 2, 16


class SGDModule(CausalLMModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _samples(n: int) -> list[dict[str, torch.Tensor]]:
    full = random_batch(n, SEQ, seed=1)
    return [{k: v[i] for k, v in full.items()} for i in range(n)]


def _loader(n: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_samples(n), batch_size=BATCH, shuffle=False)


def _trainer(strategy, max_steps: int, accumulate: int = 1, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **kwargs,
    )


class _WeightsAfterEachStep(L.Callback):
    """Full (gathered under ZeRO-3) fp32 weights after every optimizer step."""

    def __init__(self) -> None:
        self.snapshots: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        import deepspeed

        params = list(pl_module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            self.snapshots.append([p.detach().float().clone() for p in params])


def _reference(module: CausalLMModule, steps: int, accumulate: int, clip: float | None = None) -> list[list[torch.Tensor]]:
    """Plain PyTorch: the same micro-batches, loss / accumulate, clip by norm, the module's own optimizer."""
    optimizer = module.configure_optimizers()
    batches = list(_loader(steps * accumulate * BATCH))
    out = []
    for step in range(steps):
        for micro in range(accumulate):
            loss_sum, n = module.loss_sum_and_tokens(batches[step * accumulate + micro])
            (loss_sum / n / accumulate).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        out.append([p.detach().clone() for p in module.parameters()])
    return out


def test_zero2_sgd_accumulation_equals_plain_pytorch_exactly():
    """SGD makes the weights a linear image of the gradients: equal weights mean equal gradients.

    Also the regression test for Lightning's double loss scaling (its loop divides by
    ``accumulate_grad_batches`` and ``engine.backward`` divided again), which ZeroStrategy turns off.
    """
    L.seed_everything(0)
    module = SGDModule(config={**GPT2_TINY, **NO_DROPOUT})
    reference = _reference(copy.deepcopy(module), steps=2, accumulate=2)
    record = _WeightsAfterEachStep()
    _trainer("lowmem_zero2", max_steps=2, accumulate=2, callbacks=[record]).fit(module, _loader(8))
    assert len(record.snapshots) == 2
    for got_step, want_step in zip(record.snapshots, reference):
        for got, want in zip(got_step, want_step):
            assert torch.equal(got, want)


def test_zero2_accumulation_scheduler_equals_plain_pytorch_exactly():
    """AccumulationScheduler sets DeepSpeed's window and weighs each micro-batch once (no k^2, no k x)."""
    from lightning_lowmem import AccumulationScheduler

    L.seed_everything(0)
    module = SGDModule(config={**GPT2_TINY, **NO_DROPOUT})
    reference = _reference(copy.deepcopy(module), steps=2, accumulate=2)
    record = _WeightsAfterEachStep()
    accumulation = AccumulationScheduler(effective_batch_size=2 * BATCH, micro_batch_size=BATCH)
    _trainer("lowmem_zero2", max_steps=2, callbacks=[record, accumulation]).fit(module, _loader(8))
    assert len(record.snapshots) == 2
    for got_step, want_step in zip(record.snapshots, reference):
        for got, want in zip(got_step, want_step):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7)  # one multiply by (weight / micro) = 1.0


def test_zero3_offload_adamw_becomes_cpu_adam_and_matches_plain_adamw(tmp_path, caplog):
    """AdamW -> DeepSpeedCPUAdam (logged), accumulation + clipping from the Trainer, then consolidate -> plain load.

    Tolerance 2e-5 absolute on the weights (lr 1e-3, 3 steps): DeepSpeedCPUAdam's vectorised C++ update rounds
    differently from torch's AdamW (different operation order in fp32), the difference grows by ~1e-6 per step.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    import lightning_lowmem

    L.seed_everything(0)
    module = CausalLMModule(config={**GPT2_TINY, **NO_DROPOUT}, learning_rate=1e-3)
    reference_module = copy.deepcopy(module)
    reference = _reference(reference_module, steps=3, accumulate=2, clip=0.5)
    record = _WeightsAfterEachStep()
    trainer = _trainer("lowmem_zero3_offload", max_steps=3, accumulate=2, gradient_clip_val=0.5, callbacks=[record])
    with caplog.at_level("INFO"):
        trainer.fit(module, _loader(12))

    assert isinstance(trainer.strategy.optimizers[0].optimizer, DeepSpeedCPUAdam)
    assert "replaced by `DeepSpeedCPUAdam(adamw_mode=True)`" in caplog.text
    config = trainer.strategy.config
    assert config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 0.5
    assert config["train_micro_batch_size_per_gpu"] == BATCH
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["pin_memory"] and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["stage3_gather_16bit_weights_on_model_save"] and zero["overlap_comm"] and zero["contiguous_gradients"]
    assert zero["reduce_bucket_size"] == GPT2_TINY["n_embd"] ** 2  # "auto" resolved from the model's hidden size

    assert len(record.snapshots) == 3
    for got_step, want_step in zip(record.snapshots, reference):
        for got, want in zip(got_step, want_step):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)

    # the directory checkpoint -> one plain fp32 state dict, loadable by the bare Hugging Face model
    ckpt_dir = tmp_path / "zero.ckpt"
    trainer.save_checkpoint(ckpt_dir)
    out = tmp_path / "model.pt"
    state = lightning_lowmem.zero.consolidate(ckpt_dir, out, strip_prefix="model.")
    assert all(t.dtype == torch.float32 for t in state.values())
    plain = copy.deepcopy(reference_module.model)
    plain.load_state_dict(torch.load(out), strict=True)
    for got, want in zip(plain.parameters(), record.snapshots[-1]):
        assert torch.equal(got, want)


def test_bad_setups_are_reported_together():
    """fp16 on a CPU without fp16, accumulation contradicting the JSON, and an accumulation-changing callback."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    strategy = ZeroStrategy(stage=2, config={"gradient_accumulation_steps": 4, "gradient_clipping": 2.0})
    module = CausalLMModule(config={**GPT2_TINY, **NO_DROPOUT})
    precision = "16-mixed" if not _cpu_fp16() else "32-true"
    trainer = _trainer(
        strategy,
        max_steps=1,
        accumulate=2,
        precision=precision,
        gradient_clip_val=1.0,
        callbacks=[GradientAccumulationScheduler({0: 2})],
    )
    with pytest.raises(ValueError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader(4))
    message = str(err.value)
    assert "gradient_accumulation_steps=4" in message and "accumulate_grad_batches=2" in message
    assert "GradientAccumulationScheduler" in message
    if precision == "16-mixed":
        assert "bf16-mixed" in message


def test_offload_refuses_sgd_with_what_to_use():
    module = SGDModule(config={**GPT2_TINY, **NO_DROPOUT})
    with pytest.raises(ValueError, match="torch.optim.sgd.SGD.*lowmem_zero2"):
        _trainer("lowmem_zero2_offload", max_steps=1).fit(module, _loader(2))


@pytest.mark.parametrize("preset", ["lowmem_zero2", "lowmem_zero3"])
def test_a_gradient_arriving_twice_in_one_backward_is_refused_with_the_cause(preset):
    """One block applied three times under reentrant checkpointing: DeepSpeed reduces each gradient once per backward
    and asserts (ZeRO-3 with no message); ours names the cause and the fix, DeepSpeed's assertion chained."""
    from tests.conformance.corpus_kinds import SharedReentrantBlock

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"arrived twice in one backward.*use_reentrant=False.*lowmem_offload") as err:
        _trainer(preset, max_steps=1, limit_val_batches=0).fit(SharedReentrantBlock())
    assert isinstance(err.value.__cause__, AssertionError)


def test_bf16_mixed_on_a_parametrization_with_fp32_buffers_is_refused_with_the_cause():
    """Spectral norm's power iteration multiplies the weight (cast to bf16 by DeepSpeed) with its fp32 `_u` buffer:
    DeepSpeed failed at the first forward (`addmv` on mixed dtypes); refused at setup as for running statistics."""
    from tests.conformance.corpus_kinds import ParametrizedBlocks

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"parametrization buffers \(`blocks\.0\.spectral\.parametrizations\.weight`.*"
                                         r"buffer_dtype"):
        _trainer("lowmem_zero2", max_steps=1, precision="bf16-mixed", limit_val_batches=0).fit(ParametrizedBlocks())


class _Cells(torch.utils.data.Dataset):
    """A batch read at once (``dataset[indices]``), as scvi-tools' ``AnnTorchDataset``: counts and a batch index."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x, self.batch = torch.rand(12, 6, generator=gen), torch.randint(0, 2, (12, 1), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, indices):
        return {"x": self.x[indices], "batch": self.batch[indices]}


class _BatchesInItsSampler(torch.utils.data.DataLoader):
    """scvi-tools' ``AnnDataLoader``: batches in its sampler (``batch_size=None``) unless it is given a sampler."""

    def __init__(self, dataset, batch_size=128, sampler=None, **kwargs):
        if sampler is None:
            sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(dataset), batch_size, False)
            batch_size = None
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)


class _OneHotCovariate(L.LightningModule):
    """scvi-tools' ``FCLayers``: the batch index one-hot encoded and concatenated to the input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(6 + 2, 1)
        self.shapes: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        self.shapes.append(tuple(batch["x"].shape))
        x = torch.cat([batch["x"], torch.nn.functional.one_hot(batch["batch"].squeeze(-1), 2).float()], dim=-1)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return _BatchesInItsSampler(_Cells(), batch_size=4)


def test_a_loader_batching_in_its_sampler_is_refused_before_lightning_collates_its_batches():
    """Issue 47 item 4 (scvi-tools under `lowmem_zero2_offload`: `expand` failed in its first step). Lightning's
    distributed sampler rebuilds the loader through its class, which then collates whole batches (shape (1, 4, 6));
    refused before the first step, and the named fix trains as plain Lightning does."""
    def trainer(strategy, **kwargs):
        return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)

    module = _OneHotCovariate()
    with pytest.raises(ValueError, match=r"`_BatchesInItsSampler` that batches in its sampler.*`batch_size=4`.*"
                                         r"use_distributed_sampler=False"):
        trainer("lowmem_zero2").fit(module)
    assert module.shapes == []
    plain, zero = _OneHotCovariate(), _OneHotCovariate()
    trainer("auto").fit(plain)
    trainer("lowmem_zero2", use_distributed_sampler=False).fit(zero)
    assert zero.shapes == plain.shapes == [(4, 6)] * 3
    for got, want in zip(zero.parameters(), plain.parameters()):
        assert torch.equal(got, want)


def _chained_schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A ChainedScheduler around a SequentialLR: every scheduler in it holds the optimizer it was built on."""
    from torch.optim import lr_scheduler as S

    warm_then_decay = S.SequentialLR(opt, [S.LinearLR(opt, 0.25, total_iters=2), S.ExponentialLR(opt, 0.5)], [2])
    return S.ChainedScheduler([warm_then_decay, S.ConstantLR(opt, factor=0.5, total_iters=3)])


class ChainedScheduleModule(CausalLMModule):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": _chained_schedule(opt), "interval": "step"}}


class _LearningRates(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(trainer.strategy.optimizers[0].optimizer.param_groups[0]["lr"])  # what DeepSpeedCPUAdam steps with


def test_offload_swap_keeps_a_chained_schedule():
    """AdamW -> DeepSpeedCPUAdam: every scheduler inside a ChainedScheduler/SequentialLR follows the swap, so the
    CPU optimizer steps with the learning rates the schedule gives a plain AdamW."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    reference_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    reference_sched, want = _chained_schedule(reference_opt), []
    for _ in range(5):
        want.append(reference_opt.param_groups[0]["lr"])
        reference_opt.step()
        reference_sched.step()

    record = _LearningRates()
    trainer = _trainer("lowmem_zero2_offload", max_steps=5, callbacks=[record])
    trainer.fit(ChainedScheduleModule(config={**GPT2_TINY, **NO_DROPOUT}), _loader(10))
    cpu_adam = trainer.strategy.optimizers[0].optimizer
    assert isinstance(cpu_adam, DeepSpeedCPUAdam)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert [s.optimizer for s in (scheduler, *scheduler._schedulers, *scheduler._schedulers[0]._schedulers)] == [cpu_adam] * 5
    assert record.lrs == want


def _cpu_fp16() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def test_our_callbacks_compose_or_say_what_to_use_instead(tmp_path):
    """MemoryReport and AccumulationScheduler (a fixed window) run under a ZeRO preset; ActivationOffload refuses
    DeepSpeed with what to use instead, as ActivationCheckpointing(policy="sqrt") refuses ZeRO-3 (before any
    training); ActivationCheckpointing's other policies compose (tests/callbacks/test_activation_checkpointing_zero.py)."""
    from lightning_lowmem import AccumulationScheduler, ActivationCheckpointing, ActivationOffload, MemoryReport

    L.seed_everything(0)
    module = CausalLMModule(config={**GPT2_TINY, **NO_DROPOUT})
    report = MemoryReport(every_n_steps=1, plot=False, predict=False, save_dir=tmp_path)
    accumulation = AccumulationScheduler(effective_batch_size=2 * BATCH, micro_batch_size=BATCH)
    trainer = _trainer("lowmem_zero2", max_steps=2, callbacks=[report, accumulation])
    trainer.fit(module, _loader(8))
    assert trainer.global_step == 2
    assert trainer.strategy.config["gradient_accumulation_steps"] == 2
    assert len(report.steps) >= 1 and (tmp_path / "memory_report.json").is_file()

    for preset, callback, advice in (("lowmem_zero3", ActivationCheckpointing("sqrt"), "policy='all'"),
                                     ("lowmem_zero2", ActivationOffload(), "lowmem_offload")):  # fmt: skip
        with pytest.raises(ValueError, match=advice):
            _trainer(preset, max_steps=1, callbacks=[callback]).fit(
                CausalLMModule(config={**GPT2_TINY, **NO_DROPOUT}), _loader(2)
            )


class _WarnsItself(L.LightningModule):
    """Plain-tensor regression that logs `val_loss` per epoch and warns once itself (a user's own warning)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.helpers.foreign import LitPlainTensor

        self.inner = LitPlainTensor()

    def training_step(self, batch, batch_idx):
        warnings.warn("the user's own FutureWarning", FutureWarning)
        return (self.inner(batch) - self.inner.target(batch)).square().mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.inner(batch).square().mean())

    def train_dataloader(self):
        return self.inner.train_dataloader()

    def val_dataloader(self):
        return self.inner.val_dataloader()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_deepspeed_deprecations_and_single_process_sync_dist_filtered_only_while_running():
    """ZeRO-3 calls deprecated torch.distributed collectives ~40 times per step, and Lightning asks a single process
    for `sync_dist`; both are filtered (by message and module) while the strategy runs, and nothing else is."""
    before = list(warnings.filters)
    module = _WarnsItself()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer("lowmem_zero3", max_steps=3, limit_val_batches=2, val_check_interval=3).fit(module)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "reduce_scatter_tensor" in m or "all_gather_into_tensor" in m]
    assert not [m for m in messages if "sync_dist=True" in m]
    assert messages.count("the user's own FutureWarning") == 3
    assert warnings.filters == before  # removed at teardown
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn_explicit("`torch.distributed.reduce_scatter_tensor` is deprecated.", FutureWarning,
                               "c10d_logger.py", 83, module="torch.distributed.c10d_logger")
    assert len(caught) == 1  # outside a fit the same message is shown again


_PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def test_zero3_state_dict_after_fit_warns_once_and_names_both_fixes(tmp_path):
    from lightning_lowmem.strategies.zero.after_fit import PARTITIONED_MESSAGE
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    module = _WarnsItself()
    # NOTE: no persistence threshold: ZeRO-3 would otherwise keep this tiny model's parameters whole
    trainer = _trainer(ZeroStrategy(stage=3, config=_PARTITION_ALL), max_steps=2, limit_val_batches=0)
    trainer.fit(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_checkpoint(tmp_path / "last.ckpt")  # DeepSpeed's own state dict: no warning
        assert not [w for w in caught if "partitioned" in str(w.message)]
        first, second = module.state_dict(), module.inner.state_dict()
    assert all(v.numel() == 0 for v in first.values()) and all(v.numel() == 0 for v in second.values())
    ours = [str(w.message) for w in caught if "partitioned" in str(w.message)]
    assert ours == [PARTITIONED_MESSAGE]
    assert "gather_on_fit_end=True" in ours[0] and "lowmem consolidate" in ours[0]


def test_zero3_gather_on_fit_end_gives_the_module_its_fp32_weights(tmp_path):
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy, consolidate

    module = _WarnsItself()
    trainer = _trainer(ZeroStrategy(stage=3, gather_on_fit_end=True, config=_PARTITION_ALL), max_steps=2, limit_val_batches=2,
                       precision="bf16-mixed")
    trainer.fit(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = {k: v.clone() for k, v in module.state_dict().items()}
    assert not [w for w in caught if "partitioned" in str(w.message)]
    trainer.save_checkpoint(tmp_path / "last.ckpt")  # the partitions were kept: DeepSpeed still saves
    consolidate(tmp_path / "last.ckpt", tmp_path / "model.pt")
    masters = torch.load(tmp_path / "model.pt")
    assert masters.keys() == state.keys()
    for key, value in masters.items():
        assert value.dtype == state[key].dtype == torch.float32 and torch.equal(value, state[key]), key
    trainer.validate(module, verbose=False)  # the engine is intact

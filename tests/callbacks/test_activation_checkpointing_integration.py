"""ActivationCheckpointing through ``Trainer.fit``: single device, configure_model, checkpoints, lowmem_offload, DDP."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.activation_checkpointing.hooks import checkpoint_info, checkpointed_modules
from lightning_lowmem.demo.module import CausalLMModule, build_causal_lm
from tests.helpers.models import GPT2_TINY, random_batch, tiny_lm_module

STEPS = 3
DROPOUT = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}


def _loader(steps: int = STEPS) -> DataLoader:
    batches = [random_batch(batch_size=2, seq_len=16, seed=i) for i in range(steps)]
    return DataLoader(batches, batch_size=None)


def _trainer(callbacks=(), **kwargs) -> L.Trainer:
    defaults = {
        "accelerator": "cpu", "devices": 1, "max_steps": STEPS, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
    }  # fmt: skip
    return L.Trainer(callbacks=list(callbacks), **{**defaults, **kwargs})


def _fit(module: L.LightningModule, callbacks=(), **kwargs) -> dict[str, torch.Tensor]:
    L.seed_everything(7, verbose=False)
    _trainer(callbacks, **kwargs).fit(module, _loader())
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _module(model_type: str = "gpt2") -> CausalLMModule:
    L.seed_everything(0, verbose=False)
    return tiny_lm_module(model_type, config=DROPOUT if model_type == "gpt2" else {"attention_dropout": 0.1})


@pytest.mark.parametrize(
    ("model_type", "kwargs"),
    [
        ("gpt2", {"policy": "sqrt"}),
        ("gpt2", {"policy": "budget", "budget": "700KB"}),
        ("llama", {"policy": "selective"}),
        ("llama", {"policy": "every_n", "n": 3}),
    ],
)
def test_fit_matches_fit_without_callback(model_type, kwargs):
    module = _module(model_type)
    reference = _fit(copy.deepcopy(module))
    cb = ActivationCheckpointing(**kwargs)
    weights = _fit(module, [cb])
    assert cb.wrapped, "nothing was checkpointed"
    assert list(weights) == list(reference)
    for name in reference:
        assert torch.equal(reference[name], weights[name]), name
    assert module.model.config.use_cache is True  # turned off while fitting, restored after
    assert "configure_model" not in module.__dict__


def test_budget_measures_and_picks_fewest_blocks():
    module = _module()
    cb = ActivationCheckpointing(policy="budget", budget=10**12)
    _fit(module, [cb])
    assert cb.measured is not None and len(cb.measured["blocks"]) == GPT2_TINY["n_layer"]
    assert all(b > i > 0 for b, i in zip(cb.measured["blocks"], cb.measured["block_inputs"]))
    assert cb.wrapped == []  # everything fits: nothing to recompute


def test_budget_below_minimum_names_the_minimum():
    with pytest.raises(ValueError, match=r"below the minimum possible for this model and batch: \d+ bytes"):
        _fit(_module(), [ActivationCheckpointing(policy="budget", budget=1000)])


class BuiltInConfigureModel(CausalLMModule):
    """The model exists only after ``configure_model`` (the pattern for big models and FSDP2)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.save_hyperparameters({"learning_rate": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.95),
                                   "warmup_steps": 0, "loss_reduction": "mean"})  # fmt: skip
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            L.seed_everything(0, verbose=False)
            self.model = build_causal_lm("gpt2", {**GPT2_TINY, **DROPOUT})


def test_model_built_in_configure_model_and_checkpoint_round_trip(tmp_path):
    reference = _fit(BuiltInConfigureModel())
    module = BuiltInConfigureModel()
    cb = ActivationCheckpointing(policy="all")
    L.seed_everything(7, verbose=False)
    trainer = _trainer([cb])
    trainer.fit(module, _loader())
    assert cb.wrapped == [f"model.transformer.h.{i}" for i in range(GPT2_TINY["n_layer"])]
    assert all(checkpoint_info(b) is None for b in module.model.transformer.h)  # removed at the end of fit
    for name, value in module.state_dict().items():
        assert torch.equal(reference[name], value), name
    # saved with the callback -> loads strictly into a model that never had it ...
    trainer.save_checkpoint(tmp_path / "with.ckpt")
    plain = tiny_lm_module("gpt2", config=DROPOUT)
    plain.load_state_dict(torch.load(tmp_path / "with.ckpt", weights_only=False)["state_dict"], strict=True)
    # ... and a checkpoint written without it resumes under it
    plain_trainer = _trainer(max_steps=1)
    plain_trainer.fit(plain, _loader(1))
    plain_trainer.save_checkpoint(tmp_path / "without.ckpt")
    resumed = BuiltInConfigureModel()
    cb2 = ActivationCheckpointing(policy="sqrt")
    _trainer([cb2], max_steps=2).fit(resumed, _loader(), ckpt_path=tmp_path / "without.ckpt")
    assert cb2.wrapped and resumed.trainer.global_step == 2


def test_fit_with_lowmem_offload_matches_without_callback():
    module = _module()
    reference = _fit(copy.deepcopy(module), strategy="lowmem_offload")
    cb = ActivationCheckpointing(policy="all")
    weights = _fit(module, [cb], strategy="lowmem_offload")
    assert cb.wrapped
    for name in reference:
        assert torch.equal(reference[name], weights[name]), name


class ReportsCheckpointed(CausalLMModule):
    """Logs how many blocks are checkpointed, so a spawned DDP worker can tell the main process."""

    def training_step(self, batch, batch_idx):
        self.log("checkpointed_blocks", float(len(checkpointed_modules(self))), rank_zero_only=True)
        return super().training_step(batch, batch_idx)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_two_processes_matches_ddp_without_callback():
    """2-process gloo DDP with a static graph: bit-identical to the same DDP run without the callback.

    (Not compared with one process: each rank draws its own dropout masks, so DDP's averaged gradient
    differs from a single process's by rounding.)
    """
    from lightning.pytorch.strategies import DDPStrategy

    L.seed_everything(0, verbose=False)
    module = ReportsCheckpointed(config={**GPT2_TINY, **DROPOUT})

    def ddp() -> DDPStrategy:
        return DDPStrategy(start_method="spawn", static_graph=True)

    runs = []
    for callbacks in ([], [ActivationCheckpointing(policy="sqrt")]):
        trained = copy.deepcopy(module)
        L.seed_everything(7, verbose=False)
        trainer = _trainer(callbacks, strategy=ddp(), devices=2, use_distributed_sampler=False)
        trainer.fit(trained, _loader())
        runs.append((trainer.callback_metrics["checkpointed_blocks"].item(), trained.state_dict()))
    (plain_count, reference), (count, weights) = runs
    assert (plain_count, count) == (0, GPT2_TINY["n_layer"])
    changed = module.state_dict()
    assert any(not torch.equal(changed[k], weights[k]) for k in weights), "DDP did not train"
    for name in reference:
        assert torch.equal(reference[name], weights[name]), name


def _kept_for_backward(module: L.LightningModule) -> int:
    """Bytes of the distinct non-parameter storages one `training_step` keeps for backward, seen from outside
    (a checkpointed region keeps only its inputs)."""
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    module.log = module.log_dict = lambda *a, **k: None  # detached from a loop: logging is refused
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            module.training_step(next(iter(module.train_dataloader())), 0)
    finally:
        del module.log, module.log_dict
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize(("name", "chosen"), [("classifier", ["features"]), ("autoencoder", ["encoder", "decoder"])])
def test_module_without_repeated_blocks_gets_measured_blocks_bit_identical(name, chosen):
    """No `nn.ModuleList` anywhere: the largest submodules that free memory are chosen on the first batch."""
    from tests.helpers.foreign import make

    def fit(callbacks):
        module = make(name)
        L.seed_everything(7, verbose=False)
        _trainer(callbacks, limit_val_batches=0).fit(module)
        return module, {k: v.detach().clone() for k, v in module.state_dict().items()}

    plain, reference = fit([])
    cb = ActivationCheckpointing()
    checkpointed, weights = fit([cb])
    assert cb.wrapped == chosen and list(cb.chosen_by_measurement) == chosen
    assert all(v > 0 for v in cb.chosen_by_measurement.values())
    ActivationCheckpointing(policy=cb.wrapped)._apply(checkpointed)  # the same blocks (the fit's end removed them)
    assert _kept_for_backward(checkpointed) < _kept_for_backward(plain)  # classifier: 245 kB -> 32 kB
    for key in reference:
        assert torch.equal(reference[key], weights[key]), key

"""ActivationOffload through ``Trainer.fit``: bit-identical training, logged bytes, strategies, warnings."""

from __future__ import annotations

import copy
import warnings
from collections import namedtuple
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_lowmem.callbacks.activation_offload import callback as ao
from lightning_lowmem.callbacks.activation_offload.callback import METRIC_KEYS, ActivationOffload
from lightning_lowmem.demo.module import CausalLMModule
from tests.helpers.models import random_batch, tiny_lm_module
from tests.helpers.runif import RunIf
from tests.helpers.streams import assert_copies_were_deferred

pytestmark = pytest.mark.integration

SEQ = 16


def _data(n: int, batch_size: int = 2) -> DataLoader:
    batches = [random_batch(batch_size, SEQ, seed=i) for i in range(n)]
    return DataLoader(batches, batch_size=None, shuffle=False)


def _trainer(callbacks: list[Callback], max_steps: int = 3, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=kwargs.pop("devices", 1),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )


class GradRecorder(Callback):
    """Gradients of every optimizer step, as the optimizer is about to see them."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters() if p.grad is not None])


def _fit(module: L.LightningModule, callbacks: list[Callback], n_batches: int, **kwargs: Any) -> GradRecorder:
    recorder = GradRecorder()
    L.seed_everything(7, verbose=False)
    _trainer([*callbacks, recorder], **kwargs).fit(module, _data(n_batches))
    return recorder


def _checkpointing_callbacks() -> list[Callback]:
    from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing

    return [ActivationCheckpointing()]


@pytest.mark.parametrize(
    ("arch", "checkpointing", "boundaries_only", "accumulate"),
    [
        ("gpt2", False, False, 1),
        ("llama", True, True, 2),  # ActivationCheckpointing + boundaries_only, over accumulated micro-batches
    ],
)
def test_fit_bit_identical_to_training_without_offload(arch, checkpointing, boundaries_only, accumulate, transfer_mode):
    torch.manual_seed(0)
    config = {"use_cache": False, **({"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1} if arch == "gpt2" else {})}
    module = tiny_lm_module(arch, config=config, learning_rate=1e-2)
    plain = copy.deepcopy(module)
    extra = _checkpointing_callbacks() if checkpointing else []
    offload = ActivationOffload(min_bytes=1024, prefetch=2, boundaries_only=boundaries_only)
    steps = 3
    got = _fit(module, [*extra, offload], steps * accumulate, max_steps=steps, accumulate_grad_batches=accumulate)
    extra = _checkpointing_callbacks() if checkpointing else []
    want = _fit(plain, extra, steps * accumulate, max_steps=steps, accumulate_grad_batches=accumulate)
    assert len(got.grads) == len(want.grads) == steps
    for step, (g, w) in enumerate(zip(got.grads, want.grads)):
        assert all(torch.equal(a, b) for a, b in zip(g, w)), f"gradients differ at step {step}"
    for (name, p), q in zip(module.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), f"weight {name} differs"
    assert offload.last_step.bytes_offloaded > 0
    assert_copies_were_deferred(transfer_mode)
    if boundaries_only:  # only the block inputs of the step's micro-batches went to the host
        n_layer = module.model.config.num_hidden_layers
        assert offload.last_step.boundary_saves == n_layer * accumulate
        assert offload.last_step.storages_offloaded == n_layer * accumulate


def _census_bytes(module: CausalLMModule, batch: dict[str, torch.Tensor], min_bytes: int) -> int:
    """Bytes of the distinct storages a plain saved-tensor census sees that offload must move."""
    seen: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    skip = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers(), *batch.values()]}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `self.log` outside a Trainer
        module.training_step(batch, 0)
    unique = {
        (t.untyped_storage()._cdata, t._version): t.untyped_storage().nbytes()
        for t in seen
        if t.untyped_storage().data_ptr() not in skip and t.numel() * t.element_size() >= min_bytes
    }
    return sum(unique.values())


class _HookProbe(CausalLMModule):
    """Records whether saved-tensor hooks are installed in each kind of step."""

    probes: dict[str, list[bool]]

    def _probe(self, kind: str) -> None:
        self.__dict__.setdefault("probes", {}).setdefault(kind, []).append(
            torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        )

    def training_step(self, batch, batch_idx):
        self._probe("train")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self._probe("val")
        return super().validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        self._probe("predict")
        return self(batch["input_ids"])

    def val_dataloader(self):
        return _data(1)


def test_logged_bytes_match_census_and_eval_left_alone():
    torch.manual_seed(0)
    module = _HookProbe(model_type="gpt2", config={"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64})
    expected = _census_bytes(copy.deepcopy(module), random_batch(2, SEQ, seed=0), min_bytes=4096)
    offload = ActivationOffload(min_bytes=4096)
    trainer = _trainer([offload], max_steps=1, limit_val_batches=1, val_check_interval=1)
    trainer.fit(module, _data(1))
    metrics = trainer.callback_metrics
    assert set(METRIC_KEYS) <= set(metrics)
    assert int(metrics["activation_offload/bytes_per_step"]) == expected == offload.last_step.bytes_offloaded
    assert int(metrics["activation_offload/host_peak_bytes"]) == offload.memory_breakdown().host["activations"] > 0
    trainer.predict(module, _data(1))
    assert module.probes["train"] == [True]
    assert module.probes["val"] == [False] and module.probes["predict"] == [False]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # nothing left installed


def test_batch_encoding_batch_is_kept_in_place_like_a_dict():
    """A Hugging Face ``BatchEncoding`` batch (a ``UserDict``, not a ``dict``): its tensors are found and kept in place,
    so the step offloads exactly what it offloads for the same batch as a dict. ``min_bytes=0`` puts every saved
    tensor in play, the input ids the embedding saves included; the gradients are those of a fit without offload."""
    from transformers import BatchEncoding

    def fit(wrap, callbacks):
        batches = [wrap(random_batch(2, SEQ, seed=i)) for i in range(2)]
        torch.manual_seed(0)
        module = tiny_lm_module("gpt2", config={"use_cache": False, "n_layer": 1})
        recorder = GradRecorder()
        _trainer([*callbacks, recorder], max_steps=2).fit(module, DataLoader(batches, batch_size=None))
        return recorder.grads

    as_dict, as_encoding = ActivationOffload(min_bytes=0), ActivationOffload(min_bytes=0)
    fit(dict, [as_dict])
    got = fit(BatchEncoding, [as_encoding])
    assert as_encoding.last_step.bytes_offloaded > 0
    assert as_encoding.last_step == as_dict.last_step
    want = fit(BatchEncoding, [])
    assert all(torch.equal(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))


def test_pin_memory_on_cpu_warns_once():
    module = tiny_lm_module(config={"n_layer": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer([ActivationOffload(pin_memory=True)], max_steps=2).fit(module, _data(2))
    pin = [w for w in caught if "pin_memory=True" in str(w.message)]
    assert len(pin) == 1, [str(w.message) for w in pin]
    assert "falling back to pageable" in str(pin[0].message)


def test_host_ram_warning_before_exhaustion(monkeypatch):
    vm = namedtuple("vm", "total available")
    monkeypatch.setattr(ao.psutil, "virtual_memory", lambda: vm(total=100 * 2**30, available=10 * 2**30 + 50_000))
    module = tiny_lm_module(config={"n_layer": 1})
    with pytest.warns(UserWarning, match=r"about to need .* of host RAM") as record:
        _trainer([ActivationOffload(min_bytes=0)], max_steps=2).fit(module, _data(2))
    assert sum("host RAM" in str(w.message) for w in record) == 1


def test_boundaries_only_without_checkpointing_warns():
    module = tiny_lm_module(config={"n_layer": 1})
    offload = ActivationOffload(boundaries_only=True)
    with pytest.warns(UserWarning, match="saw no checkpointed block inputs"):
        _trainer([offload], max_steps=1).fit(module, _data(1))
    assert offload.last_step.bytes_offloaded == 0


@pytest.mark.parametrize("strategy_name", ["deepspeed", "lowmem_zero2"])
@pytest.mark.deepspeed
@RunIf(deepspeed=True)
def test_deepspeed_strategy_refused_with_reason(strategy_name):
    import lightning_lowmem  # noqa: F401  (registers lowmem_* names)

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy_name, logger=False)
    with pytest.raises(ValueError, match=r"ActivationOffload cannot run under this strategy: .*DeepSpeed.*cpu_checkpointing"):
        ActivationOffload().setup(trainer, tiny_lm_module(config={"n_layer": 1}), "fit")


def test_works_under_lowmem_offload():
    import lightning_lowmem  # noqa: F401

    torch.manual_seed(0)
    module = tiny_lm_module(config={"n_layer": 2}, learning_rate=1e-2)
    plain = copy.deepcopy(module)
    offload = ActivationOffload(min_bytes=1024)
    got = _fit(module, [offload], 2, max_steps=2, strategy="lowmem_offload")
    want = _fit(plain, [], 2, max_steps=2, strategy="lowmem_offload")
    for g, w in zip(got.grads, want.grads):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
    for p, q in zip(module.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    assert offload.last_step.bytes_offloaded > 0


class _AssertOffloaded(Callback):
    """Fails the fit (in whichever process runs it) unless the offload callback moved bytes this step."""

    def __init__(self, offload: ActivationOffload) -> None:
        self.offload = offload

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        stats = self.offload.engine.stats
        if not (stats.bytes_offloaded > 0 and stats.bytes_restored == stats.bytes_offloaded):
            raise AssertionError(f"rank {trainer.global_rank}: nothing offloaded and restored: {stats}")


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_two_processes_bit_identical():
    torch.manual_seed(0)
    module = tiny_lm_module(config={"n_layer": 2}, learning_rate=1e-2)
    plain, initial = copy.deepcopy(module), copy.deepcopy(module)
    kwargs = {"max_steps": 2, "devices": 2, "strategy": "ddp_spawn"}
    offload = ActivationOffload(min_bytes=1024)
    _fit(module, [offload, _AssertOffloaded(offload)], 4, **kwargs)
    _fit(plain, [], 4, **kwargs)
    for (name, p), q in zip(module.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), f"weight {name} differs after DDP training"
    # the trained weights came back from the rank processes (a run that trained nothing would also be "equal")
    assert not all(torch.equal(p, q) for p, q in zip(module.parameters(), initial.parameters()))

"""``lowmem_offload_params``: the blocks' compute weights streamed from the host, numerics equal to ``lowmem_offload``.

Every numerics test runs twice (``transfer_mode``): on the plain CPU copies and on the CUDA transfer logic with
copies deferred (``DeferredOps``), where a weight read before its fetch landed is NaN.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.demo.module import CausalLMModule
from lightning_lowmem.measure.tracker import MemoryTracker
from lightning_lowmem.strategies.offload.param_stream import ParamStream
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy
from lightning_lowmem.strategies.offload.stream_plan import plan_resident
from tests.helpers.models import random_batch
from tests.helpers.runif import RunIf

GPT2 = {"n_layer": 3, "n_embd": 32, "n_head": 2, "n_positions": 16, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0}
LLAMA = {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 16}


def _module(kind: str = "gpt2", seed: int = 0) -> CausalLMModule:
    torch.manual_seed(seed)
    return CausalLMModule(model_type=kind, config=GPT2 if kind == "gpt2" else LLAMA, learning_rate=1e-2)


def _data(n: int = 4) -> DataLoader:
    return DataLoader([random_batch(2, 16, seed=i) for i in range(n)], batch_size=None)


class Watch(Callback):
    """Keeps the strategy's stream and counts its fetches (the stream is gone after teardown)."""

    def __init__(self) -> None:
        self.stream: ParamStream | None = None
        self.fetches = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stream = trainer.strategy._stream

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fetches = self.stream.fetches if self.stream is not None else 0


def _fit(module: L.LightningModule, strategy: Any, *, steps: int = 3, callbacks: list[Any] = (), ckpt_path: Any = None,
         **kwargs: Any):
    kwargs.setdefault("precision", "bf16-true")
    watch = Watch()
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[*callbacks, watch], limit_val_batches=0, num_sanity_val_steps=0, **kwargs)
    trainer.fit(module, _data(kwargs.get("accumulate_grad_batches", 1) * steps + 1), ckpt_path=ckpt_path)
    return trainer, watch


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, value in pa.items():
        assert torch.equal(value, pb[name]), f"{name} differs"


def _compare(kind: str, transfer_mode: Any, make_callbacks: Any = list, stream_kwargs: Any = None, **kwargs: Any):
    mode, built = transfer_mode
    reference = _module(kind)
    streamed = copy.deepcopy(reference)
    _fit(reference, OffloadStrategy(**(stream_kwargs or {}) | {"offload_params": False}), callbacks=make_callbacks(),
         **kwargs)
    _, watch = _fit(streamed, OffloadStrategy(**(stream_kwargs or {}) | {"offload_params": True}),
                    callbacks=make_callbacks(), **kwargs)
    _assert_same_weights(streamed, reference)
    assert watch.fetches >= 3 * 3  # 3 blocks fetched in each of 3 forwards (backward refetches all but the tail)
    if mode == "deferred":
        assert sum(o.copies_queued for o in built) > 0
    return watch


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_stream_weights_equal_offload(kind, checkpointing, transfer_mode):
    """GPT-2 (tied embeddings) and LLaMA, alone and with every block checkpointed: bit-identical weights."""
    _compare(kind, transfer_mode, lambda: [ActivationCheckpointing("all")] if checkpointing else [])


def test_stream_accumulation_clipping_activation_offload(transfer_mode):
    _compare("gpt2", transfer_mode, lambda: [ActivationCheckpointing("all"), ActivationOffload(boundaries_only=True)],
             accumulate_grad_batches=2, gradient_clip_val=0.05)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_stream_prefetch_and_optimizer_in_backward(prefetch, transfer_mode):
    _compare("llama", transfer_mode, stream_kwargs={"prefetch": prefetch, "optimizer_in_backward": True})


@pytest.mark.bnb
@RunIf(bitsandbytes=True)
def test_stream_fp16_loss_scaling_and_low_bit_optimizer():
    from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer

    _compare("gpt2", ("immediate", []), precision="16-true")
    _compare("gpt2", ("immediate", []), lambda: [LowBitOptimizer(min_8bit_size=256)])


@pytest.mark.parametrize("strategy", ["lowmem_offload_params"])
def test_stream_resume_3_plus_3_equals_6(tmp_path, strategy):
    """6 steps straight (saving at step 3) == resuming that checkpoint for 3 more (and the same as `lowmem_offload`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(**kwargs: Any) -> L.Trainer:
        return L.Trainer(accelerator="cpu", strategy=strategy, precision="bf16-true", max_steps=6, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, **kwargs)

    straight = _module("gpt2")
    resumed = _module("gpt2", seed=1)  # a different start: everything must come from the checkpoint
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    trainer(callbacks=[saver]).fit(straight, _data(3))
    trainer(enable_checkpointing=False).fit(resumed, _data(3), ckpt_path=str(tmp_path / "step=3.ckpt"))
    _assert_same_weights(resumed, straight)


class WeightProbe(TorchDispatchMode):
    """At every aten op: bytes of the module's parameter storages that are not one-element placeholders."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module, self.most = module, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen, total = set(), 0
        for p in self.module.parameters():
            st = p.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
        self.most = max(self.most, total)
        return out


class Measure(Callback):
    """Device-role bytes (MemoryTracker) and parameter bytes (probe) over the second training step."""

    def __init__(self) -> None:
        self.tracker: MemoryTracker | None = None
        self.probe: WeightProbe | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.tracker = MemoryTracker(module=pl_module)
            self.tracker.track(batch)
            self.probe = WeightProbe(pl_module)
            self.tracker.__enter__()
            self.probe.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.probe.__exit__(None, None, None)
            self.tracker.__exit__(None, None, None)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_stream_device_weights_bounded_at_every_instant(prefetch):
    """Parameter bytes <= non-block weights + (prefetch+1) blocks at every op; the tracked device peak drops by the rest."""
    layers = 4
    config = {**GPT2, "n_layer": layers}
    torch.manual_seed(0)
    reference = CausalLMModule(config=config, learning_rate=1e-2)
    streamed = copy.deepcopy(reference)
    resident, streaming = Measure(), Measure()
    _fit(reference, OffloadStrategy(), callbacks=[resident, ActivationCheckpointing("all")], steps=2)
    _fit(streamed, OffloadStrategy(offload_params=True, prefetch=prefetch),
         callbacks=[streaming, ActivationCheckpointing("all")], steps=2)
    block = sum(p.numel() * 2 for p in reference.model.transformer.h[0].parameters())
    blocks = layers * block
    everything = sum(p.numel() * 2 for p in reference.parameters())
    assert resident.probe.most == everything
    # NOTE: + 2 B per dtype for the shared one-element placeholders of the released weights
    assert everything - blocks + (prefetch + 1) * block <= streaming.probe.most <= everything - blocks + (prefetch + 1) * block + 8
    saved = resident.tracker.peak_bytes - streaming.tracker.peak_bytes
    assert saved >= (layers - prefetch - 1) * block - block // 4, (saved, block)


def test_stream_auto_budget_keeps_0_some_all_blocks_resident(caplog):
    module = _module("llama")
    sizes = [sum(p.numel() * 2 for p in module.model.model.layers[i].parameters()) for i in range(3)]
    other = sum(p.numel() * 2 for p in module.parameters()) - sum(sizes)
    # prefetch=0: one streamed block on the device at a time
    for budget, want in [(other + sizes[0] + 1, 0), (other + 2 * sizes[0] + 1, 1), (other + sum(sizes), 3)]:
        reference = _module("llama")
        streamed = copy.deepcopy(reference)
        _fit(reference, "lowmem_offload", steps=2)
        with caplog.at_level("INFO", logger="lightning_lowmem.strategies.offload.strategy"):
            trainer, watch = _fit(streamed, OffloadStrategy(offload_params="auto", prefetch=0, device_budget=budget),
                                  steps=2)
        assert trainer.strategy.resident_blocks == want
        assert f"{want} of 3 blocks resident" in caplog.text
        assert (watch.fetches > 0) == (want < 3)
        _assert_same_weights(streamed, reference)
    assert plan_resident([10, 10, 10], 5, 5 + 30, 1) == 3
    with pytest.raises(ValueError, match="at least 25 bytes"):
        plan_resident([10, 10, 10], 5, 24, 1)
    # on CUDA one released block may still be read by the GPU while the next is fetched ([bounded streaming])
    with pytest.raises(ValueError, match=r"at least 35 bytes.*3 block\(s\).*prefetch \+ 1 \+ 1 released"):
        plan_resident([10, 10, 10, 10], 5, 34, 1, released=1)


def test_stream_memory_breakdown_and_validate():
    module = _module("gpt2")
    _fit(module, "lowmem_offload_params", steps=1)
    block_numel = sum(p.numel() for p in module.model.transformer.h.parameters())
    strategy = OffloadStrategy(offload_params=True)
    need = strategy.host_bytes_needed(module, [], with_grads=False)
    assert need["streamed_weights"] == 0  # every block weight is trained: its fetch rounds its master (no host copy)
    module.model.transformer.h.requires_grad_(False)
    need = strategy.host_bytes_needed(module, [], with_grads=False)
    assert need["streamed_weights"] == 4 * block_numel  # frozen: no master, a host copy (32-true on a bare strategy)
    module.requires_grad_(True)
    validator = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(offload_params=True), precision="bf16-true",
                          logger=False, enable_progress_bar=False, enable_model_summary=False)
    module.validation_step = lambda batch, *args: module.training_step(batch, 0)
    validator.validate(module, _data(2))


def test_stream_breakdown_during_fit():
    seen = {}

    class Grab(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen["bd"] = trainer.strategy.memory_breakdown()
            seen["per_param"] = trainer.strategy.host_bytes_per_param()

    module = _module("gpt2")
    _fit(module, "lowmem_offload_params", steps=1, callbacks=[Grab()])
    block_numel = sum(p.numel() for p in module.model.transformer.h.parameters())
    every = sum(p.numel() for p in module.parameters())
    assert seen["bd"].host["weights"] == 0  # no host copy of a trained streamed weight: fetched from its master
    assert 4 + 4 + 8 <= seen["per_param"]["total"] <= 4 + 4 + 8 + 0.01  # masters, grads, AdamW state
    assert seen["bd"].device["weights"] <= 2 * (every - block_numel) + 8


@torch.no_grad()
def test_stream_ring_slot_rewritten_only_after_the_copy_that_read_it_landed():
    """[derived uploads] a trained streamed weight has no host copy: each fetch rounds its master into a ring slot
    (``prefetch + 2`` of them). With copies that land only when waited for (``DeferredOps("lazy")``) and more fetches
    queued than slots, every block still arrives with its own master's values."""
    from lightning_lowmem.core.streams import DeferredOps, cpu_stand_in

    module = _module("llama").to(torch.bfloat16)
    with cpu_stand_in(lambda: DeferredOps("lazy")):
        stream = ParamStream(module, [True, True, True], prefetch=0, device=torch.device("cpu"))
    masters = {id(p): torch.randn(p.shape) for ps in stream.params for p in ps}
    stream.detach_weights(masters)
    assert len(stream._ring) == 2 and not stream._buckets  # two slots, and no host copy
    for b in range(3):
        stream._fetch(b)  # NOTE: the third reuses the first block's slot while its copy is still queued
    for b in range(3):
        stream._ready(b)
        for p in stream.params[b]:
            assert torch.equal(p.data, masters[id(p)].bfloat16()), f"block {b}"


def test_stream_bad_input_reported_at_once():
    with pytest.raises(ValueError) as err:
        OffloadStrategy(offload_params="yes", prefetch=-1, device_budget="lots")  # type: ignore[arg-type]
    text = str(err.value)
    assert "`offload_params='yes'`" in text and "`prefetch=-1`" in text and "`device_budget='lots'`" in text

    class Flat(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

        def training_step(self, batch, i):
            return self.b(self.a(batch)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", strategy="lowmem_offload_params", precision="bf16-true", max_steps=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"has none: no parameter would stream, all 4 \(`a.weight`.*offload_params='auto'"):
        trainer.fit(Flat(), DataLoader(torch.randn(4, 4), batch_size=2))
    trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(offload_params="auto"), max_steps=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="needs `device_budget`"):
        trainer.fit(_module("gpt2"), _data(2))


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_stream_on_cuda_equals_resident(prefetch):
    """The CUDA path (CudaOps: pinned host copies, side stream, events): weights equal to resident lowmem_offload."""
    reference = _module("llama")
    streamed = copy.deepcopy(reference)
    kwargs = {"accelerator": "cuda", "devices": 1}
    for module, strategy in ((reference, OffloadStrategy()), (streamed, OffloadStrategy(offload_params=True, prefetch=prefetch))):
        L.Trainer(strategy=strategy, precision="bf16-true", max_steps=3, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[ActivationCheckpointing("all")],
                  **kwargs).fit(module, _data(4))
    _assert_same_weights(streamed, reference)


# --- load_weights: a save_pretrained directory, tensor by tensor into the masters ---------------------------------


@pytest.mark.parametrize(("kind", "build"), [("gpt2", "meta"), ("llama", "empty_init")])
def test_load_weights_shard_by_shard_equals_from_pretrained(tmp_path, kind, build):
    """A module built without weights + `load_weights` trains exactly like one built by `from_pretrained`."""
    source = _module(kind, seed=7)
    source.model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2  # sharded
    config = GPT2 if kind == "gpt2" else LLAMA
    reference = CausalLMModule(model_type=kind, pretrained_path=str(tmp_path), learning_rate=1e-2)
    _fit(reference, "lowmem_offload", steps=2)
    strategy = OffloadStrategy(offload_params=True, load_weights=tmp_path)
    if build == "meta":
        with torch.device("meta"):
            module = CausalLMModule(model_type=kind, config=config, learning_rate=1e-2)
    else:
        trainer = L.Trainer(accelerator="cpu", strategy=OffloadStrategy(), logger=False)
        with trainer.init_module(empty_init=True):
            module = CausalLMModule(model_type=kind, config=config, learning_rate=1e-2)
    trainer, _ = _fit(module, strategy, steps=2)
    assert strategy.load_report is not None and strategy.load_report["files"] > 2
    _assert_same_weights(module, reference)


def test_load_weights_bad_input(tmp_path):
    with pytest.raises(ValueError, match="expected a local directory holding a Hugging Face"):
        OffloadStrategy(load_weights=tmp_path / "nowhere")
    with torch.device("meta"):
        module = _module("llama")
    with pytest.raises(ValueError, match=r"buffers on the meta device \(`model.model.rotary_emb.inv_freq`"):
        _fit(module, OffloadStrategy(), steps=1)

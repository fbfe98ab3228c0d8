"""A QLoRA base (bitsandbytes ``Params4bit``, packed 4-bit) streamed block by block by ``lowmem_offload_params``.

Before, the packed weights were not streamed (parameter streaming moved floating-point weights only): the whole
4-bit base stayed on the device. Now each block's packed bytes and their absmax per 64 values live on the host and
visit the device with their block. On the CPU (bitsandbytes 0.50's CPU kernels) a streamed run is
bit-identical to the resident one: adapters, the packed base, every buffer, and the checkpoint's state.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_lowmem import Adapters
from lightning_lowmem.strategies.offload import OffloadStrategy
from lightning_lowmem.strategies.offload.packed_weights import is_streamable_packed
from tests.callbacks.test_adapters import LORA, fit, state
from tests.callbacks.test_adapters_quantized import TrainableOnly
from tests.helpers.runif import RunIf

pytestmark = [pytest.mark.integration, RunIf(peft=True, bitsandbytes=True)]


class Watch(Callback):
    """The packed weights the stream holds, how many fetches it made, and the checkpoint's state at the end."""

    def on_train_batch_end(self, trainer, *args):
        stream = trainer.strategy._stream
        if stream is not None:
            self.packed = sum(is_streamable_packed(p) for ps in stream.params for p in ps)
            self.fetches = stream.fetches
            packed = [p for ps in stream.params for p in ps if is_streamable_packed(p)]
            self.placeholders = bool(packed) and all(p.data.stride() == (0,) * p.dim() for p in packed)
            absmax = [p.quant_state.absmax for p in packed]  # NOTE: the per-block quantization state streams too
            self.absmax_released = all(a.stride() == (0,) * a.dim() for a in absmax)

    def on_train_end(self, trainer, pl_module):
        self.checkpoint = {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}


@pytest.mark.parametrize("quant", ["nf4"])
def test_packed_4bit_base_is_streamed_and_trains_as_the_resident_run(quant):
    qlora = {**LORA, "quantize_base": quant}
    resident, streamed = TrainableOnly(None), TrainableOnly(None)
    want_watch, got_watch = Watch(), Watch()
    fit(resident, [Adapters("lora", **qlora), want_watch], OffloadStrategy(host_optimizer="as_is"))
    fit(streamed, [Adapters("lora", **qlora), got_watch], OffloadStrategy(host_optimizer="as_is", offload_params=True))
    # NOTE: failed before: the packed weights were not streamed (the stream held floating-point weights only)
    assert got_watch.packed == 14  # 2 layers x 7 linears
    assert got_watch.fetches > 0 and got_watch.placeholders  # between steps the packed weights are released
    assert got_watch.absmax_released  # and their absmax per 64 values
    assert all(type(m.weight.quant_state.absmax) is torch.Tensor for m in streamed.modules()
               if hasattr(getattr(m, "weight", None), "quant_state"))  # given back a plain tensor after the fit
    want, got = state(resident), state(streamed)
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []  # the packed base came back too
    assert got_watch.checkpoint.keys() == want_watch.checkpoint.keys()
    assert [k for k in want_watch.checkpoint
            if not torch.equal(got_watch.checkpoint[k], want_watch.checkpoint[k])] == []


def test_int8_base_stays_resident():
    """``Linear8bitLt`` keeps its own reference to the int8 matrix (``state.CB``): swapping ``p.data`` would free
    nothing and leave it stale, so 8-bit weights are not streamed (the floating-point block weights still are)."""
    module = TrainableOnly(None)
    watch = Watch()
    fit(module, [Adapters("lora", **{**LORA, "quantize_base": "int8"}), watch],
        OffloadStrategy(host_optimizer="as_is", offload_params=True))
    assert watch.packed == 0 and watch.fetches > 0


class FetchedAtBackward(Callback):
    """At the first backward and after it: the storages of packed weight copies made in the step that are still
    alive and are not the parameters' current data (copies another object holds)."""

    @staticmethod
    def _storages(stream) -> set[int]:
        import gc

        sizes = {p.numel() * p.element_size() for ps in stream.params for p in ps if is_streamable_packed(p)}
        found = set()
        for t in gc.get_objects():
            # NOTE: `type()`, not `isinstance()`: the latter asks a dead weak proxy (another test's) for its class;
            # and a tensor without storage (another test's fake or sparse one) is skipped
            if not issubclass(type(t), torch.Tensor) or t.dtype != torch.uint8:
                continue
            try:
                storage = t.untyped_storage()
                if storage.nbytes() in sizes:
                    found.add(storage.data_ptr())
            except (RuntimeError, NotImplementedError):
                continue
        return found

    def on_train_batch_start(self, trainer, *args):
        self.before = self._storages(trainer.strategy._stream)  # the host copies, and whatever earlier tests left

    def _held(self, stream) -> set[int]:
        current = {p.untyped_storage().data_ptr() for ps in stream.params for p in ps}
        return self._storages(stream) - self.before - current

    def on_before_backward(self, trainer, pl_module, loss):
        self.held = self._held(trainer.strategy._stream)

    def on_before_optimizer_step(self, trainer, *args):
        self.held_after = self._held(trainer.strategy._stream)
        trainer.should_stop = True


def test_the_step_keeps_no_fetched_packed_block_alive():
    """bitsandbytes' ``MatMul4Bit`` keeps its packed weight as an attribute of its autograd context, out of reach of
    the stream's saved-tensor hooks: every block's fetched copy stayed alive until backward (the whole base on the
    device). While streaming, the weight is kept through ``save_for_backward``: the stream re-fetches it."""
    watch = FetchedAtBackward()
    module = TrainableOnly(None, layers=4)
    fit(module, [Adapters("lora", **{**LORA, "quantize_base": "nf4"}), watch],
        OffloadStrategy(host_optimizer="as_is", offload_params=True, prefetch=0), steps=1)
    # NOTE: failed before: 4 layers x 7 linears' fetched copies were held by the graph (28 storages)
    assert watch.held == set()
    assert watch.held_after == set()  # the backward's copies are not kept by the graph's contexts either

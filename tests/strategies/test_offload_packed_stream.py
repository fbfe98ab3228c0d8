"""A QLoRA base (bitsandbytes ``Params4bit``, packed 4-bit) streamed block by block by ``lowmem_offload_params``.

Before, the packed weights were not streamed (parameter streaming moved floating-point weights only): the whole
4-bit base stayed on the device. Now each block's packed bytes live on the host and visit the device with their
block; the quantization state stays with the layer. On the CPU (bitsandbytes 0.50's CPU kernels) a streamed run is
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

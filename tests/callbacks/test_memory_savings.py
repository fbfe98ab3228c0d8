"""The memory each technique claims to save, measured by the project's own recorder through ``Trainer.fit``.

One tiny GPT-2, one batch shape, two steps; the second (steady-state) step of each run is compared with the
same run without the technique. Every margin is computed from the model's sizes (parameter counts, the
hidden-state size of one token batch), not hard-coded. Activation checkpointing's and ``lowmem_offload``'s
savings are asserted in ``tests/callbacks/test_activation_checkpointing.py`` and
``tests/callbacks/test_memory_report_integration.py``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer
from lightning_lowmem.callbacks.optimizer_in_backward import OptimizerInBackward
from lightning_lowmem.core.accounting import MemoryBreakdown
from lightning_lowmem.measure.recorder import StepMemoryRecorder
from tests.helpers.models import random_batch, tiny_lm_module
from tests.helpers.runif import RunIf

pytestmark = pytest.mark.integration

CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 16}
BATCH, SEQ = 1, 16
F32 = 4


class BoundaryRecorder(StepMemoryRecorder):
    """The recorder, plus the live bytes by role at the forward/backward boundary of each sampled step."""

    def __init__(self) -> None:
        super().__init__(every_n_steps=1)
        self.boundary: list[MemoryBreakdown] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.tracker is not None:
            self.boundary.append(self.tracker.breakdown())
        super().on_before_backward(trainer, pl_module, loss)


def _fit(callbacks: list) -> tuple[dict[str, Any], MemoryBreakdown, torch.nn.Module]:
    """The steady-state step's record, its boundary breakdown, and the module."""
    torch.manual_seed(0)
    module = tiny_lm_module(config=CONFIG)
    recorder = BoundaryRecorder()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, max_steps=2, callbacks=[*callbacks, recorder])
    trainer.fit(module, DataLoader([random_batch(BATCH, SEQ, seed=i) for i in range(2)], batch_size=None))
    assert [s["step"] for s in recorder.steps] == [0, 1]
    return recorder.steps[1], recorder.boundary[1], module


@pytest.fixture(scope="module")
def plain() -> tuple[dict[str, Any], MemoryBreakdown, torch.nn.Module]:
    return _fit([])


def _device(record: dict[str, Any], phase: str, category: str = "total") -> int:
    return record["phases"][phase]["device"][category]


def test_optimizer_in_backward_frees_the_gradients(plain):
    """Plain Lightning keeps every gradient from the end of backward to the next step's ``zero_grad`` (through the
    next forward); fused into backward, at most one parameter's gradient is alive at a phase's peak."""
    base, _, module = plain
    fused, _, _ = _fit([OptimizerInBackward()])
    params = [p for p in module.parameters() if p.requires_grad]
    all_grads = F32 * sum(p.numel() for p in params)
    largest = F32 * max(p.numel() for p in params)
    for phase in ("forward", "backward", "optimizer"):
        assert _device(base, phase, "gradients") == all_grads, phase
        assert _device(fused, phase, "gradients") <= largest, phase
    # the forward and optimizer peaks drop by the gradients (all but the largest at most); so does the step's
    assert _device(fused, "forward") <= _device(base, "forward") - (all_grads - largest)
    assert _device(fused, "optimizer") <= _device(base, "optimizer") - all_grads
    assert fused["peak_bytes"] < base["peak_bytes"]


def test_activation_offload_moves_the_saved_activations_to_the_host(plain):
    """At the forward/backward boundary, the saved activations are host copies; less than one hidden state (one
    layer's output for the batch) stays on the device."""
    base, base_boundary, _ = plain
    offload = ActivationOffload(min_bytes=0)
    moved, boundary, _ = _fit([offload])
    hidden_state = F32 * BATCH * SEQ * CONFIG["n_embd"]
    activations = base_boundary.device["activations"]
    assert activations > 2 * CONFIG["n_layer"] * hidden_state  # there is something to move: several per block
    assert base_boundary.host["activations"] == 0
    assert boundary.device["activations"] < hidden_state
    assert boundary.host["activations"] >= activations - hidden_state  # moved, not dropped
    assert boundary.host["activations"] == offload.last_step.host_bytes_peak
    assert _device(moved, "forward", "activations") < hidden_state
    assert moved["peak_bytes"] < base["peak_bytes"]
    assert moved["peak_bytes_host"] >= activations - hidden_state


@pytest.mark.bnb
@RunIf(bitsandbytes=True)
def test_low_bit_optimizer_state_is_a_quarter_of_adamw(plain):
    """AdamW keeps two fp32 moments (8 B/param); 8-bit AdamW two uint8 moments (2 B/param), an fp32 absmax per 256
    values per moment, and 32-bit moments for tensors under ``min_8bit_size``. bitsandbytes runs on CPU here."""
    base, _, module = plain
    callback = LowBitOptimizer()
    low, _, _ = _fit([callback])
    sizes = [p.numel() for p in module.parameters() if p.requires_grad]
    n = sum(sizes)
    assert 8 * n <= _device(base, "optimizer", "optimizer_state") <= 8 * n + 8 * len(sizes)  # + a step per tensor
    eight_bit = sum(2 * s + 2 * F32 * math.ceil(s / 256) for s in sizes if s >= callback.min_8bit_size)
    thirty_two = sum(8 * s for s in sizes if s < callback.min_8bit_size)
    qmaps = 2 * 256 * F32  # the two quantization maps, shared by every tensor
    assert eight_bit > 10 * thirty_two  # this model's state is mostly 8-bit: the comparison below is about 1/4
    state = _device(low, "optimizer", "optimizer_state")
    assert 2 * n <= state <= eight_bit + thirty_two + qmaps + 8 * len(sizes)
    assert state < 0.3 * _device(base, "optimizer", "optimizer_state")
    for phase in ("forward", "backward", "optimizer"):  # the state lives through the whole step
        assert _device(low, phase, "optimizer_state") == state
    assert low["peak_bytes"] <= base["peak_bytes"] - (8 * n - state)

"""A module that changes a saved tensor in place fails under every saved-tensor hook technique, as in plain PyTorch.

Autograd checks at backward that a tensor saved for it was not changed in place since (its version counter),
and skips that check for tensors packed by ``saved_tensors_hooks``. ``ActivationOffload``, the checkpointing of
``ActivationCheckpointing`` (``torch.utils.checkpoint``, non-reentrant, and the ``"sqrt"`` segments) and parameter
streaming all pack saved tensors, so a module with this bug trained silently on other values. Each case: plain
Lightning raises, and so does the technique (through ``Trainer.fit``); a module whose in-place operations are
legal (an in-place ReLU, an in-place product, on tensors nobody saved) trains bit-identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import lightning_lowmem  # noqa: F401  (registers the strategy names)
from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.activation_offload.callback import ActivationOffload
from tests.helpers.activation_modules import _Fixed, assert_same_state, fit_state

pytestmark = pytest.mark.integration

ERROR = "modified by an inplace operation"


class _Block(nn.Module):
    def __init__(self, bug: str) -> None:
        super().__init__()
        self.lin1, self.lin2, self.bug = nn.Linear(16, 16), nn.Linear(16, 16), bug

    def forward(self, x: Tensor) -> Tensor:
        if self.bug == "weight-before-use":
            with torch.no_grad():
                self.lin1.weight.clamp_(-0.1, 0.1)  # legal in plain PyTorch: nothing saved it yet
        a = self.lin1(x).sigmoid()  # sigmoid saves its output `a`
        out = self.lin2(a)  # the linear saves `a` and its weight
        if self.bug == "inside":
            a.mul_(2)  # the bug: `a` changed after it was saved
        elif self.bug == "weight-after-use":
            with torch.no_grad():
                self.lin2.weight.mul_(0.5)
        return out + a if self.bug != "output" else a


class LitBlocks(_Fixed):
    """Three repeated blocks and a head; ``bug`` says where a saved tensor is changed in place (if anywhere)."""

    def __init__(self, bug: str) -> None:
        super().__init__()
        self.bug = bug
        self.blocks = nn.ModuleList(_Block(bug) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def _tensors(self) -> tuple[Tensor, ...]:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(32, 16, generator=g)
        return x, x.sin().sum(-1, keepdim=True)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        for block in self.blocks:
            x = block(x)
        if self.bug == "output":
            x.add_(1)  # the last block's sigmoid output, saved inside the (checkpointed) block
        return F.mse_loss(self.head(x), y)


# NOTE: `policy="budget"` and the explicit policies wrap blocks as "all" and "every_n" do (the same wrapper)
TECHNIQUES = {
    "offload": lambda: {"callbacks": [ActivationOffload(min_bytes=0)]},
    "offload-kept": lambda: {"callbacks": [ActivationOffload(min_bytes=1 << 30)]},  # nothing moved, all kept
    "checkpoint-all": lambda: {"callbacks": [ActivationCheckpointing()]},
    "checkpoint-selective": lambda: {"callbacks": [ActivationCheckpointing(policy="selective")]},
    "checkpoint-sqrt": lambda: {"callbacks": [ActivationCheckpointing(policy="sqrt")]},
    "checkpoint+offload": lambda: {
        "callbacks": [ActivationCheckpointing(), ActivationOffload(boundaries_only=True, min_bytes=0)]
    },
    "param-streaming": lambda: {"strategy": "lowmem_offload_params"},
}


def _fit(bug: str, technique: str | None = None):
    kwargs = TECHNIQUES[technique]() if technique else {}
    return fit_state(lambda: LitBlocks(bug), kwargs.pop("callbacks", []), steps=2, precision="32-true", **kwargs)


@pytest.mark.parametrize("bug", ["inside", "output"])
def test_plain_lightning_refuses_the_module(bug):
    with pytest.raises(RuntimeError, match=ERROR):
        _fit(bug)


@pytest.mark.parametrize("technique", list(TECHNIQUES))
@pytest.mark.parametrize("bug", ["inside", "output"])
def test_every_technique_refuses_it_too(bug, technique):
    """Inside a block (between its save and the block's end), or after the block (its output, saved inside)."""
    with pytest.raises(RuntimeError, match=ERROR) as err:
        _fit(bug, technique)
    assert "saved for the backward of" in str(err.value)  # the op whose backward needed it
    assert "Fix the module" in str(err.value)


class _LegalBlock(nn.Module):
    """In-place operations plain PyTorch accepts: a ReLU on a product (not saved), a product on a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        # NOTE: on `lin1(x) * 2`, not on `lin1(x)`: selective checkpointing keeps matmul outputs, and torch refuses
        # an in-place change of a tensor it keeps ("Tensor cached during selective activation checkpoint")
        h = F.relu(self.lin1(x) * 2, inplace=True)  # a product by a number saves nothing
        s = self.lin2(h) + x
        s.mul_(0.5)  # nothing saved `s`
        return torch.tanh(s)


class LitLegal(LitBlocks):
    def __init__(self) -> None:
        super().__init__("none")
        self.blocks = nn.ModuleList(_LegalBlock() for _ in range(3))


@pytest.mark.parametrize("technique", list(TECHNIQUES))
def test_legal_in_place_operations_train_as_plain_lightning(technique):
    kwargs = TECHNIQUES[technique]()
    callbacks = kwargs.pop("callbacks", [])
    reference = {"strategy": "lowmem_offload"} if "strategy" in kwargs else {}  # streaming is lowmem_offload's
    want, _ = fit_state(LitLegal, [], steps=2, precision="32-true", **reference)
    got, _ = fit_state(LitLegal, callbacks, steps=2, precision="32-true", **kwargs)
    assert_same_state(got, want)


@pytest.mark.parametrize("bug", ["weight-after-use", "weight-before-use"])
def test_param_streaming_refuses_a_forward_that_changes_its_weights(bug):
    """After its use (plain raises at backward), or before it (plain keeps the change; streaming would lose it:
    the block's next fetch comes from the host copy)."""
    if bug == "weight-after-use":
        with pytest.raises(RuntimeError, match=ERROR):
            _fit(bug)
    else:
        _fit(bug)  # plain trains, with the clamped weights
    with pytest.raises(RuntimeError, match=r"block `blocks\.0` changed its weight `lin\d\.weight` in place"):
        _fit(bug, "param-streaming")

"""ActivationCheckpointing leaves every module buffer as plain training leaves it, and recomputes on the right ones.

A checkpointed block runs its forward again in backward: a ``BatchNorm`` there would update its running statistics
and ``num_batches_tracked`` twice, and a block that reads a buffer it updates would recompute something else. The
measuring probe (models without repeated blocks, ``policy="budget"``) runs one more forward, which must leave no
trace either. Each case fits 3 steps and compares every weight and buffer with plain Lightning by ``torch.equal``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing, choose_for_budget
from lightning_lowmem.callbacks.activation_checkpointing.hooks import BlockCheckpoint, CheckpointInfo
from tests.helpers.activation_modules import LitCalibrated, LitConvBN, assert_same_state, fit_state

pytestmark = pytest.mark.integration

MODULES = {
    "conv2d-bn": functools.partial(LitConvBN, 2),
    "conv1d-bn": functools.partial(LitConvBN, 1),
    "conv2d-bn-cumulative": functools.partial(LitConvBN, 2, momentum=None),  # reads num_batches_tracked
    "own-buffers": LitCalibrated,  # its forward reads the buffers it updates
}
POLICIES = {
    "all": {},
    "every_n": {"policy": "every_n", "n": 2},
    "sqrt": {"policy": "sqrt"},
    "selective": {"policy": "selective"},
    "explicit": {"policy": ["_ConvBNBlock", "_Calibrated"]},
}


@functools.cache
def _plain(name: str):
    return fit_state(MODULES[name])[0]


def _fit(name: str, **kwargs):
    callback = ActivationCheckpointing(**kwargs)
    state, _ = fit_state(MODULES[name], [callback])
    return state, callback


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ["conv2d-bn", "own-buffers"])
def test_every_policy_leaves_buffers_as_plain_training(name, policy):
    got, callback = _fit(name, **POLICIES[policy])
    assert callback.wrapped
    assert_same_state(got, _plain(name))


@pytest.mark.parametrize("name", ["conv1d-bn", "conv2d-bn-cumulative"])
@pytest.mark.parametrize("policy", ["all", "sqrt"])
def test_batchnorm_kinds(name, policy):
    got, _ = _fit(name, **POLICIES[policy])
    assert_same_state(got, _plain(name))
    assert all(int(v) == 3 for k, v in got.items() if k.endswith("num_batches_tracked"))


@pytest.mark.parametrize("name", ["conv2d-bn", "own-buffers"])
def test_budget_probe_and_the_blocks_it_chooses(name):
    """A budget everything fits (the probe runs, nothing is wrapped), then the smallest budget (all wrapped)."""
    got, callback = _fit(name, policy="budget", budget=10**12)
    assert callback.measured and callback.wrapped == []
    assert_same_state(got, _plain(name))
    m = callback.measured
    minimum = choose_for_budget(m["outside"], m["blocks"], m["block_inputs"], 10**12)[1]
    got, callback = _fit(name, policy="budget", budget=minimum)
    assert len(callback.wrapped) == len(m["blocks"])
    assert_same_state(got, _plain(name))


NO_BLOCKS = {
    "conv1d-bn-no-blocks": functools.partial(LitConvBN, 1, 0),
    "own-buffers-no-blocks": functools.partial(LitCalibrated, False),
}


@pytest.mark.parametrize("policy", ["all", "sqrt"])
@pytest.mark.parametrize("name", list(NO_BLOCKS))
def test_models_without_repeated_blocks_measured_on_the_first_batch(name, policy):
    """No repeated blocks: the probe measures which submodules to wrap, then they train as plain Lightning."""
    want, _ = fit_state(NO_BLOCKS[name])
    callback = ActivationCheckpointing(**POLICIES[policy])
    got, _ = fit_state(NO_BLOCKS[name], [callback])
    assert callback.chosen_by_measurement
    assert_same_state(got, want)


def test_recompute_runs_on_the_buffers_forward_found_every_backward():
    """Two backward passes through one graph (``retain_graph``): each recompute starts from the same buffers."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ref = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ref.load_state_dict(block.state_dict())
    assert BlockCheckpoint(CheckpointInfo("block", 0, 0, is_boundary=True)).attach(block)
    x = torch.randn(8, 4)
    loss, loss_ref = block(x).square().sum(), ref(x).square().sum()
    for _ in range(2):
        loss.backward(retain_graph=True)
        loss_ref.backward(retain_graph=True)
    assert_same_state(block.state_dict(), ref.state_dict())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(block.parameters(), ref.parameters()))
    assert int(block[1].num_batches_tracked) == 1

"""ActivationCheckpointing under the DeepSpeed ZeRO presets (CPU accelerator, gloo): the same training as without it.

Non-reentrant ``torch.utils.checkpoint`` inside each block's module call composes with ZeRO-3's parameter fetching
(the hooks gather a module's parameters around its forward, again around the recompute's submodule calls, and
before the block's backward): weights and buffers after 3 steps are ``torch.equal`` to the same preset without
checkpointing. ``policy="sqrt"`` replays blocks without their module hooks and is refused under stage 3.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from tests.helpers.activation_modules import LitCalibrated, LitConvBN, assert_same_state, fit_state
from tests.helpers.runif import RunIf

pytestmark = [
    pytest.mark.integration,
    pytest.mark.deepspeed,
    RunIf(deepspeed=True),
    pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.*:FutureWarning"),
]


def _strategy(preset: str):
    from lightning_lowmem.strategies.zero.strategy import ZeroStrategy

    stage = 3 if "zero3" in preset else 2
    # NOTE: stage 3 leaves the parameters partitioned after fit; gathered back so the state dicts compare
    return ZeroStrategy(stage=stage, offload_optimizer="offload" in preset, offload_parameters=preset.endswith("3_offload"),
                        gather_on_fit_end=stage == 3)  # fmt: skip


def _fit(factory, preset: str, callbacks=()):
    return fit_state(factory, callbacks, strategy=_strategy(preset), use_distributed_sampler=False)


@pytest.mark.parametrize(
    ("preset", "name", "policy"),
    [
        ("lowmem_zero2", "conv-bn", "all"),
        ("lowmem_zero2", "own-buffers", "sqrt"),
        ("lowmem_zero3", "conv-bn", "all"),
        ("lowmem_zero3", "own-buffers", "selective"),
        ("lowmem_zero2_offload", "conv-bn", "every_n"),
        ("lowmem_zero3_offload", "own-buffers", "all"),
    ],
)
def test_zero_presets_with_checkpointing_train_as_without(preset, name, policy):
    factory = {"conv-bn": LitConvBN, "own-buffers": LitCalibrated}[name]
    want, _ = _fit(factory, preset)
    callback = ActivationCheckpointing(**({"policy": "every_n", "n": 2} if policy == "every_n" else {"policy": policy}))
    got, trainer = _fit(factory, preset, [callback])
    assert callback.wrapped
    assert trainer.strategy.config["zero_optimization"]["stage"] == (3 if "zero3" in preset else 2)
    assert_same_state(got, want)


def test_zero3_measures_the_blocks_of_a_model_without_repeated_ones_as_one_device_does():
    """The probe counts a gathered weight saved for backward as a parameter, not an activation: the same choice."""
    factory = functools.partial(LitConvBN, 2, 0)
    single = ActivationCheckpointing()
    fit_state(factory, [single], steps=1)
    want, _ = _fit(factory, "lowmem_zero3")
    callback = ActivationCheckpointing()
    got, _ = _fit(factory, "lowmem_zero3", [callback])
    assert callback.chosen_by_measurement == single.chosen_by_measurement and callback.wrapped
    assert_same_state(got, want)


def test_sqrt_is_refused_under_zero3_before_the_first_step():
    with pytest.raises(ValueError, match=r"policy='sqrt'.*ZeRO stage 3.*policy='all'"):
        _fit(LitCalibrated, "lowmem_zero3", [ActivationCheckpointing(policy="sqrt")])


def test_hugging_face_blocks_under_zero3():
    """A GPT-2 (Hugging Face blocks) under ZeRO-3: bit-identical with every block checkpointed."""
    from lightning_lowmem.demo.module import CausalLMModule
    from tests.helpers.models import GPT2_TINY, random_batch

    class _GPT2(CausalLMModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader([random_batch(2, 16, seed=i) for i in range(3)], batch_size=None)

    factory = functools.partial(_GPT2, config={**GPT2_TINY, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    want, _ = _fit(factory, "lowmem_zero3")
    callback = ActivationCheckpointing()
    got, _ = _fit(factory, "lowmem_zero3", [callback])
    assert len(callback.wrapped) == GPT2_TINY["n_layer"]
    assert_same_state(got, want)


@pytest.mark.parametrize("base", ["zero2_offload", "zero3_offload"])
def test_planner_zero_candidates_carry_checkpointing_and_the_dry_run_counts_it(base):
    """The planner's ZeRO candidates with checkpointing trace (no refusal), and keep fewer activations than without."""
    from lightning_lowmem import estimate_memory
    from lightning_lowmem.plan.recipes import Recipe, candidates

    assert {r.checkpointing for r in candidates(2) if r.base == base} == {None, "every_n", "all"}
    tiny = {"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 258}
    plain, ckpt = (estimate_memory(tiny, 2, 64, target="cpu", **Recipe(base, 2, c).flags(2)) for c in (None, "all"))  # type: ignore[arg-type]
    assert ckpt.method == plain.method == "dry_run+zero_closed_form"
    assert "ActivationCheckpointing" in " ".join(ckpt.run["callbacks"])
    kept_plain, kept_ckpt = (max(bd.device["activations"] for bd in e.phases.values()) for e in (plain, ckpt))
    assert 0 < kept_ckpt < kept_plain / 2, (kept_ckpt, kept_plain)
    assert ckpt.peak_device < plain.peak_device

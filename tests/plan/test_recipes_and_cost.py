"""The planner's candidates, their order of savings, the cost model and the hardware profiles (no tracing)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_lowmem.plan.cost import ModelShape, step_cost
from lightning_lowmem.plan.hardware import PROFILES, load_profile
from lightning_lowmem.plan.recipes import Recipe, candidates, micro_batches

XL = ModelShape(num_params=1_557_611_200, num_blocks=48, hidden=1600, seq_len=1024, vocab=50257)
CARD = PROFILES["rtx3060-12gb"]


def test_micro_batches_halve_while_they_divide():
    assert micro_batches(8) == [8, 4, 2, 1]
    assert micro_batches(6) == [6, 3, 1]
    assert micro_batches(1) == [1]


def test_candidates_leave_out_pairs_the_real_run_refuses():
    recipes = candidates(4)
    assert all(r.conflict(4) is None for r in recipes)
    assert not any(r.base == "offload_obw" and r.micro_batch_size != 4 for r in recipes)
    assert not any(r.base == "zero3_offload" and r.chunked_loss for r in recipes)
    assert not any(r.base.startswith("zero") and r.activation_offload for r in recipes)
    # checkpointing composes with ZeRO (per-block policies): the ZeRO candidates carry it too
    assert {r.checkpointing for r in recipes if r.base.startswith("zero")} == {None, "every_n", "all"}
    assert not any(r.base == "half" for r in recipes)
    assert any(r.base == "half" for r in candidates(4, pure_half=True))
    # a technique the user fixed is never added by the plan
    assert not any(r.checkpointing for r in candidates(4, checkpointing=False))
    assert {r.micro_batch_size for r in candidates(4, micro=False)} == {4}


def test_the_optimizer_is_changed_only_where_allowed():
    """Issue 48: 8-bit AdamW trains with other maths than the module's AdamW; like a lean optimizer, it is a candidate
    only where the user lists it (``optimizers``), and never on DeepSpeed (its engine builds its own optimizer); with
    the step in backward it steps each master (issue 45: tests/strategies/test_offload_low_bit.py)."""
    assert {r.optimizer for r in candidates(4)} == {None}
    allowed = candidates(4, optimizers=(None, "adamw8bit"))
    eight_bit = [r for r in allowed if r.optimizer == "adamw8bit"]
    assert eight_bit and not any(r.base.startswith("zero") for r in eight_bit)
    lean = Recipe("offload_params_obw", 4, "all", optimizer="adamw8bit")
    assert lean in eight_bit and lean.name() == "lowmem_offload_params + opt-in-bwd + 8-bit AdamW + ckpt(all), micro 4"
    run = lean.run(4)
    assert (run.strategy.offload_params, run.strategy.optimizer_in_backward) == (True, True)
    assert [type(c).__name__ for c in run.callbacks] == ["ActivationCheckpointing", "LowBitOptimizer"]
    assert Recipe("offload", 4, optimizer="adamw8bit").name() == "lowmem_offload + 8-bit AdamW, micro 4"
    assert Recipe("offload", 4, optimizer="adamw8bit").training_name == "full fine-tune with 8-bit AdamW"


def test_saves_at_least_is_the_order_of_techniques():
    plain = Recipe("offload", 4)
    more = Recipe("offload", 2, "all", activation_offload=True)
    assert more.saves_at_least(plain) and not plain.saves_at_least(more)
    assert not Recipe("offload", 1, "all").saves_at_least(Recipe("offload", 4, None, activation_offload=True))
    assert not Recipe("fp32", 1, "all").saves_at_least(Recipe("offload", 4))  # across bases: no order


def test_recipe_becomes_the_run_the_trainer_gets():
    run = Recipe("offload", 2, "all", chunked_loss=True, optimizer="adamw8bit").run(batch_size=8)
    names = [type(c).__name__ for c in run.callbacks]
    assert run.precision == "bf16-true" and type(run.strategy).__name__ == "OffloadStrategy"
    assert names == ["AccumulationScheduler", "ActivationCheckpointing", "ChunkedLMLoss", "LowBitOptimizer"]
    sched = run.callbacks[0]
    assert (sched.effective_batch_size, sched.micro_batch_size) == (8, 2)
    assert Recipe("mixed", 8).run(8, half="16").precision == "16-mixed"
    assert Recipe("zero3_offload", 8).run(8).strategy == "lowmem_zero3_offload"


def test_cost_counts_recompute_transfers_and_the_host_step():
    base = step_cost(Recipe("offload", 4), XL, 4, CARD)
    ckpt = step_cost(Recipe("offload", 4, "all"), XL, 4, CARD)
    half_ckpt = step_cost(Recipe("offload", 4, "every_n"), XL, 4, CARD)
    # recomputing every block's forward: a third more FLOPs for the blocks (2 of the 6 N T)
    assert ckpt.flops / base.flops == pytest.approx(4 / 3, rel=0.05)
    assert base.flops < half_ckpt.flops < ckpt.flops
    assert base.link_bytes == pytest.approx(2 * 2 * XL.num_params)  # bf16 weights in, bf16 gradients out
    micro = step_cost(Recipe("offload", 1), XL, 4, CARD)
    assert micro.link_bytes == pytest.approx(5 * 2 * XL.num_params)  # gradients leave once per micro-batch
    assert step_cost(Recipe("offload", 4, "all", activation_offload=True), XL, 4, CARD).link_s > ckpt.link_s
    assert step_cost(Recipe("offload", 4, optimizer="adamw8bit"), XL, 4, CARD).host_optimizer_s < base.host_optimizer_s
    # the optimizer in backward hides the host step behind backward
    assert step_cost(Recipe("offload_obw", 4), XL, 4, CARD).total_s < base.total_s
    # resident fp32 states: no host step, no link
    resident = step_cost(Recipe("mixed", 4), XL, 4, CARD)
    assert resident.link_bytes == 0 and resident.host_optimizer_s == 0 and resident.total_s < base.total_s
    # fp32 compute runs at the fp32 rate
    assert step_cost(Recipe("fp32", 4), XL, 4, CARD).compute_s > 1.9 * resident.compute_s


def test_zero3_fetches_weights_in_forward_and_backward():
    z2 = step_cost(Recipe("zero2_offload", 4), XL, 4, CARD)
    z3 = step_cost(Recipe("zero3_offload", 4), XL, 4, CARD)
    assert z3.link_bytes == pytest.approx(3 * 2 * XL.num_params) and z3.link_bytes > z2.link_bytes
    # a recomputed forward gathers the blocks' weights once more; ZeRO-2 keeps its weights on the device
    block_params = XL.num_params - XL.vocab * XL.hidden
    z3_ckpt = step_cost(Recipe("zero3_offload", 4, "all"), XL, 4, CARD)
    assert z3_ckpt.link_bytes - z3.link_bytes == pytest.approx(2 * block_params)
    assert step_cost(Recipe("zero2_offload", 4, "all"), XL, 4, CARD).link_bytes == z2.link_bytes


def test_profiles_load_by_name_dict_and_yaml(tmp_path):
    assert load_profile("rtx2060-6gb").bf16 is False
    slow = load_profile({"base": "rtx3060-12gb", "link_gbps": 12})
    assert slow.link_gbps == 12 and slow.fp32_tflops == CARD.fp32_tflops
    path = tmp_path / "card.yaml"
    path.write_text("base: a100-80gb\nefficiency: 0.3\n")
    assert load_profile(str(path)) == dataclasses.replace(PROFILES["a100-80gb"], efficiency=0.3)
    with pytest.raises(ValueError, match=r"Passed `hardware='rtx9090'`; expected a shipped profile"):
        load_profile("rtx9090")
    with pytest.raises(ValueError, match=r"link_gb"):
        load_profile({"base": "rtx3060-12gb", "link_gb": 12})
    for profile in PROFILES.values():
        assert profile.source and profile.half_tflops >= profile.fp32_tflops


def test_streaming_fetches_block_weights_per_pass():
    resident = step_cost(Recipe("offload", 4), XL, 4, CARD)
    streamed = step_cost(Recipe("offload_params", 4), XL, 4, CARD)
    recomputed = step_cost(Recipe("offload_params", 4, "all"), XL, 4, CARD)
    blocks = XL.num_params - XL.vocab * XL.hidden
    # every block fetched in forward and in backward (2 x 2 B) instead of copied once after the step (2 B)
    assert streamed.link_bytes - resident.link_bytes == pytest.approx(2 * 2 * blocks - 2 * blocks)
    assert recomputed.link_bytes - streamed.link_bytes == pytest.approx(2 * blocks)
    run = Recipe("offload_params", 4, "all").run(4)
    assert run.strategy.offload_params is True and run.precision == "bf16-true"


def test_measuring_the_host_leaves_the_global_generator_as_it_was():
    """`lowmem_auto` measures a CPU before `configure_model` and the first batch: a draw from the global generator
    there gave a module built in `configure_model` other initial weights than plain Lightning's (found by the sweep)."""
    import torch

    from lightning_lowmem.plan.hardware import measure_host

    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    measure_host(seconds=0.01)
    assert torch.equal(torch.rand(3), want)

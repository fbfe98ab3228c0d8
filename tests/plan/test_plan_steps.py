"""The named steps of ``plan``: argument checks, candidates, floors, the search and who refused, each on its own."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.callbacks.activation_checkpointing.callback import ActivationCheckpointing
from lightning_lowmem.callbacks.low_bit_optimizer import LowBitOptimizer
from lightning_lowmem.plan.search import Budgets, Judge, candidate_rows, floors, refusing_technique, search
from lightning_lowmem.predict.run_spec import RunSpec

SHAPE = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2}


def _budgets(device: str = "12GB") -> Budgets:
    return Budgets.of(SHAPE, 2, 32, None, device, None, "rtx3060-12gb", "cuda")


def test_budgets_name_every_problem_at_once():
    with pytest.raises(ValueError) as info:
        Budgets.of(SHAPE, 0, 32, None, "twelve", None, "no-such-gpu", "tpu")
    message = str(info.value)
    for part in ("batch_size=0", "twelve", "no-such-gpu", "target='tpu'"):
        assert part in message


def test_budgets_take_the_profiles_memory_and_half():
    budgets = Budgets.of(SHAPE, 2, 32, None, None, "64GB", "rtx3060-12gb", "cuda")
    assert budgets.device == budgets.profile.memory_bytes and budgets.host == 64 * 10**9
    assert budgets.half == ("bf16" if budgets.profile.bf16 else "16")


def test_candidate_rows_are_fastest_first_and_leave_out_what_the_user_fixed():
    budgets = _budgets()
    rows = candidate_rows(budgets.source, budgets.profile, budgets.half, frozenset(), pure_half=False, bases=None)
    assert [r.cost.total_s for r in rows] == sorted(r.cost.total_s for r in rows)
    assert any(r.recipe.checkpointing for r in rows)
    fixed = candidate_rows(budgets.source, budgets.profile, budgets.half, frozenset({"checkpointing"}),
                           pure_half=False, bases=None)
    assert fixed and not any(r.recipe.checkpointing for r in fixed)


def test_floors_are_not_beaten_by_any_candidate():
    budgets = _budgets()
    rows = candidate_rows(budgets.source, budgets.profile, budgets.half, frozenset(), pure_half=False, bases=None)
    found = floors(rows)
    assert {r.recipe.base for r in found} == {r.recipe.base for r in rows}
    for floor in found:
        assert not any(o is not floor and o.recipe.saves_at_least(floor.recipe)
                       and not floor.recipe.saves_at_least(o.recipe) for o in rows)


def test_search_picks_the_fastest_that_fits_and_traces_only_its_base():
    budgets = _budgets()
    rows = candidate_rows(budgets.source, budgets.profile, budgets.half, frozenset(), pure_half=False,
                          bases=("fp32", "offload"))
    judge = Judge(budgets.source, budgets, (), frozenset(), None, "cuda", {})
    chosen = search(rows, floors(rows), judge)
    assert chosen is rows[0] and chosen.status == "fits"  # a tiny model fits 12 GB as it is
    assert judge.traces == len({id(f) for f in floors(rows) if f.recipe.base == chosen.recipe.base} | {id(chosen)})
    assert all(r.status == "not traced" for r in rows if r.recipe.base != chosen.recipe.base)


def test_search_returns_none_when_nothing_fits():
    budgets = _budgets("1KB")
    rows = candidate_rows(budgets.source, budgets.profile, budgets.half, frozenset(), pure_half=False, bases=("fp32",))
    judge = Judge(budgets.source, budgets, (), frozenset(), None, "cuda", {})
    assert search(rows, floors(rows), judge) is None
    assert all(r.status in ("too big", "refused") for r in rows)


def test_refusing_technique_is_the_callback_whose_code_raised():
    ckpt, low_bit = ActivationCheckpointing(policy="all"), LowBitOptimizer()
    run = RunSpec(callbacks=[ckpt, low_bit])
    try:
        low_bit.check_convertible(torch.optim.SGD([torch.zeros(1, requires_grad=True)]))
    except ValueError as err:
        assert refusing_technique(err, run) is low_bit
    else:
        pytest.fail("LowBitOptimizer converted SGD")
    assert refusing_technique(ValueError("the module's own"), run) is None
    assert refusing_technique(ValueError("no run"), None) is None

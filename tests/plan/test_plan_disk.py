"""The planner and the disk tier (issue 45 item 5): the disk bases are candidates only with a directory, ranked after
the bases in RAM, so chosen only where the host budget refuses those; a disk budget is checked; a refusal for the host
budget without a directory says what the disk tier would need."""

from __future__ import annotations

import pytest

from lightning_lowmem.cli import main
from lightning_lowmem.core.units import fmt_size
from lightning_lowmem.plan.cost import ModelShape, step_cost
from lightning_lowmem.plan.hardware import PROFILES
from lightning_lowmem.plan.recipes import DISK, IN_BACKWARD, Recipe, candidates
from lightning_lowmem.plan.search import NoRecipeFitsError, plan
from lightning_lowmem.plan.source import Source

SHAPE = {"model_type": "gpt2", "n_layer": 8, "n_embd": 64, "n_head": 2, "vocab_size": 256}  # NOTE: no parameter is most of the model
BATCH, SEQ = 2, 32
#: the offload bases (in RAM and on disk): fp32 and bf16-mixed keep no host state, so the host budget cannot refuse them
RAM = ("offload", "offload_obw", "offload_params", "offload_params_obw")
XL = ModelShape(num_params=1_557_611_200, num_blocks=48, hidden=1600, seq_len=1024, vocab=50257)
CACHE: dict = {}  # dry runs shared by the tests of this file


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    """Predicted host peaks of the leanest recipes in RAM and on disk, and the disk tier's bytes (plain recipes: the
    techniques only add host bytes, ActivationOffload's copies)."""
    disk_dir = str(tmp_path_factory.mktemp("tier"))
    source = Source.of(SHAPE, BATCH, SEQ, None, [])

    def estimate(base):
        return source.estimate(Recipe(base, BATCH, disk=disk_dir if base in DISK else None).run(BATCH), "cuda")

    ram = min(estimate(b).peak_host for b in RAM)
    disk = [estimate(b) for b in DISK]
    return disk_dir, ram, max(e.peak_host for e in disk), max(e.peak_disk for e in disk)


def _plan(host, disk_dir=None, disk_budget=None):
    return plan(SHAPE, BATCH, SEQ, device_memory="12GB", host_memory=host, hardware="rtx3060-12gb", cache=CACHE,
                bases=RAM + (DISK if disk_dir else ()), disk_dir=disk_dir, disk_budget=disk_budget)


def test_the_disk_bases_come_only_with_a_directory_and_step_in_backward(tmp_path):
    assert not any(r.base in DISK for r in candidates(4))
    recipes = [r for r in candidates(4, disk_dir=str(tmp_path)) if r.base in DISK]
    assert {r.base for r in recipes} == set(DISK) and all(r.disk == str(tmp_path) for r in recipes)
    assert set(DISK) <= set(IN_BACKWARD) and all(r.micro_batch_size == 4 for r in recipes)  # no accumulation
    run = Recipe("offload_params_disk", 4, "all", disk=str(tmp_path)).run(4)
    assert (run.strategy.disk, run.strategy.offload_params, run.strategy.optimizer_in_backward) == (
        str(tmp_path), True, True)
    assert Recipe("offload_disk", 4, disk="/x").name() == "lowmem_offload_disk, micro 4"
    with pytest.raises(ValueError, match=r"\['offload_disk'\] need a directory for the disk tier: pass `disk_dir`"):
        candidates(4, bases=["offload", "offload_disk"])


def test_the_disk_tier_pays_its_reads_and_writes_and_ranks_after_the_ram_bases(tmp_path):
    card = PROFILES["rtx3060-12gb"]
    for ram, disk in (("offload_obw", "offload_disk"), ("offload_params_obw", "offload_params_disk")):
        for optimizer, state in ((None, 8), ("adamw8bit", 2)):
            in_ram = step_cost(Recipe(ram, 4, optimizer=optimizer), XL, 4, card)
            on_disk = step_cost(Recipe(disk, 4, optimizer=optimizer, disk="/x"), XL, 4, card)
            assert on_disk.total_s > in_ram.total_s and on_disk.link_bytes == in_ram.link_bytes
            if disk == "offload_disk":  # master and state read and written, the master read again for the upload
                assert on_disk.disk_bytes == pytest.approx(XL.num_params * (2 * (4 + state) + 4))
    # a faster disk costs less
    fast = step_cost(Recipe("offload_disk", 4, disk="/x"), XL, 4, card.override(disk_gbps=30))
    assert fast.total_s < step_cost(Recipe("offload_disk", 4, disk="/x"), XL, 4, card).total_s
    # the planner ranks every disk candidate after every candidate in RAM
    from lightning_lowmem.plan.search import Budgets, candidate_rows

    budgets = Budgets.of(SHAPE, BATCH, SEQ, None, "12GB", None, "rtx3060-12gb", "cuda", disk_dir=str(tmp_path))
    rows = candidate_rows(budgets.source, budgets.profile, budgets.half, frozenset(), pure_half=False, bases=None,
                          disk_dir=budgets.disk_dir)
    on_disk = [r.recipe.base in DISK for r in rows]
    assert any(on_disk) and on_disk == sorted(on_disk)


def test_a_host_budget_too_small_for_ram_chooses_the_disk_tier_within_its_budget(figures):
    disk_dir, ram, disk_host, disk_bytes = figures
    assert disk_host < ram
    host = (disk_host + ram) // 2
    p = _plan(host, disk_dir, disk_budget=2 * disk_bytes)
    chosen = p.chosen
    assert chosen.recipe.base in DISK and chosen.peak_host <= host and 0 < chosen.peak_disk <= 2 * disk_bytes
    assert p.run.strategy.disk == disk_dir
    assert all(r.status != "fits" for r in p.rows if r.recipe.base not in DISK)  # nothing in RAM fits the host
    assert f"disk {fmt_size(chosen.peak_disk)} of {fmt_size(2 * disk_bytes)} in {disk_dir}" in p.summary()
    assert "disk" in p.table().splitlines()[0].split()
    assert {"recipe": chosen.name, "peak_disk": chosen.peak_disk}.items() <= next(
        row for row in p.to_dict()["rows"] if row["recipe"] == chosen.name).items()


def test_without_a_directory_the_refusal_says_what_the_disk_tier_needs(figures):
    _, ram, disk_host, disk_bytes = figures
    with pytest.raises(NoRecipeFitsError) as err:
        _plan((disk_host + ram) // 2)
    text = str(err.value)
    assert "It would fit with" in text and "`--disk-dir DIR` (Python: `disk_dir=`)" in text
    assert "keeps the fp32 masters and optimizer state in files on a local disk: lowmem_offload" in text
    assert f", disk {fmt_size(disk_bytes)}; give it a directory" in text


def test_a_disk_budget_too_small_refuses_naming_the_disk_figure(figures):
    disk_dir, ram, disk_host, disk_bytes = figures
    with pytest.raises(NoRecipeFitsError) as err:
        _plan((disk_host + ram) // 2, disk_dir, disk_budget=disk_bytes // 2)
    text = str(err.value)
    assert f"a disk budget of {fmt_size(disk_bytes // 2)}" in text
    assert f"with {fmt_size(disk_bytes)} of disk" in text


def test_lowmem_plan_disk_flags_are_checked_together(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "gpt2", "--batch-size", "2", "--seq-len", "32", "--device-memory", "12GB",
              "--host-budget", "lots", "--disk-budget", "2TB", "--hardware", "rtx3060-12gb"])
    assert exit_.value.code == 2
    text = capsys.readouterr().err
    assert "`--host-budget` 'lots' that does not parse" in text and "`--disk-budget 2TB` without `--disk-dir`" in text
    with pytest.raises(SystemExit):
        main(["plan", "--model", "gpt2", "--batch-size", "2", "--seq-len", "32", "--device-memory", "12GB",
              "--host-memory", "1GB", "--host-budget", "2GB", "--disk-dir", str(tmp_path / "missing")])
    text = capsys.readouterr().err
    assert "they are the same budget" in text
    assert f"`--disk-dir {tmp_path / 'missing'}`, which is not a directory" in text


@pytest.mark.slow
def test_lowmem_plan_takes_the_host_budget_and_the_disk_tier(figures, capsys):
    disk_dir, ram, disk_host, _ = figures
    source = Source.of(SHAPE, BATCH, SEQ, None, [])
    # a device budget under bf16-mixed's least peak (fp32 and bf16-mixed keep no host state: they would fit the host)
    mixed = source.estimate(Recipe("mixed", 1, "all", True, True).run(BATCH), "cuda").peak_device
    floor = source.estimate(Recipe("offload_disk", BATCH, "all", True, True, disk=disk_dir).run(BATCH), "cuda")
    assert floor.peak_device < mixed
    shape = [arg for k, v in SHAPE.items() if k != "model_type" for arg in ("--set", f"{k}={v}")]
    assert main(["plan", "--model", "gpt2", *shape, "--batch-size", str(BATCH), "--seq-len", str(SEQ),
                 "--device-memory", str((floor.peak_device + mixed) // 2), "--host-budget", str((disk_host + ram) // 2),
                 "--disk-dir", disk_dir, "--disk-budget", "2TB", "--hardware", "rtx3060-12gb"]) == 0
    chosen = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("chosen: "))
    assert chosen.startswith(("chosen: lowmem_offload_disk", "chosen: lowmem_offload_params + disk tier"))
    assert f" of {fmt_size(2 * 10**12)} in {disk_dir};" in chosen


def test_lowmem_auto_takes_a_disk_directory_and_budget(tmp_path):
    from lightning_lowmem.plan.auto import AutoStrategy

    auto = AutoStrategy(device_budget="1GB", disk_dir=str(tmp_path), disk_budget="2TB")
    assert (auto.disk_dir, auto.disk_budget) == (str(tmp_path), "2TB")
    with pytest.raises(ValueError) as err:
        AutoStrategy(disk_budget="2TB", host_budget="lots")
    assert "`disk_budget='2TB'` without `disk_dir`" in str(err.value) and "'lots'" in str(err.value)
    with pytest.raises(TypeError, match=r"Passed `disk_dir=3`; expected a directory"):
        AutoStrategy(disk_dir=3)


def test_the_disk_shorthand_builds_the_disk_tier_and_refuses_without_the_step_in_backward(figures):
    from lightning_lowmem import estimate_memory
    from lightning_lowmem.predict.run_spec import RunSpec

    disk_dir, _, disk_host, disk_bytes = figures
    strategy = RunSpec.from_flags(offload=True, offload_params=True, optimizer_in_backward=True, disk=disk_dir).strategy
    assert (strategy.disk, strategy.offload_params, strategy.optimizer_in_backward) == (disk_dir, True, True)
    for flags in ({"offload": True}, {"optimizer_in_backward": True}):
        with pytest.raises(ValueError, match=r"Passed `disk='.*'` with `offload=.*`, `optimizer_in_backward=.*`; the "
                                             r"disk tier is part of `lowmem_offload`"):
            RunSpec.from_flags(disk=disk_dir, **flags)
    est = estimate_memory(SHAPE, BATCH, SEQ, precision="bf16-true", offload=True, optimizer_in_backward=True,
                          disk=disk_dir)
    assert est.peak_disk == disk_bytes and est.peak_host <= disk_host
    with pytest.raises(ValueError, match=r"`method='analytic'` with the disk tier"):
        estimate_memory(SHAPE, BATCH, SEQ, precision="bf16-true", offload=True, optimizer_in_backward=True,
                        disk=disk_dir, method="analytic")


def test_a_dry_run_does_not_check_this_machines_free_disk_space(figures, monkeypatch):
    """The plan refused a full-depth trace of LLaMA-7B's disk tier with "75.31 GiB needed, 73.96 GiB free" (this
    machine's /tmp): a dry run predicts a run that may be on another machine; the real run checks at setup."""
    import collections
    import shutil

    from lightning_lowmem import estimate_memory

    disk_dir, _, _, disk_bytes = figures
    monkeypatch.setattr(shutil, "disk_usage", lambda path: collections.namedtuple("Usage", "total used free")(0, 0, 0))
    est = estimate_memory(SHAPE, BATCH, SEQ, precision="bf16-true", offload=True, optimizer_in_backward=True,
                          disk=disk_dir, extrapolate=False)
    assert est.peak_disk == disk_bytes

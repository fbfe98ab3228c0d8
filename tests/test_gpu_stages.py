"""The GPU stages (benchmarks/gpu/): the registry, the budgets, the wheel checks, the runner's guards.

The stages themselves run on a GPU machine (``make gpu-check STAGE=N``) and in the CPU rehearsal
(``make gpu-rehearsal``, a few minutes: not part of this suite); these tests are the quick part.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import registry, wheels

REPO = Path(__file__).resolve().parents[1]

EXPECTED = {
    1: ["claim[recipe_12gib]", "claim[dry_run]", "claim[plain_uncapped]", "speed[recipe_vs_plain]", "cuda_tests",
        "param_stream_bound", "environment"],
    2: ["activation_offload", "param_stream[resident]", "param_stream[prefetch=0]", "param_stream[prefetch=1]",
        "param_stream[prefetch=2]", "dry_run_vs_measured"],
    3: ["qlora_adapters[lora]", "qlora_adapters[qlora]", "qlora_adapters[qlora_streamed]", "qlora_adapters[dry_run]"],
    4: ["optimizer[adamw]", "low_bit[adamw8bit]", "low_bit[paged_adamw8bit]", "lean_optimizer[galore]",
        "lean_optimizer[apollo_mini]", "lean_optimizer[adam_mini]", "lean_optimizer[adamw8bit]",
        "lean_optimizer[adamw4bit]"],
    5: ["host_step[serial]", "host_step[in_backward]", "host_adamw", "synccheck"],
    6: ["chunked_loss", "micro_batch_search", "deepspeed_zero"],
}


@pytest.mark.parametrize("stage", registry.STAGES)
def test_stage_registry_lists_every_entry_within_the_budget(stage):
    entries = registry.entries(stage)
    assert [e.name for e in entries] == EXPECTED[stage]
    for e in entries:
        assert (e.fn is None) == bool(e.planned), e.name  # runnable, or a planned slot saying what comes
        assert e.fn is None or (callable(e.fn) and e.budget_s > 0), e.name
        assert registry.safe_name(e.name) and e.what
    assert len({registry.safe_name(e.name) for e in entries}) == len(entries)  # result files do not collide
    # every entry running out its time (the wheel install and each process start counted) still ends the stage
    # inside 7 minutes: with the machine's start, a stage and one rerun fit a task's 15 minutes of device time
    assert registry.worst_case_s(entries) <= registry.STAGE_BUDGET_S == 420


def test_stage1_runs_the_headline_claims_first_and_the_environment_last():
    names = [e.name for e in registry.entries(1)]
    assert names[:3] == ["claim[recipe_12gib]", "claim[dry_run]", "claim[plain_uncapped]"]
    assert names.index("cuda_tests") < names.index("param_stream_bound") < names.index("environment") == len(names) - 1


def test_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="Passed stage 7; expected one of 1, 2, 3, 4, 5, 6"):
        registry.entries(7)


def test_cuda_test_files_are_the_files_with_a_cuda_only_test():
    from benchmarks.gpu.stage1 import cuda_test_files

    files = cuda_test_files(REPO)
    assert "tests/strategies/test_offload.py" in files and "tests/test_gpu_stages.py" not in files
    for f in files:
        assert "min_cuda_gpus" in (REPO / f).read_text() or "bf16_cuda" in (REPO / f).read_text()


def test_stage_scripts_import_only_public_names_outside_the_one_seam():
    """A move of the package's internal modules must break one file, benchmarks/gpu/_imports.py, and this test."""
    import benchmarks.gpu._imports as seam

    assert all(getattr(seam, name) is not None for name in seam.__all__)
    for path in sorted((REPO / "benchmarks" / "gpu").glob("*.py")):
        if path.name == "_imports.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                       [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            internal = [m for m in modules if m.startswith("lightning_lowmem.")]
            assert not internal, f"{path.name}:{node.lineno} imports {internal}: import it in _imports.py"
    # NOTE: the offload strategy's internals are being rewritten: the stages use its public surface only
    assert "strategies.offload" not in (REPO / "benchmarks" / "gpu" / "_imports.py").read_text()


# --- the wheels ------------------------------------------------------------------------------------------------
def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = (), pad: int = 0) -> Path:
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *(f"Requires-Dist: {r}" for r in requires)]) + "\n\nA description.\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}-{version}.dist-info/METADATA", meta)
        z.writestr(f"{dist}/data.bin", os.urandom(pad))  # NOTE: random: stored size stays ~pad once compressed
    return path


WANTED = (("alpha", "1.0", "a"), ("jsonargparse", "4.53.0", "b"), ("docstring-parser", "0.18.0", "c"))


def _complete(folder: Path) -> None:
    _wheel(folder, "alpha", "1.0", ("torch>=2", "pandas; extra == 'benchmark'", "tomli; python_version < '3.11'"))
    _wheel(folder, "jsonargparse", "4.53.0", ("PyYAML>=3.13", "jsonargparse[typing-extensions]; extra == 'signatures'",
                                              "docstring-parser>=0.17; extra == 'signatures'",
                                              ("typing-extensions>=4.12; python_version < '3.11' and extra == "
                                               "'typing-extensions'")))
    _wheel(folder, "docstring_parser", "0.18.0")


def test_wheel_check_passes_a_complete_folder_and_prints_both_totals(tmp_path):
    _complete(tmp_path)
    lines, problems = wheels.check(tmp_path, {"torch", "pyyaml"}, tree_bytes=3 * 2**20, wanted=WANTED)
    assert problems == []
    assert any(line.startswith(".whl total:") for line in lines)
    assert any("tree that travels" in line and "3.00 MiB" in line for line in lines)


def test_wheel_check_names_every_problem(tmp_path):
    _complete(tmp_path)
    (tmp_path / "docstring_parser-0.18.0-py3-none-any.whl").unlink()  # jsonargparse[signatures] needs it
    _wheel(tmp_path, "alpha", "0.9")  # a second version of one package
    _wheel(tmp_path, "stray", "1.0")  # not in the list
    _wheel(tmp_path, "needy", "1.0", ("not-on-the-image>=1",))
    wanted = (*WANTED, ("needy", "1.0", "d"))
    _, problems = wheels.check(tmp_path, {"torch", "pyyaml"}, tree_bytes=0, wanted=wanted)
    text = "\n".join(problems)
    assert "missing docstring-parser==0.18.0 (c): run `make gpu-wheels`" in text
    assert "alpha: expected 1.0 once, found alpha-0.9-py3-none-any.whl, alpha-1.0-py3-none-any.whl" in text
    assert "stray-1.0-py3-none-any.whl is not in the list" in text
    assert "jsonargparse[signatures] needs docstring-parser>=0.17: neither a wheel" in text
    assert "needy needs not-on-the-image>=1: neither a wheel in the folder nor a package of the GPU image" in text
    assert "typing" not in text and "tomli" not in text and "pandas" not in text  # markers for py3.12, no extras


def test_wheel_check_enforces_the_sizes(tmp_path):
    _complete(tmp_path)
    _wheel(tmp_path, "big", "1.0", pad=300_000)
    _, problems = wheels.check(tmp_path, {"torch", "pyyaml"}, tree_bytes=10**6, wanted=(*WANTED, ("big", "1.0", "")),
                               wheel_limit=200_000, tree_limit=10**6)
    assert any(p.startswith(".whl holds 0.") and p.endswith("over 0.19 MiB") for p in problems)
    assert "the tree that travels is 0.95 MiB, not under 0.95 MiB" in problems


def test_wheel_list_is_pinned_and_met_by_the_image():
    assert len({wheels.norm(n) for n, _, _ in wheels.WHEELS}) == len(wheels.WHEELS)
    assert all(v and v[0].isdigit() for _, v, _ in wheels.WHEELS)
    image = wheels.image_packages()
    assert {"torch", "lightning", "transformers", "pytest-timeout", "typing-extensions", "pyyaml"} <= image
    assert not {wheels.norm(n) for n, _, _ in wheels.WHEELS} & image  # carry only what the image lacks


def test_travel_bytes_counts_tracked_untracked_and_wheels_not_ignored_files(tmp_path):
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.whl/\n/ignored\n")  # 16 B
    (tmp_path / "tracked").write_bytes(b"x" * 100)
    subprocess.run([*git, "add", "."], cwd=tmp_path, check=True)
    (tmp_path / "untracked").write_bytes(b"x" * 10)
    (tmp_path / "ignored").write_bytes(b"x" * 1000)
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "a.whl").write_bytes(b"x" * 7)
    assert wheels.travel_bytes(tmp_path, tmp_path / ".whl") == 16 + 100 + 10 + 7


# --- the runner ---------------------------------------------------------------------------------------------
def test_runner_survives_errors_hangs_skips_and_crashes(tmp_path):
    """Each entry's outcome is recorded and the stage goes on: a hung entry is killed at its budget, a crashed worker
    is replaced, a later entry reads an earlier one's result."""
    from benchmarks.gpu.run_stage import StageRun, child_env

    state = tmp_path / "state"
    state.mkdir()
    got: dict[str, dict] = {}
    run = StageRun(0, True, state, child_env(tmp_path / "site"), tmp_path / "log", time.time() + 300,
                   module="tests.helpers.gpu_stage_fake")
    from tests.helpers import gpu_stage_fake

    run.run([e for e in gpu_stage_fake.ENTRIES if e.fn is not None], lambda e, r: got.__setitem__(e.name, r))
    assert {k: v["status"] for k, v in got.items()} == {
        "ok": "ok", "raises": "error", "hangs": "timeout", "skips": "skipped", "crashes": "error", "reads_prior": "ok"}
    assert got["ok"]["rows"][0] == {"x": 1, "rehearsal": True, "threads": len(os.sched_getaffinity(0))}
    assert "RuntimeError: planted failure" in got["raises"]["error"]
    assert got["hangs"]["reason"] == "ran out of its 2 s"
    assert got["skips"]["reason"] == "needs something this machine lacks"
    assert "exited with code 3" in got["crashes"]["reason"]
    assert got["reads_prior"]["rows"] == [{"prior_status": "ok"}]


FAKE_PARTIAL = """
import time

from benchmarks.gpu.registry import Entry


def records_then_hangs(ctx):
    ctx.record({"rows": [{"figure": 1}], "figures": [{"figure": "f", "gpu": "1 GiB", "headline": True}]})
    time.sleep(3600)


def records_then_raises(ctx):
    ctx.record({"rows": [{"figure": 2}]})
    raise RuntimeError("after a figure")


def knows_its_deadline(ctx):
    return {"rows": [{"left": ctx.seconds_left()}]}


ENTRIES = [Entry("records_then_hangs", 4, records_then_hangs, "records, then hangs"),
           Entry("records_then_raises", 30, records_then_raises, "records, then raises"),
           Entry("knows_its_deadline", 30, knows_its_deadline, "reads its deadline")]
"""


def test_runner_writes_each_figure_as_it_is_measured_and_keeps_it_when_the_entry_is_cut_short(tmp_path):
    from benchmarks.gpu.run_stage import StageRun, child_env

    (tmp_path / "fake_partial_stage.py").write_text(FAKE_PARTIAL)
    env = child_env(tmp_path / "site")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    state = tmp_path / "state"
    state.mkdir()
    seen: list[tuple[str, dict]] = []
    run = StageRun(0, True, state, env, tmp_path / "log", time.time() + 300, module="fake_partial_stage")
    import importlib

    sys.path.insert(0, str(tmp_path))
    try:
        fake = importlib.import_module("fake_partial_stage")
    finally:
        sys.path.remove(str(tmp_path))
    run.run(list(fake.ENTRIES), lambda e, r: seen.append((e.name, dict(r))))
    hung = [r for name, r in seen if name == "records_then_hangs"]
    assert hung[0]["status"] == "running" and hung[0]["rows"] == [{"figure": 1}]  # reported before the entry ended
    assert hung[-1]["status"] == "timeout" and hung[-1]["rows"] == [{"figure": 1}] and hung[-1]["figures"]
    raised = [r for name, r in seen if name == "records_then_raises"][-1]
    assert raised["status"] == "error" and raised["rows"] == [{"figure": 2}] and "after a figure" in raised["error"]
    left = [r for name, r in seen if name == "knows_its_deadline"][-1]["rows"][0]["left"]
    assert 20 < left <= 30


def test_results_page_puts_each_figure_beside_its_prediction_and_the_cpu_figure(tmp_path):
    from benchmarks.gpu import report

    figure = {"figure": "the recipe's peak", "gpu": "6.1 GiB", "dry_run": "6.3 GiB", "cpu": "dry run 6.32 GiB",
              "headline": True}
    payload = {"stage": 1, "title": "t", "mode": "GPU", "date": "2026-12-02T00:00:00+00:00", "command": "c",
               "machine": {"device": "NVIDIA H200"}, "wheels": {"dir": ".whl", "installed": []}, "budget_s": 420,
               "seconds": 1.0, "entries": [{"name": "claim[recipe_12gib]", "what": "w", "budget_s": 185,
                                            "status": "ok", "figures": [figure]},
                                           {"name": "later", "what": "w", "budget_s": 5, "status": "pending"}]}
    report.write(payload, [tmp_path / "results", tmp_path / "out"])
    for d in ("results", "out"):
        assert sorted(p.name for p in (tmp_path / d).iterdir()) == ["stage1.json", "stage1.md", "summary.md"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| the recipe's peak | 6.1 GiB | 6.3 GiB | dry run 6.32 GiB | stage 1 `claim[recipe_12gib]` (ok) |" in summary
    assert "## Figures" in (tmp_path / "results" / "stage1.md").read_text()
    assert report.headline_rows([payload]) == [["the recipe's peak", "6.1 GiB; dry run 6.3 GiB",
                                                "**GPU** (NVIDIA H200, 2026-12-02)", "gpu/stage1"]]


# --- benchmarks/bench_param_stream.py ---------------------------------------------------------------------------
def test_param_stream_bench_times_gpu_steps_on_every_usable_cpu(monkeypatch):
    """Its CPU timing runs on one thread (a shared machine); the GPU steps' host work must get the machine's threads."""
    import benchmarks.bench_param_stream as bench

    seen = []

    def fake_step_times(args, variants, accelerator):
        seen.append((accelerator, torch.get_num_threads()))
        return {name: {"wall": 1.0, "cpu": 1.0} for name in variants}

    monkeypatch.setattr(bench, "step_times", fake_step_times)
    monkeypatch.setattr(bench, "write_results", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(sys, "argv", ["bench_param_stream.py", "--skip-estimates"])
    threads = torch.get_num_threads()
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    assert seen == [("cpu", 1), ("cuda", 3)]


def test_stage4_entries_name_the_package_kinds_and_carry_their_packages():
    """Each optimizer entry is a LowBitOptimizer or LeanOptimizer kind, and each package an entry needs is carried or
    on the image (an entry whose package is missing skips: a dropped wheel would turn its GPU figure into a skip)."""
    from benchmarks.gpu import stage4
    from lightning_lowmem.callbacks.lean_optimizer import KINDS as LEAN_KINDS
    from lightning_lowmem.callbacks.low_bit_optimizer import KINDS as LOW_BIT_KINDS

    assert set(stage4.LEAN) <= set(LEAN_KINDS) and set(stage4.LOW_BIT) <= set(LOW_BIT_KINDS)
    available = {wheels.norm(n) for n, _, _ in wheels.WHEELS} | wheels.image_packages()
    needed = {wheels.norm(stage4.WHEEL[m]) for m in stage4.LEAN.values()} | {"peft", "bitsandbytes"}
    assert needed <= available, needed - available

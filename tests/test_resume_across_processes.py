"""Stop a run, resume it in a new process: the weights equal the uninterrupted run's (``torch.equal``), every strategy.

Each case runs ``tests/_resume_child.py`` once straight, writing checkpoints after the given batches (from
``on_train_batch_end``, as ``ModelCheckpoint`` does), then once per checkpoint in a fresh process that resumes from
it to the same ``max_steps``. The fp32 weights (the optimizer's masters), the module's own weights and buffers, the
learning rates and the global step must equal the straight run's bit for bit. A checkpoint after a batch inside an
accumulation window is a mid-window stop.

The normal run keeps a representative subset (one case per cause found); the full matrix (every strategy and
precision, two stops each, the accumulation windows) runs with ``make resume-matrix``
(``LOWMEM_RESUME_MATRIX=1 pytest -m slow tests/test_resume_across_processes.py``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_lowmem.core.optional import package_available

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "_resume_child.py"
MATRIX = os.environ.get("LOWMEM_RESUME_MATRIX") == "1"
needs_deepspeed = pytest.mark.skipif(not package_available("deepspeed"), reason="needs the deepspeed extra")


def run_child(spec: dict) -> None:
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(spec)], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]


def differences(reference: dict[str, torch.Tensor], resumed: dict[str, torch.Tensor]) -> list[str]:
    assert reference.keys() == resumed.keys()
    return [k for k in reference if not torch.equal(reference[k], resumed[k])]


def assert_resumes_identical(tmp_path: Path, strategy: str, precision: str, steps: int, save_at: list[int],
                             accumulation: dict | None = None, strategy_args: dict | None = None,
                             **spec: object) -> None:
    """``spec``: more keys of the child's spec (``model``, ``adapters``: see ``tests/_resume_child.py``)."""
    base = {"strategy": strategy, "strategy_args": strategy_args, "precision": precision, "steps": steps,
            "accumulation": accumulation, "ckpt_dir": str(tmp_path), **spec}
    run_child(dict(base, save_at=save_at, out=str(tmp_path / "straight.pt")))
    reference = torch.load(tmp_path / "straight.pt")
    assert int(reference["global_step"]) == steps
    failed = {}
    for batch in save_at:
        out = tmp_path / f"resumed_after_batch_{batch}.pt"
        run_child(dict(base, resume=str(tmp_path / f"batch={batch}.ckpt"), out=str(out)))
        bad = differences(reference, torch.load(out))
        if bad:
            failed[batch] = f"{len(bad)} tensors differ, e.g. {bad[:3]}"
    assert not failed, f"resumed after batch -> difference from the uninterrupted run: {failed}"


# --- the normal run: one case per cause ----------------------------------------------------------------------


def test_accumulation_scheduler_resumes_mid_window_identically(tmp_path):
    """A checkpoint after the 2nd of a window's 3 micro-batches (token normalisation): the window's gradients and
    counts are in the checkpoint, so the resumed step is the uninterrupted one (Lightning keeps no gradients)."""
    assert_resumes_identical(tmp_path, "auto", "32-true", steps=2, save_at=[4],
                             accumulation={"effective": 6, "micro": 2, "tokens": True})


@pytest.mark.slow
def test_offload_with_accumulation_scheduler_resumes_mid_window_identically(tmp_path):
    """The same under ``lowmem_offload`` (bf16 compute weights): the window's gradients live on the fp32 masters."""
    assert_resumes_identical(tmp_path, "lowmem_offload", "bf16-true", steps=2, save_at=[2],
                             accumulation={"effective": 4, "micro": 2})


@pytest.mark.slow
@pytest.mark.deepspeed
@needs_deepspeed
def test_zero2_offload_resumes_identically_after_five_steps(tmp_path):
    """``DeepSpeedCPUAdam``'s bias-correction powers live in its C++ object: resumed at step 5 (from then on
    ``pow(beta, t)`` and the uninterrupted product ``beta*...*beta`` differ in the last bit) they are replayed."""
    assert_resumes_identical(tmp_path, "lowmem_zero2_offload", "32-true", steps=7, save_at=[4])


@pytest.mark.deepspeed
@needs_deepspeed
def test_cpu_adam_replay_rebuilds_the_bias_correction_of_the_uninterrupted_run():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from lightning_lowmem.strategies.zero.resume import replay_cpu_adam_steps

    torch.manual_seed(0)
    start, grads = torch.randn(300), [torch.randn(300) for _ in range(9)]

    def adam(p):
        return DeepSpeedCPUAdam([{"params": [p]}], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)

    def steps(opt, p, gs):
        for g in gs:
            p.grad = g.clone()
            opt.step()

    straight = torch.nn.Parameter(start.clone())
    steps(adam(straight), straight, grads)
    first = torch.nn.Parameter(start.clone())
    opt = adam(first)
    steps(opt, first, grads[:6])
    saved = copy.deepcopy(opt.state_dict())
    results = {}
    for replay in (False, True):
        p = torch.nn.Parameter(first.detach().clone())
        resumed = adam(p)
        resumed.load_state_dict(copy.deepcopy(saved))
        if replay:
            assert replay_cpu_adam_steps(SimpleNamespace(optimizer=resumed)) == 6  # found inside a ZeRO wrapper
        steps(resumed, p, grads[6:])
        results[replay] = torch.equal(p, straight)
    assert results == {False: False, True: True}  # the cause, and the fix


# --- the full matrix: `make resume-matrix` ---------------------------------------------------------------------

STOPS = [1, 5]  # after optimizer step 2 and step 6 of 8 (DeepSpeedCPUAdam's powers differ from step 5 on)
ZERO = ["lowmem_zero2", "lowmem_zero2_offload", "lowmem_zero3", "lowmem_zero3_offload"]
CASES = (
    [pytest.param("auto", p, 8, STOPS, None, None, id=f"plain-{p}") for p in ("32-true", "bf16-mixed")]
    + [pytest.param("lowmem_offload", p, 8, STOPS, None, None, id=f"lowmem_offload-{p}")
       for p in ("32-true", "bf16-true", "bf16-mixed", "16-true", "16-mixed")]
    + [pytest.param("lowmem_offload_params", "bf16-true", 8, STOPS, None, None, id="lowmem_offload_params-bf16-true")]
    + [pytest.param(z, p, 8, STOPS, None, None, id=f"{z}-{p}", marks=[pytest.mark.deepspeed, needs_deepspeed])
       for z in ZERO for p in ("32-true", "bf16-mixed")]
    + [pytest.param("lowmem_auto", "32-true", 8, STOPS, None, {"device_budget": "64MB"}, id="lowmem_auto")]
    # accumulation: windows of 3 micro-batches (batches 2, 5, 8 end them); stops inside and on the edges
    + [pytest.param(s, p, 3, [1, 2, 4, 7], {"effective": 6, "micro": 2, "tokens": True}, None,
                    id=f"AccumulationScheduler-tokens-{s}-{p}")
       for s, p in (("auto", "32-true"), ("lowmem_offload", "bf16-true"), ("lowmem_offload", "16-mixed"),
                    ("lowmem_offload_params", "bf16-true"))]
    + [pytest.param("auto", "32-true", 3, [1, 2, 4, 7], {"effective": 6, "micro": 2}, None,
                    id="AccumulationScheduler-samples-plain")]
    # DeepSpeed owns the window (window edges only: a mid-window checkpoint warns), plain Lightning's accumulation
    + [pytest.param(z, "32-true", 4, [3, 5], {"effective": 4, "micro": 2}, None, id=f"AccumulationScheduler-{z}",
                    marks=[pytest.mark.deepspeed, needs_deepspeed]) for z in ("lowmem_zero2_offload", "lowmem_zero3")]
    + [pytest.param("auto", "32-true", 4, [1, 5], {"trainer": 2}, None, id="accumulate_grad_batches-plain"),
       pytest.param("lowmem_offload", "bf16-true", 4, [1, 5], {"trainer": 2}, None,
                    id="accumulate_grad_batches-lowmem_offload")]
)


@pytest.mark.slow
@pytest.mark.skipif(not MATRIX, reason="the full matrix: `make resume-matrix` (LOWMEM_RESUME_MATRIX=1)")
@pytest.mark.parametrize(("strategy", "precision", "steps", "save_at", "accumulation", "strategy_args"), CASES)
def test_resume_matrix(tmp_path, strategy, precision, steps, save_at, accumulation, strategy_args):
    assert_resumes_identical(tmp_path, strategy, precision, steps, save_at, accumulation, strategy_args)

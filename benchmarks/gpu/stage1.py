"""Stage 1: the headline claims, the most valuable first, each figure written out the moment it is measured.

1. ``claim[recipe_12gib]``: GPT-2-XL (1.56B) full fine-tuning with the documented 12 GB recipe (``lowmem_offload``
   bf16-true + ``ActivationCheckpointing("all")`` + accumulation 4 + ``LowBitOptimizer("adamw8bit")``, clip 1.0) at
   micro-batch 4 x 1024 under a 12 GiB cap (``torch.cuda.set_per_process_memory_fraction``): whether it fits, the
   allocator's allocated and reserved peaks, each micro-batch's loss, step time, tokens/s, the GPU's busy fraction;
   as many optimizer steps (up to 3) as its time allows.
2. ``claim[dry_run]``: the dry run's prediction (CUDA target) of that run beside its measured peaks.
3. ``claim[plain_uncapped]``: plain Lightning (``strategy="auto"``, bf16-mixed: fp32 weights on the GPU, the same
   8-bit AdamW on the GPU, no checkpointing) on the uncapped GPU, same seed, weights, batches, accumulation and
   clipping: its losses beside the recipe's, micro-batch by micro-batch.
4. ``speed[recipe_vs_plain]``: step time, tokens/s and busy fraction of the two at the same effective batch.
5. ``cuda_tests``: ``pytest -m cuda`` (the CUDA-only correctness tests), with a time cap.
6. ``param_stream_bound``: on a wide GPT-2 (8 x 3072), ``lowmem_offload_params`` (prefetch 1) against the resident
   ``lowmem_offload``: the streamed blocks on the device at the allocator's peaks against the bound ``prefetch + 2``,
   and the step time against resident.
7. ``environment``: driver, versions, where each carried package was imported from, the pinned H2D/D2H and host
   memory bandwidths (facts collected on the way, last).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.registry import Context, Entry

CAP_BYTES = 12 * 2**30
ACCUMULATE = 4
RECIPE = ("lowmem_offload bf16-true + ActivationCheckpointing('all') + accumulate_grad_batches=4 + "
          "LowBitOptimizer('adamw8bit') + gradient_clip_val=1.0")
PLAIN = ("plain Lightning: strategy='auto', bf16-mixed (fp32 weights on the GPU), LowBitOptimizer('adamw8bit') on the "
         "GPU, no checkpointing, accumulate_grad_batches=4, gradient_clip_val=1.0")
#: the wide model of the streaming bound: blocks of 113M parameters (226 MB in bf16)
WIDE = {"n_layer": 8, "n_embd": 3072, "n_head": 24, "n_positions": 1024}
PREFETCH = 1


#: dropout off in the recipe and plain runs: CUDA draws a dropout mask per dtype-dependent vector width, so a
#: bf16-true run and an autocast one would drop different elements; the comparison is of the training arithmetic
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _xl(ctx: Context, steps: int) -> Any:
    from benchmarks.gpu import _common as c

    return c.shape(ctx, batch=4, seq=1024, steps=steps, warmup=1, accumulate=ACCUMULATE,
                   config={**c.GPT2_XL, **NO_DROPOUT}, tiny={**c.TINY, **NO_DROPOUT},
                   label="GPT-2-XL 48x1600, vocab 50257, dropout 0")


def _run(clock: Any, s: Any, **extra: Any) -> dict[str, Any]:
    """What a fit measured, as one record: steps, losses, step time, tokens/s, busy fraction, allocator peaks."""
    from benchmarks.gpu import _common as c

    step = clock.step_seconds()
    per_step = step["gpu_s"] or step["host_s"]
    losses = clock.losses()
    return {"optimizer_steps": len(clock.ends), "micro_batches": len(losses), "losses": losses,
            "step_s": per_step, "step_gpu_s": step["gpu_s"], "step_host_s": step["host_s"],
            "steps_timed": step["steps_timed"], "timed_after_warmup": step["warm"],
            "step_host_s_each": [c.rnd(t) for t in clock.step_times()],
            "tokens_per_s": c.rnd(s.tokens_per_step / per_step, 1) if per_step else None,
            "gpu_busy_fraction": clock.busy_fraction if clock.busy_fraction is not None else clock.busy.error,
            **c.cuda_peaks(), **extra}


def recipe_12gib(ctx: Context) -> dict[str, Any]:
    import torch

    from benchmarks.gpu import _common as c
    from lightning_lowmem import ActivationCheckpointing, LowBitOptimizer, OffloadStrategy

    s = _xl(ctx, steps=3)
    lm = c.module(s, ctx.device)
    c.fresh_cuda()
    cap = None
    if not ctx.rehearsal:
        cap = CAP_BYTES
        torch.cuda.set_per_process_memory_fraction(CAP_BYTES / torch.cuda.get_device_properties(0).total_memory)
    notes = [(f"{s.label}, micro-batch {s.batch}x{s.seq}, {RECIPE}; cap: the caching allocator limited to "
              f"{c.gib(cap) if cap else 'none (CPU rehearsal)'} (torch.cuda.set_per_process_memory_fraction; the "
              "CUDA context, about 0.5 GiB on a real card, is outside it); weights drawn on the GPU (seed 0), moved "
              "to the host before fit; random token batches (seed 0). Steps: up to 3, as many as the entry's time "
              "allows (the host's 8-bit AdamW step, bitsandbytes' CPU kernels, dominates); step time: mean of the "
              "steps after the first when there are two or more."),
             "losses: each micro-batch's training loss (Lightning's, times accumulate_grad_batches)."]
    strategy = OffloadStrategy()

    def result(clock: Any, fits: bool | None, why: str = "") -> dict[str, Any]:
        breakdown = clock.host if clock.host is not None else strategy.memory_breakdown().host if clock.ends else None
        host = sum(breakdown.values()) if breakdown is not None else None
        run = _run(clock, s, fits=fits, cap_bytes=cap, strategy_host_bytes=host, **({"oom": why} if why else {}))
        rows = [{"step": i + 1, "host_s": c.rnd(t), "losses": [c.rnd(x, 5) for x in
                                                               run["losses"][i * s.accumulate:(i + 1) * s.accumulate]]}
                for i, t in enumerate(clock.step_times())]
        verdict = ("fits" if fits else "does NOT fit" if fits is False else "fits so far")
        figure = {"figure": f"GPT-2-XL 4 x 1024, the 12 GB recipe under a 12 GiB cap ({len(clock.ends)} optimizer "
                            f"steps of 4 x 4 x 1024 tokens)",
                  "gpu": (f"{verdict}: allocated peak {c.gib(run.get('allocated_peak_bytes'))}, reserved peak "
                          f"{c.gib(run.get('reserved_peak_bytes'))}; host (the strategy's) {c.gib(host)}"),
                  "dry_run": None, "cpu": None, "headline": True}
        return {"rows": rows, "run": run, "notes": notes, "figures": [figure],
                "status": "failed" if fits is False else "ok"}

    clock = c.StepClock(warmup=1, on_step=lambda k: ctx.record(result(k, None)), deadline=ctx.deadline,
                        reserve_s=5)
    try:
        c.fit(ctx, s, strategy, [clock, ActivationCheckpointing("all"), LowBitOptimizer("adamw8bit")],
              precision="bf16-true", lm=lm, gradient_clip_val=1.0)
    except torch.cuda.OutOfMemoryError as err:
        return result(clock, False, str(err)[:500])
    return result(clock, True)


def recipe_dry_run(ctx: Context) -> dict[str, Any]:
    """The dry run (CUDA target) of the recipe at the same shape, beside its measured peaks."""
    from benchmarks.gpu import _common as c
    from lightning_lowmem import ActivationCheckpointing, LowBitOptimizer, OffloadStrategy, dry_run

    s = _xl(ctx, steps=3)
    est = dry_run(lambda: c.module(s), batch_size=s.batch, seq_len=s.seq, strategy=OffloadStrategy(),
                  precision="bf16-true", callbacks=[ActivationCheckpointing("all"), LowBitOptimizer("adamw8bit")],
                  accumulate_grad_batches=s.accumulate, target="cuda")
    context = sum(x.bytes for x in est.corrections if x.name == "cuda_context")
    measured = (ctx.prior("claim[recipe_12gib]") or {}).get("run", {})
    allocated, reserved = measured.get("allocated_peak_bytes"), measured.get("reserved_peak_bytes")
    tensors = est.peak_device - context
    row = {"predicted_device_bytes": est.peak_device, "cuda_context_bytes": context, "predicted_tensors_bytes": tensors,
           "measured_allocated_peak_bytes": allocated, "measured_reserved_peak_bytes": reserved,
           "predicted_over_allocated": c.rnd(tensors / allocated) if allocated else None,
           "predicted_over_reserved": c.rnd(tensors / reserved) if reserved else None,
           "predicted_host_bytes": est.peak_host, "measured_strategy_host_bytes": measured.get("strategy_host_bytes"),
           "binding_phase": est.binding_phase, "dry_run_s": c.rnd(est.wall_s, 1)}
    readme = c.cpu_figure(ctx, "estimate_gpt2xl", batch=4, combination="offload + ckpt(all) + 8-bit AdamW")
    figure = {"figure": "GPT-2-XL 4 x 1024, the 12 GB recipe: device peak, measured vs the dry run",
              "gpu": f"allocated peak {c.gib(allocated)}, reserved {c.gib(reserved)}",
              "dry_run": f"{c.gib(tensors)} of tensors (+ {c.gib(context)} CUDA context), "
                         f"{row['predicted_over_allocated'] or '-'}x the allocated peak",
              "cpu": (f"dry run {c.gib(readme['device_peak'])} device, host {c.gib(readme['host_peak'])} "
                      "(estimate_gpt2xl.json, the README's figure)") if readme else None, "headline": True}
    return {"rows": [row], "figures": [figure], "notes": [
        ("predicted_tensors_bytes: the dry run's device peak less its fixed CUDA-context correction (the allocator "
         "counts tensors, not the context); measured: the recipe's allocated/reserved peaks under the cap above "
         "(same shape, strategy, callbacks, precision, accumulation). predicted_host_bytes: the dry run's host peak; "
         "measured_strategy_host_bytes: the strategy's memory_breakdown().host after the fit.")]}


def plain_uncapped(ctx: Context) -> dict[str, Any]:
    from benchmarks.gpu import _common as c
    from lightning_lowmem import LowBitOptimizer

    s = _xl(ctx, steps=5)
    lm = c.module(s, ctx.device, on_host=False)
    c.fresh_cuda()
    clock = c.StepClock(warmup=1)
    c.fit(ctx, s, "auto", [clock, LowBitOptimizer("adamw8bit")], precision="bf16-mixed", lm=lm,
          gradient_clip_val=1.0)
    run = _run(clock, s)
    recipe = (ctx.prior("claim[recipe_12gib]") or {}).get("run") or {}
    theirs = recipe.get("losses") or []
    rows = [{"micro_batch": i + 1, "optimizer_step": i // s.accumulate + 1, "recipe_loss": c.rnd(a, 6),
             "plain_loss": c.rnd(b, 6), "abs_diff": c.rnd(abs(a - b), 6), "rel_diff": c.rnd(abs(a - b) / abs(b), 6)}
            for i, (a, b) in enumerate(zip(theirs, run["losses"]))]
    first = [r["abs_diff"] for r in rows if r["optimizer_step"] == 1]
    later = [r["abs_diff"] for r in rows if r["optimizer_step"] > 1]
    figure = {"figure": "GPT-2-XL, the 12 GB recipe's losses vs plain Lightning on the uncapped GPU (same seed, "
                        "weights, batches)",
              "gpu": (f"max |diff| {max(first, default=0):.4g} before the first update, {max(later, default=0):.4g} "
                      f"after ({len(rows)} micro-batches; plain's first loss {c.rnd(run['losses'][0], 4)})"
                      if rows else "no recipe losses to compare (claim[recipe_12gib] did not record any)"),
              "dry_run": None, "cpu": None, "headline": True}
    return {"rows": rows, "run": run, "figures": [figure], "notes": [
        (f"{s.label}, micro-batch {s.batch}x{s.seq}, {PLAIN}; {s.steps} optimizer steps (the first left out of the "
        "step time), same weights (seed 0, drawn on the GPU) and batches as claim[recipe_12gib]."),
        ("The two differ by where the fp32 weights live and how the forward rounds (bf16-true compute weights and "
         "host masters vs autocast over fp32 weights), by checkpointing (exact recompute, RNG replayed) and by the "
         "8-bit AdamW's kernel (bitsandbytes' CPU code on the host vs its CUDA kernel).")]}


def speed(ctx: Context) -> dict[str, Any]:
    from benchmarks.gpu import _common as c

    runs = {"recipe (12 GiB cap)": (ctx.prior("claim[recipe_12gib]") or {}).get("run"),
            "plain Lightning (uncapped)": (ctx.prior("claim[plain_uncapped]") or {}).get("run")}
    rows = [{"run": name, **{k: (r or {}).get(k) for k in ("step_s", "step_gpu_s", "step_host_s", "steps_timed",
                                                            "tokens_per_s", "gpu_busy_fraction")}}
            for name, r in runs.items()]
    ours, plain = (r["step_s"] for r in rows)
    ratio = c.rnd(ours / plain, 2) if ours and plain else None
    cpu = c.cpu_figure(ctx, "offload", table="step time", variant="lowmem_offload bf16-true")
    busy = [r["gpu_busy_fraction"] for r in rows]
    cold = "" if (runs["recipe (12 GiB cap)"] or {}).get("timed_after_warmup", True) else " (its one step, warm-up in)"
    figure = {"figure": "GPT-2-XL, the 12 GB recipe's optimizer step vs plain Lightning (effective batch 16 x 1024)",
              "gpu": (f"{rows[0]['step_s']} s{cold} vs {rows[1]['step_s']} s ({ratio}x); {rows[0]['tokens_per_s']} "
                      f"vs {rows[1]['tokens_per_s']} tokens/s; GPU busy {busy[0]} vs {busy[1]}"),
              "dry_run": None,
              "cpu": (f"{cpu['x_plain_same_precision']:.2f}x plain bf16-true (CPU, GPT-2 3.26M, offload.json)"
                      if cpu else None), "headline": True}
    return {"rows": rows, "figures": [figure], "notes": [
        ("step_s: seconds per optimizer step (4 micro-batches of 4 x 1024 tokens) on the GPU's timeline, the mean "
         "of the steps after the first; tokens_per_s: 16,384 tokens per step over it; gpu_busy_fraction: NVML's "
         "utilization (share of time a kernel ran) sampled over those steps.")]}


def pytest_run(ctx: Context, args: list[str], timeout_s: float, prefix: list[str] | None = None) -> dict[str, Any]:
    """Run pytest in a child process; one row per test from its JUnit XML. At ``timeout_s`` it is interrupted
    (SIGINT: pytest ends the session and writes the XML of the tests that ran), and killed 8 s later."""
    import signal
    import xml.etree.ElementTree as ET

    stem = ctx.state_dir / f"pytest-{os.getpid()}-{time.monotonic_ns()}"
    xml, log = stem.with_suffix(".xml"), stem.with_suffix(".out")
    cmd = [*(prefix or []), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ctx.repo, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    capped = False
    try:
        proc.wait(timeout=max(timeout_s - 8, 1))
    except subprocess.TimeoutExpired:
        capped = True
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    print(text[-20000:], flush=True)  # NOTE: into the stage's log
    rows = []
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            if case.get("name") is None:
                continue  # NOTE: the placeholder an interrupted session writes
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                found = case.find(tag)
                if found is not None:
                    outcome = f"{tag}: {(found.get('message') or '')[:160]}"
            rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                         "seconds": round(float(case.get("time") or 0), 2)})
    tail = (text.strip().splitlines() or [""])[-1]
    shown = " ".join(cmd[len(prefix or []):])
    if capped:
        return {"rows": rows, "status": "failed", "notes": [f"`{shown}` interrupted at its {timeout_s:.0f} s cap: {tail}"]}
    # NOTE: exit 0 all passed (or skipped), 5 none collected: anything else is a failure (tests failed, errors)
    code = proc.returncode
    return {"rows": rows, "notes": [f"`{shown}` -> exit {code}: {tail}"], "status": "ok" if code in (0, 5) else "failed"}


def cuda_test_files(repo: Path) -> list[str]:
    """The test files holding a CUDA-only test (``RunIf(min_cuda_gpus=...)`` or ``RunIf(bf16_cuda=True)``, which
    tests/conftest.py marks ``cuda``): collecting those alone keeps the whole suite's imports out of the cap."""
    found = re.compile(r"RunIf\([^)]*(min_cuda_gpus|bf16_cuda)")
    return sorted(str(p.relative_to(repo)) for p in (repo / "tests").rglob("test_*.py") if found.search(p.read_text()))


def cuda_tests(ctx: Context) -> dict[str, Any]:
    from benchmarks.gpu import _common as c

    c.fresh_cuda()  # NOTE: the device memory the plain run's process still caches goes back for the tests' processes
    files = cuda_test_files(ctx.repo)
    out = pytest_run(ctx, ["-m", "cuda", "--timeout=30", *files], timeout_s=ctx.seconds_left() - 3)
    counts: dict[str, int] = {}
    for r in out["rows"]:
        kind = r["outcome"].split(":")[0]
        counts[kind] = counts.get(kind, 0) + 1
    out["figures"] = [{"figure": "CUDA-only correctness tests (`pytest -m cuda`)",
                       "gpu": ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none collected",
                       "dry_run": None, "cpu": None, "headline": True}]
    out["notes"].append(f"files: {', '.join(files)}; each test at most 30 s, the whole run capped at the entry's time")
    return out


def param_stream_bound(ctx: Context) -> dict[str, Any]:
    from benchmarks.gpu import _common as c
    from lightning_lowmem import OffloadStrategy

    s = c.shape(ctx, batch=4, seq=1024, steps=3, warmup=1, config=WIDE, vocab=8192,
                label="GPT-2 8x3072 (0.92B), vocab 8192")
    rows: list[dict[str, Any]] = []
    sizes: dict[str, Any] = {}
    for run, kwargs in (("streamed", {"offload_params": True, "prefetch": PREFETCH}), ("resident", {})):
        lm = c.module(s, ctx.device)
        blocks = lm.model.transformer.h
        block_bytes = [2 * sum(p.numel() for p in b.parameters()) for b in blocks]  # NOTE: bf16 compute weights
        total = 2 * sum(p.numel() for p in lm.parameters())
        sizes = {"blocks": len(blocks), "block_bytes": max(block_bytes), "non_block_bytes": total - sum(block_bytes)}
        c.fresh_cuda()
        clock = c.StepClock(warmup=1)
        c.fit(ctx, s, OffloadStrategy(**kwargs), [clock], precision="bf16-true", lm=lm)
        step = clock.step_seconds()
        rows.append({"run": run, "step_gpu_s": step["gpu_s"], "step_host_s": step["host_s"], **c.cuda_peaks()})
        ctx.record({"rows": rows, "sizes": sizes})
        del lm, blocks, clock
    streamed, resident = rows
    bound = PREFETCH + 2
    derived = {}
    for kind in ("reserved", "allocated"):
        a, b = streamed.get(f"{kind}_peak_bytes"), resident.get(f"{kind}_peak_bytes")
        derived[f"blocks_on_device_at_{kind}_peak"] = (
            c.rnd(sizes["blocks"] - (b - a) / sizes["block_bytes"], 2) if a is not None and b is not None else None)
    slow = (streamed["step_gpu_s"] or streamed["step_host_s"]) / (resident["step_gpu_s"] or resident["step_host_s"])
    rows.append({"run": "derived", "bound_blocks": bound, **derived, "step_vs_resident": c.rnd(slow, 3), **sizes})
    cpu = c.cpu_figure(ctx, "param_stream", part="cpu step", strategy="lowmem_offload_params")
    at_peak = derived["blocks_on_device_at_reserved_peak"]
    figure = {"figure": f"parameter streaming, wide GPT-2 8 x 3072 ({sizes['block_bytes'] / 2**20:.0f} MiB blocks), "
                        f"prefetch {PREFETCH}: streamed blocks on the device, step time",
              "gpu": f"{at_peak} blocks at the reserved peak (bound prefetch + 2 = {bound}); step {c.rnd(slow, 2)}x resident",
              "dry_run": f"at most {bound} blocks (the bound)",
              "cpu": f"step {cpu['vs_resident']}x resident (CPU, {cpu['model']}, param_stream.json)" if cpu else None,
              "headline": True}
    status = "failed" if at_peak is not None and at_peak > bound + 0.25 else "ok"
    return {"rows": rows, "figures": [figure], "status": status, "notes": [
        (f"{s.label}, batch {s.batch}x{s.seq}, bf16-true, torch AdamW on the host, {s.steps} steps each (the first "
         "left out of the step time), streamed (lowmem_offload_params, prefetch 1) then resident (lowmem_offload) in "
         "one process, the allocator emptied and its peaks reset between them."),
        ("blocks_on_device_at_*_peak = blocks - (resident peak - streamed peak) / block bytes: the two runs differ "
         "only in the blocks' compute weights, so the difference of their peaks counts the blocks streaming kept "
         "off the device. 'failed' when it exceeds the bound by more than a quarter block.")]}


#: packages carried as wheels (see benchmarks/gpu/wheels.py) or expected on the GPU machine's image
PACKAGES = ("torch", "lightning", "pytorch_lightning", "transformers", "peft", "accelerate", "triton", "bitsandbytes",
            "jsonargparse", "docstring_parser", "typeshed_client", "liger_kernel", "cut_cross_entropy", "galore_torch",
            "apollo_torch", "adam_mini", "torchao", "deepspeed", "pytest", "pytest_timeout", "psutil", "numpy")


def _cmd(cmd: list[str], timeout: float = 10) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(ctx: Context) -> dict[str, Any]:
    import psutil
    import torch

    facts: dict[str, Any] = {
        "python": f"{platform.python_version()} ({sys.executable})", "cpu_count": os.cpu_count(),
        "usable_cpus": ctx.threads, "ram_bytes": psutil.virtual_memory().total, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "nvidia_smi": _cmd(["nvidia-smi", ("--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,"
                            "pcie.link.width.max,clocks.max.sm"), "--format=csv,noheader"]),
        "nvcc": ((_cmd(["nvcc", "--version"]) or "").splitlines() or [None])[-1],
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts |= {"device": torch.cuda.get_device_name(0), "capability": f"{props.major}.{props.minor}",
                  "device_memory_bytes": props.total_memory, "multiprocessors": props.multi_processor_count,
                  "cudnn": torch.backends.cudnn.version()}
    rows = [{"fact": k, "value": str(v)} for k, v in facts.items()]
    from importlib.metadata import PackageNotFoundError, packages_distributions
    from importlib.metadata import version as dist_version

    dists = packages_distributions()
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        version, where = None, "missing"
        if spec is not None:
            # NOTE: the folder the package (or single-file module) was found in: the wheels' or the image's
            locations = list(spec.submodule_search_locations or [])
            where = str(Path(locations[0]).parent if locations else Path(spec.origin or "").parent)
            try:
                version = dist_version((dists.get(name) or [name])[0])
            except PackageNotFoundError:
                version = None
        rows.append({"fact": f"package {name}", "value": f"{version or '-'} from {where}"})
    rows += _bandwidths(ctx)
    return {"rows": rows, "facts": facts, "notes": [
        ("bandwidths: the median of 10 copies of 64 MiB (lowmem_offload's staging bucket size) timed by CUDA events; "
        "host: in-place a += b over 256 MiB fp32 buffers (12 B per element), the best of 3.")]}


def _bandwidths(ctx: Context) -> list[dict[str, Any]]:
    import torch

    n = 64 * 2**20
    rows = []
    if torch.cuda.is_available():
        host, back = torch.ones(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8).pin_memory()
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        for name, fn in (("H2D pinned", lambda: dev.copy_(host, non_blocking=True)),
                         ("D2H pinned", lambda: back.copy_(dev, non_blocking=True))):
            fn()
            times = []
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            rows.append({"fact": f"{name} GB/s", "value": str(round(n / sorted(times)[5] / 1e9, 2))})
    a, b = torch.ones(2**26 if not ctx.rehearsal else 2**22), torch.ones(2**26 if not ctx.rehearsal else 2**22)
    best = min(_timed(lambda: a.add_(b)) for _ in range(3))
    rows.append({"fact": "host a += b GB/s", "value": str(round(12 * a.numel() / best / 1e9, 2))})
    return rows


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


ENTRIES = [
    Entry("claim[recipe_12gib]", 210, recipe_12gib,
          "GPT-2-XL 12 GB recipe under a 12 GiB cap: fits, peaks, losses, step time", fresh=True),
    Entry("claim[dry_run]", 20, recipe_dry_run, "the dry run (CUDA target) of the recipe vs its measured peaks"),
    Entry("claim[plain_uncapped]", 40, plain_uncapped,
          "plain Lightning on the uncapped GPU, same seed: losses beside the recipe's", fresh=True),
    Entry("speed[recipe_vs_plain]", 5, speed, "step time, tokens/s, GPU busy fraction: recipe vs plain"),
    Entry("cuda_tests", 40, cuda_tests, "every `cuda`-marked test (pytest -m cuda), capped"),
    Entry("param_stream_bound", 45, param_stream_bound,
          "wide GPT-2, prefetch 1: streamed blocks at the device peak vs prefetch + 2; step vs resident", fresh=True),
    Entry("environment", 10, environment, "device, driver, versions, carried packages, link and host bandwidths"),
]

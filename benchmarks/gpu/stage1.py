"""Stage 1: the machine, its links, the CUDA tests, and where a ``lowmem_offload`` GPT-2-XL step spends its time.

Entries: ``environment`` (device, driver, versions, where each carried package was imported from),
``pinned_bandwidth`` (H2D / D2H / both at once through pinned buffers at the staging bucket size),
``host_adamw`` (the fused host AdamW at the machine's thread count vs one thread; the host's memory bandwidth),
``cuda_tests`` (``pytest -m cuda``), ``synccheck`` (``compute-sanitizer --tool synccheck`` on two CUDA tests),
``offload_phases`` (forward, backward, drain, guard, host step, upload of GPT-2-XL steps, CUDA events).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.registry import Context, Entry, Skip

#: packages carried as wheels (see benchmarks/gpu/wheels.py) or expected on the GPU machine's image
PACKAGES = ("torch", "lightning", "pytorch_lightning", "transformers", "peft", "accelerate", "triton", "bitsandbytes",
            "jsonargparse", "docstring_parser", "typeshed_client", "liger_kernel", "cut_cross_entropy", "galore_torch",
            "apollo_torch", "adam_mini", "torchao", "deepspeed", "pytest", "pytest_timeout", "psutil", "numpy")


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(ctx: Context) -> dict[str, Any]:
    import psutil
    import torch

    rows: list[dict[str, Any]] = []
    facts: dict[str, Any] = {
        "python": f"{platform.python_version()} ({sys.executable})", "cpu_count": os.cpu_count(),
        "usable_cpus": ctx.threads, "torch_threads": torch.get_num_threads(), "ram_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max",
                            "--format=csv,noheader"]),
        "nvcc": (_run(["nvcc", "--version"]) or "").splitlines()[-1:] or None,
        "compute_sanitizer": sanitizer_path(),
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts |= {"device": torch.cuda.get_device_name(0), "capability": f"{props.major}.{props.minor}",
                  "device_memory_bytes": props.total_memory, "multiprocessors": props.multi_processor_count,
                  "cudnn": torch.backends.cudnn.version(), "bf16": torch.cuda.is_bf16_supported()}
    rows += [{"fact": k, "value": str(v)} for k, v in facts.items()]
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
    return {"rows": rows, "facts": facts}


def sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    for candidate in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if found is None and os.access(candidate, os.X_OK):
            found = candidate
    return found


def pinned_bandwidth(ctx: Context) -> dict[str, Any]:
    from benchmarks.gpu._imports import BUCKET_BYTES

    sizes = [2**20, BUCKET_BYTES, 4 * BUCKET_BYTES] if not ctx.rehearsal else [2**20, 8 * 2**20]
    reps = 20 if not ctx.rehearsal else 3
    rows = [row for nbytes in sizes for row in (_host_copy(nbytes, reps) if ctx.rehearsal else _links(nbytes, reps))]
    return {"rows": rows, "notes": [(f"lowmem_offload's staging bucket: {BUCKET_BYTES} B; median of {reps} copies "
                                     "(CUDA events); 'at once' counts the bytes of both directions.")]}


def _host_copy(nbytes: int, reps: int) -> list[dict[str, Any]]:
    """The rehearsal's stand-in (no device): a host-to-host copy of the same size, labelled as such."""
    import torch

    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    return [{"direction": "host copy (CPU rehearsal)", "bytes": nbytes,
             "GB_per_s": round(reps * nbytes / (time.perf_counter() - t0) / 1e9, 2)}]


def _links(nbytes: int, reps: int) -> list[dict[str, Any]]:
    """H2D and D2H through pinned buffers (and pageable H2D, and both directions at once), timed by CUDA events."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dev, dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(side):
            host2.copy_(dev2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    cases = {
        "H2D pinned": lambda: dev.copy_(host, non_blocking=True),
        "D2H pinned": lambda: host2.copy_(dev2, non_blocking=True),
        "H2D pageable": lambda: dev.copy_(pageable),
        "H2D + D2H at once (two streams)": both,
    }
    rows = []
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        times.sort()
        moved = 2 * nbytes if fn is both else nbytes
        rows.append({"direction": name, "bytes": nbytes, "GB_per_s": round(moved / times[len(times) // 2] / 1e9, 2),
                     "best_GB_per_s": round(moved / times[0] / 1e9, 2)})
    return rows


def host_adamw(ctx: Context) -> dict[str, Any]:
    import torch

    from benchmarks._harness import interleaved
    from benchmarks.gpu._common import threads
    from benchmarks.gpu._imports import enable_fused, why_not_fused

    n_tensor = 2_000_000 if ctx.rehearsal else 25_000_000  # NOTE: 200M params on the GPU machine: 3.2 GB of state
    params = [torch.nn.Parameter(torch.randn(n_tensor)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    ours = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if why_not_fused(ours) is not None:
        raise RuntimeError(f"the host AdamW would not be fused: {why_not_fused(ours)}")
    enable_fused(ours)
    foreach = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    a, b = torch.randn(4 * n_tensor), torch.randn(4 * n_tensor)
    rows = []
    for n_threads in sorted({ctx.threads, 1}, reverse=True):
        with threads(n_threads):
            timed = interleaved({"fused (lowmem_offload's host AdamW)": ours.step, "foreach": foreach.step,
                                 "bandwidth a += b": lambda: a.add_(b)}, rounds=3 if ctx.rehearsal else 4)
        bw = timed.pop("bandwidth a += b")
        bandwidth = 3 * a.numel() * 4 / bw["min_s"]
        for name, t in timed.items():
            rate = 8 * n_tensor / t["median_s"]
            rows.append({"optimizer": name, "threads": n_threads, "params": 8 * n_tensor,
                         "Mparams_per_s": round(rate / 1e6, 1), "step_ms": round(1e3 * t["median_s"], 1),
                         "fraction_of_bandwidth_bound": round(28 * rate / bandwidth, 3),
                         "host_GB_per_s": round(bandwidth / 1e9, 2)})
    return {"rows": rows, "notes": [("fp32 AdamW over 8 flat tensors (param, grad, m, v: 16 B/param, far beyond the "
                                     "cache); bound: 28 B/param at the a += b bandwidth measured in the same rounds.")]}


def _pytest(ctx: Context, args: list[str], timeout_s: int, prefix: list[str] | None = None) -> dict[str, Any]:
    """Run pytest in a child process; one row per test from its JUnit XML."""
    import xml.etree.ElementTree as ET

    xml = ctx.state_dir / f"junit-{os.getpid()}-{time.monotonic_ns()}.xml"
    cmd = [*(prefix or []), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
    proc = subprocess.run(cmd, cwd=ctx.repo, capture_output=True, text=True, timeout=timeout_s, check=False)
    print(proc.stdout[-20000:], proc.stderr[-5000:], sep="\n", flush=True)  # NOTE: into the stage's log
    rows = []
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                found = case.find(tag)
                if found is not None:
                    outcome = f"{tag}: {(found.get('message') or '')[:160]}"
            rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                         "seconds": round(float(case.get("time") or 0), 2)})
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    # NOTE: exit 0 all passed (or skipped), 5 none collected: anything else is a failure (tests failed, errors)
    return {"rows": rows, "notes": [f"`{' '.join(cmd[len(prefix or []):])}` -> exit {proc.returncode}: {tail}"],
            "status": "ok" if proc.returncode in (0, 5) else "failed", "returncode": proc.returncode}


def cuda_tests(ctx: Context) -> dict[str, Any]:
    # NOTE: per-test limit well inside the entry's budget (collection of the whole tree counts against it too)
    return _pytest(ctx, ["-m", "cuda", "--timeout=60", "tests"], timeout_s=ENTRY_BUDGET["cuda_tests"] - 5)


SYNCCHECK_TESTS = (
    "tests/test_deferred_transfers.py::test_cuda_stream_transfer_folds_every_gradient_exactly_once_in_queue_order",
    "tests/strategies/test_offload.py::test_cuda_root_device_staging_and_weights",
)


def synccheck(ctx: Context) -> dict[str, Any]:
    tool = sanitizer_path()
    if tool is None and not ctx.rehearsal:
        raise Skip("compute-sanitizer not found (PATH, /usr/local/cuda/bin)")
    # NOTE: the rehearsal has no sanitizer: it runs the same tests plainly, so a renamed test shows here first
    prefix = [tool, "--tool", "synccheck", "--error-exitcode", "3"] if tool and not ctx.rehearsal else []
    out = _pytest(ctx, ["--timeout=80", *SYNCCHECK_TESTS], timeout_s=ENTRY_BUDGET["synccheck"] - 5, prefix=prefix)
    out["notes"].append("compute-sanitizer --tool synccheck (exit 3 = a hazard found)" if prefix else
                        "no compute-sanitizer: the tests ran without it")
    return out


def offload_phases(ctx: Context) -> dict[str, Any]:
    from benchmarks.gpu import _common as c

    s = c.shape(ctx, steps=6, warmup=2)
    c.fresh_cuda()
    clock = c.PhaseClock()
    strategy = c.DrainTimedOffload(clock)
    c.fit(ctx, s, strategy, [clock])
    step = clock.step_seconds(s.warmup)
    return {
        "rows": clock.phase_rows(s.warmup),
        "notes": [(f"{s.label}, batch {s.batch}x{s.seq}, lowmem_offload, bf16-true, torch AdamW (fused on the host), "
                   f"{s.steps} steps, the first {s.warmup} left out; median step: GPU timeline {_r(step['gpu_s'])} s, "
                   f"host {_r(step['host_s'])} s; device peaks {c.cuda_peaks()}."),
                  ("gpu_ms: CUDA events recorded on the compute stream at each boundary (no synchronisation in the "
                   "step); a phase's GPU time includes the wait for work queued before it. host_ms: the host clock.")],
        "step": step,
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


ENTRY_BUDGET = {"environment": 20, "pinned_bandwidth": 30, "host_adamw": 50, "cuda_tests": 140, "synccheck": 90,
                "offload_phases": 150}

ENTRIES = [
    Entry("environment", ENTRY_BUDGET["environment"], environment, "device, driver, versions, carried packages"),
    Entry("pinned_bandwidth", ENTRY_BUDGET["pinned_bandwidth"], pinned_bandwidth,
          "H2D / D2H through pinned buffers at the staging bucket size"),
    Entry("host_adamw", ENTRY_BUDGET["host_adamw"], host_adamw, "fused host AdamW rate at the machine's threads"),
    Entry("cuda_tests", ENTRY_BUDGET["cuda_tests"], cuda_tests, "every `cuda`-marked test (pytest -m cuda)"),
    Entry("synccheck", ENTRY_BUDGET["synccheck"], synccheck, "compute-sanitizer synccheck on two CUDA tests"),
    Entry("offload_phases", ENTRY_BUDGET["offload_phases"], offload_phases,
          "per-phase time of GPT-2-XL lowmem_offload steps (CUDA events)", fresh=True),
]

"""What every benchmark uses: machine facts, side-by-side timing, and results written as JSON + markdown.

A benchmark script builds a list of rows (one per variant measured side by side in the same run),
then calls :func:`write_results`, which writes ``benchmarks/results/NAME.json`` and ``NAME.md``.
Memory is reported in bytes, by category (see ``lightning_lowmem.memory.categories``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """Facts that make a figure comparable: processor, cores, memory, library versions, GPU."""
    import lightning
    import psutil

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def time_it(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median and spread of ``fn``'s wall time in seconds (CUDA is synchronised around each call)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeat": repeat}


def interleaved(variants: dict[str, Callable[[], Any]], rounds: int = 5, warmup: int = 1) -> dict[str, dict[str, float]]:
    """Time several variants in alternation (A B C A B C ...), so machine noise hits them alike."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {
        name: {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "repeat": rounds}
        for name, ts in times.items()
    }


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _repo_relative(script: str) -> str:
    """``benchmarks/bench_x.py`` whatever the checkout's location (results are compared across machines)."""
    path = Path(script).resolve()
    try:
        return str(path.relative_to(RESULTS.parent.parent))
    except ValueError:
        return script


def write_results(
    name: str,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    *,
    title: str,
    notes: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
    results_dir: Path | None = None,
) -> tuple[Path, Path]:
    """Write ``NAME.json`` (every row, the machine, the command) and ``NAME.md`` (a table of ``columns``)."""
    out = Path(results_dir or os.environ.get("LOWMEM_BENCH_RESULTS", RESULTS))
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "title": title,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, _repo_relative(sys.argv[0]), *sys.argv[1:]]),
        "machine": machine(),
        "rows": list(rows),
        "notes": list(notes),
        **(extra or {}),
    }
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    m = payload["machine"]
    header = (
        f"# {title}\n\nMeasured {payload['date']} on {m['processor']}, {m['cpu_count']} cores, "
        f"{fmt_bytes(m['ram_bytes'])} RAM, GPU: {m['gpu'] or 'none'}; torch {m['torch']}, lightning {m['lightning']}.\n"
        f"Command: `{payload['command']}`\n\n"
    )
    body = markdown_table(rows, columns)
    md_path.write_text(header + body + "\n" + "".join(f"\n- {n}" for n in notes) + ("\n" if notes else ""))
    print(header + body)
    for n in notes:
        print("-", n)
    return json_path, md_path


def step_probe(at: int | None = 1) -> Any:
    """A Lightning callback that tracks training step ``at`` with ``MemoryTracker`` and times every step.

    Phases follow Lightning's hooks (forward until ``on_before_backward``, backward until
    ``on_after_backward``, then the optimizer). After fit: ``probe.tracker`` and ``probe.times``.
    """
    import lightning as L

    from lightning_lowmem.memory.measure import MemoryTracker

    class StepProbe(L.Callback):
        def __init__(self) -> None:
            self.at, self.tracker, self.times, self._t0 = at, None, [], 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.at is not None and trainer.global_step == self.at:
                self.tracker = MemoryTracker(module=pl_module, optimizers=trainer.optimizers)
                self.tracker.__enter__()
                self.tracker.track(batch)
                self.tracker.set_phase("forward")
            self._t0 = time.perf_counter()

        def on_before_backward(self, trainer, pl_module, loss):
            if self.tracker is not None and self.tracker.active:
                self.tracker.set_phase("backward")

        def on_after_backward(self, trainer, pl_module):
            if self.tracker is not None and self.tracker.active:
                self.tracker.set_phase("optimizer")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._t0)
            if self.tracker is not None and self.tracker.active:
                self.tracker.set_phase(None)
                self.tracker.__exit__(None, None, None)

    return StepProbe()


def add_gpt2_args(parser: Any, *, rounds: int) -> None:
    """The GPT-2-architecture shape options the activation benchmarks share (12 layers at seq 512 by default)."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=rounds)


def build_gpt2(args: Any) -> tuple[torch.nn.Module, torch.Tensor]:
    """A seeded GPT-2-architecture model in train mode from :func:`add_gpt2_args` options, and a batch of ids."""
    from lightning_lowmem.demo.module import build_causal_lm

    torch.manual_seed(0)
    config = {"n_layer": args.layers, "n_embd": args.width, "n_head": args.heads, "n_positions": args.seq, "use_cache": False}
    model = build_causal_lm("gpt2", config)
    model.train()
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return model, ids

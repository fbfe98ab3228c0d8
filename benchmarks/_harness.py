"""What every benchmark uses: machine facts, side-by-side timing, a quiet Trainer, token batches, and
results written as JSON + markdown.

A benchmark script builds a list of rows (one per variant measured side by side in the same run),
then calls :func:`write_results`, which writes ``benchmarks/results/NAME.json`` and ``NAME.md``.
Memory is reported in bytes, by category (see ``lightning_lowmem.core.accounting``).

Every script runs both as ``python benchmarks/run.py NAME`` and as ``python benchmarks/bench_NAME.py``
from the repository root: each puts the repository root first on ``sys.path`` before importing this
module, so the checkout's ``lightning_lowmem`` is measured, not an installed copy.
"""

from __future__ import annotations

import contextlib
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
from typing_extensions import override

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
        "last_level_cache_bytes": last_level_cache_bytes(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache of CPU 0 (Linux sysfs; None elsewhere).

    A memory-bound kernel measures memory only on a working set well beyond it: below, it measures the cache.
    """
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KMGkmg")) * scale)
    return max(sizes, default=None)


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


def command() -> str:
    """The command that made these results, as typed from the repository root.

    ``benchmarks/run.py`` passes its own command line in ``LOWMEM_BENCH_COMMAND`` (``python benchmarks/run.py
    offload``); a script run directly prints itself (``python benchmarks/bench_offload.py``). Both run as printed.
    """
    # NOTE: the runner's line is taken only for the script it started (LOWMEM_BENCH_SCRIPT): a variable left
    # exported in a shell would otherwise label a later direct run with the wrong command
    via_runner = os.environ.get("LOWMEM_BENCH_COMMAND")
    if via_runner and os.environ.get("LOWMEM_BENCH_SCRIPT") == str(Path(sys.argv[0]).resolve()):
        return via_runner
    return " ".join([Path(sys.executable).name, _repo_relative(sys.argv[0]), *sys.argv[1:]])


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
        "command": command(),
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
        f"{fmt_bytes(m['ram_bytes'])} RAM, last-level cache {fmt_bytes(m['last_level_cache_bytes'])}, "
        f"GPU: {m['gpu'] or 'none'}; torch {m['torch']}, lightning {m['lightning']}.\n"
        f"Command: `{payload['command']}`\n\n"
    )
    body = markdown_table(rows, columns)
    md_path.write_text(header + body + "\n" + "".join(f"\n- {n}" for n in notes) + ("\n" if notes else ""))
    print(header + body)
    for n in notes:
        print("-", n)
    return json_path, md_path


def step_probe(at: int | None = 1) -> Any:
    """A Lightning callback that times every step and, unless ``at`` is None, tracks training step ``at`` with
    ``MemoryTracker``.

    Phases follow Lightning's hooks (forward until ``on_before_backward``, backward until
    ``on_after_backward``, then the optimizer). After fit: ``probe.tracker`` and ``probe.times``.
    NOTE: with ``at=None`` the probe has only the batch start/end hooks (nothing runs between backward and the step).
    """
    import lightning as L

    from lightning_lowmem.measure.tracker import MemoryTracker

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.at, self.tracker, self.times, self._t0 = at, None, [], 0.0

        @override
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.at is not None and trainer.global_step == self.at:
                self.tracker = MemoryTracker(module=pl_module, optimizers=trainer.optimizers)
                self.tracker.__enter__()
                self.tracker.track(batch)
                self.tracker.set_phase("forward")
            self._t0 = time.perf_counter()

        @override
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._t0)
            if self.tracker is not None and self.tracker.active:
                self.tracker.set_phase(None)
                self.tracker.__exit__(None, None, None)

    class StepProbe(StepTimes):
        @override
        def on_before_backward(self, trainer, pl_module, loss):
            if self.tracker is not None and self.tracker.active:
                self.tracker.set_phase("backward")

        @override
        def on_after_backward(self, trainer, pl_module):
            if self.tracker is not None and self.tracker.active:
                self.tracker.set_phase("optimizer")

    return StepTimes() if at is None else StepProbe()


def add_gpt2_args(parser: Any, *, rounds: int) -> None:
    """The GPT-2-architecture shape options the activation benchmarks share (12 layers at seq 512 by default)."""
    add_int_args(parser, layers=12, seq=512, width=256, heads=4, batch=2, rounds=rounds)


def build_gpt2(args: Any) -> tuple[torch.nn.Module, torch.Tensor]:
    """A seeded GPT-2-architecture model in train mode from :func:`add_gpt2_args` options, and a batch of ids."""
    from lightning_lowmem.demo.module import build_causal_lm

    torch.manual_seed(0)
    config = {"n_layer": args.layers, "n_embd": args.width, "n_head": args.heads, "n_positions": args.seq, "use_cache": False}
    model = build_causal_lm("gpt2", config)
    model.train()
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return model, ids


def bench_trainer(**kwargs: Any) -> Any:
    """A ``lightning.Trainer`` that only trains: CPU, one device, no logger, checkpoints, progress bar or model
    summary (a benchmark times the step, not the bookkeeping around it). ``kwargs`` add to or override these."""
    import lightning as L

    quiet = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
             "enable_progress_bar": False, "enable_model_summary": False}
    return L.Trainer(**{**quiet, **kwargs})


def lm_sample(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A causal-LM batch (or sample) of token ``ids``: full attention mask, labels = the ids."""
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def lm_batches(n: int, shape: tuple[int, ...], *, vocab: int = 256, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` :func:`lm_sample` of random ids of ``shape``, drawn in turn from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [lm_sample(torch.randint(0, vocab, shape, generator=g)) for _ in range(n)]


def lm_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, tracker: Any = None,
            hooks: Any = None) -> None:
    """One plain training step of a Hugging Face causal LM on ``ids`` (labels = ids): forward under ``hooks``
    (a context manager), backward, optimizer step; phases marked on ``tracker`` (a ``MemoryTracker``) if given."""
    phase = tracker.phase if tracker is not None else (lambda _: contextlib.nullcontext())
    with phase("forward"), hooks if hooks is not None else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def step_clock() -> Any:
    """A Lightning callback that records each training batch's wall and CPU seconds (``.wall``, ``.cpu``), from
    ``on_train_batch_start`` to ``on_train_batch_end``, CUDA synchronised at both ends."""
    import lightning as L

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []
            self._t = (0.0, 0.0)

        @override
        def on_train_batch_start(self, *args: Any) -> None:
            sync()
            self._t = (time.perf_counter(), time.process_time())

        @override
        def on_train_batch_end(self, *args: Any) -> None:
            sync()
            self.wall.append(time.perf_counter() - self._t[0])
            self.cpu.append(time.process_time() - self._t[1])

    return StepClock()


def add_int_args(parser: Any, **defaults: int) -> None:
    """``--name`` integer options with these defaults (``step_steps`` becomes ``--step-steps``), in the given order."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)

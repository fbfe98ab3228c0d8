"""A worker process of ``run_stage.py``: runs some entries of one stage in order, each guarded, each result a file.

``python -m benchmarks.gpu.worker --stage N --entries a,b --state DIR [--rehearsal]``. For each entry it writes
``DIR/<name>.start`` (the runner's clock for that entry's time limit starts there) and, when the entry is done,
``DIR/<name>.json``: ``{"status": "ok" | "failed" | "skipped" | "error", "seconds", "rows", "notes", ...}`` (and,
while it measures, ``DIR/<name>.partial.json``: see :meth:`Context.record`). An exception is recorded with its
traceback; the next entry runs. The runner kills a worker whose entry runs out of time and starts another for the
entries after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # NOTE: run as a file too, the checkout's package and benchmarks first

from benchmarks.gpu.registry import Context, Skip, entries, safe_name, write_json


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, which a container or ``taskset`` narrows), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run_entry(entry: Any, ctx: Context) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        out = dict(entry.fn(ctx))
        out.setdefault("status", "ok")
    except Skip as why:
        out = {"status": "skipped", "reason": str(why)}
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            raise
        out = {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000],
               "traceback": traceback.format_exc()[-6000:]}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--entries", required=True, help="comma-separated entry names, run in this order")
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--rehearsal", action="store_true")
    parser.add_argument("--module", default=None, help="the module holding ENTRIES (default: the stage's)")
    parser.add_argument("--slack", type=float, default=1.0, help="each entry's limit is slack x its budget")
    args = parser.parse_args(argv)
    import torch

    threads = usable_cpus()
    torch.set_num_threads(threads)  # NOTE: the host step and the host casts run at the machine's thread count
    ctx = Context(stage=args.stage, rehearsal=args.rehearsal, state_dir=args.state, repo=REPO, threads=threads)
    by_name = {e.name: e for e in entries(args.stage, args.module)}
    for name in args.entries.split(","):
        entry = by_name[name]
        start = time.time()
        ctx.entry, ctx.deadline = name, start + args.slack * entry.budget_s
        (args.state / f"{safe_name(name)}.start").write_text(str(start))
        print(f"--- {name} ---", flush=True)
        result = run_entry(entry, ctx)
        write_json(args.state / f"{safe_name(name)}.json", result)
        print(f"--- {name}: {result['status']} in {result['seconds']} s ---", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What serving both Lightning packages costs at import: ``import lightning_lowmem`` before and after, and the
``pytorch_lightning`` build (``lightning_lowmem.pl``, compiled from the source at import) against the ``lightning`` one.

Part 1: ``import lightning_lowmem`` in a fresh interpreter, its cumulative time from ``python -X importtime``, for the
checkout and for the package at ``--baseline`` (a git revision, extracted to a temporary folder), interleaved
(A B A B ...), ``--rounds`` each; the median is the figure (2 busy cores: single runs vary by 3x).
Part 2: in a fresh interpreter with its Lightning package already imported, the time to import the public classes a
``pytorch_lightning`` user of neuralforecast reaches first (``OffloadStrategy``, ``ActivationCheckpointing``,
``AccumulationScheduler``) from ``lightning_lowmem`` (bytecode cached) and from ``lightning_lowmem.pl`` (each module
parsed, rewritten and compiled in memory, no cache), and how many modules each build loaded.

Usage: ``python benchmarks/run.py import_time [--rounds 15] [--baseline REV]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: run as a file, only benchmarks/ is on the path
from benchmarks._harness import write_results

ROOT = Path(__file__).resolve().parents[1]
_CLASSES = "OffloadStrategy, ActivationCheckpointing, AccumulationScheduler"
_BUILD = """
import json, sys, time
import {lightning}
t = time.perf_counter()
from {build} import {classes}
s = time.perf_counter() - t
print(json.dumps({{"seconds": s, "modules": sum(m.startswith("{build}.") for m in sys.modules)}}))
"""


def _import_us(folder: Path) -> int:
    """``import lightning_lowmem``'s cumulative microseconds in a fresh interpreter, the package taken from ``folder``."""
    env = {**os.environ, "PYTHONPATH": str(folder)}
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import lightning_lowmem"], cwd=folder, env=env,
                         capture_output=True, text=True, check=True).stderr
    line = next(line for line in out.splitlines() if line.rstrip().endswith("| lightning_lowmem"))
    return int(line.split("|")[1])


def _extract(rev: str, into: Path) -> Path:
    data = subprocess.run(["git", "archive", rev, "lightning_lowmem"], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(data.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def _build(lightning: str, build: str) -> dict[str, float]:
    code = _BUILD.format(lightning=lightning, build=build, classes=_CLASSES)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--baseline", default="6194738", help="git revision of the package before the change")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        baseline = _extract(args.baseline, Path(tmp))
        _import_us(baseline), _import_us(ROOT)  # NOTE: bytecode written, page cache warm
        before, after = [], []
        for _ in range(args.rounds):
            before.append(_import_us(baseline))
            after.append(_import_us(ROOT))
    rows = [
        {"variant": f"import lightning_lowmem at {args.baseline}", "median_ms": statistics.median(before) / 1e3,
         "min_ms": min(before) / 1e3, "runs": len(before)},
        {"variant": "import lightning_lowmem at the checkout", "median_ms": statistics.median(after) / 1e3,
         "min_ms": min(after) / 1e3, "runs": len(after)},
    ]
    _build("lightning", "lightning_lowmem"), _build("pytorch_lightning", "lightning_lowmem.pl")  # NOTE: warm
    for lightning, build in [("lightning", "lightning_lowmem"), ("pytorch_lightning", "lightning_lowmem.pl")]:
        runs = [_build(lightning, build) for _ in range(max(3, args.rounds // 3))]
        seconds = [r["seconds"] for r in runs]
        rows.append({"variant": f"from {build} import {_CLASSES} (after import {lightning})",
                     "median_ms": statistics.median(seconds) * 1e3, "min_ms": min(seconds) * 1e3,
                     "runs": len(runs), "modules": runs[0]["modules"]})
    write_results(
        "import_time", rows, ["variant", "median_ms", "min_ms", "runs", "modules"],
        title="Import time: lightning_lowmem, and its build for pytorch_lightning (lightning_lowmem.pl)",
        notes=[
            ("`import lightning_lowmem` imports the same modules before and after (no Lightning package): the change "
             "adds a finder class to `lightning_lowmem._registry` and registers the names with pytorch_lightning's "
             "registry when that is imported, where a guard refused them before."),
            ("lightning_lowmem.pl compiles its modules in memory in every process (no bytecode cache; `ast` and the "
             "compiler are imported with its first module): its first import costs the difference of the last two "
             "rows, once per process, for pytorch_lightning users only."),
        ],
    )


if __name__ == "__main__":
    main()

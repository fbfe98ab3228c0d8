"""The conformance sweep: every module of the corpus x every flag (and, on the callback hosts, x Lightning's own
callbacks), each cell judged against plain Lightning, plus the dry run per module.

    python tests/conformance/run.py                      # the whole sweep (`make conformance`), resumable
    python tests/conformance/run.py --modules 'hf_*' --groups torch --flags lowmem_offload   # a shard
    python tests/conformance/run.py --report             # rewrite conformance.json / .md from the store

Each (module, group) runs in its own worker process (a fresh interpreter: ``worker.py``), one at a time, at
``nice`` 10 and one torch thread. Every finished cell is appended to ``benchmarks/results/conformance.cells.jsonl``
with the fingerprint of the code it ran (the package and this harness, file contents, and library versions): a sweep
stopped at any point resumes where it stopped, and a sweep after any change to the code re-runs every cell
(``--fresh`` re-runs regardless). A worker that dies or runs over ``--worker-timeout`` has its current cell recorded
as a ``crash`` and is restarted after it. ``--report`` (also run at the end of every sweep) writes
``benchmarks/results/conformance.json`` and ``conformance.md`` from the rows of the current fingerprint.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.conformance.worker import GROUPS, append, cells, done

RESULTS = ROOT / "benchmarks" / "results"
# harness files that do not change a verdict (a change to them does not re-run the sweep)
_NOT_VERDICTS = {"run.py", "report.py", "screen.py", "known_bugs.py", "test_slice.py", "test_harness.py", "__init__.py"}
STORE = RESULTS / "conformance.cells.jsonl"


def fingerprint() -> str:
    """A hash of the code a cell's verdict depends on: the package, this harness (their syntax trees: comments and
    formatting do not count), and the library versions."""
    h = hashlib.sha256()
    harness = ROOT / "tests" / "conformance"
    paths = [*sorted((ROOT / "lightning_lowmem").rglob("*.py")), *sorted(harness.glob("*.py"))]
    for path in paths:
        if path.parent == harness and path.name in _NOT_VERDICTS:
            continue
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(ast.dump(ast.parse(path.read_bytes())).encode())
    from importlib import metadata

    for dist in ("torch", "lightning", "transformers", "deepspeed", "peft", "bitsandbytes", "torchmetrics"):
        try:
            h.update(f"{dist}=={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}: absent".encode())
    return h.hexdigest()[:16]


def _tasks(modules: list[str], groups: list[str], flags: list[str]) -> list[tuple[str, str, int]]:
    """(module, group, cells) of the sweep, modules in corpus order, groups in GROUPS order."""
    from tests.conformance.corpus import MODULES

    names = [m for m in MODULES if not modules or any(fnmatch.fnmatch(m, p) for p in modules)]
    out = []
    for module in names:
        for group in groups:
            n = len(cells(module, group, flags))
            if n:
                out.append((module, group, n))
    return out


def _worker(module: str, group: str, flags: list[str], fp: str, store: Path, log, timeout: float,
            nice: int) -> None:
    """Run the worker until its cells are all in the store; record the cell of a worker that died as a crash."""
    current = Path(tempfile.gettempdir()) / f"conformance-current-{os.getpid()}.json"
    for attempt in range(50):
        current.unlink(missing_ok=True)
        command = [sys.executable, "-m", "tests.conformance.worker", "--module", module, "--group", group, "--store",
                   str(store), "--fingerprint", fp, "--current", str(current), "--flags", ",".join(flags)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        if nice:  # NOTE: `nice` itself, not preexec_fn (unsafe with threads)
            command = ["nice", "-n", str(nice), *command]
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = f"killed after the worker timeout of {timeout:.0f} s"
        except BaseException:  # the sweep itself is stopped: so is its worker (its finished cells are kept)
            process.kill()
            process.wait()
            raise
        if code == 0:
            return
        if not current.exists():  # died before its first cell: nothing to resume from
            print(f"  worker {module}/{group} failed to start (exit {code}); see the log", flush=True)
            return
        row = json.loads(current.read_text())
        reason = code if isinstance(code, str) else f"exit status {code}" if code > 0 else f"signal {-code}"
        row.update(verdict="crash", detail=f"the worker process died while running this cell ({reason})",
                   fingerprint=fp, seconds=None)
        append(store, row)
        print(f"  crash    {row['module']} | {row['flag']} (worker died: {reason}); restarting (try {attempt + 2})",
              flush=True)


def sweep(args: argparse.Namespace) -> None:
    fp = fingerprint()
    store = Path(args.store)
    store.parent.mkdir(parents=True, exist_ok=True)
    if args.fresh and store.exists():
        kept = [line for line in store.read_text().splitlines() if f'"fingerprint": "{fp}"' not in line]
        store.write_text("".join(line + "\n" for line in kept))
    tasks = _tasks(args.modules, args.groups, args.flags)
    finished = done(store, fp)
    print(f"fingerprint {fp}: {sum(n for *_, n in tasks)} cells in {len(tasks)} worker runs, "
          f"{len(finished)} already in {store}", flush=True)
    started = time.time()
    log_path = Path(args.log)
    # NOTE: a sweep stopped by a signal still records its wall time (the results' total sweep time counts it)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    try:
        with open(log_path, "a") as log:
            for i, (module, group, n) in enumerate(tasks, 1):
                todo = sum(1 for f, c in cells(module, group, args.flags) if (module, _name(f, c)) not in finished)
                if not todo:
                    continue
                t0 = time.time()
                print(f"[{i}/{len(tasks)}] {module} / {group}: {todo} of {n} cells", flush=True)
                _worker(module, group, args.flags, fp, store, log, args.worker_timeout, args.nice)
                print(f"    {time.time() - t0:.0f} s", flush=True)
    finally:
        append(store, {"session": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": round(time.time() - started, 1),
                       "fingerprint": fp, "argv": sys.argv[1:]})
    from tests.conformance.report import write

    write(store, fp, RESULTS)


def _name(flag, companion) -> str:
    from tests.conformance.worker import cell_name

    return cell_name(flag, companion)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", default="", help="comma-separated names or patterns (default: all)")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    parser.add_argument("--flags", default="", help="comma-separated substrings of the cell names to run")
    parser.add_argument("--fresh", action="store_true", help="re-run cells already done with this code")
    parser.add_argument("--report", action="store_true", help="only rewrite conformance.json/.md from the store")
    parser.add_argument("--store", default=str(STORE))
    parser.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "lightning_lowmem_conformance.log"))
    parser.add_argument("--worker-timeout", type=float, default=3600)
    parser.add_argument("--nice", type=int, default=10)
    args = parser.parse_args(argv)
    args.modules = [m for m in args.modules.split(",") if m]
    args.groups = [g for g in args.groups.split(",") if g]
    args.flags = [f for f in args.flags.split(",") if f]
    unknown = sorted(set(args.groups) - set(GROUPS))
    if unknown:
        parser.error(f"unknown group(s) {unknown}; expected some of {', '.join(GROUPS)}")
    if args.report:
        from tests.conformance.report import write

        write(Path(args.store), fingerprint(), RESULTS)
        return 0
    sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

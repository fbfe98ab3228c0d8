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
``benchmarks/results/conformance.json`` and ``conformance.md`` from the latest row of every cell of the corpus, each
labelled with the fingerprint of the code it ran at (the headline counts the cells at the current code and at each
earlier one).

After a fix, ``--rerun-failed`` re-runs at the current code only the cells whose latest row (at any fingerprint) is
``differs``, ``crash``, ``off`` or ``n/a`` (an n/a is an error: plain Lightning's own run failed), and the cells that
never ran; a cell whose latest row already ran at the current code is not re-run (``--fresh`` re-runs it). The other
cells keep their rows from the code they ran at, and the report says so.

    python tests/conformance/run.py --rerun-failed      # then the report, as after every sweep
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
FAILING = ("differs", "crash", "off", "n/a")  # what --rerun-failed re-runs (n/a: plain Lightning's own run failed)


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
            nice: int, only: list[str] | None = None) -> None:
    """Run the worker until its cells (``only``: these names) are all in the store; record the cell of a worker that
    died as a crash."""
    current = Path(tempfile.gettempdir()) / f"conformance-current-{os.getpid()}.json"
    only_path = Path(tempfile.gettempdir()) / f"conformance-only-{os.getpid()}.json"
    if only is not None:
        only_path.write_text(json.dumps(only))
    for attempt in range(50):
        current.unlink(missing_ok=True)
        command = [sys.executable, "-m", "tests.conformance.worker", "--module", module, "--group", group, "--store",
                   str(store), "--fingerprint", fp, "--current", str(current), "--flags", ",".join(flags)]
        if only is not None:
            command += ["--only", str(only_path)]
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


def commit() -> str:
    """The checkout's commit, ``+changes`` when the package or the harness differ from it (the sessions record it, so
    the report can say which commit a fingerprint was)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--", "lightning_lowmem", "tests/conformance")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+changes" if dirty else "")


def to_rerun(store: Path, tasks: list[tuple[str, str, int]], flags: list[str], which: str = "all") -> set[tuple[str, str]]:
    """(module, cell) of the sweep whose latest row, at any fingerprint, is FAILING, or that never ran; ``which``:
    ``known`` only those a ``known_bugs.py`` entry explains, ``unknown`` only the others (``all``: both)."""
    from tests.conformance.known_bugs import classify
    from tests.conformance.report import latest

    rows = latest(store)
    out = set()
    for module, group, _ in tasks:
        for f, c in cells(module, group, flags):
            row = rows.get((module, _name(f, c)))
            if row is None or row["verdict"] in FAILING:
                known = row is not None and classify({"detail": "", **row}) is not None
                if which == "all" or (which == "known") == known:
                    out.add((module, _name(f, c)))
    return out


def sweep(args: argparse.Namespace) -> None:
    fp, at = fingerprint(), commit()  # NOTE: the commit when the sweep starts (its code), not when it ends
    store = Path(args.store)
    store.parent.mkdir(parents=True, exist_ok=True)
    if args.fresh and store.exists():
        kept = [line for line in store.read_text().splitlines() if f'"fingerprint": "{fp}"' not in line]
        store.write_text("".join(line + "\n" for line in kept))
    tasks = _tasks(args.modules, args.groups, args.flags)
    finished = done(store, fp)
    wanted = to_rerun(store, tasks, args.flags, args.which) if args.rerun_failed else None
    if wanted is not None:
        tasks = [(m, g, n) for m, g, n in tasks if any((m, _name(f, c)) in wanted for f, c in cells(m, g, args.flags))]
        print(f"--rerun-failed: {len(wanted)} cells whose latest row is {'/'.join(FAILING)} or missing, "
              f"{len(wanted & finished)} of them already at this code", flush=True)
    print(f"fingerprint {fp}: {sum(n for *_, n in tasks)} cells in {len(tasks)} worker runs, "
          f"{len(finished)} already in {store}", flush=True)
    started = time.time()
    log_path = Path(args.log)
    # NOTE: a sweep stopped by a signal still records its wall time (the results' total sweep time counts it)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    try:
        with open(log_path, "a") as log:
            for i, (module, group, n) in enumerate(tasks, 1):
                names = [_name(f, c) for f, c in cells(module, group, args.flags)
                         if (module, _name(f, c)) not in finished and (wanted is None or (module, _name(f, c)) in wanted)]
                if not names:
                    continue
                t0 = time.time()
                print(f"[{i}/{len(tasks)}] {module} / {group}: {len(names)} of {n} cells", flush=True)
                _worker(module, group, args.flags, fp, store, log, args.worker_timeout, args.nice,
                        names if wanted is not None else None)
                print(f"    {time.time() - t0:.0f} s", flush=True)
    finally:
        append(store, {"session": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": round(time.time() - started, 1),
                       "fingerprint": fp, "commit": at, "argv": sys.argv[1:]})
    from tests.conformance.report import write

    write(store, fp, _results(store, args.results))


def _results(store: Path, results: str) -> Path:
    """Where the report goes: ``benchmarks/results`` for the sweep's own store, beside any other store (a shard's
    store in /tmp must not overwrite the committed results)."""
    if results:
        return Path(results)
    return RESULTS if store.resolve() == STORE.resolve() else store.with_name(store.stem + "-report")


def _name(flag, companion) -> str:
    from tests.conformance.worker import cell_name

    return cell_name(flag, companion)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", default="", help="comma-separated names or patterns (default: all)")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    parser.add_argument("--flags", default="", help="comma-separated substrings of the cell names to run")
    parser.add_argument("--fresh", action="store_true", help="re-run cells already done with this code")
    parser.add_argument("--rerun-failed", action="store_true", help="re-run only the cells whose latest row (any "
                        f"code) is {'/'.join(FAILING)}, and those never run")
    parser.add_argument("--which", choices=("all", "known", "unknown"), default="all", help="with --rerun-failed: "
                        "only the failing cells a known_bugs.py entry explains (known), only the others (unknown)")
    parser.add_argument("--report", action="store_true", help="only rewrite conformance.json/.md from the store")
    parser.add_argument("--store", default=str(STORE))
    parser.add_argument("--results", default="", help="the report's directory (default: benchmarks/results for the "
                        "default store, STORE-report/ beside any other)")
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

        write(Path(args.store), fingerprint(), _results(Path(args.store), args.results))
        return 0
    sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run one benchmark script, or all of them: ``python benchmarks/run.py NAME [ARGS...]`` / ``... all``.

Each ``benchmarks/bench_NAME.py`` writes ``benchmarks/results/NAME.json`` and ``NAME.md``.
Benchmarks run one at a time (a lock file serialises them), since two at once on a small machine
would measure each other.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))


def run(name: str, args: list[str]) -> int:
    script = HERE / f"bench_{name}.py"
    if not script.is_file():
        print(f"Passed benchmark {name!r}; expected one of: {', '.join(available())} (or 'all').", file=sys.stderr)
        return 2
    with open("/tmp/lightning_lowmem_bench.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
            # the results' "Command:" line: this run as typed from the repository root (see _harness.command)
            "LOWMEM_BENCH_COMMAND": shlex.join([Path(sys.executable).name, "benchmarks/run.py", name, *args]),
            "LOWMEM_BENCH_SCRIPT": str(script),
        }
        return subprocess.call([sys.executable, str(script), *args], env=env)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Available:", ", ".join(available()))
        return 0
    if argv[0] == "all":
        return max([run(name, argv[1:]) for name in available()] or [0])
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

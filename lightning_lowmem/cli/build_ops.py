"""``lowmem build-ops``: build DeepSpeed's CPU ops ahead of time, removing stale build locks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_lowmem.core.ops_build import DEFAULT_OPS, build_ops


def main(argv: Sequence[str] | None = None) -> int:
    """``lowmem build-ops [--op CPUAdamBuilder ...] [--keep-stale-locks]``."""
    parser = argparse.ArgumentParser(prog="lowmem build-ops", description="Build DeepSpeed's CPU ops ahead of time "
                                     "(cpu_adam, shm collectives), removing stale build locks.")
    parser.add_argument("--op", action="append", dest="ops", metavar="BUILDER",
                        help=f"a DeepSpeed op builder class name (repeatable; default: {', '.join(DEFAULT_OPS)})")
    parser.add_argument("--keep-stale-locks", action="store_true", help="fail on a stale lock instead of removing it")
    args = parser.parse_args(list(argv) if argv is not None else None)
    for line in build_ops(args.ops or DEFAULT_OPS, remove_stale=not args.keep_stale_locks):
        print(line)
    sys.stdout.flush()
    return 0

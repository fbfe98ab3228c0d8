"""One worker process of the sweep: the cells of one module and one group, appended to the store as they finish.

Started by ``run.py`` as a fresh interpreter (never a fork). Cells already in the store with this fingerprint are
skipped, so a worker that died is restarted where it stopped; the cell running when it died is named in
``--current`` for the runner to record as a crash. Between cells the process-wide state a run may change (default
dtype, grad mode, ``F.linear``, which DeepSpeed ZeRO-3 patches, the process group, the distributed environment
variables) is put back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GROUPS = ("torch", "deepspeed", "callbacks", "callbacks-deepspeed", "dry_run")
CELL_TIMEOUT_S = 300
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def cells(module: str, group: str, flag_filter: list[str] | None = None) -> list[tuple[Any, Any]]:
    """(flag, companion) pairs of one module and group (``flag`` a dry-run config name for ``dry_run``)."""
    from tests.conformance.companions import COMPANIONS
    from tests.conformance.corpus import CALLBACK_HOSTS, MODULES
    from tests.conformance.dryrun import CONFIGS
    from tests.conformance.flags import FLAGS

    spec = MODULES[module]
    if group == "dry_run":
        out: list[tuple[Any, Any]] = [(c, None) for c in CONFIGS]
    elif group in ("torch", "deepspeed"):
        out = [(f, None) for f in FLAGS if f.group == group and f.applies(spec) is None]
    elif module not in CALLBACK_HOSTS:
        out = []
    else:
        ds = group == "callbacks-deepspeed"
        flags = [f for f in FLAGS if f.applies(spec) is None and (
            f.group == "torch" if not ds else (f.group == "deepspeed" and "+" not in f.name))]
        out = [(f, c) for c in COMPANIONS if c.applies(spec) is None for f in flags]
    if flag_filter:
        out = [(f, c) for f, c in out if any(part in cell_name(f, c) for part in flag_filter)]
    return out


def cell_name(flag: Any, companion: Any) -> str:
    name = flag if isinstance(flag, str) else flag.name
    if isinstance(flag, str):
        return f"dry_run:{name}"
    return name + (f" + {companion.name}" if companion is not None else "")


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout(f"the cell ran over {CELL_TIMEOUT_S} s")


@contextlib.contextmanager
def _global_state_kept() -> Any:
    import torch

    dtype, grad, linear = torch.get_default_dtype(), torch.is_grad_enabled(), torch.nn.functional.linear
    matmul, autocast_cache = torch.get_float32_matmul_precision(), torch.is_autocast_cache_enabled()
    env = {k: os.environ.get(k) for k in (*_DIST_VARS, "PL_GLOBAL_SEED")}
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.nn.functional.linear = linear
        torch.set_float32_matmul_precision(matmul)
        torch.set_autocast_cache_enabled(autocast_cache)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.compiler.reset()


def done(store: Path, fingerprint: str) -> set[tuple[str, str]]:
    """(module, flag) of the store's rows made with ``fingerprint``."""
    out = set()
    if store.exists():
        for line in store.read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if row.get("fingerprint") == fingerprint and "verdict" in row:
                    out.add((row["module"], row["flag"]))
    return out


def append(store: Path, row: dict[str, Any]) -> None:
    """One line, written whole and flushed to disk (a killed sweep keeps every finished cell)."""
    with open(store, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_lowmem", "deepspeed", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--module", required=True)
    parser.add_argument("--group", required=True, choices=GROUPS)
    parser.add_argument("--store", required=True, type=Path)
    parser.add_argument("--fingerprint", required=True)
    parser.add_argument("--current", required=True, type=Path)
    parser.add_argument("--flags", default="")
    parser.add_argument("--only", type=Path, default=None, help="a JSON list of the cell names to run (others skipped)")
    args = parser.parse_args(argv)
    _quiet()
    import torch

    torch.set_num_threads(1)
    import lightning_lowmem  # noqa: F401  (registers the strategy names)
    from tests.conformance.cell import run_cell
    from tests.conformance.corpus import MODULES
    from tests.conformance.dryrun import check

    spec = MODULES[args.module]
    finished = done(args.store, args.fingerprint)
    only = set(json.loads(args.only.read_text())) if args.only is not None else None
    signal.signal(signal.SIGALRM, _alarm)
    for flag, companion in cells(args.module, args.group, [f for f in args.flags.split(",") if f]):
        name = cell_name(flag, companion)
        if (spec.name, name) in finished or (only is not None and name not in only):
            continue
        args.current.write_text(json.dumps({"module": spec.name, "flag": name, "group": args.group}))
        signal.alarm(CELL_TIMEOUT_S)
        try:
            with _global_state_kept():
                row = check(spec, flag) if args.group == "dry_run" else run_cell(spec, flag, companion)
        finally:
            signal.alarm(0)
        row.update(group=args.group, fingerprint=args.fingerprint, finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
        append(args.store, row)
        print(f"{row['verdict']:8s} {spec.name} | {name}", flush=True)
    args.current.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

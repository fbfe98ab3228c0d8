"""Checks before the first step of what would otherwise fail after it, or wait forever (private helper of strategies).

An unwritable ``ModelCheckpoint`` directory (:func:`checkpoint_dir_problems`), ``LOCAL_RANK`` without
``WORLD_SIZE`` (:func:`launch_problem`), and :class:`SlowStartNotice` for a slow start-up step.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import Self

from lightning_lowmem._internals import lightning as lightning_internals
from lightning_lowmem.core import ops_build as _ops_build


def writable_problem(directory: str | os.PathLike) -> str | None:
    """Why a checkpoint cannot be written into ``directory`` (created if missing), or None."""
    path = Path(directory).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{str(path)!r} cannot be created: {str(existing)!r} is a file"
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".lowmem-write-probe-")
    except OSError as err:
        where = "" if existing == path else f" (it does not exist yet, and its parent {str(existing)!r} cannot be written)"
        return f"{str(path)!r} cannot be written{where}: {err.strerror or err}"
    os.close(fd)
    os.unlink(probe)
    return None


def checkpoint_dir_problems(trainer: Any) -> list[str]:
    """A problem line for each ``ModelCheckpoint`` of a fitting ``trainer`` whose directory cannot be written."""
    if trainer.state.fn != TrainerFn.FITTING:
        return []
    problems = []
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
        if not dirpath or not lightning_internals.is_local_file_protocol(dirpath):
            continue
        problem = writable_problem(dirpath)
        if problem is not None:
            problems.append(
                f"the checkpoint directory {problem}; the first save (after training started) would fail. Pass a "
                "writable `ModelCheckpoint(dirpath=...)` / `Trainer(default_root_dir=...)`, fix the directory's "
                "permissions or mount, or `Trainer(enable_checkpointing=False)`"
            )
    return problems


def launch_problem(strategy: Any) -> str | None:
    """Why no process would ever join this one (a stray ``LOCAL_RANK``), or None."""
    env = strategy.cluster_environment
    processes = len(strategy.parallel_devices or []) * strategy.num_nodes
    if not isinstance(env, LightningEnvironment) or not env.creates_processes_externally or processes <= 1:
        return None
    if "WORLD_SIZE" in os.environ:
        return None
    return (
        f"`LOCAL_RANK={os.environ.get('LOCAL_RANK')}` is set in the environment, so Lightning takes it that a launcher "
        f"(torchrun, srun) started the {processes} processes and starts none itself; but WORLD_SIZE is not set, so "
        f"none did, and this process would wait forever at 'initializing deepspeed distributed' for the other "
        f"{processes - 1}. Unset it (`env -u LOCAL_RANK python train.py`) to have Lightning start the processes, or "
        f"launch them: `torchrun --nproc-per-node {len(strategy.parallel_devices or [])} train.py`"
    )


class SlowStartNotice:
    """``with SlowStartNotice("DeepSpeed's distributed start-up", hint):`` prints, every ``LOWMEM_WAIT_NOTICE_S``
    seconds (default 60), the step, the time so far, the build locks present and ``hint`` on stderr."""

    def __init__(self, step: str, hint: str = "") -> None:
        self.step, self.hint = step, hint
        self.interval = float(os.environ.get("LOWMEM_WAIT_NOTICE_S", "60"))
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="lowmem-slow-start-notice", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _run(self) -> None:
        start = time.monotonic()
        while not self._done.wait(self.interval):
            locks = _ops_build.build_locks()
            waiting = (
                " Build locks present: " + "; ".join(lock.describe() for lock in locks) + " (a lock held by no process "
                "and unchanged for minutes is left by an interrupted build: remove it, then `lowmem build-ops`)."
                if locks else ""
            )
            print(
                f"lowmem: {self.step} has taken {time.monotonic() - start:.0f} s so far.{waiting} {self.hint}".rstrip(),
                file=sys.stderr, flush=True,
            )


OP_BUILD_HINT = (
    "The first use of a DeepSpeed op compiles it (`cpu_adam`: about 2 min on 2 cores), once per TORCH_EXTENSIONS_DIR; "
    "`lowmem build-ops` does it ahead of time."
)


class LaunchError(RuntimeError):
    """The processes of a multi-process run were not started; this one would wait for them forever."""


def check_start(strategy: Any) -> None:
    """Refuse a start that would wait forever: a stray ``LOCAL_RANK``, a stale DeepSpeed op-build lock."""
    problem = launch_problem(strategy)
    if problem is not None:
        raise LaunchError(f"`{type(strategy).__name__}`: {problem}.")
    locks = _ops_build.stale_locks()  # NOTE: before DeepSpeed would wait on one
    if locks:
        raise _ops_build.StaleBuildLockError(_ops_build.stale_lock_message(locks, f"`{type(strategy).__name__}`"))


def rendezvous_notice(strategy: Any) -> SlowStartNotice:
    """The notice for DeepSpeed's distributed start-up (rendezvous of every process, the CPU collectives' op build)."""
    world = len(strategy.parallel_devices or []) * strategy.num_nodes
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    launcher = (
        "Lightning started them" if not getattr(strategy.cluster_environment, "creates_processes_externally", False)
        else "a launcher is expected to have started them (LOCAL_RANK is set)"
    )
    return SlowStartNotice(
        f"DeepSpeed's distributed start-up (rank {strategy.global_rank} of {world}, meeting at {address}; {launcher})",
        "It waits for every process to arrive; if some are not running (crashed, never started), stop this one. "
        + OP_BUILD_HINT,
    )

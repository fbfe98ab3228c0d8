"""The GPU stages' entries: what each stage measures, how long each part may take, and the slots for later work.

A stage is a list of :class:`Entry`. ``run_stage.py`` runs them in order, each guarded (an entry that fails records
its error and the stage goes on) and each under its own time limit (``budget_s``); the budgets of a stage, plus a
process start per ``fresh`` entry and the wheel install, add up to at most :data:`STAGE_BUDGET_S` (7 minutes), so a
stage and one rerun fit the 15 minutes of device time a task is lent, machine start included, when it ends early.

To add a measurement: write ``def my_entry(ctx) -> dict`` in ``stage{N}.py`` (see :class:`Context`), and put an
``Entry`` in that module's ``ENTRIES`` (replacing its planned slot, if one is listed); ``tests/test_gpu_stages.py``
lists every stage's entries and checks the budgets. An entry that measures for long calls :meth:`Context.record`
with what it has so far: the runner writes it out at once, and keeps it if the entry is cut short.

This module imports nothing heavy (no torch): the tests build the registry in milliseconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: a stage's wall-clock limit: 7 minutes (a task gets 15 minutes of device time, the machine's start included)
STAGE_BUDGET_S = 420
#: the wheel install and the runner's own start, before the first entry
SETUP_RESERVE_S = 20
#: one worker process start (python, torch, lightning, transformers imported), counted per process
PROCESS_START_S = 10
STAGES = (1, 2, 3, 4, 5, 6)
#: in the CPU rehearsal an entry is stopped at twice its budget: the budgets are the GPU machine's (full sizes, 16
#: cores), and the rehearsal's fixed costs (imports, Trainer setup) run on 2 shared cores;
#: the stage as a whole must still end inside :data:`STAGE_BUDGET_S`
REHEARSAL_SLACK = 2.0


class Skip(Exception):
    """Raised by an entry that cannot run on this machine (the reason is recorded; the stage goes on)."""


def need(module: str, why: str, wheel: str | None = None) -> None:
    """Skip the entry when ``module`` cannot be imported, naming why it is needed and the wheel that carries it."""
    if importlib.util.find_spec(module) is None:
        raise Skip(f"{module} is not installed: {why} (carry its wheel {wheel or module}: make gpu-wheels)")


@dataclass(frozen=True)
class Entry:
    """One guarded measurement of a stage.

    ``fn(ctx)`` returns ``{"rows": [...], "notes": [...], "figures": [...], "status": "ok" | "failed"}`` (all
    optional; ``status`` "failed" when it ran and what it checks did not hold, e.g. a CUDA test failed; ``figures``:
    the results page's lines, see ``report.py``). ``fresh``: run in a new process (clean allocator statistics and
    pinned host memory; the host RAM of an earlier entry returned). ``fn=None`` with ``planned`` set is a slot kept
    for later work: listed in the results, never run.
    """

    name: str
    budget_s: int
    fn: Callable[[Context], dict[str, Any]] | None
    what: str
    fresh: bool = False
    planned: str = ""


@dataclass
class Context:
    """What an entry gets: where it runs and how big, its deadline, and the results of the entries before it."""

    stage: int
    rehearsal: bool
    state_dir: Path
    repo: Path
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    entry: str = ""
    deadline: float = math.inf

    @property
    def device(self) -> str:
        """``"cuda"`` on the GPU machine; ``"cpu"`` in the rehearsal (CUDA parts run on the deferred stand-in)."""
        return "cpu" if self.rehearsal else "cuda"

    def seconds_left(self) -> float:
        """Seconds until the runner stops this entry (its budget from its start)."""
        return self.deadline - time.time()

    def prior(self, name: str) -> dict[str, Any] | None:
        """The recorded result of an earlier entry of this stage (None if it did not run or did not finish)."""
        path = self.state_dir / f"{safe_name(name)}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def record(self, result: dict[str, Any]) -> None:
        """What this entry has measured so far (rows, notes, figures): written to the results at once, and kept as
        the entry's result if it is cut short (its time runs out, its worker dies, the machine is taken back)."""
        write_json(self.state_dir / f"{safe_name(self.entry)}.partial.json", result)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically (the runner polls for the file: it must never read half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def safe_name(name: str) -> str:
    """An entry name as a file name: letters, digits, ``.``, ``_`` and ``-`` only."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def entries(stage: int, module: str | None = None) -> list[Entry]:
    """The entries of ``stage`` (``ENTRIES`` of ``benchmarks.gpu.stage{N}``, or of ``module``), in the order they run."""
    if module is None and stage not in STAGES:
        raise ValueError(f"Passed stage {stage!r}; expected one of {', '.join(map(str, STAGES))}.")
    return list(importlib.import_module(module or f"benchmarks.gpu.stage{stage}").ENTRIES)


def processes(stage_entries: list[Entry]) -> int:
    """Worker processes a stage starts when nothing times out: one, plus one per ``fresh`` entry after the first."""
    runnable = [e for e in stage_entries if e.fn is not None]
    return 1 + sum(1 for i, e in enumerate(runnable) if e.fresh and i > 0)


def worst_case_s(stage_entries: list[Entry]) -> int:
    """The stage's wall time if every entry ran out its budget: budgets + process starts + the setup reserve."""
    budgets = sum(e.budget_s for e in stage_entries if e.fn is not None)
    return budgets + PROCESS_START_S * processes(stage_entries) + SETUP_RESERVE_S

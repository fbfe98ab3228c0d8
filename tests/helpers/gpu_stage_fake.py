"""A fake GPU stage for tests/test_gpu_stages.py: one entry of each outcome the runner must survive."""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.gpu.registry import Context, Entry, Skip


def ok(ctx: Context) -> dict[str, Any]:
    return {"rows": [{"x": 1, "rehearsal": ctx.rehearsal, "threads": ctx.threads}]}


def raises(ctx: Context) -> dict[str, Any]:
    raise RuntimeError("planted failure")


def hangs(ctx: Context) -> dict[str, Any]:
    time.sleep(3600)
    return {}


def skips(ctx: Context) -> dict[str, Any]:
    raise Skip("needs something this machine lacks")


def crashes(ctx: Context) -> dict[str, Any]:
    os._exit(3)  # NOTE: a segfault in an extension looks like this to the runner


def reads_prior(ctx: Context) -> dict[str, Any]:
    first = ctx.prior("ok")
    return {"rows": [{"prior_status": first["status"] if first else None}]}


ENTRIES = [
    Entry("ok", 30, ok, "returns a row"),
    Entry("raises", 30, raises, "raises"),
    Entry("hangs", 2, hangs, "runs past its budget"),
    Entry("skips", 30, skips, "cannot run here"),
    Entry("crashes", 30, crashes, "kills its worker"),
    Entry("reads_prior", 30, reads_prior, "reads an earlier entry's result"),
    Entry("later", 0, None, "a slot", planned="comes later"),
]

"""Python frame inspection: the only module of the package that walks the call stack or a traceback's frames
(``sys._getframe`` is a CPython implementation detail; reading who called us is fragile enough to live in one place)."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

#: every implementation-private name used here, checked by tests/test_internals.py
PRIVATE_SYMBOLS = ("sys._getframe",)


def caller_frame(depth: int = 1) -> FrameType:
    """The frame ``depth`` levels above the caller of this function (1: the caller's caller)."""
    return sys._getframe(depth + 1)


def raising_instances(err: BaseException) -> list[Any]:
    """The ``self`` of each frame ``err`` was raised through, outermost first (None where a frame has none): how the
    planner finds which technique refused a run (by object, not by message)."""
    out = []
    tb = err.__traceback__
    while tb is not None:
        out.append(tb.tb_frame.f_locals.get("self"))
        tb = tb.tb_next
    return out

"""Cells whose ``differs``/``crash`` is a known bug, with where it is followed: the report sorts the sweep's failures
into these and new ones, and the fast slice marks these ``xfail`` (not strict: a fix turns them green by itself).

``BEING_FIXED``: bugs colleagues are fixing in the package. ``REPRODUCED``: bugs this sweep found, each with a minimal
reproduction under ``tests/conformance/known/`` (a failing test, ``xfail(strict=True)`` until the fix lands).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    module: str  # a regular expression on the module name
    flag: str  # a regular expression searched in the cell name
    what: str
    where: str  # "being fixed" or the reproduction's path
    verdicts: tuple[str, ...] = ("differs", "crash")
    detail: str = ""  # a regular expression searched in the detail, when the module and flag are not enough

    def matches(self, row: dict) -> bool:
        return (row["verdict"] in self.verdicts and re.fullmatch(self.module, row["module"]) is not None
                and re.search(self.flag, row["flag"]) is not None and re.search(self.detail, row["detail"]) is not None)


# Bugs colleagues are fixing in the package, not reproduced here (empty: the last round's are fixed on main, their
# reproductions under known/ pass).
BEING_FIXED: list[Known] = []
_K = "tests/conformance/known/"
REPRODUCED: list[Known] = []  # every reproduction under known/ passes now


def classify(row: dict) -> Known | None:
    return next((k for k in [*BEING_FIXED, *REPRODUCED] if k.matches(row)), None)

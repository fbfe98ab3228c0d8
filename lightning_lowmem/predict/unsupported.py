"""Refusals of the dry run: :class:`DryRunUnsupportedError`, naming the op and the line of the model that called it.

Shared by the fake execution (:mod:`~lightning_lowmem.predict.fake`), its kernels and its data-dependent ops
(:mod:`~lightning_lowmem.predict.data_dependent`).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any

import torch

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.dry_run_refusal import DryRunUnsupportedError

# frames that are not "the model's code" when an op cannot be traced: torch, the dry run itself, the standard library
_PACKAGE = os.path.dirname(os.path.dirname(__file__)) + os.sep  # lightning_lowmem/
# NOTE: the dry run's own code: this folder, the measurement it drives and the byte accounting (a frame there is
# never the model's line)
_INFRA = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep,
          os.path.join(_PACKAGE, "measure") + os.sep,
          *(os.path.join(_PACKAGE, *f) for f in (("core", "accounting.py"), ("core", "units.py"),
                                                 ("core", "optimizer_state.py"), ("cli", "estimate.py"))))
_STDLIB = os.path.dirname(contextlib.__file__) + os.sep


def _is_infra(filename: str) -> bool:
    name = os.path.abspath(filename)
    if name.startswith(_INFRA) or (name.startswith(_STDLIB) and f"{os.sep}site-packages{os.sep}" not in name):
        return True
    return any(f"{os.sep}{package}{os.sep}" in name for package in ("lightning", "lightning_utilities"))


def _is_library(filename: str) -> bool:
    """An installed package or this one: not the user's own code."""
    name = os.path.abspath(filename)
    return name.startswith(_PACKAGE) or any(f"{os.sep}{d}{os.sep}" in name for d in ("site-packages", "dist-packages"))


def _where(frames: list[traceback.FrameSummary]) -> str | None:
    """The model's line among ``frames`` (outermost first): the innermost frame of the user's own code and, when
    the op was called inside an installed library (torchmetrics, transformers), that library's innermost line."""
    fmt = lambda f: f"{f.filename}:{f.lineno} ({(f.line or '').strip()})"
    outside = [f for f in frames if not _is_infra(f.filename)]
    if not outside:
        return None
    own = [f for f in outside if not _is_library(f.filename)]
    if own and own[-1] is not outside[-1]:
        return f"{fmt(own[-1])}, in {fmt(outside[-1])}"
    return fmt(outside[-1])


def model_line(tb: Any = None) -> str | None:
    """``file:line (code)`` of the model's line that called the failing op (of traceback ``tb``; default: here)."""
    return _where(traceback.extract_tb(tb) if tb is not None else traceback.extract_stack())


#: how ``nn.Module._apply`` refuses to move a fake parameter (see :func:`unsupported`)
SWAP_REFUSED = "_apply(): Couldn't swap"


def unsupported(err: BaseException) -> DryRunUnsupportedError:
    if str(err).startswith(SWAP_REFUSED):
        return DryRunUnsupportedError(
            "Module.to()", f"torch moves a fake parameter with `swap_tensors`, which refuses one that autograd or another "
            f"object still holds ({err}; pytorch#148977, seen on Switch Transformers under lowmem_offload)",
            model_line(err.__traceback__))
    op = getattr(err, "func", None)
    detail = str(err) or type(err).__name__
    if isinstance(err, (torch_internals.DataDependentOutputException, torch_internals.DynamicOutputShapeException)):
        detail = f"its output depends on the values of a tensor computed from the weights ({detail})"
    else:
        detail = f"it has no fake-tensor implementation ({detail})"
    return DryRunUnsupportedError(str(op) if op is not None else type(err).__name__, detail,
                                  model_line(err.__traceback__))


__all__ = ["SWAP_REFUSED", "DryRunUnsupportedError", "model_line", "unsupported"]

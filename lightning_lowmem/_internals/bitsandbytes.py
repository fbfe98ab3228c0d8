"""bitsandbytes internals: the only module that touches its private modules (:data:`PRIVATE_SYMBOLS`, checked by
``tests/test_internals.py``). bitsandbytes is optional: it is imported inside each function."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: bitsandbytes names used here (dotted), checked by tests/test_internals.py
PRIVATE_SYMBOLS = ("bitsandbytes.autograd._functions.MatMul4Bit",)


def matmul_4bit_function() -> type:
    """bitsandbytes' ``MatMul4Bit``: the autograd function of ``matmul_4bit`` (``Linear4bit``'s forward)."""
    from bitsandbytes.autograd import _functions

    return _functions.MatMul4Bit


@contextlib.contextmanager
def applied_matmul_4bit(function: Any) -> Iterator[None]:
    """Within the block, ``bitsandbytes.matmul_4bit`` applies ``function``, a subclass of ``MatMul4Bit`` (NOTE: it looks
    the function up in its private module at each call; no public way to choose it). Restored on exit."""
    from bitsandbytes.autograd import _functions

    previous = _functions.MatMul4Bit
    _functions.MatMul4Bit = function
    try:
        yield
    finally:
        _functions.MatMul4Bit = previous

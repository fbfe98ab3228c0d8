"""Byte sizes: one parser and one formatter for every size the package accepts or prints (CLI included)."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str | float, name: str = "a memory size") -> int:
    """``"12 GiB"`` -> 12 * 2**30, ``"12GB"`` -> 12e9, ``"12e9"`` -> 12e9, ``"1.5 TB"``; numbers pass through.

    Raises:
        TypeError: neither a string nor a number.
        ValueError: not a positive number with an optional unit B, KB, MB, GB, TB, KiB, MiB, GiB, TiB
            (``name`` says which argument, e.g. ``"`budget`"``).
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise TypeError(f"Passed {name} {text!r} of type {type(text).__name__}; expected a number of bytes or a size "
                        "such as '12GB' (12e9 bytes) or '12 GiB' (12 * 2^30).")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE.fullmatch(str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            hint = " ('G' alone is ambiguous: write GB for 10^9 or GiB for 2^30)" if match and match.group(2) else ""
            raise ValueError(
                f"Passed {name} {text!r} that does not parse{hint}; expected a number with an optional unit, "
                "e.g. '12GB' (12e9 bytes), '12 GiB' (12 * 2^30), '12e9' or '6144MiB'."
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    nbytes = value * _UNITS[unit]
    if not math.isfinite(nbytes) or nbytes <= 0:
        raise ValueError(f"Passed {name} {text!r}; it must be positive.")
    return int(nbytes)


def fmt_gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def fmt_size(n: float | None) -> str:
    """GiB from 1 GiB up, MiB below (a small model's peaks are not all "0.01 GiB")."""
    return "-" if n is None else (fmt_gib(n) if abs(n) >= 2**30 else fmt_mib(n))


def fmt_bytes(n: float | None) -> str:
    """A size for a message, in the unit that reads best: B, KiB, MiB (fmt_size from 1 MiB up).

    >>> fmt_bytes(64), fmt_bytes(3 * 2**10), fmt_bytes(199395552)
    ('64 B', '3.00 KiB', '190.16 MiB')
    """
    if n is None or abs(n) >= 2**20:
        return fmt_size(n)
    return f"{int(n)} B" if abs(n) < 2**10 else f"{n / 2**10:.2f} KiB"


def fmt_mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f} MiB"


__all__ = ["fmt_bytes", "fmt_gib", "fmt_mib", "fmt_size", "parse_bytes"]

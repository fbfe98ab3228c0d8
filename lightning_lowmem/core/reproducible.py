"""``Reproducible``: technique objects that remember their constructor arguments, so a run gets fresh copies."""

from __future__ import annotations

import inspect
from typing import Any


class Reproducible:
    """Remembers its constructor arguments, so that an unused copy can be made (:meth:`fresh`): a dry run needs a
    technique object no Trainer has touched yet, built as the user built theirs."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__new__(cls)
        # NOTE: unpickling calls `cls.__new__(cls)` without arguments, then restores `__dict__` (with these)
        obj._init_args = (args, kwargs)
        return obj

    def fresh(self, **changes: Any) -> Any:
        """A new object built with this one's constructor arguments (nested reproducible objects fresh too),
        with ``changes`` to them by name."""
        args, kwargs = getattr(self, "_init_args", ((), {}))
        if changes:
            args, kwargs = (), {**init_arguments(self), **changes}
        return type(self)(*(fresh(a) for a in args), **{k: fresh(v) for k, v in kwargs.items()})

    def resolved(self) -> Any:
        """:meth:`fresh`, with what this object decided at run time (an automatic choice) fixed; None when it
        decided to do nothing."""
        return self.fresh()


def init_arguments(obj: Any) -> dict[str, Any]:
    """The constructor arguments a :class:`Reproducible` object was built with, by name (positional ones named)."""
    args, kwargs = getattr(obj, "_init_args", ((), {}))
    names = list(inspect.signature(type(obj).__init__).parameters)[1 : len(args) + 1]
    return {**dict(zip(names, args)), **kwargs}


def fresh(obj: Any) -> Any:
    """``obj.fresh()`` for a :class:`Reproducible` object; any other value is returned as it is."""
    return obj.fresh() if isinstance(obj, Reproducible) else obj

"""How the suite reaches into the user's objects: the ``lightning`` vs ``pytorch_lightning`` boundary, a
``training_step`` called as Lightning calls it, attributes swapped for a while."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def check_lightning_object(obj: Any, what: str) -> None:
    """Refuse objects of the standalone ``pytorch_lightning`` package with a message that says what to do.

    lightning_lowmem targets the unified ``lightning`` package; the two packages keep separate class
    hierarchies and registries, so their objects cannot be mixed.
    """
    module = type(obj).__module__ or ""
    if module == "pytorch_lightning" or module.startswith("pytorch_lightning."):
        raise TypeError(
            f"Passed a `{type(obj).__module__}.{type(obj).__qualname__}` as {what}; lightning_lowmem works with the "
            "unified `lightning` package only. Replace `import pytorch_lightning as pl` with "
            "`import lightning.pytorch as pl` (or `import lightning as L` and use `L.Trainer`, "
            "`L.LightningModule`, `L.Callback`)."
        )


def training_step_args(step: Any, batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """The positional arguments Lightning's loop gives ``step`` (a ``training_step``): ``batch``, and ``batch_idx``
    only when the signature takes it (``training_step(self, batch)`` is allowed).

    NOTE: the same rule as Lightning's ``_build_kwargs`` (decorators unwrapped through ``__wrapped__``), so code
    that runs a module's step itself (trials, probes) calls it as the Trainer would.
    """
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    return (batch, batch_idx) if is_param_in_hook_signature(step, "batch_idx", min_args=2) else (batch,)


_MISSING = object()


@contextlib.contextmanager
def swapped(target: Any, **attributes: Any) -> Iterator[None]:
    """Set ``attributes`` in ``target``'s own ``__dict__`` (an instance, a class or a module); put back what was there.

    NOTE: restores the target's own previous entry rather than deleting ours, so nested swaps (a probe inside the
    OOM splitter's capture, a side step inside a side step) each get back what they found.
    """
    own = vars(target)
    previous = {name: own.get(name, _MISSING) for name in attributes}
    for name, value in attributes.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(target, name)
            else:
                setattr(target, name, value)

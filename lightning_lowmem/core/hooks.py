"""How the suite reaches into the user's objects: the ``lightning`` vs ``pytorch_lightning`` boundary, a
``training_step`` called as Lightning calls it."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_lowmem._internals.twin import BUILDS, package_for, package_of


def check_lightning_object(obj: Any, what: str) -> None:
    """Refuse an object of the other Lightning package than this build's, saying which build to import
    (``lightning_lowmem`` or ``lightning_lowmem.pl``, :mod:`lightning_lowmem._internals.twin`)."""
    ours, theirs = package_for(__name__), package_of(obj)
    if theirs is None or theirs == ours:
        return
    raise TypeError(
        f"Passed a `{type(obj).__module__}.{type(obj).__qualname__}` (of the `{theirs}` package) as {what}, imported "
        f"from `{BUILDS[ours]}`, which is built for the `{ours}` package; the two packages' objects cannot be mixed. "
        f"For a `{theirs}` Trainer (e.g. one a library builds itself), import the same class from `{BUILDS[theirs]}`: "
        f"`from {BUILDS[theirs]} import ...` (the same names, from the same source). The `lowmem_*` strategy names "
        "work with both packages."
    )


def training_step_args(step: Any, batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """The positional arguments Lightning's loop gives ``step`` (a ``training_step``): ``batch``, and ``batch_idx``
    only when the signature takes it (Lightning's ``_build_kwargs`` rule)."""
    return (batch, batch_idx) if is_param_in_hook_signature(step, "batch_idx", min_args=2) else (batch,)

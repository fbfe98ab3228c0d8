"""Autograd's in-place check, kept for tensors that saved-tensor hooks take over (private helper).

Autograd skips its version check for tensors packed by ``saved_tensors_hooks`` (``ActivationOffload``,
``ActivationCheckpointing``); each such hook records a :class:`SavedVersion` at pack time and calls
:meth:`SavedVersion.check` at unpack, which raises the error plain PyTorch raises.

NOTE: the counter is kept through a storage-less ``detach()`` alias (it shares ``t``'s version counter), so the
check keeps no memory alive; views made without autograd's view tracking have counters of their own, as autograd's.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_lowmem._internals import torch as torch_internals

_HINT = (
    "Fix the module: make that operation out of place (`y = y + 1` instead of `y.add_(1)`, `inplace=False` for "
    "activation modules), or `.clone()` the tensor before changing it. `torch.autograd.set_detect_anomaly(True)` "
    "shows the forward line of the operation that saved it."
)


class SavedVersion:
    """The version a saved tensor had when it was saved, and its live version counter (``counter``: the tensor when
    ``keep``, else a storage-less alias sharing its counter)."""

    __slots__ = ("counter", "dtype", "shape", "version")

    def __init__(self, t: torch.Tensor, keep: bool = False) -> None:
        self.version = torch_internals.tensor_version(t)
        self.dtype, self.shape = t.dtype, t.shape
        if keep:
            self.counter = t
        else:
            alias = t.detach()
            alias.data = t.new_empty(0)
            self.counter = alias

    def check(self, who: str) -> None:
        """Raise what plain PyTorch raises if the saved tensor was modified in place since it was saved."""
        now = torch_internals.tensor_version(self.counter)
        if now != self.version:
            node = torch_internals.current_autograd_node_name()  # NOTE: the node being run: the op that saved it
            saved_by = f", saved for the backward of {node}," if node else ""
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{self.dtype} {list(self.shape)}]{saved_by} is at version {now}; expected version {self.version} "
                f"instead. {who} checked this: the module changed a tensor in place after an operation had saved "
                "it for backward. Plain PyTorch refuses this backward with this same error; the saved-tensor hooks "
                f"of {who} would hide it from autograd, and the gradients would silently use other values. {_HINT}"
            )


class CheckedSaves:
    """Around the forward of a ``torch.utils.checkpoint`` region: each save still goes to the checkpoint's hooks,
    wrapped with a :class:`SavedVersion` that backward checks first. ``inner``: a context entered first and left last.
    NOTE: non-reentrant checkpointing never checks versions (a tensor changed in place would come back recomputed).
    """

    __slots__ = ("_hooks", "inner", "who")

    def __init__(self, who: str, inner: Any = None) -> None:
        self.who, self.inner = who, inner
        self._hooks: Any = None

    def __enter__(self) -> None:
        if self.inner is not None:
            self.inner.__enter__()
        below = torch_internals.top_saved_tensors_hooks()
        if below is None:  # NOTE: not inside a checkpoint: our hooks would keep what nobody asked to keep
            return
        pack_below, unpack_below = below
        who = self.who

        def pack(t: torch.Tensor) -> tuple[SavedVersion, Any]:
            return SavedVersion(t), pack_below(t)

        def unpack(packed: tuple[SavedVersion, Any]) -> torch.Tensor:
            packed[0].check(who)
            return unpack_below(packed[1])

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()

    def __exit__(self, *exc: object) -> Any:
        hooks, self._hooks = self._hooks, None
        try:
            if hooks is not None:
                hooks.__exit__(*exc)
        finally:
            result = self.inner.__exit__(*exc) if self.inner is not None else None
        return result


__all__ = ["CheckedSaves", "SavedVersion"]

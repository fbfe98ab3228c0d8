"""Autograd's in-place check, kept for tensors that saved-tensor hooks take over (private helper).

Plain PyTorch refuses a backward that needs a tensor which was modified in place after an operation saved it
(``y = x.sigmoid(); z = y * w; y.add_(1)``: "one of the variables needed for gradient computation has been
modified by an inplace operation"), comparing the tensor's version counter with the version it had when saved.
Autograd skips that check for every tensor packed by ``saved_tensors_hooks``: under ``ActivationOffload``, the
checkpointing of ``ActivationCheckpointing`` and the segments of its ``"sqrt"`` policy, such a module would train
on the saved-time values (offload) or on recomputed ones (checkpointing) instead of failing. Each of those hooks
records a :class:`SavedVersion` at pack time and calls :meth:`SavedVersion.check` at unpack, which raises the
error plain PyTorch raises, saying which technique checked it and what to change in the module.

NOTE: [the counter without the memory] A tensor that is offloaded or recomputed must not be kept alive (that is
the memory the technique frees). ``t.detach()`` shares ``t``'s version counter (views share their base's), and
assigning it an empty ``.data`` drops its reference to the storage but keeps that counter: a storage-less alias
whose ``_version`` follows every in-place change of ``t`` and of every alias of it, even after ``t`` itself is
gone. Views made without autograd's view tracking (``unsafe_chunk``, ``.data``) have counters of their own,
exactly as autograd sees them, so the check raises where plain PyTorch raises and nowhere else.
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
    """The version a saved tensor had when it was saved, and a handle on its live version counter.

    ``counter``: the saved tensor itself when the hooks keep it anyway (it is what unpack returns); otherwise a
    storage-less alias sharing its version counter (see the module's note), which holds no memory.
    """

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
    """Around the forward of a ``torch.utils.checkpoint`` region: each save still goes to the hooks below (the
    checkpoint's, which keep nothing and recompute in backward), wrapped with a :class:`SavedVersion` that backward
    checks before asking them for the value. ``inner``: a context entered first and left last (selective
    checkpointing's dispatch mode).

    NOTE: non-reentrant ``torch.utils.checkpoint`` never checks versions: a tensor saved inside the region and
    changed in place afterwards comes back as recomputed (the change undone, or replayed), where plain PyTorch
    raises. The check compares the *original* tensor's counter, as autograd does. It reads the hooks below with
    ``_internals.torch.top_saved_tensors_hooks`` (private torch API, as parameter streaming does).
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

"""The first-step check of ``lowmem_offload`` under ``*-mixed``: a weight stored in the compute dtype is used by its
layer's op only.

Under ``bf16-mixed``/``16-mixed`` the strategy stores in the compute dtype the weights that autocast rounds at every
use (:func:`~lightning_lowmem.strategies.offload.precision.autocast_cast_params`: the weights and biases of linear and
convolution layers): their layer's op reads the values plain Lightning's autocast would give it. Other code that reads
such a weight (a self-distillation teacher moved toward its student, a weight penalty ``sum(p.pow(2))``) would see
its bf16 rounding where plain mixed precision reads fp32, and code that writes one in place (that teacher's update)
would store it in bf16: the run would train otherwise, silently. On the first training step a ``TorchFunctionMode``
follows every call that takes such a weight (or a view of it, by storage) and refuses any but the layer ops, views
and metadata, naming the weight and the call.

NOTE: torch functions, not aten ops: a linear layer's bias reaches an aten ``add`` in ``F.linear``'s own
decomposition, which no aten-level check could tell from user code. A call this package makes itself inside the step
(manual optimization's upload after ``opt.step()``, the gradient hooks of a layer called several times) is told by
its caller's file. Not run on a model holding ``torch.compile``-d modules (their weights are not cast: see
``precision._compiled_params``).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.accounting import storage_key_or_none

#: what autocast rounds a weight for, as the layers whose weights are cast call it
_LAYER_OPS = {F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
              torch.addmm, F.multi_head_attention_forward}
#: methods that make a view of the weight or read its metadata, not its values (a view is followed by its storage)
_VIEWS_AND_METADATA = {"t", "view", "view_as", "chunk", "split", "transpose", "reshape", "unflatten", "narrow",
                       "detach", "__getitem__", "unsqueeze", "squeeze", "expand", "permute", "size", "dim", "numel",
                       "stride", "is_floating_point", "data_ptr", "untyped_storage", "storage_offset", "element_size",
                       "is_contiguous", "__hash__", "__len__", "type", "get_device", "nelement", "ndimension",
                       "register_hook", "register_post_accumulate_grad_hook"}
_OURS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the lightning_lowmem package
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


class CastWeightUseCheck(TorchFunctionMode):
    """Raises ValueError at the first call that reads or writes a weight stored in the compute dtype other than through
    its layer's op (``names``: ``{storage key: parameter name}`` of those weights)."""

    def __init__(self, names: dict[tuple[str, int], str], precision: str) -> None:
        super().__init__()
        self.names = names
        self.precision = precision

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in _LAYER_OPS or name in _VIEWS_AND_METADATA or name in ("__get__", "__set__"):
            return func(*args, **kwargs)
        for t in torch_internals.tree_leaves((args, kwargs)):
            key = storage_key_or_none(t) if isinstance(t, torch.Tensor) else None
            if key in self.names and not _called_by_us():
                raise ValueError(
                    f"lowmem_offload(precision='{self.precision}') stores `{self.names[key]}` in the compute dtype, as "
                    "autocast rounds it for its layer's op, and this training step calls "
                    f"`{getattr(func, '__qualname__', name)}` on it: that call reads its rounding (or writes it) where "
                    f"plain Lightning's '{self.precision}' keeps the weight fp32 (an EMA teacher moved toward its "
                    "student, a weight penalty), so the run would train otherwise. Use precision='32-true' or "
                    f"'{self.precision.replace('mixed', 'true')}' with `lowmem_offload` (the same maths as plain "
                    "Lightning's), or plain mixed precision without it.")
        return func(*args, **kwargs)


def _called_by_us() -> bool:
    """Whether the first frame outside torch and this module is this package's own code."""
    frame = inspect.currentframe()
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and not path.startswith(_TORCH):
            return path.startswith(_OURS + os.sep)
        frame = frame.f_back
    return False


__all__ = ["CastWeightUseCheck"]

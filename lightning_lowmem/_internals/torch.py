"""Private torch APIs: the only module of the package that touches them (frame inspection: :mod:`.frames`).

Each one is wrapped or re-exported here with a NOTE on why no public API does the job. :data:`PRIVATE_SYMBOLS` and
:data:`INSTANCE_ATTRIBUTES` list every private name used; ``tests/test_internals.py`` asserts that each exists in
the installed torch, so an upgrade that removes one fails there, by name, instead of deep inside a training step.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Generator
from types import FrameType, SimpleNamespace
from typing import Any

import torch
from torch import nn

# NOTE: fake tensors have no public module: torch's own users (torch.compile, torch.export) import them from here too
from torch._subclasses import fake_tensor as _fake_tensor

# NOTE: `_BatchNorm` is the one base of every batch-norm layer (SyncBatchNorm, lazy forms...); no public class is
from torch.nn.modules.batchnorm import _BatchNorm

# NOTE: dispatch modes and pytrees have no public home; every TorchDispatchMode user imports them from here
from torch.utils import _python_dispatch, _pytree

# NOTE: the non-reentrant checkpoint's two halves (see `checkpoint_region`)
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator as _checkpoint_generator

#: every private torch name used here (dotted, from ``torch``), checked by tests/test_internals.py
PRIVATE_SYMBOLS = (
    "torch._subclasses.fake_tensor.FakeTensor",
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch._subclasses.fake_tensor.is_fake",
    "torch._subclasses.fake_tensor.unset_fake_temporarily",
    "torch._subclasses.fake_tensor.UnsupportedOperatorException",
    "torch._subclasses.fake_tensor.DataDependentOutputException",
    "torch._subclasses.fake_tensor.DynamicOutputShapeException",
    "torch._subclasses.fake_tensor.UnsupportedFakeTensorException",
    "torch.nn.modules.batchnorm._BatchNorm",
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._python_dispatch._disable_current_modes",
    "torch.utils._python_dispatch._get_current_dispatch_mode_stack",
    "torch.utils._python_dispatch._push_mode",
    "torch.utils._python_dispatch._pop_mode",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
    "torch.utils._pytree.tree_flatten",
    "torch.utils._pytree.tree_unflatten",
    "torch.utils._pytree.tree_map",
    "torch.utils._pytree.tree_leaves",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch._C._current_graph_task_id",
    "torch._C._current_autograd_node",
    "torch._C._storage_Use_Count",
    "torch._C._VariableFunctions._pad_packed_sequence",
    "torch._foreach_norm",
    "torch._amp_foreach_non_finite_check_and_unscale_",
    "torch.autograd.Variable._execution_engine",
    "torch._subclasses.fake_tensor.FakeTensorConverter.tensor_memo",
    "torch.ops.aten._local_scalar_dense",
    "torch.ops.aten._unsafe_view",
    "torch.ops.aten._to_copy",
    "torch.ops.aten._index_put_impl_",
    "torch.ops.aten._unique",
    "torch.ops.aten._unique2",
    "torch.ops.aten._pack_padded_sequence",
    "torch.ops.aten._grouped_mm",
    "torch.ops.aten._embedding_bag",
    "torch.ops.aten._embedding_bag_forward_only",
    "torch.ops.aten._safe_softmax",
    "torch.cuda._initialized",
    "torch._dynamo.eval_frame.OptimizedModule",
    "torch.utils.checkpoint._checkpoint_without_reentrant_generator",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper",
)
#: private attributes of torch objects (class path -> attribute names), checked on an instance by the test
INSTANCE_ATTRIBUTES = {
    "torch.Tensor": ("_version",),
    "torch.UntypedStorage": ("_cdata",),
    "torch.nn.Module": ("_compiled_call_impl", "_buffers", "_parameters", "_forward_hooks", "_forward_hooks_always_called", "_backward_hooks",
                        "_backward_pre_hooks", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"),
    "torch.optim.lr_scheduler.SequentialLR": ("_schedulers",),
    "torch.optim.lr_scheduler.ChainedScheduler": ("_schedulers",),
    "torch._ops.OpOverload": ("_schema", "is_view"),
    "torch._dynamo.eval_frame.OptimizedModule": ("_orig_mod",),
}

FakeTensor = _fake_tensor.FakeTensor
FakeTensorMode = _fake_tensor.FakeTensorMode
is_fake = _fake_tensor.is_fake
unset_fake_temporarily = _fake_tensor.unset_fake_temporarily
DataDependentOutputException = _fake_tensor.DataDependentOutputException
DynamicOutputShapeException = _fake_tensor.DynamicOutputShapeException
#: what a fake mode raises for an op it cannot run
FAKE_ERRORS = (
    _fake_tensor.UnsupportedOperatorException,
    _fake_tensor.DataDependentOutputException,
    _fake_tensor.DynamicOutputShapeException,
    _fake_tensor.UnsupportedFakeTensorException,
)

TorchDispatchMode = _python_dispatch.TorchDispatchMode
#: ``with disable_current_modes():`` runs ops unseen by every dispatch mode (the dry run's real kernels)
disable_current_modes = _python_dispatch._disable_current_modes
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors a wrapper tensor subclass holds (torchao's quantized optimizer state), or None for a tensor with
    its own storage.

    NOTE: a wrapper subclass reports a storage of its nominal size that holds no data; its bytes are those of the
    tensors ``__tensor_flatten__`` names. No public API tells the two kinds apart.
    """
    if not _python_dispatch.is_traceable_wrapper_subclass(t):
        return None
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    out: list[torch.Tensor] = []
    for name in names:
        inner = getattr(t, name)
        out += inner_tensors(inner) or [inner]
    return out


#: ``dispatch_mode_stack()``: the dispatch modes entered now, outermost first
dispatch_mode_stack = _python_dispatch._get_current_dispatch_mode_stack
#: ``pop_dispatch_mode()`` takes the innermost mode off the stack (without its ``__exit__``), ``push_dispatch_mode(m)``
#: puts it back. NOTE: a mode can only leave from the top; MemoryTracker lifts later ones off while two modes interleave
pop_dispatch_mode = _python_dispatch._pop_mode
push_dispatch_mode = _python_dispatch._push_mode


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of a storage: its StorageImpl (``_cdata``; NOTE: not ``data_ptr()``, 0 for fake and empty ones)."""
    return storage._cdata


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place change; shared by its views and ``detach()``)."""
    return t._version


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many tensors (views, ``detach()``) hold ``storage``; no public API counts a storage's holders."""
    return torch._C._storage_Use_Count(storage._cdata)


def op_is_mutable(func: Any) -> bool:
    """Whether the aten op overload ``func`` writes into an argument (in-place, ``out=``, ``resize_``, ``set_``)."""
    return bool(func._schema.is_mutable)


def op_is_view(func: Any) -> bool:
    """Whether the aten op overload ``func`` returns a view of an argument (its output aliases an input's storage)."""
    return bool(func.is_view)


def op_arguments(func: Any) -> list[Any]:
    """The argument declarations of the aten op overload ``func``'s schema (``.alias_info.is_write``: written)."""
    return list(func._schema.arguments)


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled: what ``torch.compile(module)`` returns (``OptimizedModule``), or a module
    whose ``nn.Module.compile()`` set ``_compiled_call_impl``. No public way to ask."""
    from torch._dynamo.eval_frame import OptimizedModule  # NOTE: here: importing dynamo takes a second

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def eager_copies(module: nn.Module, memo: dict[int, Any], skip: set[int]) -> None:
    """Enter into a ``copy.deepcopy`` ``memo`` an eager copy of each compiled module inside ``module`` (what
    ``torch.compile(m)`` wraps; one whose ``nn.Module.compile()`` is undone), innermost first, except those holding a
    parameter whose id is in ``skip``.

    NOTE: dynamo skips for good a compiled frame it meets under a fake mode, and the user's module then trains
    uncompiled (tests/conformance/known/test_compiled_submodule.py): a fake copy runs compiled regions eagerly.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    for m in reversed(list(module.modules())):
        if skip and any(id(p) in skip for p in m.parameters()):
            continue
        if isinstance(m, OptimizedModule):
            memo[id(m)] = copy.deepcopy(m._orig_mod, memo)
        elif getattr(m, "_compiled_call_impl", None) is not None:
            memo[id(m)] = eager = copy.deepcopy(m, memo)
            eager._compiled_call_impl = None


def op_returns(func: Any) -> list[Any]:
    """The return declarations of the aten op overload ``func``'s schema."""
    return list(func._schema.returns)


#: aten ops whose names start with an underscore (internal ops the dry run must recognise by identity)
ATEN = SimpleNamespace(
    local_scalar_dense=torch.ops.aten._local_scalar_dense,
    unsafe_view=torch.ops.aten._unsafe_view,
    to_copy=torch.ops.aten._to_copy,
    index_put_impl_=torch.ops.aten._index_put_impl_,
    unique=torch.ops.aten._unique,
    unique2=torch.ops.aten._unique2,
    pack_padded_sequence=torch.ops.aten._pack_padded_sequence,
    grouped_mm=torch.ops.aten._grouped_mm,
    embedding_bag=torch.ops.aten._embedding_bag,
    embedding_bag_forward_only=torch.ops.aten._embedding_bag_forward_only,
    safe_softmax=torch.ops.aten._safe_softmax,  # NOTE: only scaled_dot_product_attention's math kernel calls it
)
#: the C++ function behind ``nn.utils.rnn.pad_packed_sequence`` (it fills integer buffers the dry run keeps real)
PAD_PACKED_SEQUENCE = torch._C._VariableFunctions._pad_packed_sequence


#: ``foreach_norm(tensors)``: the L2 norm of each tensor, in one pass (NOTE: no public per-tensor form;
#: ``get_total_norm`` rounds and overflows differently from what the non-finite guard of ``lowmem_offload`` reads)
foreach_norm = torch._foreach_norm
#: ``non_finite_check_and_unscale_(grads, found_inf, inv_scale)``: the kernel of ``GradScaler.unscale_``, so
#: ``lowmem_offload``'s fp16 scaler unscales the host masters exactly as GradScaler would
non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_


def in_backward() -> bool:
    """Whether the autograd engine is running a backward now (a hook called from it, a recompute)."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward running now ends (call only when :func:`in_backward`; NOTE: the engine's
    own queue, as FSDP and DDP use it: no public API ends a backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_autograd_node_name() -> str | None:
    """The name of the backward node the engine is running (None outside backward, or without the API)."""
    current = getattr(torch._C, "_current_autograd_node", None)  # NOTE: read-only, guarded
    node = current() if current is not None else None
    return node.name() if node is not None else None


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The (pack, unpack) saved-tensor hooks innermost now, or None (NOTE: nothing public reads the pair below a
    new one, a checkpoint's, which parameter streaming and the in-place check inside checkpointed blocks need)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


_CHECKPOINT_FILE: str | None = None
_FUNCTION_FILE = torch.autograd.function.__file__


def saved_by_checkpoint(frame: FrameType | None) -> bool:
    """Whether a pack hook called from ``frame`` packs an input that ``torch.utils.checkpoint`` saves for recompute.
    NOTE: checkpointing saves a block's inputs from ``torch/utils/checkpoint.py`` itself (past ``autograd/function.py``):
    this reads torch's file layout, and ``ActivationOffload`` warns when ``boundaries_only=True`` sees no boundary.
    """
    global _CHECKPOINT_FILE
    if _CHECKPOINT_FILE is None:
        import torch.utils.checkpoint  # NOTE: imported by any checkpointing there is; here only on first use

        _CHECKPOINT_FILE = torch.utils.checkpoint.__file__
    for _ in range(6):
        if frame is None:
            return False
        filename = frame.f_code.co_filename
        if filename == _CHECKPOINT_FILE:
            return True
        if filename != _FUNCTION_FILE:
            return False
        frame = frame.f_back
    return False


def checkpoint_region(fn: Callable[..., Any], context_fn: Callable[[], tuple[Any, Any]], *args: Any,
                      **kwargs: Any) -> Generator[None, None, None]:
    """Non-reentrant ``torch.utils.checkpoint`` of what runs between this generator's first and second ``next()``:
    ``fn(*args, **kwargs)`` (the recompute), the RNG state preserved, ``context_fn`` as ``checkpoint``'s. NOTE: a
    forward pre-hook and forward hook need ``checkpoint``'s halves apart (as torch's composable one does): no public API.
    """
    return _checkpoint_generator(fn, True, context_fn, "default", False, True, *args, **kwargs)


def is_checkpoint_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is torch.distributed's ``CheckpointWrapper``/``OffloadWrapper`` (FSDP's
    ``activation_checkpointing_policy``, ``apply_activation_checkpointing``); their module is private."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    return isinstance(module, ActivationWrapper)


BatchNormBase = _BatchNorm


def module_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffer table (the live dict, ``None`` entries included), to swap a buffer's tensor for a
    while (NOTE: ``setattr`` would run the global buffer-registration hooks)."""
    return module._buffers  # type: ignore[return-value]


def module_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter table (the live dict): a tied weight set in place in every owner (``to_empty``)."""
    return module._parameters


def forward_hooks(module: nn.Module) -> dict[int, Callable[..., Any]]:
    """``module``'s forward hooks by handle id (the live dict)."""
    return module._forward_hooks  # type: ignore[return-value]


def forward_pre_hooks(module: nn.Module) -> dict[int, Callable[..., Any]]:
    """``module``'s forward pre-hooks by handle id (the live dict): a technique finds the hooks it registered, which
    a deep copy of the module carries, without a handle (there is no public way to list a module's hooks)."""
    return module._forward_pre_hooks  # type: ignore[return-value]


def remove_forward_pre_hook(module: nn.Module, key: int) -> None:
    """Remove forward pre-hook ``key`` of ``module`` as its ``RemovableHandle`` would (the handle is long gone)."""
    del module._forward_pre_hooks[key]
    module._forward_pre_hooks_with_kwargs.pop(key, None)


def hook_tables(module: nn.Module) -> list[dict[Any, Any]]:
    """``module``'s own hook tables (the live dicts), found by their names' ending so a table torch adds is found too:
    a copy of the module that must run none of the other techniques' hooks gets empty ones instead."""
    return [v for k, v in vars(module).items()
            if isinstance(v, dict) and k.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called"))]


def remove_forward_hook(module: nn.Module, key: int) -> None:
    """Remove forward hook ``key`` of ``module`` as its ``RemovableHandle`` would (the handle is long gone)."""
    del module._forward_hooks[key]
    module._forward_hooks_always_called.pop(key, None)


def forget_fake_output(t: torch.Tensor) -> None:
    """Drop the fake mode's memo entry of ``t``, an op's output, whose weak reference makes ``swap_tensors`` (which
    ``nn.Module._apply`` moves a fake parameter with) refuse it. NOTE: the entry's key is a fresh meta tensor's id, never
    looked up again (pytorch#148977)."""
    if not isinstance(t, FakeTensor):
        return
    memo = t.fake_mode.fake_tensor_converter.tensor_memo
    for ref in weakref.getweakrefs(t):
        if isinstance(ref, weakref.KeyedRef) and memo.get(ref.key) is t:
            del memo[ref.key]


def chained_schedulers(scheduler: Any) -> tuple[Any, ...]:
    """The inner schedulers of a ``SequentialLR``/``ChainedScheduler`` (empty for any other scheduler)."""
    return tuple(getattr(scheduler, "_schedulers", ()))


def track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` the way ``LRScheduler.__init__`` does (torch's own wrapper is a local function).

    NOTE: without it every re-pointed scheduler would warn "optimizer.step() has been overridden" at its first step.
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    opt_ref = weakref.ref(optimizer)
    func = optimizer.step.__func__  # type: ignore[attr-defined]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def device_module_initialized(device_module: Any) -> bool:
    """Whether a device module (``torch.cuda``) has started, i.e. has RNG states worth saving: the private flag
    ``torch.utils.checkpoint`` reads, so a replay saves the RNG states exactly when torch's checkpoint would."""
    return bool(getattr(device_module, "_initialized", False))

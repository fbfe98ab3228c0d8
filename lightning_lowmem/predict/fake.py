"""Real code on fake tensors: the environment a dry run executes the user's training in (``docs/estimate.md``).

Inside :func:`fake_execution`, every tensor made from a parameter is a ``FakeTensor`` (shape, dtype and storage size,
no bytes). What makes real code run there:

* Values where they exist: ops whose tensor inputs are all real run for real (in a training step only when their
  outputs are small), so masks, token counts and "is this mask all ones?" checks get the real run's answer.
* Stand-ins where they do not: a data-dependent read of a fake tensor gets the value a healthy run gives where the op
  that made it says so (``isfinite`` all True, ``isnan``/``isinf`` all False, ``torch.equal`` True), else ``0.0``,
  ``1`` or ``False``; :attr:`FakeExecution.stand_ins` counts them.
* ``module.to()`` swaps a fake parameter in place, as torch does (the fake mode's memo of a detached output is dropped:
  ``swap_tensors`` refuses weakly referenced tensors).
* ``self.log`` does nothing: the dry run's Trainer is ``barebones``.
* Data-dependent sizes: :mod:`lightning_lowmem.predict.data_dependent`; fake kernels that allocate less than the real
  CPU kernel: :mod:`lightning_lowmem.predict.kernels`.
* Ops that cannot run on fake tensors raise :class:`DryRunUnsupportedError`, naming the op and the model's line.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.predict.data_dependent import DataDependent
from lightning_lowmem.predict.depth import fewer_layers, find_blocks
from lightning_lowmem.predict.kernels import KernelMatch
from lightning_lowmem.predict.unsupported import SWAP_REFUSED, DryRunUnsupportedError, model_line, unsupported

FakeTensor = torch_internals.FakeTensor
FAKE_ERRORS = torch_internals.FAKE_ERRORS
#: outputs of an all-real op up to this size are computed for real (values exist); larger ones stay fake
REAL_OUTPUT_LIMIT = 16 * 2**20
_SCALAR = torch_internals.ATEN.local_scalar_dense.default
_EQUAL = torch.ops.aten.equal.default
_DETACH = torch.ops.aten.detach.default
_SAFE_SOFTMAX = torch_internals.ATEN.safe_softmax.default
_BOOL_READS = frozenset({_EQUAL, torch.ops.aten.is_nonzero.default})
_aten = torch.ops.aten
# NOTE: the value a check of weight-derived values has in a healthy run (finite numbers): `if not torch.isfinite(loss)`
# and a non-finite-gradient guard must not skip the step a dry run predicts
_HEALTHY_OUTPUT = {_aten.isfinite: True, _aten.isnan: False, _aten.isinf: False, _aten.isposinf: False,
                   _aten.isneginf: False, _aten.ones_like: True, _aten.zeros_like: False}
_KEEPS_VALUE = frozenset({_aten.all, _aten.any, _aten.stack, _aten.cat, _aten.view, _aten.reshape, torch_internals.ATEN.unsafe_view,
                          _aten.squeeze, _aten.unsqueeze, _aten.expand, _aten.select, _aten.slice, _aten.clone,
                          _aten.detach, torch_internals.ATEN.to_copy, _aten.alias, _aten.t, _aten.permute, _aten.flatten})
_NEGATES = frozenset({_aten.logical_not, _aten.bitwise_not})
_COMPARES = frozenset({_aten.eq, _aten.ne})
_AND = frozenset({_aten.mul, _aten.logical_and, _aten.bitwise_and})  # of booleans
# NOTE: an empty tensor made from nothing carries no values, so a real one would only cost real bytes: fake
# (`empty_like`/`new_empty` take the kind of their input), except small integer ones inside C++ composites that fill
# them (see `_bookkeeping`)
_EMPTY = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default})
_HALF = (torch.bfloat16, torch.float16)
class _Values(torch_internals.TorchDispatchMode):
    """Above the fake mode: real values where the inputs are real, stand-ins for reads of fake values."""

    def __init__(self, execution: FakeExecution) -> None:
        super().__init__()
        self.execution = execution

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        tensors = [t for t in torch_internals.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            execution = self.execution
            if func is _SCALAR:
                return execution.stand_in(tensors[0].dtype, execution.healthy.get(tensors[0]))
            if func in _BOOL_READS:
                return execution.stand_in(torch.bool, True if func is _EQUAL else execution.healthy.get(tensors[0]))
            if execution.data_dependent.handles(func):
                return execution.data_dependent(func, args, kwargs)
            if execution.kernels.replaces(func):
                return execution.kernels.replace(func, args, kwargs)
            out = func(*args, **kwargs)
            if func is _DETACH:
                _detached(args[0], out)
            elif func is _SAFE_SOFTMAX and torch.is_grad_enabled():
                # NOTE: SDPA's math kernel (CPU's, with dropout): its s x s probabilities are kept for backward
                calls, nbytes = execution.sdpa_math
                execution.sdpa_math = (calls + 1, nbytes + out.untyped_storage().nbytes())
            if execution.kernels.handles(func):
                out = execution.kernels(func, args, kwargs, out)
            if isinstance(out, torch.Tensor) and out.dtype == torch.bool:
                execution.note_health(func, args, tensors, out)
            return out
        if self.execution.passthrough or (func in _EMPTY and not (self.execution.in_composite
                                                                   and _bookkeeping(func, args, kwargs))):
            return func(*args, **kwargs)  # fake: an empty tensor carries no values
        if (func is _SCALAR or torch_internals.op_is_mutable(func) or (tensors and not self.execution.in_step)
                or not _makes_tensors(func) or self.execution.data_dependent.handles(func)):
            # NOTE: reads and in-place changes of real tensors stay real (the fake mode refuses to change a real
            # tensor's metadata); outside the training step (data set-up, loading a batch) every op on real tensors
            # stays real: the data must keep its values whatever its size.
            with torch_internals.unset_fake_temporarily():
                return func(*args, **kwargs)
        # NOTE: factories, and ops in the step: run under the fake mode first (cheap) to learn the output sizes; only
        # small outputs are worth their real bytes and compute (a causal mask of 64k x 64k tokens is not).
        try:
            out = func(*args, **kwargs)
        except (torch_internals.DataDependentOutputException, torch_internals.DynamicOutputShapeException):
            # NOTE: its size depends on the values: only the real kernel knows it (the inputs are real)
            with torch_internals.unset_fake_temporarily():
                return func(*args, **kwargs)
        sizes = [t.untyped_storage().nbytes() for t in torch_internals.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if sum(sizes) > REAL_OUTPUT_LIMIT:
            return out
        with torch_internals.unset_fake_temporarily():
            return func(*args, **kwargs)


def _detached(p: torch.Tensor, out: torch.Tensor) -> None:
    """``out = p.detach()``. NOTE: ``module.to()`` swaps a fake parameter with ``Parameter(p.to(...))`` (a real one goes
    through ``.data``): ``out`` must hold no weak reference (``forget_fake_output``) and carry ``p``'s attributes (a packed
    4-bit weight's ``quant_state``), which a real parameter keeps."""
    torch_internals.forget_fake_output(out)
    if isinstance(p, torch.nn.Parameter):
        mine = vars(out)
        mine.update({k: v for k, v in vars(p).items() if k not in mine and k != "_is_param"})


def _bookkeeping(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """A small integer ``empty``: lengths or indices that a C++ composite (``pad_packed_sequence``) fills and reads.

    NOTE: only inside those composites (``FakeExecution.in_composite``): elsewhere a real empty could be filled by an
    op on fake tensors, keep its garbage and be read as a value (a token count).
    """
    dtype = kwargs.get("dtype")
    if dtype is None or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return False
    return math.prod(args[0]) * dtype.itemsize <= REAL_OUTPUT_LIMIT if args else False


_MAKES_TENSORS: dict[Any, bool] = {}


def _makes_tensors(func: Any) -> bool:
    """Whether an op returns tensors (``allclose`` returns a bool: its value can only come from a real run)."""
    known = _MAKES_TENSORS.get(func)
    if known is None:
        known = _MAKES_TENSORS[func] = any("Tensor" in str(r.type) for r in torch_internals.op_returns(func))
    return known


#: C++ composites that allocate integer buffers with ``at::empty`` and write them through data pointers
_FILLS_INTEGER_BUFFERS = frozenset({torch_internals.PAD_PACKED_SEQUENCE})


class _Composites(TorchFunctionMode):
    """Marks the calls of :data:`_FILLS_INTEGER_BUFFERS` (see ``_bookkeeping``)."""

    def __init__(self, execution: FakeExecution) -> None:
        super().__init__()
        self.execution = execution

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func not in _FILLS_INTEGER_BUFFERS:
            return func(*args, **(kwargs or {}))
        execution = self.execution
        inside, execution.in_composite = execution.in_composite, True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            execution.in_composite = inside


class FakeExecution:
    """The state of one :func:`fake_execution`: its fake mode and the stand-in values it handed out."""

    def __init__(self) -> None:
        self.mode = torch_internals.FakeTensorMode(allow_non_fake_inputs=True)
        self.stand_ins: dict[str, int] = {}
        #: inside a training step (set by the dry run's hooks): all-real ops with large outputs stay fake there
        self.in_step = False
        #: every op goes to the fake mode (see :meth:`fake`)
        self.passthrough = False
        #: inside a C++ composite that fills small integer buffers (see ``_bookkeeping``)
        self.in_composite = False
        #: fake boolean tensors whose value in a healthy run is known (``isfinite(x)`` is all True)
        self.healthy: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: data-dependent ops (``nonzero``, ``unique``...): their bounds in :attr:`DataDependent.bounds`
        self.data_dependent = DataDependent(model_line)
        #: (calls, bytes of their probabilities) of ``scaled_dot_product_attention``'s math kernel under autograd
        self.sdpa_math = (0, 0)
        #: fake kernels corrected to the real CPU kernels' outputs (:attr:`KernelMatch.corrections`)
        self.kernels = KernelMatch(lambda op, detail: DryRunUnsupportedError(op, detail, model_line()))

    def notes(self) -> list[str]:
        """What this execution assumed or corrected, one line each (the dry run lists them in its notes)."""
        out = [f"{op} at {where}: {assumption} ({n}x)" for (op, where, assumption), n in self.data_dependent.bounds.items()]
        for (op, what), n in self.kernels.corrections.items():
            detail = self.kernels.details.get((op, what))
            out.append(f"{op}: fake kernel corrected to the real CPU kernel's output ({what}; "
                       f"+{self.kernels.added_bytes[(op, what)]:,} B over {n} calls{'; ' + detail if detail else ''})")
        return out

    def note_health(self, func: Any, args: Any, inputs: list[torch.Tensor], out: torch.Tensor) -> None:
        """Remember what a boolean result is in a healthy run, when its op says (see ``_HEALTHY_OUTPUT``).

        NOTE: ``isfinite``/``isinf`` decompose into ``x == x``, ``x.abs() != inf``... (on integers ``ones_like``) before
        dispatch, where this mode sees them also in a gradient hook (a step in backward's non-finite check).
        """
        packet = func.overloadpacket
        known = [self.healthy.get(t) for t in inputs if t.dtype == torch.bool]
        if packet in _HEALTHY_OUTPUT:
            self.healthy[out] = _HEALTHY_OUTPUT[packet]
        elif packet in _COMPARES and len(args) > 1 and (args[0] is args[1] or (
                isinstance(args[1], float) and math.isinf(args[1]))):
            self.healthy[out] = (packet is _aten.eq) == (args[0] is args[1])  # x == x, x != inf: True
        elif packet in _KEEPS_VALUE and known and None not in known and len(set(known)) == 1:
            self.healthy[out] = known[0]
        elif packet in _AND and len(known) == len(inputs) and None not in known:
            self.healthy[out] = all(known)
        elif packet in _NEGATES and known and known[0] is not None:
            self.healthy[out] = not known[0]

    def stand_in(self, dtype: torch.dtype, healthy: bool | None = None) -> Any:
        if healthy is not None:
            value: Any = healthy if dtype == torch.bool else (float(healthy) if dtype.is_floating_point else int(healthy))
        elif dtype == torch.bool:
            value = False
        elif dtype.is_floating_point or dtype.is_complex:
            value = 0.0
        else:
            value = 1
        key = f"{dtype} -> {value!r}"
        self.stand_ins[key] = self.stand_ins.get(key, 0) + 1
        return value

    def fake(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fake CPU tensor with ``t``'s size, stride and (or) ``dtype``: no bytes are allocated."""
        passthrough, self.passthrough = self.passthrough, True
        try:
            with self.mode:
                return torch.empty_strided(t.size(), t.stride(), dtype=dtype or t.dtype, device="cpu")
        finally:
            self.passthrough = passthrough


@contextlib.contextmanager
def fake_execution() -> Iterator[FakeExecution]:
    """Run the block with fake tensors from parameters on, real values where they exist (see module docstring).

    Python warnings are ignored and Lightning's (and this package's) loggers at ``ERROR`` inside: a dry run's warnings
    and info lines would describe the simulation, not the user's run.

    Raises:
        DryRunUnsupportedError: an op of the model cannot run on fake tensors.
    """
    execution = FakeExecution()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_lowmem")]
    levels = [lg.level for lg in loggers]
    try:
        with warnings.catch_warnings(), execution.mode, \
                _Values(execution), _Composites(execution):
            warnings.simplefilter("ignore")
            for lg in loggers:
                lg.setLevel(logging.ERROR)
            yield execution
    except Exception as err:
        if isinstance(err, FAKE_ERRORS) or str(err).startswith(SWAP_REFUSED):
            raise unsupported(err) from err
        raise
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _FakeCopies(TorchFunctionMode):
    """Inside :func:`fake_copy`: ``copy.deepcopy`` gets each tensor's fake (``Tensor.__deepcopy__`` asks the torch
    function modes first); a stray parameter's ``.data.clone()`` (one no module registers) gets it too."""

    def __init__(self, fake_of: Any) -> None:
        super().__init__()
        self.fake_of = fake_of

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.__deepcopy__:
            tensor, memo = args
            if id(tensor) not in memo:
                memo[id(tensor)] = self.fake_of(tensor)
            return memo[id(tensor)]
        if func is torch.Tensor.clone and not isinstance(args[0], FakeTensor):
            return self.fake_of(args[0])
        return func(*args, **(kwargs or {}))


def fake_copy(module: torch.nn.Module, execution: FakeExecution, upcast_half: bool = False,
              blocks: int | None = None) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers are fake (same sizes, strides, tying); nothing allocated.

    The module objects are deep-copied (cheap: no tensor bytes), so the caller's module is never touched;
    tied weights stay one tensor. ``upcast_half``: bf16/fp16 floating tensors become fp32 (the module as
    built, before a half-precision plugin converted it). ``blocks``: keep only the first ``blocks`` repeated blocks
    (:func:`~lightning_lowmem.predict.depth.find_blocks`; the others are never copied). A Trainer reference is not
    copied.
    """
    memo: dict[int, Any] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if upcast_half and t.dtype in _HALF else t.dtype
        shape = getattr(t, "ds_shape", None)  # NOTE: DeepSpeed ZeRO-3 leaves empty partitions; this is the full size
        f = execution.fake(t if shape is None else torch.empty(shape, device="meta"), dtype)
        if isinstance(t, torch.nn.Parameter):
            f = torch.nn.Parameter(f, requires_grad=t.requires_grad)
            if type(t) is not torch.nn.Parameter and issubclass(type(t), torch.nn.Parameter):
                # NOTE: a parameter subclass (bitsandbytes' `Params4bit`) cannot wrap a fake tensor: its copy is a
                # parameter carrying its attributes (the quantization state, with fake tensors)
                memo[id(t)] = f
                f.__dict__.update(copy.deepcopy(t.__dict__, memo))
        return f

    # NOTE: deepcopy's memo is the seam: each parameter is entered with its fake before the copy (a parameter's
    # `__deepcopy__` consults no torch function mode), every other tensor is made fake by `_FakeCopies`, and a cut
    # model's block list is entered already cut
    found = find_blocks(module) if blocks is not None else None
    dropped = {id(p) for b in list(found[2])[blocks:] for p in b.parameters()} if found is not None else set()
    with _FakeCopies(fake_of):
        for _, p in module.named_parameters(remove_duplicate=False):
            if id(p) not in memo and id(p) not in dropped:  # NOTE: one tied to a kept part comes by `_FakeCopies`
                memo[id(p)] = fake_of(p)
        torch_internals.eager_copies(module, memo, dropped)  # NOTE: compiled regions run eagerly (see its NOTE)
        if found is not None:
            kept = torch.nn.ModuleList([copy.deepcopy(b, memo) for b in list(found[2])[:blocks]])
            memo[id(found[2])] = kept
        out = copy.deepcopy(module, memo)
    if found is not None:
        fewer_layers(out, len(found[2]), blocks)  # type: ignore[arg-type]
    return out


__all__ = ["DryRunUnsupportedError", "FakeExecution", "fake_copy", "fake_execution", "model_line"]

"""Fake kernels that allocate what the real CPU kernels allocate (``docs/estimate.md``).

For a few ops torch's fake kernel (meta function) returns less than the real CPU kernel (the oneDNN LSTM's workspace,
the unreduced buffer under an elementwise loss's 0-d result); each entry of :data:`PROBED` names one and what differs,
and ``tests/memory/test_kernels.py`` runs every entry's real and fake kernel side by side. The real kernel is asked
once per input signature on zeros; above :data:`PROBE_BYTES`, at three shorter lengths congruent modulo 64 and
extrapolated (an upper bound where they are not on one line, said in the note). :data:`REPLACED` gives the CPU
kernel's outputs where the meta function refuses what it takes (``aten._grouped_mm`` at fp32) or allocates what it
does not (``aten._embedding_bag``'s bf16 ``offset2bag``). Corrections are counted in :attr:`KernelMatch.corrections`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lightning_lowmem._internals import torch as torch_internals

_aten = torch.ops.aten
#: a real probe of an op runs at full size when its inputs and fake outputs (x8 for the buffers only the real kernel
#: knows) are below this; above it, at shorter lengths
PROBE_BYTES = 1024 * 2**20


class _Out(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    nbytes: int
    alias: int | None  # index of an earlier output on the same storage


class _Entry(NamedTuple):
    what: str
    #: ``(args) -> [(arg index, dim), ...]``: the dimension the probe may shorten, in each argument having it
    #: (together); None or []: full size only
    length: Callable[[tuple[Any, ...]], list[tuple[int, int]]] | None
    #: only separate outputs the fake kernel aliases (no probe)
    unalias_only: bool = False


def _rnn_length(args: tuple[Any, ...]) -> list[tuple[int, int]]:
    # NOTE: the input is (seq, batch, features) whatever `batch_first` says (aten's lstm transposes it before)
    if len(args) > 8 and args[8]:  # packed sequences: batch_sizes given, input is (total, features)
        return []
    return [(0, 0)]


def _loss_length(args: tuple[Any, ...]) -> list[tuple[int, int]]:
    """The largest dimension of the input, in every tensor argument that has it at full size (input, target, weight);
    an elementwise loss's buffer is linear in any of them."""
    first = args[0]
    if not isinstance(first, torch.Tensor) or not first.dim():
        return []
    dim = max(range(first.dim()), key=lambda d: first.shape[d])
    n = first.shape[dim]
    return [(i, dim) for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.shape == first.shape and a.shape[dim] == n]


_UNREDUCED = "the unreduced loss the real kernel's 0-d loss is a view of"
PROBED: dict[Any, _Entry] = {
    _aten.mkldnn_rnn_layer.default: _Entry("the workspace the real CPU (oneDNN) kernel keeps for backward", _rnn_length),
    _aten.mkldnn_rnn_layer_backward.default: _Entry("separate input-hidden and hidden-hidden bias gradients", None,
                                                    unalias_only=True),
    **{op: _Entry(_UNREDUCED, _loss_length) for op in (_aten.mse_loss.default, _aten.smooth_l1_loss.default,
                                                         _aten.soft_margin_loss.default,
                                                         _aten.binary_cross_entropy.default)},
}


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten._grouped_mm``'s output as the CPU kernel allocates it: contiguous, of the meta function's shape."""
    # NOTE: the shapes of torch's meta function (`_create_grouped_mm_output_tensor`); its dtype checks are the CUDA
    # kernel's (bf16 inputs only), so the dry run of a Hugging Face mixture of experts at fp32 raised there
    groups = offs.size(0) if offs is not None else 0
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        shape = [groups, mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        shape = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        shape = [mat_a.size(1), mat_b.size(1)]
    else:
        shape = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def _embedding_bag(weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, scale_grad_by_freq: bool = False,
                   mode: int = 0, sparse: bool = False, per_sample_weights: torch.Tensor | None = None,
                   include_last_offset: bool = False, padding_idx: int = -1, *, op: Any = None) -> Any:
    """``aten._embedding_bag``'s outputs as the CPU kernel allocates them: in ``mode="sum"`` its fast path
    (``is_fast_path`` in ATen's EmbeddingBag.cpp: fp32, fp16 and bf16 weights) leaves ``offset2bag`` empty."""
    # NOTE: torch's meta function takes the fast path for fp32/fp16 only, so a bf16 bag got an index-sized
    # offset2bag the real kernel never allocates (+3.6 % on the dry run of a small recommender)
    out = (op or torch_internals.ATEN.embedding_bag.default)(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
                                               per_sample_weights, include_last_offset, padding_idx)
    fast = (mode == 0 and weight.dtype == torch.bfloat16 and weight.stride(1) == 1 and padding_idx < 0
            and (per_sample_weights is None or per_sample_weights.stride(0) == 1))
    if fast and out[1].numel():
        out = (out[0], out[1].new_empty(0), *out[2:])
    return out


#: ops whose fake kernel refuses inputs the real CPU kernel takes, or allocates what it does not:
#: ``{op: (what differs, the fake kernel used)}``
REPLACED: dict[Any, tuple[str, Callable[..., Any]]] = {
    torch_internals.ATEN.grouped_mm.default: ("the meta function accepts bf16 inputs only; the CPU kernel any float",
                                _grouped_mm),
    torch_internals.ATEN.embedding_bag.default: ("the meta function gives a bf16 sum bag an offset2bag the CPU kernel leaves empty",
                                   _embedding_bag),
    torch_internals.ATEN.embedding_bag_forward_only.default: (
        "the meta function gives a bf16 sum bag an offset2bag the CPU kernel leaves empty",
        functools.partial(_embedding_bag, op=torch_internals.ATEN.embedding_bag_forward_only.default)),
}


def _outputs(out: Any) -> list[torch.Tensor | None]:
    leaves, _ = torch_internals.tree_flatten(out)
    return [t if isinstance(t, torch.Tensor) else None for t in leaves]


def _describe(outs: list[torch.Tensor | None]) -> list[_Out | None]:
    seen: dict[int, int] = {}
    specs: list[_Out | None] = []
    for i, t in enumerate(outs):
        if t is None:
            specs.append(None)
            continue
        st = t.untyped_storage()
        key = torch_internals.storage_key(st)
        specs.append(_Out(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, st.nbytes(), seen.get(key)))
        seen.setdefault(key, i)
    return specs


def _signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    leaves, _ = torch_internals.tree_flatten((args, kwargs))
    sig: list[Any] = [torch.is_grad_enabled()]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append((tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.untyped_storage().nbytes()))
        else:
            sig.append(x if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else repr(x))
    return tuple(sig)


class KernelMatch:
    """Corrects the fake outputs of the ops in :data:`PROBED` to what the real CPU kernel returns.

    ``refuse(op, detail)`` builds the exception raised when an op cannot be matched (it names the model's line).
    """

    def __init__(self, refuse: Callable[[str, str], Exception]) -> None:
        self.refuse = refuse
        self._cache: dict[tuple[Any, ...], list[_Out | None]] = {}
        #: ``{(op, what): calls corrected}``
        self.corrections: dict[tuple[str, str], int] = {}
        #: ``{(op, what): bytes added over the fake kernel's outputs, summed over calls}``
        self.added_bytes: dict[tuple[str, str], int] = {}
        #: ``{(op, what): how a size was found}`` when not by a full-size probe (extrapolated)
        self.details: dict[tuple[str, str], str] = {}

    @staticmethod
    def handles(func: Any) -> bool:
        return func in PROBED

    @staticmethod
    def replaces(func: Any) -> bool:
        return func in REPLACED

    def replace(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func``'s fake outputs from :data:`REPLACED`'s kernel instead of its own fake kernel."""
        what, kernel = REPLACED[func]
        name = (str(func), what)
        self.corrections[name] = self.corrections.get(name, 0) + 1
        self.added_bytes.setdefault(name, 0)
        return kernel(*args, **kwargs)

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        entry = PROBED[func]
        leaves, spec = torch_internals.tree_flatten(out)
        fakes = _outputs(out)
        if entry.unalias_only:
            real = [s if s is None or s.alias is None else s._replace(alias=None) for s in _describe(fakes)]
        else:
            key = (func, *_signature(args, kwargs))
            real = self._cache.get(key)  # type: ignore[assignment]
            if real is None:
                real = self._cache[key] = self._probe(func, entry, args, kwargs, fakes)
        fixed, added = self._rebuild(fakes, _describe(fakes), real)
        if fixed is None:
            return out
        name = (str(func), entry.what)
        self.corrections[name] = self.corrections.get(name, 0) + 1
        self.added_bytes[name] = self.added_bytes.get(name, 0) + added
        return torch_internals.tree_unflatten([f if f is not None else leaf for f, leaf in zip(fixed, leaves)], spec)

    def _probe(self, func: Any, entry: _Entry, args: tuple[Any, ...], kwargs: dict[str, Any],
               fakes: list[torch.Tensor | None]) -> list[_Out | None]:
        leaves = [x for x in torch_internals.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        cost = sum(t.untyped_storage().nbytes() for t in leaves) + 8 * sum(
            t.untyped_storage().nbytes() for t in fakes if t is not None)
        if cost <= PROBE_BYTES:
            return _describe(_outputs(self._real(func, args, kwargs, self.refuse)))
        where = entry.length(args) if entry.length is not None else []
        full = args[where[0][0]].shape[where[0][1]] if where else 0
        # NOTE: lengths congruent to the full one modulo 64: oneDNN pads every row of its workspace parts to 64 bytes
        # and each part to 4 KiB pages, so the parts' page rounding is the same at these lengths and at the full one,
        # and the sizes lie exactly on one line through them
        first = full % 64 or 64
        lengths = (first, first + 64, first + 128)
        if not where or lengths[2] >= full or cost * lengths[2] / full > PROBE_BYTES:
            raise self.refuse(str(func), f"the real kernel's output sizes ({entry.what}) are known only by running it, "
                                         f"which needs about {cost / 2**20:,.0f} MiB here (more than the dry run's "
                                         f"{PROBE_BYTES / 2**20:,.0f} MiB probe budget)")
        step = 64
        dims = dict(where)
        probes = []
        for n in lengths:
            shorter = tuple(torch.empty((*a.shape[:dims[i]], n, *a.shape[dims[i] + 1:]), dtype=a.dtype) if i in dims else a
                            for i, a in enumerate(args))
            probes.append((_describe(_outputs(func(*shorter, **kwargs))),
                           _describe(_outputs(self._real(func, shorter, kwargs, self.refuse)))))
        out: list[_Out | None] = []
        varying = ""
        for i, (fake_full, real_full) in enumerate(zip(_describe(fakes), probes[0][1])):
            if fake_full is None or real_full is None:
                out.append(real_full)
                continue
            sizes = [p[1][i].nbytes for p in probes]  # type: ignore[union-attr]
            increments = (sizes[1] - sizes[0], sizes[2] - sizes[1])
            nbytes = sizes[2] + (full - lengths[2]) // step * max(increments)
            if increments[0] != increments[1]:
                varying = (f"; the page rounding of output {i} varies ({increments[0]:,} and {increments[1]:,} B per "
                           "64 steps): the larger taken, an upper bound")
            same_shape = all(p[1][i].shape == p[0][i].shape for p in probes)  # type: ignore[union-attr]
            shape = fake_full.shape if same_shape else (nbytes // max(fake_full.dtype.itemsize, 1),)
            stride = fake_full.stride if same_shape else (1,)
            out.append(_Out(shape, stride, fake_full.offset if same_shape else 0, real_full.dtype, nbytes,
                            real_full.alias))
        self.details[(str(func), entry.what)] = (
            f"extrapolated from lengths {lengths} of dimension {where[0][1]} to {full}{varying}")
        return out

    @staticmethod
    def _real(func: Any, args: Any, kwargs: Any, refuse: Callable[[str, str], Exception]) -> Any:
        """``func`` run by the real CPU kernel on zeros of the inputs' sizes (aliasing kept), unseen by any mode.

        Raises ``refuse(op, why)`` where this CPU's kernel refuses the inputs (oneDNN has no fp16 LSTM on most CPUs,
        no bf16 one without AVX-512): the run itself fails the same way on this CPU.
        """
        bases: dict[int, torch.Tensor] = {}

        def real(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            key = torch_internals.storage_key(x.untyped_storage())
            if key not in bases:  # zeros of the whole storage, so that aliasing arguments stay aliased
                n = x.untyped_storage().nbytes() // max(x.element_size(), 1)
                bases[key] = torch.zeros(max(n, x.storage_offset() + 1 if x.numel() else 0), dtype=x.dtype)
            return bases[key].as_strided(x.shape, x.stride(), x.storage_offset())

        with torch_internals.disable_current_modes(), torch_internals.unset_fake_temporarily(), torch.random.fork_rng(devices=[]):
            real_args, real_kwargs = torch_internals.tree_map(real, (args, kwargs))
            try:
                return func(*real_args, **real_kwargs)
            except RuntimeError as err:
                raise refuse(str(func), f"this CPU's kernel refuses these inputs ({str(err).split('. ')[0]}): the "
                                        "run itself fails the same way on this CPU; another precision runs") from err

    @staticmethod
    def _rebuild(fakes: list[torch.Tensor | None], have: list[_Out | None],
                 want: list[_Out | None]) -> tuple[list[torch.Tensor | None] | None, int]:
        """New fake outputs where ``have`` (the fake kernel's) differs from ``want`` (the real kernel's); None: none."""
        if len(have) != len(want):
            return None, 0
        fixed: list[torch.Tensor | None] = list(fakes)
        changed, added = False, 0
        for i, (h, w) in enumerate(zip(have, want)):
            if h is None or w is None or (h.nbytes == w.nbytes and h.alias == w.alias and h.shape == w.shape):
                continue
            changed = True
            if w.alias is not None and fixed[w.alias] is not None:
                fixed[i] = fixed[w.alias].as_strided(w.shape, w.stride, w.offset)  # type: ignore[union-attr]
                continue
            numel = w.nbytes // max(w.dtype.itemsize, 1)
            fixed[i] = torch.empty(numel, dtype=w.dtype).as_strided(w.shape, w.stride, w.offset)
            added += w.nbytes - (h.nbytes if h.alias is None else 0)
        return (fixed if changed else None), added


__all__ = ["PROBED", "PROBE_BYTES", "REPLACED", "KernelMatch"]

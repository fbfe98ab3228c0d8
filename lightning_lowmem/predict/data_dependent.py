"""Ops whose output size depends on values (``nonzero``, ``unique``, ``bincount``, boolean indexing...) in a dry run.

Each size is taken from what is known, and every assumption is recorded (:attr:`DataDependent.bounds`): exact where
the deciding inputs are real (from the batch); selections of fake values take every element as selected (``nonzero``'s
indices are then real, so code indexing modules by them runs); ``unique`` of fake values is one distinct value with
its storage counted at the upper bound; ``bincount`` of fake values has ``minlength`` bins (refused without it).
Anything else raises :class:`~lightning_lowmem.predict.fake.DryRunUnsupportedError`. See ``docs/estimate.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.predict.unsupported import DryRunUnsupportedError

_aten = torch.ops.aten
_MASK_DTYPES = (torch.bool, torch.uint8)
#: index tensors up to this size are made real (their values are known): 16 MiB, as ``fake.REAL_OUTPUT_LIMIT``
_REAL_INDEX_LIMIT = 16 * 2**20


def _is_fake(t: Any) -> bool:
    return isinstance(t, torch_internals.FakeTensor)


def _real(fn: Callable[[], Any]) -> Any:
    with torch_internals.unset_fake_temporarily():
        return fn()


def _bounded_storage(shape: tuple[int, ...], numel_bound: int, dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor of ``shape`` on a storage of ``numel_bound`` elements (its memory counted at the bound)."""
    base = torch.empty(max(numel_bound, math.prod(shape)), dtype=dtype)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return base.as_strided(shape, tuple(reversed(strides)), 0)


class DataDependent:
    """Runs data-dependent ops inside a fake execution; collects the assumptions made (see the module docstring).

    ``where`` is a callable returning the model's line of the current call (recorded with each assumption).
    """

    def __init__(self, where: Callable[[], str | None]) -> None:
        self.where = where
        #: ``{(op, line, assumption): calls}``
        self.bounds: dict[tuple[str, str, str], int] = {}
        self._impls: dict[Any, Callable[..., Any]] = {
            _aten.nonzero.default: self._nonzero,
            _aten.masked_select.default: self._masked_select,
            _aten.index.Tensor: self._index,
            _aten.index_put.default: self._index_put,
            _aten.index_put_.default: self._index_put,
            torch_internals.ATEN.index_put_impl_.default: self._index_put,
            torch_internals.ATEN.unique2.default: self._unique2,
            torch_internals.ATEN.unique.default: self._unique,
            _aten.unique_dim.default: self._unique_dim,
            _aten.unique_consecutive.default: self._unique_consecutive,
            _aten.bincount.default: self._bincount,
            torch_internals.ATEN.pack_padded_sequence.default: self._pack_padded_sequence,
        }

    def handles(self, func: Any) -> bool:
        return func in self._impls

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` (some input fake) with the sizes the module docstring describes."""
        return self._impls[func](func, *args, **kwargs)

    def note(self, func: Any, assumption: str) -> None:
        key = (str(func), self.where() or "(no line of the model's code on the stack)", assumption)
        self.bounds[key] = self.bounds.get(key, 0) + 1

    def refuse(self, func: Any, detail: str) -> Exception:
        return DryRunUnsupportedError(str(func), detail, self.where())

    def _nonzero(self, func: Any, x: torch.Tensor) -> torch.Tensor:
        self.note(func, f"every element of the fake {tuple(x.shape)} input taken as nonzero (upper bound)")
        if x.numel() * max(x.dim(), 1) * 8 > _REAL_INDEX_LIMIT:
            return torch.empty((x.numel(), x.dim()), dtype=torch.long)
        # NOTE: the indices of every element are known values: real, so that code indexing by them runs (Switch
        # Transformers' experts: `for i in mask.nonzero(): self.experts[f"expert_{i[0]}"]`, every expert called)
        return _real(lambda: torch.ones(x.shape, dtype=torch.bool).nonzero())

    def _mask_indices(self, func: Any, indices: list[Any]) -> list[Any]:
        """Boolean/byte masks among ``indices`` replaced by the long indices of their nonzero elements."""
        out: list[Any] = []
        for idx in indices:
            if not isinstance(idx, torch.Tensor) or idx.dtype not in _MASK_DTYPES or not idx.dim():
                out.append(idx)
                continue
            # NOTE: a real mask (from the batch): exact
            nz = self._nonzero(func, idx) if _is_fake(idx) else _real(lambda idx=idx: torch.nonzero(idx))
            out.extend(nz.unbind(1))
        return out

    def _index(self, func: Any, x: torch.Tensor, indices: list[Any]) -> torch.Tensor:
        return func(x, self._mask_indices(func, list(indices)))

    def _index_put(self, func: Any, x: torch.Tensor, indices: list[Any], values: torch.Tensor, *rest: Any) -> Any:
        return func(x, self._mask_indices(func, list(indices)), values, *rest)

    def _masked_select(self, func: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        if _is_fake(mask):
            self.note(func, f"every element of the fake {tuple(mask.shape)} mask taken as True (upper bound)")
            n = math.prod(shape)
        else:
            n = _real(lambda: int(mask.expand(shape).count_nonzero()))
        return torch.empty((n,), dtype=x.dtype)

    def _unique_outputs(self, func: Any, x: torch.Tensor, dim: int | None, return_inverse: bool,
                        return_counts: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.note(func, f"fake {tuple(x.shape)} input taken as one distinct value (its storage counted with every "
                        "element distinct, an upper bound)")
        if dim is None:
            n = x.numel()
            values = _bounded_storage((min(n, 1),), n, x.dtype)
            inverse = torch.empty(x.shape if return_inverse else (0,), dtype=torch.long)
        else:
            d = dim % max(x.dim(), 1)
            n = x.shape[d]
            shape = (*x.shape[:d], min(n, 1), *x.shape[d + 1:])
            values = _bounded_storage(tuple(shape), x.numel(), x.dtype)
            inverse = torch.empty((n,) if return_inverse else (0,), dtype=torch.long)
        counts = _bounded_storage((min(n, 1),), n, torch.long) if return_counts else torch.empty((0,), dtype=torch.long)
        return values, inverse, counts

    def _unique2(self, func: Any, x: torch.Tensor, sorted: bool = True, return_inverse: bool = False,
                 return_counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._unique_outputs(func, x, None, return_inverse, return_counts)

    def _unique(self, func: Any, x: torch.Tensor, sorted: bool = True,
                return_inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self._unique_outputs(func, x, None, return_inverse, False)[:2]

    def _unique_dim(self, func: Any, x: torch.Tensor, dim: int, sorted: bool = True, return_inverse: bool = False,
                    return_counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._unique_outputs(func, x, dim, return_inverse, return_counts)

    def _unique_consecutive(self, func: Any, x: torch.Tensor, return_inverse: bool = False,
                            return_counts: bool = False, dim: int | None = None) -> tuple[torch.Tensor, ...]:
        return self._unique_outputs(func, x, dim, return_inverse, return_counts)

    def _bincount(self, func: Any, x: torch.Tensor, weights: torch.Tensor | None = None,
                  minlength: int = 0) -> torch.Tensor:
        if not _is_fake(x):  # NOTE: real values, fake weights: the length is known exactly
            length = max(int(minlength), _real(lambda: int(x.max())) + 1 if x.numel() else 0)
        elif minlength > 0:
            self.note(func, f"values of the fake {tuple(x.shape)} input taken below minlength={minlength}")
            length = int(minlength)
        else:
            raise self.refuse(func, "`torch.bincount` of values computed from the weights without `minlength`: its "
                                    "length is the largest value + 1, which the dry run cannot know; pass `minlength`")
        dtype = torch.long if weights is None else _real(
            lambda: torch.bincount(torch.zeros(1, dtype=torch.long), weights=torch.zeros(1, dtype=weights.dtype)).dtype)
        return torch.empty((length,), dtype=dtype)

    def _pack_padded_sequence(self, func: Any, x: torch.Tensor, lengths: torch.Tensor,
                              batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if _is_fake(lengths):
            raise self.refuse(func, "the sequence lengths were computed from the weights; pass lengths from the batch")
        counts = _real(lambda: [int(n) for n in lengths.tolist()])
        steps = max(counts, default=0)
        batch_sizes = _real(lambda: torch.tensor([sum(n > t for n in counts) for t in range(steps)], dtype=torch.long))
        return torch.empty((sum(counts), *x.shape[2:]), dtype=x.dtype), batch_sizes


__all__ = ["DataDependent"]

"""A checkpoint of another model or optimizer, resumed: one error naming the file, what differs and what to do
(instead of torch's ``KeyError: 'step'`` or a list of size mismatches without the file's name).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_lowmem._internals import lightning as lightning_internals

# per-parameter state keys -> the optimizer family that writes them (for the message only)
_FAMILIES = {
    "exp_avg_sq": "Adam/AdamW", "momentum_buffer": "SGD with momentum", "square_avg": "RMSprop/Adadelta",
    "sum": "Adagrad", "exp_inf": "Adamax", "ax": "ASGD", "prev": "Rprop", "state1": "a bitsandbytes optimizer",
}
_WEIGHTS_ONLY = (
    "or keep only its weights: `Module.load_from_checkpoint(path)` (or `torch.load(path)['state_dict']`) and fit "
    "without `ckpt_path` (the optimizer, the schedule and the step count start afresh)"
)


def where(trainer: Any) -> str:
    """``ckpt_path='...'`` of the fit being resumed, for messages."""
    path = getattr(trainer, "ckpt_path", None)
    return f"`ckpt_path={str(path)!r}`" if path else "the checkpoint"


def expected_state_keys(optimizer: torch.optim.Optimizer) -> set[str] | None:
    """The per-parameter state keys ``optimizer``'s class writes, from one step of a twin on a 1-element tensor
    (None when the twin cannot be built or stepped)."""
    probe = torch.zeros(1, requires_grad=True)
    group = {k: v for k, v in optimizer.param_groups[0].items() if k not in ("params", "initial_lr")}
    try:
        twin = type(optimizer)([{**group, "params": [probe]}])
        probe.grad = torch.ones(1)
        twin.step()
        return {str(k) for k in twin.state.get(probe, {})}
    except Exception:  # noqa: BLE001  NOTE: a probe only; the real load decides
        return None


def mismatch_message(keys: set[str], optimizer: Any, source: str, expected: set[str] | None = None,
                     err: BaseException | None = None, weights_only: str = _WEIGHTS_ONLY) -> str:
    family = next((f for k, f in _FAMILIES.items() if k in keys), "another optimizer")
    written = f"{family} (per-parameter {sorted(keys)})" if keys else "another kind of optimizer"
    name = type(optimizer).__name__
    wants = f" (it keeps {sorted(expected)})" if expected else " (it keeps no per-parameter state)" if expected == set() else ""
    cause = f" ({type(err).__name__}: {err})" if err is not None else ""
    return (
        f"Cannot resume from {source}: its optimizer state was written by {written}, but `configure_optimizers` now "
        f"returns {'an' if name[:1] in 'AEIOU' else 'a'} `{name}`{wants}{cause}. Resume with the optimizer that wrote "
        f"it, {weights_only}."
    )


def load_optimizer(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], source: str) -> None:
    """``optimizer.load_state_dict(saved)`` (one entry of a checkpoint's ``optimizer_states``), refusing (ValueError)
    a state another kind of optimizer wrote: its per-parameter keys are none of those this optimizer writes."""
    keys = {str(k) for state in saved.get("state", {}).values() if isinstance(state, Mapping) for k in state}
    expected = expected_state_keys(optimizer) if keys else None
    if expected is not None and (not expected or keys.isdisjoint(expected)):
        raise ValueError(mismatch_message(keys, optimizer, source, expected))
    try:
        optimizer.load_state_dict(saved)
    except (KeyError, TypeError) as err:  # NOTE: torch's own `ValueError`s (group counts) already say what differs
        raise ValueError(mismatch_message(keys, optimizer, source, err=err)) from err


def shape_message(diff: Sequence[tuple[str, Sequence[int], Sequence[int]]], source: str,
                  hparams: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None] = (None, None)) -> str:
    examples = "; ".join(f"`{k}` is {list(a)} there, {list(b)} here" for k, a, b in diff[:3])
    more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
    changed = _changed(*hparams)
    return (
        f"Cannot resume from {source}: it was written by a model of another shape ({len(diff)} tensor(s) differ: "
        f"{examples}{more})."
        + (f" Its hyper-parameters differ from this model's: {changed}." if changed else "")
        + " Build the model as it was when the checkpoint was written (the checkpoint keeps its hyper-parameters), or "
        "fit this model without `ckpt_path` to start afresh."
    )


def parse_size_mismatches(message: str) -> list[tuple[str, list[int], list[int]]]:
    """torch's ``size mismatch for NAME: copying a param with shape torch.Size([..]) from checkpoint, the shape in
    current model is torch.Size([..])`` lines, parsed."""
    pattern = r"size mismatch for ([\w.]+): .*?torch\.Size\(\[([\d, ]*)\]\).*?torch\.Size\(\[([\d, ]*)\]\)"
    return [(m.group(1), [int(x) for x in m.group(2).split(",") if x.strip()],
             [int(x) for x in m.group(3).split(",") if x.strip()]) for m in re.finditer(pattern, message)]


def _changed(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> str:
    if not isinstance(saved, Mapping) or not isinstance(current, Mapping):
        return ""
    out = []
    for key in sorted(set(saved) & set(current)):
        a, b = saved[key], current[key]
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += [f"{key}.{k}: {a.get(k)!r} there, {b.get(k)!r} here" for k in sorted(set(a) | set(b))
                    if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{key}: {a!r} there, {b!r} here")
    return "; ".join(out[:4])


def check_model(checkpoint: Mapping[str, Any], module: Any) -> None:
    """Refuse (ValueError) a checkpoint whose ``state_dict`` holds tensors of other shapes than ``module``'s."""
    shapes = {n: tuple(t.shape) for n, t in [*module.named_parameters(), *module.named_buffers()]}
    diff = [(k, tuple(v.shape), shapes[k]) for k, v in checkpoint.get("state_dict", {}).items()
            if k in shapes and hasattr(v, "shape") and tuple(v.shape) != shapes[k]]
    if diff:
        hparams = (checkpoint.get("hyper_parameters"), dict(getattr(module, "hparams", {}) or {}))
        raise ValueError(shape_message(diff, where(lightning_internals.attached_trainer(module)), hparams))
